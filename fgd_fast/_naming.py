"""How the optimizers name a parameter: the names ``stiefel_param_groups`` records, and the
label a message gives a parameter (its name, else its flat index)."""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["label", "remembered_name", "remember_names"]

#: parameter -> name, recorded by ``stiefel_param_groups``: a group's ``names`` list no longer
#: lines up with its ``params`` once ``ZeroRedundancyOptimizer`` gives each rank a subset of
#: them (it copies the other keys of the group whole), but the tensors keep their names here
_names: WeakIdKeyDictionary = WeakIdKeyDictionary()


def remember_names(params: list[torch.Tensor], names: list[str]) -> None:
    """Record ``names[i]`` as the name of ``params[i]`` for labels and ``orthogonality()``."""
    for p, name in zip(params, names):
        _names[p] = name


def label(key: str | int) -> str:
    """How messages name a parameter: ``'layer.weight'`` or ``#3``."""
    if isinstance(key, str):
        return key if key.startswith("#") else repr(key)
    return f"#{key}"


def remembered_name(p: torch.Tensor) -> str | None:
    """The name :func:`remember_names` recorded for ``p`` (None if none)."""
    return _names.get(p)
