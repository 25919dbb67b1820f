"""Where the torch backend's CPU step goes: the middle's share, and what a transposed read costs.

For each ``cpu``-scale benchmark workload (float32, one thread, the benchmark's gradient stream)
this study times the torch-backend FGD step and, interleaved, the low-rank Cayley SGD step
(median of ``--rounds``), and the time spent inside :func:`fgd_fast.backends.algebra.middle`
(the ``p × p`` middle and guard, a timer around the call) per step. It also times an
elementwise add of a ``(12, 128, 128)`` batch with a contiguous second operand and with a
transposed one (``x + x.mT``: what a ``sym`` reads), the cost behind the middle's one-transpose
forms.

    python -m benchmarks.studies.middle_share [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.contenders import contender
from benchmarks.machine import describe, environment
from benchmarks.measure import LR, gradient_pool
from benchmarks.studies import counts_checked
from benchmarks.workloads import weight_shapes, workloads
from fgd_fast.backends import algebra, torch_groups


def _timed_middle():
    """Wrap the torch backend's ``middle`` with a timer; returns (seconds list, undo)."""
    spent: list[float] = []
    real = torch_groups.middle

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - t0)

    torch_groups.middle = timed
    return spent, lambda: setattr(torch_groups, "middle", real)


def step_and_middle(w, rounds: int) -> dict[str, float]:
    """Median step times (s) of FGD (torch backend) and low-rank Cayley, and FGD's middle per step."""
    device = torch.device("cpu")
    pool = gradient_pool(weight_shapes(w), device)
    fgd = contender("fgd-torch").make(w.model(device), w.rule, LR)
    cayley = contender("cayley-sgd-lowrank").make(w.model(device), w.rule, LR)
    spent, undo = _timed_middle()
    times: dict[str, list[float]] = {"fgd": [], "cayley": []}
    middle: list[float] = []
    try:
        for r in range(rounds + 3):
            for name, case in (("fgd", fgd), ("cayley", cayley)):
                case.set_grads(pool[r % len(pool)])
                spent.clear()
                t0 = time.perf_counter()
                case.step()
                if r >= 3:
                    times[name].append(time.perf_counter() - t0)
                    if name == "fgd":
                        middle.append(sum(spent))
    finally:
        undo()
    return {
        "fgd": statistics.median(times["fgd"]),
        "cayley": statistics.median(times["cayley"]),
        "middle": statistics.median(middle),
    }


def transposed_add(reps: int = 200) -> tuple[float, float]:
    """Seconds of ``x + y`` and of ``x + x.mT`` for a (12, 128, 128) float32 batch."""
    x, y = torch.randn(12, 128, 128), torch.randn(12, 128, 128)
    out = []
    for f in (lambda: x + y, lambda: x + x.mT):
        for _ in range(10):
            f()
        t0 = time.perf_counter()
        for _ in range(reps):
            f()
        out.append((time.perf_counter() - t0) / reps)
    return out[0], out[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args(argv)
    counts_checked(ap, args, "rounds")
    torch.set_num_threads(1)
    assert torch_groups.middle is algebra.middle, "the torch backend calls algebra.middle"
    env = environment(torch.device("cpu"))
    print(f"{describe(env)} | {args.rounds} interleaved rounds (median)")
    contiguous, transposed = transposed_add()
    print(f"\n(12, 128, 128) float32 add: x + y {contiguous * 1e6:.1f} µs, x + x.mT {transposed * 1e6:.1f} µs")
    print("\n| workload | FGD step | its middle | low-rank Cayley | FGD ÷ Cayley |")
    print("|---|---:|---:|---:|---:|")
    for w in workloads("cpu"):
        t = step_and_middle(w, args.rounds)
        share = f"{t['middle'] * 1e3:.2f} ms ({t['middle'] / t['fgd']:.0%})"
        print(
            f"| {w.description} | {t['fgd'] * 1e3:.2f} ms | {share} | {t['cayley'] * 1e3:.2f} ms | "
            f"{t['fgd'] / t['cayley']:.2f}× |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
