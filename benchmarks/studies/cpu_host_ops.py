"""The torch backend's host-side choices on a CPU, each measured against the alternative.

One thread, float32, the shapes of the ``cpu``-scale benchmark workloads:

* a symmetric Gram ``RRᵀ`` as one product or as block halves (``_HALVES_FROM``);
* equal-shape layers staged into a stack by ``torch.stack(out=)`` or by ``_foreach_copy_``
  into per-layer views;
* a multi-``p`` layout's per-layer sums and norms by ``segment_reduce`` or per group
  (``Layout.sums``, ``Layout.norm``), and ``a + bᵀ`` by ``index_select`` or per group;
* the norms of three blocks per layer (the guard's bound) per group over the stacked blocks or
  by one multi-tensor norm over every layer's view (``Layout.norms``: fewer ops, which the op
  ceiling of ``tests/test_op_count.py`` needs).

    python -m benchmarks.studies.cpu_host_ops [--reps 300]

Prints the machine and one table (µs per call, best of five runs of ``--reps`` calls).
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.machine import describe, environment
from benchmarks.studies import counts_checked
from fgd_fast.backends.layout import Layout

GRAM_SHAPES = [(64, 576), (96, 864), (102, 918), (128, 128), (128, 512), (128, 1152), (192, 1728), (256, 2304)]
STACKS = [((51, 51, 3, 3), 6), ((26, 26, 3, 3), 4), ((13, 13, 3, 3), 3)]  # ResNet-50 ×0.2's staged buckets
LAYOUTS = {"ResNet-50 ×0.2": [(4, 13), (4, 26), (6, 51), (3, 102)], "WRN-28-1.5": [(7, 24), (7, 48), (7, 96)]}


def best_us(f, reps: int) -> float:
    """µs per call of ``f``: the best of five runs of ``reps`` calls (after a warm-up)."""
    for _ in range(max(5, reps // 20)):
        f()
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            f()
        runs.append((time.perf_counter() - t0) / reps * 1e6)
    return min(runs)


def _gram(p: int, n: int, reps: int) -> tuple[str, float, float]:
    r, out, h = torch.randn(1, p, n), torch.empty(1, p, p), p // 2

    def halves():
        torch.bmm(r[:, :h], r.transpose(1, 2), out=out[:, :h])
        torch.bmm(r[:, h:], r[:, h:].transpose(1, 2), out=out[:, h:, h:])
        out[:, h:, :h] = out[:, :h, h:].transpose(1, 2)

    k = max(3, reps * 2_000_000 // (p * p * n))
    one = best_us(lambda: torch.bmm(r, r.mT, out=out), k)
    return f"Gram RRᵀ p={p} n={n}: one product \\| halves", one, best_us(halves, k)


def _stage(shape: tuple[int, ...], c: int, reps: int) -> tuple[str, float, float]:
    tensors = [torch.randn(shape) for _ in range(c)]
    stack = torch.empty(c, *shape)
    views = list(stack.unbind(0))
    by_stack = best_us(lambda: torch.stack(tensors, out=stack), reps)
    by_foreach = best_us(lambda: torch._foreach_copy_([v.view(t.shape) for v, t in zip(views, tensors)], tensors), reps)
    return f"stage {c} × {shape}: torch.stack \\| _foreach_copy_", by_stack, by_foreach


def _layout(name: str, groups: list[tuple[int, int]], reps: int) -> list[tuple[str, float, float]]:
    lay = Layout(groups)
    x = torch.randn(lay.numel)
    index = lay._index()

    def per_group_plus_t():
        out = torch.empty_like(x)
        for a, o in zip(lay.pieces(x), [out[at : at + n * p * p].view(n, p, p) for at, _, n, p in lay.spans]):
            torch.add(a, a.mT, out=o)
        return out

    def segment(y):
        return torch.segment_reduce(y, "sum", lengths=index.lengths, unsafe=True)

    sums = (
        best_us(lambda: torch.cat([q.sum((-2, -1)) for q in lay.pieces(x)]), reps),
        best_us(lambda: segment(x), reps),
    )
    norms = (
        best_us(lambda: torch.cat([torch.linalg.matrix_norm(q) for q in lay.pieces(x)]), reps),
        best_us(lambda: segment(x * x).sqrt(), reps),
    )
    plus_t = best_us(lambda: x + x.index_select(0, index.perm), reps), best_us(per_group_plus_t, reps)
    blocks = [torch.randn(lay.numel) for _ in range(3)]

    def per_group():
        s = torch.stack(blocks).view(3, -1)
        views = [s[:, at : at + n * p * p].view(3, n, p, p) for at, _, n, p in lay.spans]
        return torch.cat([torch.linalg.matrix_norm(v) for v in views], 1)

    three = (
        best_us(per_group, reps),
        best_us(lambda: lay.norms(blocks), reps),  # one multi-tensor norm over every layer's view
    )
    return [
        (f"{name} sums: per group \\| segment_reduce", *sums),
        (f"{name} norms: per group \\| segment_reduce", *norms),
        (f"{name} x + xᵀ: index_select \\| per group", *plus_t),
        (f"{name} norms of 3 blocks: per group \\| _foreach_norm", *three),
    ]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=300)
    args = ap.parse_args(argv)
    counts_checked(ap, args, "reps")
    torch.set_num_threads(1)
    env = environment(torch.device("cpu"))
    print(f"{describe(env)}\n")
    print("| operation: first \\| second | first (µs) | second (µs) | first ÷ second |")
    print("|---|---:|---:|---:|")
    with torch.no_grad():
        rows = [_gram(p, n, args.reps) for p, n in GRAM_SHAPES] + [_stage(s, c, args.reps) for s, c in STACKS]
        rows += [row for name, groups in LAYOUTS.items() for row in _layout(name, groups, args.reps)]
        for label, a, b in rows:
            print(f"| {label} | {a:.1f} | {b:.1f} | {a / b:.2f} |")


if __name__ == "__main__":
    main()
