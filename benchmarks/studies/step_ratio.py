"""FGD's step time next to other contenders', measured interleaved (issue: the torch backend
at ≤ 0.75× the low-rank Cayley SGD on every CPU workload).

Every round steps each contender once, in turn, on the main job's gradient stream (so load
drifts hit all alike; the order alternates from round to round); per workload it prints each
contender's median step time with two ratios to ``--base`` (default: the low-rank Cayley SGD):
the ratio of the medians, and the median of the rounds' ratios. On a CPU it uses one torch
thread by default, like the main job. ``--faults`` adds each contender's median count of minor
page faults per step (memory the allocator returned to the system and touches again: how much
of it a step pays depends on what the process allocated before, e.g. the previous workload).

    python -m benchmarks.studies.step_ratio [--scale cpu] [--rounds 30] [--threads 1] [--faults]
        [--contenders fgd-torch cayley-sgd-lowrank ...] [--base cayley-sgd-lowrank] [--workloads 1]

``--workloads`` picks workloads by index (default: all, in order). A workload's times depend on
what the process ran before it: a contender that allocates temporaries every step (Cayley SGD)
pays page faults in a fresh process until the allocator keeps larger blocks, which a workload run
after a larger one finds already done; ``--faults`` shows it, and ``--workloads 1`` runs ResNet-50
×0.2 first.
"""

from __future__ import annotations

import argparse
import statistics
import time

try:
    import resource
except ImportError:  # (not on Windows)
    resource = None

import torch

from benchmarks.contenders import contender, unavailable
from benchmarks.machine import environment
from benchmarks.measure import LR, gradient_pool, synchronizer
from benchmarks.workloads import weight_shapes, workloads


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", default="cpu")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1, help="torch threads on a CPU (the main job uses 1)")
    ap.add_argument("--contenders", nargs="+", default=["fgd-torch", "cayley-sgd-lowrank", "sgd"])
    ap.add_argument("--base", default="cayley-sgd-lowrank", help="the contender the ratios are taken to")
    ap.add_argument("--faults", action="store_true", help="also the minor page faults per step (Unix)")
    ap.add_argument("--workloads", type=int, nargs="+", help="indices of the workloads to run (default: all)")
    args = ap.parse_args(argv)
    if args.base not in args.contenders:
        ap.error(f"--base {args.base} is not among --contenders")
    if args.faults and resource is None:
        ap.error("--faults needs the resource module (Unix)")
    minor = (lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt) if args.faults else (lambda: 0)  # noqa: E731
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    env = environment(device)
    where = env.get("gpu") or env.get("cpu")
    print(
        f"{where} | {torch.get_num_threads()} threads | load {env['load_average']} | torch {torch.__version__} | "
        f"commit {env['commit']['id'][:7]} | {args.rounds} interleaved rounds, median "
        f"(ratio to {args.base}: of the medians, median per round)"
    )
    sync = synchronizer(device)
    names = [n for n in args.contenders if unavailable(contender(n), device) is None]
    every = workloads(args.scale)
    if args.workloads and not all(0 <= i < len(every) for i in args.workloads):
        ap.error(f"--workloads: indices 0–{len(every) - 1} ({', '.join(w.description for w in every)})")
    for w in [every[i] for i in args.workloads] if args.workloads else every:
        pool = gradient_pool(weight_shapes(w), device)
        cases = {n: contender(n).make(w.model(device), w.rule, LR) for n in names}
        times: dict[str, list[float]] = {n: [] for n in names}
        faults: dict[str, list[int]] = {n: [] for n in names}
        for r in range(args.rounds + 3):
            order = list(cases.items())
            for n, case in order if r % 2 else order[::-1]:  # (alternating order: no contender always first)
                case.set_grads(pool[r % len(pool)])
                sync()
                f0, t0 = minor(), time.perf_counter()
                case.step()
                sync()
                if r >= 3:  # warm-up: momentum exists, tables built
                    times[n].append(time.perf_counter() - t0)
                    faults[n].append(minor() - f0)
        medians = {n: statistics.median(t) for n, t in times.items()}
        base = medians.get(args.base, float("nan"))
        # also the median of each round's ratio: a round's steps run back to back, so a drift of the
        # machine's speed (shared hosts: ±40% within minutes) hits both sides of a ratio alike
        per_round = {n: statistics.median(a / b for a, b in zip(t, times[args.base])) for n, t in times.items()}
        cells = ", ".join(
            f"{n} {m * 1e3:.2f} ms ({m / base:.2f}×, {per_round[n]:.2f}×"
            + (f"; {statistics.median(faults[n]):.0f} faults)" if args.faults else ")")
            for n, m in medians.items()
        )
        print(f"{w.description}: {cells}")


if __name__ == "__main__":
    main()
