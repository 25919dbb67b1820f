"""How the feedback α sets the distance FGD keeps from the manifold.

To first order in the drift D = θᵀθ − I and the velocity's normal part S = sym(θᵀΦ), a step
of the authors' form maps (D, S) by the Jordan block [[1 − 2α, 2(1 − 2α)], [0, 1 − 2α]] and adds
−ΦᵀΦ to D, so with a steady step the drift settles at D* = −ΦᵀΦ/(2α): ‖θᵀθ − I‖_F ≈ ‖ΦᵀΦ‖_F/(2α)
for every α (docs/algorithm.md, "How close to the manifold"). This script runs a 16 × 72
layer (a 3 × 3 convolution with 8 input channels) with unit-norm random gradients at lr 0.01,
momentum 0.9 for each α, and prints the settled distance (mean of the last 100 of ``--steps``),
the mean ‖ΦᵀΦ‖_F, the first-order fixed point ‖ΦᵀΦ‖/(2α) and the measurement's ratio to it,
the empirical bound ‖ΦᵀΦ‖/(2 min(α, 1 − α)), and the ratio to α = 0.4 (if among ``--alphas``).

    python -m benchmarks.studies.feedback_contraction [--steps 400] [--alphas 0.01 0.05 ... 0.99]
"""

from __future__ import annotations

import argparse
import warnings

import torch

import fgd_fast
from benchmarks.machine import describe, environment
from benchmarks.studies import counts_checked
from benchmarks.studies.unit_layer import unit_layer

ALPHAS = [0.01, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99]


def settle(alpha: float, steps: int = 400, seed: int = 0) -> tuple[float, float]:
    torch.manual_seed(seed)
    w, opt = unit_layer(alpha, "torch")
    dists, drifts = [], []
    for k in range(steps):
        g = torch.randn_like(w)
        w.grad = g / g.norm()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt.step()
        if k >= steps - 100:
            phi = fgd_fast.as_stiefel(opt.state[w]["momentum_buffer"])
            drifts.append(float(torch.linalg.matrix_norm(phi.t() @ phi)))
            dists.append(fgd_fast.stiefel_distance(w))
    return sum(dists) / len(dists), sum(drifts) / len(drifts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--alphas", type=float, nargs="+", default=ALPHAS)
    args = ap.parse_args(argv)
    counts_checked(ap, args, "steps")
    outside = [a for a in args.alphas if not 0 < a < 1]
    if outside:  # (the table divides by α and by 1 − α)
        ap.error(f"--alphas: {', '.join(f'{a:g}' for a in outside)} not in (0, 1)")
    print(f"{describe(environment(torch.device('cpu')))}; float64, 16 × 72, lr 0.01, momentum 0.9")
    rows = [(a, *settle(a, args.steps)) for a in args.alphas]
    base = dict((a, d) for a, d, _ in rows).get(0.4)
    print(
        "| α | settled ‖θᵀθ − I‖_F | mean ‖ΦᵀΦ‖_F | fixed point ‖ΦᵀΦ‖/(2α) | settled ÷ fixed point "
        "| bound ‖ΦᵀΦ‖/(2 min(α, 1−α)) | × α = 0.4 |"
    )
    print("|---|---|---|---|---|---|---|")
    for a, d, c in rows:
        fixed, bound = c / (2 * a), c / (2 * min(a, 1 - a))
        ratio = f"{d / base:.2g}" if base else "—"
        print(f"| {a} | {d:.3g} | {c:.3g} | {fixed:.3g} | {d / fixed:.2f} | {bound:.3g} | {ratio} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
