"""One Gram product ``RPᵀ`` (``R``, ``P``: ``p × n``, the torch backend's rows layout) at the
workloads' layer shapes, against the same product with p padded (zero rows: what copying the
operands into padded scratch would cost and win), measured interleaved on one CPU thread.

Every round times each variant once (``--reps`` products; the order alternates); per shape it
prints each variant's median time, its rate in GF/s of the unpadded product's flops, and the
median of the rounds' ratios to the plain product.

    python -m benchmarks.studies.gram_shapes [--shapes 51x459 102x918 48x432 96x864] [--pad 8 16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.machine import describe, environment
from benchmarks.studies import counts_checked


def _variants(p: int, n: int, pads: list[int]) -> dict:
    """The plain product and, per pad, the padded product alone and with the two copies."""
    gen = torch.Generator().manual_seed(p * n)
    r, s = (torch.randn(p, n, generator=gen) for _ in range(2))
    out = torch.empty(p, p)
    variants = {"plain": lambda: torch.mm(r, s.T, out=out)}
    for pad in pads:
        q = -(-p // pad) * pad
        if q == p:
            continue
        rq, sq, oq = torch.zeros(q, n), torch.zeros(q, n), torch.empty(q, q)

        def copied(rq=rq, sq=sq, oq=oq):
            rq[:p].copy_(r)
            sq[:p].copy_(s)
            torch.mm(rq, sq.T, out=oq)

        variants[f"p→{q}"] = lambda rq=rq, sq=sq, oq=oq: torch.mm(rq, sq.T, out=oq)
        variants[f"p→{q} + copies"] = copied
    return variants


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["51x459", "102x918", "48x432", "96x864"], help="p×n")
    ap.add_argument("--pad", nargs="+", type=int, default=[8, 16], help="pad p to a multiple of these")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args(argv)
    counts_checked(ap, args, "rounds", "reps")
    torch.set_num_threads(1)
    env = environment(torch.device("cpu"))
    print(f"{describe(env)} | {args.rounds} rounds")
    for shape in args.shapes:
        p, n = (int(x) for x in shape.split("x"))
        variants = _variants(p, n, args.pad)
        times: dict[str, list[float]] = {k: [] for k in variants}
        for r in range(args.rounds + 2):
            order = list(variants.items())
            for name, f in order if r % 2 else order[::-1]:
                t0 = time.perf_counter()
                for _ in range(args.reps):
                    f()
                if r >= 2:
                    times[name].append((time.perf_counter() - t0) / args.reps)
        flops = 2 * p * p * n
        cells = []
        for name, ts in times.items():
            ratio = statistics.median(a / b for a, b in zip(ts, times["plain"]))
            med = statistics.median(ts)
            cells.append(f"{name} {med * 1e6:.1f} µs ({flops / med / 1e9:.0f} GF/s, {ratio:.2f}×)")
        print(f"p={p} n={n}: " + ", ".join(cells))


if __name__ == "__main__":
    main()
