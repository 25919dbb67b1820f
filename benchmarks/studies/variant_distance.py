"""Where each FGD variant settles: the authors' code against Algorithm 1 as printed.

``variant="official"`` moves θ by the whole new velocity Φ₊; ``variant="paper"`` by its
tangent part only (``θ₊ = θ + Φ₊ − θN sym(θᵀΦ₊) − αθ(A − I)``). Φ₊'s normal part is second
order (‖Φ‖²), so the two settle at the same *size* of drift but on different sides of the
manifold. This script runs a 16 × 72 layer (a 3 × 3 convolution with 8 input channels), float64,
unit-norm random gradients, lr 0.01, momentum 0.9, for each α, and prints per variant the
settled ‖θᵀθ − I‖_F and tr(θᵀθ − I)/p (negative: inside the manifold), each the mean of the
last 100 of 400 steps, and the ratio official ÷ paper.

    python -m benchmarks.studies.variant_distance [--steps 400] [--alphas 0.1 0.4 0.5 0.7 0.9]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.machine import describe, environment
from benchmarks.studies import counts_checked
from benchmarks.studies.unit_layer import unit_layer


def settle(variant: str, alpha: float, steps: int, seed: int = 0) -> tuple[float, float]:
    """(mean ‖θᵀθ − I‖_F, mean tr(θᵀθ − I)/p) over the last quarter of ``steps``."""
    gen = torch.Generator().manual_seed(seed)
    w, opt = unit_layer(alpha, "reference", variant=variant, generator=gen)
    dists, traces = [], []
    for k in range(steps):
        g = torch.randn(w.shape, dtype=w.dtype, generator=gen)
        w.grad = g / g.norm()
        opt.step()
        if k >= steps - steps // 4:
            m = w.detach().reshape(16, -1)
            d = m @ m.T - torch.eye(16, dtype=m.dtype)  # θᵀθ − I (θ = W2ᵀ)
            dists.append(float(torch.linalg.matrix_norm(d)))
            traces.append(float(d.trace()) / 16)
    return statistics.fmean(dists), statistics.fmean(traces)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--alphas", type=float, nargs="+", default=[0.1, 0.4, 0.5, 0.7, 0.9])
    args = ap.parse_args(argv)
    counts_checked(ap, args, "steps")
    print(f"{describe(environment(torch.device('cpu')))}; 16 × 72, float64, {args.steps} steps")
    print("| α | official ‖D‖_F | official tr D/p | paper ‖D‖_F | paper tr D/p | official ÷ paper |")
    print("|---|---|---|---|---|---|")
    for alpha in args.alphas:
        (do, to), (dp, tp) = settle("official", alpha, args.steps), settle("paper", alpha, args.steps)
        print(f"| {alpha:g} | {do:.2e} | {to:+.2e} | {dp:.2e} | {tp:+.2e} | {do / dp:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
