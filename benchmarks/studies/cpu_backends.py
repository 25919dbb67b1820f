"""Side-by-side CPU step time of the FGD backends on WRN-28-k's orthogonal layers.

Usage: ``python -m benchmarks.studies.cpu_backends [--widths 4 10] [--repeat 5] [--threads N]``. Prints the median
step time of each backend and the speed-up of ``torch`` over ``reference``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

import fgd_fast
from benchmarks.machine import describe, environment
from benchmarks.models import wide_resnet
from benchmarks.studies import counts_checked
from fgd_fast.backends import BACKENDS


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--widths", type=float, nargs="+", default=[4, 10])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--backends", nargs="+", default=["reference", "torch"], choices=BACKENDS)
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's; the README's table used 2)")
    args = ap.parse_args(argv)
    counts_checked(ap, args, "repeat", "threads")
    for width in args.widths:  # (WRN-28-0 would build 1-channel layers and time them as if WRN-28-k)
        if not (math.isfinite(width) and width > 0):
            ap.error(f"--widths {width:g}: WRN-28-k widths must be positive numbers, e.g. 4 10 (0.5 narrows)")
    # (after the threads are set: the header reports the count used)
    print(f"{describe(environment(torch.device('cpu')))} | float32")
    for width in args.widths:
        torch.manual_seed(0)
        params = fgd_fast.stiefel_param_groups(wide_resnet(28, width), "official")[0]["params"]
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        times = {}
        for backend in args.backends:
            opt = fgd_fast.FGD([dict(params=params, orthogonal=True)], lr=0.01, backend=backend)
            opt.step()
            opt.step()  # warm-up: state exists, momentum form from here on
            samples = []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                opt.step()
                samples.append(time.perf_counter() - t0)
            times[backend] = statistics.median(samples)
        cells = " | ".join(f"{b} {t:.3f} s" for b, t in times.items())
        ratio = times.get("reference", float("nan")) / times.get("torch", float("nan"))
        print(f"WRN-28-{width:g}: {len(params)} layers | {cells} | reference/torch {ratio:.2f}x")


if __name__ == "__main__":
    main()
