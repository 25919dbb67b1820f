"""Would one GEMM θᵀ[θ | g | Φ] beat the torch backend's three Gram products A, E and B on a CPU?

The torch backend's CPU step is bound by its products on the small layers of ResNet-50 ×0.2
(p = 13…102), whose per-layer Grams run below the BLAS's large-shape rate. One product with
three times the columns runs at a higher rate, but needs θ, g and Φ side by side (a copy of
3·n·p numbers per layer) and its p × 3p result copied into the middle's blocks. This study
times both forms per shape (one thread, float32, the W2 layout ``R = θᵀ`` the convolution
layers use; median of ``--reps`` after a warm-up): three ``bmm`` against ``cat`` + one ``bmm``
+ one ``_foreach_copy_``, for single layers (read in place) and stacks of small ones.

    python -m benchmarks.studies.gram_fusion [--reps 300]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.machine import describe, environment, median_seconds
from benchmarks.studies import counts_checked

# (layers in one call, p, n = 9p): the cpu-scale workloads' 3 × 3 convolutions and a few more
SHAPES = [(1, 102, 918), (1, 96, 864), (1, 64, 576), (1, 51, 459), (4, 26, 234), (3, 13, 117), (1, 128, 1152)]


def _three(r, g, phi, blocks) -> None:
    for other, blk in zip((r, g, phi), blocks):
        torch.bmm(r, other.transpose(1, 2), out=blk)  # A = RRᵀ, E = RGᵀ, B = RPᵀ


def _fused(r, g, phi, blocks, joint, out) -> None:
    p = r.shape[1]
    torch.cat((r, g, phi), 1, out=joint)  # [R; G; P]
    torch.bmm(r, joint.transpose(1, 2), out=out)  # R[R; G; P]ᵀ = [A | E | B]
    torch._foreach_copy_(blocks, [out[..., k * p : (k + 1) * p] for k in range(3)])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=300)
    args = ap.parse_args(argv)
    counts_checked(ap, args, "reps")
    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    env = environment(cpu)
    print(f"{describe(env)} | median of {args.reps}")
    print("| layers × (p, n) | 3 × bmm | cat + bmm + copy | fused ÷ three |")
    print("|---|---:|---:|---:|")
    gen = torch.Generator().manual_seed(0)
    for c, p, n in SHAPES:
        r, g, phi = (torch.randn(c, p, n, generator=gen) for _ in range(3))  # R = θᵀ, G = gᵀ, P = Φᵀ
        blocks = [torch.empty(c, p, p) for _ in range(3)]  # A, E, B
        joint, out = torch.empty(c, 3 * p, n), torch.empty(c, p, 3 * p)
        a = median_seconds(lambda: _three(r, g, phi, blocks), cpu, args.reps)  # noqa: B023  (timed here, in this iteration)
        b = median_seconds(lambda: _fused(r, g, phi, blocks, joint, out), cpu, args.reps)  # noqa: B023
        print(f"| {c} × ({p}, {n}) | {a * 1e6:.0f} µs | {b * 1e6:.0f} µs | {b / a:.2f}× |")


if __name__ == "__main__":
    main()
