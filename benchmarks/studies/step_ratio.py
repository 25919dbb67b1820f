"""FGD's step time next to other contenders', measured interleaved (issue: the torch backend
at ≤ 0.75× the low-rank Cayley SGD on every CPU workload).

Every round steps each contender once, in turn, on the main job's gradient stream (so load
drifts hit all alike; the order rotates from round to round: :func:`round_order`); per workload it prints each
contender's median step time with two ratios to ``--base`` (default: the low-rank Cayley SGD):
the ratio of the medians, and the median of the rounds' ratios. On a CPU it uses one torch
thread by default, like the main job. ``--faults`` adds each contender's median count of minor
page faults per step (memory the allocator returned to the system and touches again: how much
of it a step pays depends on what the process allocated before, e.g. the previous workload).

    python -m benchmarks.studies.step_ratio [--scale cpu] [--rounds 30] [--threads 1] [--faults]
        [--contenders fgd-torch cayley-sgd-lowrank ...] [--base cayley-sgd-lowrank] [--workloads 1]
        [--markdown]

``--markdown`` prints a report section (one row per contender, one column per workload): the
main job (``benchmarks/run.sh``) appends it to its report, the ratios to quote.

``--workloads`` picks workloads by index (default: all, in order). A workload's times depend on
what the process ran before it: a contender that allocates temporaries every step (Cayley SGD)
pays page faults in a fresh process until the allocator keeps larger blocks, which a workload run
after a larger one finds already done; ``--faults`` shows it, and ``--workloads 1`` runs ResNet-50
×0.2 first.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

try:
    import resource
except ImportError:  # (not on Windows)
    resource = None

import torch

from benchmarks.contenders import CONTENDERS, contender, unavailable
from benchmarks.machine import bench_device, describe, environment
from benchmarks.measure import LR, gradient_pool, synchronizer
from benchmarks.studies import counts_checked
from benchmarks.workloads import SCALES, default_scale, weight_shapes, workloads


def interleaved(case_of: dict, pool: list, rounds: int, sync, minor) -> tuple[dict, dict]:
    """Per contender, the step times and page faults of ``rounds`` interleaved rounds (after 3
    warm-up rounds: momentum exists, tables built); see :func:`round_order`."""
    times: dict[str, list[float]] = {n: [] for n in case_of}
    faults: dict[str, list[int]] = {n: [] for n in case_of}
    for r in range(rounds + 3):
        for n, case in round_order(list(case_of.items()), r):
            case.set_grads(pool[r % len(pool)])
            sync()
            f0, t0 = minor(), time.perf_counter()
            case.step()
            sync()
            if r >= 3:
                times[n].append(time.perf_counter() - t0)
                faults[n].append(minor() - f0)
    return times, faults


def round_order(items: list, r: int) -> list:
    """The order of round ``r``: rotated by ``r`` places, and reversed in every other cycle of
    rotations, so that over rounds every contender runs in every place and after every other one
    alike (a reversal alone kept the middle ones in the middle)."""
    k = max(len(items), 1)
    turned = items[r % k :] + items[: r % k]
    return turned if (r // k) % 2 == 0 else turned[::-1]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.3g} µs"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--scale", default=None, choices=SCALES, help="workload sizes (default: the benchmark's, cpu on a CPU)"
    )
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1, help="torch threads on a CPU (the main job uses 1)")
    ap.add_argument("--contenders", nargs="+", default=["fgd-torch", "cayley-sgd-lowrank", "sgd"])
    ap.add_argument("--base", default="cayley-sgd-lowrank", help="the contender the ratios are taken to")
    ap.add_argument("--faults", action="store_true", help="also the minor page faults per step (Unix)")
    ap.add_argument("--workloads", type=int, nargs="+", help="indices of the workloads to run (default: all)")
    ap.add_argument("--markdown", action="store_true", help="a markdown section (the main job appends it)")
    args = ap.parse_args(argv)
    counts_checked(ap, args, "rounds", "threads")
    known = [c.name for c in CONTENDERS]
    unknown = [n for n in args.contenders if n not in known]
    if unknown:
        ap.error(f"--contenders: unknown {', '.join(unknown)}; choose from {', '.join(known)}")
    if args.base not in args.contenders:
        ap.error(f"--base {args.base} is not among --contenders")
    if args.faults and resource is None:
        ap.error("--faults needs the resource module (Unix)")
    minor = (lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt) if args.faults else (lambda: 0)  # noqa: E731
    device = bench_device()
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    scale = args.scale or default_scale()
    env = environment(device)
    sync = synchronizer(device)
    names = [n for n in args.contenders if unavailable(contender(n), device) is None]
    if args.base not in names:  # (the ratios are taken to it)
        why = unavailable(contender(args.base), device)
        ap.error(
            f"--base {args.base}: not available on this device ({why}); "
            f"choose one of the available contenders: {', '.join(names) or 'none'}"
        )
    every = workloads(scale)
    if args.workloads and not all(0 <= i < len(every) for i in args.workloads):
        ap.error(f"--workloads: indices 0–{len(every) - 1} ({', '.join(w.description for w in every)})")
    chosen = [every[i] for i in args.workloads] if args.workloads else every
    head = f"{args.rounds} interleaved rounds, median (ratio to {args.base}: of the medians, median per round)"
    if args.markdown:
        print(f"\n## Interleaved: step time and ratio to `{args.base}`\n")
        print(
            f"`python -m benchmarks.studies.step_ratio {' '.join(argv if argv is not None else sys.argv[1:])}` "
            f"({head}; every round steps each contender "
            "once, in turn, the order rotating, so a change in the machine's speed hits all alike: the ratios "
            f"to quote). {describe(env)}.\n"
        )
        print("| contender | " + " | ".join(w.description for w in chosen) + " |")
        print("|---|" + "---|" * len(chosen))
    else:
        print(f"{describe(env)} | {head}")
    rows: dict[str, list[str]] = {n: [] for n in names}
    for w in chosen:
        pool = gradient_pool(weight_shapes(w), device)
        case_of = {n: contender(n).make(w.model(device), w.rule, LR) for n in names}
        times, faults = interleaved(case_of, pool, args.rounds, sync, minor)
        medians = {n: statistics.median(t) for n, t in times.items()}
        base = medians.get(args.base, float("nan"))
        # also the median of each round's ratio: a round's steps run back to back, so a drift of the
        # machine's speed (shared hosts: ±40% within minutes) hits both sides of a ratio alike
        per_round = {n: statistics.median(a / b for a, b in zip(t, times[args.base])) for n, t in times.items()}
        for n, m in medians.items():
            fault = f"; {statistics.median(faults[n]):.0f} faults" if args.faults else ""
            rows[n].append(f"{_ms(m)} ({m / base:.2f}×, {per_round[n]:.2f}×{fault})")
        if not args.markdown:
            print(f"{w.description}: " + ", ".join(f"{n} {rows[n][-1]}" for n in names))
    if args.markdown:
        for n in names:
            print(f"| {n} | " + " | ".join(rows[n]) + " |")
        skipped = [n for n in args.contenders if n not in names]
        if skipped:
            print(f"\nNot run on this device (the reasons are in the report above): {', '.join(skipped)}.")


if __name__ == "__main__":
    main()
