"""What the step guard costs: step time of one FGD backend with the guard on (default), with
only the checks' prediction (``guard=False``: the exact distance is still computed for
``check_manifold``), and with neither (``guard=False``, checks off: no prediction at all).

Every round times each setting once, in turn (interleaved, so load drifts hit all alike); the
median over rounds is printed per workload, with the ratio to the unpredicted step.

    python -m benchmarks.studies.guard_cost [--scale cpu] [--backend torch] [--rounds 15] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import fgd_fast
from benchmarks.machine import describe, environment
from benchmarks.studies import counts_checked
from benchmarks.workloads import SCALES, workloads
from fgd_fast.backends import BACKENDS

SETTINGS = {
    "guard (default)": dict(guard=True),
    "prediction only": dict(guard=False),
    "neither": dict(guard=False, check_finite=False, check_manifold=False),
}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", default="cpu", choices=SCALES)
    ap.add_argument("--backend", default="torch", choices=BACKENDS)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's; the README's table used 2)")
    args = ap.parse_args(argv)
    counts_checked(ap, args, "rounds", "threads")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    env = environment(device)  # (after the threads are set: the header reports the count used)
    print(f"{describe(env)} | backend {args.backend}")
    for w in workloads(args.scale):
        model = w.model(device)
        params = [p for _, p in fgd_fast.select_stiefel(model, w.rule)]
        gen = torch.Generator(device=device).manual_seed(0)
        grads = [torch.randn(p.shape, generator=gen, device=device) * 1e-3 for p in params]
        opts = {}
        for name, kw in SETTINGS.items():
            copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
            opt = fgd_fast.FGD([dict(params=copies, orthogonal=True)], lr=0.01, backend=args.backend, **kw)
            opts[name] = (opt, copies)
        times = {name: [] for name in SETTINGS}
        for r in range(args.rounds + 2):
            for name, (opt, copies) in opts.items():
                for p, g in zip(copies, grads):
                    p.grad = g
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                opt.step()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                if r >= 2:  # two warm-up steps: Φ exists
                    times[name].append(time.perf_counter() - t0)
        base = statistics.median(times["neither"])
        medians = {name: statistics.median(t) for name, t in times.items()}
        cells = ", ".join(f"{name} {m * 1e3:.1f} ms ({m / base:.2f}×)" for name, m in medians.items())
        print(f"{w.description} ({len(params)} layers): {cells}")


if __name__ == "__main__":
    main()
