"""A constant of the torch backend at two values, stepped side by side on the benchmark workloads.

Two FGD optimizers (torch backend) on copies of each ``cpu``-scale workload; every round steps
both on the same gradients, each with ``fgd_fast.backends.<module>.<NAME>`` set to its value
(``NAME`` for ``torch_batched``, ``module:NAME`` for another module of ``fgd_fast.backends``; the
order alternates from round to round); per workload the median step times and the median of the
rounds' ratios (second ÷ first) are printed. This is how the CPU thresholds ``_CPU_STACK_BELOW``
and ``torch_bucket:_HALVES_FROM`` were chosen, and how ``algebra._NORM_BOUND_FIRST`` was measured.

    python -m benchmarks.studies.torch_knobs _CPU_STACK_BELOW 65536 16384 [--rounds 40]
    python -m benchmarks.studies.torch_knobs algebra:_NORM_BOUND_FIRST 0 1
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time

import torch

from benchmarks.contenders import contender
from benchmarks.machine import describe, environment
from benchmarks.measure import LR, gradient_pool
from benchmarks.workloads import weight_shapes, workloads


def _owner(knob: str):
    """``(module, name)`` of ``NAME`` (in ``torch_batched``) or ``module:NAME`` (in ``fgd_fast.backends``)."""
    module, _, name = knob.rpartition(":")
    return importlib.import_module(f"fgd_fast.backends.{module or 'torch_batched'}"), name


def compare(w, knob: str, values: tuple[int, int], rounds: int) -> tuple[float, float, float]:
    """(median step with the first value, with the second, median of the rounds' second ÷ first)."""
    device = torch.device("cpu")
    pool = gradient_pool(weight_shapes(w), device)
    cases = [contender("fgd-torch").make(w.model(device), w.rule, LR) for _ in values]
    times: list[list[float]] = [[], []]
    module, name = _owner(knob)
    kept = getattr(module, name)
    try:
        for r in range(rounds + 3):
            for k in (0, 1) if r % 2 else (1, 0):
                setattr(module, name, values[k])
                cases[k].set_grads(pool[r % len(pool)])
                t0 = time.perf_counter()
                cases[k].step()
                if r >= 3:
                    times[k].append(time.perf_counter() - t0)
    finally:
        setattr(module, name, kept)
    ratio = statistics.median(b / a for a, b in zip(*times))
    return statistics.median(times[0]), statistics.median(times[1]), ratio


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("name", help="a constant of fgd_fast.backends.torch_batched, or module:NAME for another module")
    ap.add_argument("first", type=int)
    ap.add_argument("second", type=int)
    ap.add_argument("--rounds", type=int, default=40)
    args = ap.parse_args(argv)
    module, name = _owner(args.name)
    if not hasattr(module, name):
        ap.error(f"{module.__name__} has no {name}")
    torch.set_num_threads(1)
    env = environment(torch.device("cpu"))
    print(f"{describe(env)} | {args.rounds} rounds")
    print(f"| workload | {args.name}={args.first} | ={args.second} | second ÷ first (median per round) |")
    print("|---|---:|---:|---:|")
    for w in workloads("cpu"):
        a, b, ratio = compare(w, args.name, (args.first, args.second), args.rounds)
        print(f"| {w.description} | {a * 1e3:.2f} ms | {b * 1e3:.2f} ms | {ratio:.3f} |")


if __name__ == "__main__":
    main()
