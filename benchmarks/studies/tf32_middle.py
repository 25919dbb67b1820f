"""A TF32 middle: where FGD settles when every p × p product of the middle runs at TF32.

On a GPU with ``precision="tf32"``/``"tf32x3"`` the middle's products run on TF32 tensor cores
(~2⁻¹¹ relative input rounding). The middle writes every product with ``N = I − D`` or
``A = I + D`` as ``X ∓ D·X`` (``fgd_fast.backends.algebra``), so the rounding touches only
the small correction; this study checks that on the CPU, with TF32 emulated
(``fgd_fast.backends.tf32.emulated_tf32_middle``: inputs rounded to TF32, sums in fp32), on the
float32 constrained layers of each ``cpu``-scale benchmark workload: the torch backend (Gram
and update passes in IEEE fp32 on a CPU), unit-norm random gradients, momentum 0.9, feedback
0.4, ``--steps`` steps at each ``--lrs`` (1e-2: the O(η²) drift sets the distance; 1e-4: fp32's
rounding floor does), in three middles:

* ``fp32`` — the IEEE fp32 middle (a CPU's, and ``precision="ieee"``'s on a GPU);
* ``tf32`` — every middle product at TF32, in the ``X ∓ D·X`` forms;
* ``tf32, (I − D)·X`` — the same with ``(I ± D)`` rounded as a whole (the forms before).

It prints, per workload and middle, the largest ``‖θᵀθ − I‖_F`` over the layers, the mean of
the last tenth of the steps, and its ratio to the fp32 middle's (the target: ≤ 1.2).

    python -m benchmarks.studies.tf32_middle [--steps 1000] [--workloads wrn-28-10 ...]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys

import torch

import fgd_fast
from benchmarks.machine import describe, environment
from benchmarks.studies import counts_checked
from fgd_fast.backends.tf32 import emulated_tf32_middle

LRS = (1e-2, 1e-4)
MIDDLES = {"fp32": None, "tf32": "lean", "tf32, (I − D)·X": "naive"}


def settled_distance(shapes, steps: int, form: str | None, lr: float, seed: int = 0, **options) -> float:
    """The mean over the last tenth of ``steps`` of the largest ‖θᵀθ − I‖_F of layers ``shapes``
    stepped by FGD (torch backend, ``options`` passed on) with the middle ``form`` (``None``: fp32)."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(fgd_fast.orthogonalize_(torch.randn(s, generator=gen))) for s in shapes]
    hyper = dict(lr=lr, momentum=0.9, feedback=0.4)
    opt = fgd_fast.FGD([dict(params=params, orthogonal=True)], **hyper, backend="torch", **options)
    tail = []
    with emulated_tf32_middle(form) if form else contextlib.nullcontext():
        for k in range(steps):
            for p in params:
                g = torch.randn(p.shape, generator=gen)
                p.grad = g / g.norm()
            opt.step()
            if k >= steps - max(1, steps // 10):
                tail.append(max(fgd_fast.stiefel_distance(p) for p in params))
    return statistics.fmean(tail)


def main(argv: list[str] | None = None) -> int:
    from benchmarks.workloads import weight_shapes, workloads

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--workloads", nargs="*", help="names (default: every cpu-scale workload)")
    ap.add_argument("--lrs", type=float, nargs="+", default=list(LRS))
    args = ap.parse_args(argv)
    counts_checked(ap, args, "steps")
    names = [w.name for w in workloads("cpu")]
    unknown = [n for n in args.workloads or () if n not in names]
    if unknown:  # (else an empty table, and a pass)
        ap.error(f"--workloads: unknown {', '.join(unknown)}; choose from {', '.join(names)}")
    torch.set_num_threads(1)
    env = environment(torch.device("cpu"))
    print(
        f"{describe(env)} | {args.steps} steps, "
        "largest ‖θᵀθ − I‖_F over the layers (mean of the last tenth), float32, TF32 emulated"
    )
    print("| workload | layers | lr | " + " | ".join(MIDDLES) + " | tf32 ÷ fp32 | (I − D)·X ÷ fp32 |")
    print("|---|---:|---:|" + "---:|" * (len(MIDDLES) + 2))
    worst, rows = 0.0, 0
    for w in workloads("cpu"):
        if args.workloads and w.name not in args.workloads:
            continue
        shapes = weight_shapes(w)
        for lr in args.lrs:
            dist = {name: settled_distance(shapes, args.steps, form, lr) for name, form in MIDDLES.items()}
            lean, naive = dist["tf32"] / dist["fp32"], dist["tf32, (I − D)·X"] / dist["fp32"]
            worst, rows = max(worst, lean), rows + 1
            cells = " | ".join(f"{d:.3e}" for d in dist.values())
            print(f"| {w.description} | {len(shapes)} | {lr:g} | {cells} | {lean:.3f} | {naive:.3f} |", flush=True)
    if not rows:
        print("\nno row ran", file=sys.stderr)
        return 1
    print(f"\nlargest tf32 ÷ fp32: {worst:.3f} (target ≤ 1.2)")
    return 0 if worst <= 1.2 else 1


if __name__ == "__main__":
    raise SystemExit(main())
