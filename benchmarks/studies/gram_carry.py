"""Carried Gram blocks (``FGD(gram_refresh=k)``): the step time they save and where FGD settles.

The torch backend on a CPU may take ``θᵀθ``, ``θᵀΦ``, ``ΦᵀΦ`` from the last step's ``p × p``
blocks for ``k − 1`` steps out of ``k`` (``fgd_fast.backends.carry``). This study measures, on
each ``cpu``-scale benchmark workload (float32, one thread):

* the step time of ``gram_refresh`` 1 (the default) and each ``--refresh``, interleaved with the
  low-rank Cayley SGD (median of ``--rounds``; ratios to Cayley), on the benchmark's gradient
  stream;
* the settled ``‖θᵀθ − I‖_F`` (largest over the layers, mean of the last tenth of ``--steps``
  steps, unit-norm random gradients; as ``tf32_middle.py``) at lr 1e-2 (the O(η²) drift sets
  it) and 1e-4 (fp32's rounding does, and carried blocks let rounding accumulate between
  refreshes), and its ratio to ``gram_refresh=1``.

    python -m benchmarks.studies.gram_carry [--refresh 4 8] [--rounds 15] [--steps 1000]
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
from benchmarks.studies.tf32_middle import settled_distance
from benchmarks.workloads import weight_shapes, workloads
from fgd_fast.backends import carry


def _fgd(w, refresh: int, device: torch.device):
    """The benchmark's torch-backend FGD case on ``w`` with ``gram_refresh=refresh``."""
    case = contender("fgd-torch").make(w.model(device), w.rule, LR)
    case.optimizer.gram_refresh = refresh
    return case


def step_times(w, refreshes: list[int], rounds: int) -> dict[str, float]:
    """Median step time (s) per contender, interleaved rounds on the workload's gradient stream."""
    device = torch.device("cpu")
    pool = gradient_pool(weight_shapes(w), device)
    cases = {f"refresh {k}": _fgd(w, k, device) for k in refreshes}
    cases["cayley"] = contender("cayley-sgd-lowrank").make(w.model(device), w.rule, LR)
    times: dict[str, list[float]] = {n: [] for n in cases}
    for r in range(rounds + 3):
        for n, case in cases.items():
            case.set_grads(pool[r % len(pool)])
            t0 = time.perf_counter()
            case.step()
            if r >= 3:
                times[n].append(time.perf_counter() - t0)
    return {n: statistics.median(t) for n, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--refresh", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=1000, help="steps for the settled distance (0: timing only)")
    args = ap.parse_args(argv)
    counts_checked(ap, args, "rounds", "refresh")
    torch.set_num_threads(1)
    env = environment(torch.device("cpu"))
    refreshes = [1] + [k for k in args.refresh if k != 1]
    print(f"{describe(env)} | {args.rounds} interleaved rounds (median); {args.steps} steps for the settled distance")
    names = [f"refresh {k}" for k in refreshes]
    print("\n| workload | " + " | ".join(names) + " | low-rank Cayley |")
    print("|---|" + "---:|" * (len(names) + 1))
    for w in workloads("cpu"):
        t = step_times(w, refreshes, args.rounds)
        cells = [f"{t[n] * 1e3:.2f} ms ({t[n] / t['cayley']:.2f}×)" for n in names]
        print(f"| {w.description} | " + " | ".join(cells) + f" | {t['cayley'] * 1e3:.2f} ms |", flush=True)
    if args.steps <= 0:
        return 0
    print("\n| workload | lr | " + " | ".join(names) + " | largest ÷ refresh 1 |")
    print("|---|---:|" + "---:|" * (len(names) + 1))
    for w in workloads("cpu"):
        for lr in (1e-2, 1e-4):
            dist = {}
            for k in refreshes:
                carry.forget()
                dist[k] = settled_distance(weight_shapes(w), args.steps, None, lr, gram_refresh=k)
            worst = max(dist[k] for k in refreshes[1:]) / dist[1] if len(refreshes) > 1 else 1.0
            cells = " | ".join(f"{dist[k]:.3e}" for k in refreshes)
            print(f"| {w.description} | {lr:g} | {cells} | {worst:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
