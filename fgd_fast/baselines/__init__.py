"""Baseline optimizers users compare FGD against (Cayley SGD / ADAM and adapters)."""
