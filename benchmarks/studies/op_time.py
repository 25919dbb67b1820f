"""Where a contender's step spends its time, op by op: the matrix products by shape (with their
flop rate), the large elementwise ops, and the small ones (one CPU thread, ``cpu``-scale
workloads).

Every aten op of ``--steps`` steps is timed under a dispatch mode (which adds a few µs to each
op, so the small ops read high; the products' times and rates are those of the calls
themselves). The plain step time (median, no mode) is printed beside the sums.

    python -m benchmarks.studies.op_time [--workload 1] [--contenders fgd-torch cayley-sgd-lowrank]
        [--steps 20] [--top 12]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.contenders import contender
from benchmarks.machine import describe, environment
from benchmarks.measure import LR, gradient_pool
from benchmarks.opcount import is_view, product
from benchmarks.studies import counts_checked
from benchmarks.workloads import weight_shapes, workloads

_LARGE = 1 << 14  # an op touching a tensor of at least this many elements is "large"


class _Timed(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seconds: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()
        self.flops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        dt = time.perf_counter() - t0
        name = func.overloadpacket.__name__
        found = product(name, args)
        if found is not None:
            x, y, flops = found
            key = f"{name} {tuple(x.shape)}·{tuple(y.shape)}"
            self.flops[key] += flops
        elif is_view(str(func.overloadpacket)):
            key = "views"
        else:
            large = any(isinstance(a, torch.Tensor) and a.numel() >= _LARGE for a in args)
            key = "large elementwise" if large else "small ops"
        self.seconds[key] += dt
        self.calls[key] += 1
        return out


def profile(name: str, w, steps: int) -> tuple[float, _Timed]:
    """(median plain step time in s, the timed mode after ``steps`` more steps)."""
    pool = gradient_pool(weight_shapes(w), torch.device("cpu"))
    case = contender(name).make(w.model("cpu"), w.rule, LR)
    for r in range(5):
        case.set_grads(pool[r % len(pool)])
        case.step()
    plain = []
    for r in range(steps):
        case.set_grads(pool[r % len(pool)])
        t0 = time.perf_counter()
        case.step()
        plain.append(time.perf_counter() - t0)
    timed = _Timed()
    with timed:
        for r in range(steps):
            case.set_grads(pool[r % len(pool)])
            case.step()
    return statistics.median(plain), timed


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", type=int, default=1, help="index into the cpu-scale workloads (1: ResNet-50 ×0.2)")
    ap.add_argument("--contenders", nargs="+", default=["fgd-torch", "cayley-sgd-lowrank"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top", type=int, default=12, help="the products listed per contender")
    args = ap.parse_args(argv)
    every = workloads("cpu")
    if not 0 <= args.workload < len(every):
        ap.error(f"--workload {args.workload}: an index 0–{len(every) - 1} ({', '.join(w.description for w in every)})")
    counts_checked(ap, args, "steps")
    torch.set_num_threads(1)
    env = environment(torch.device("cpu"))
    w = every[args.workload]
    print(f"{describe(env)} | {w.description}")
    for name in args.contenders:
        plain, t = profile(name, w, args.steps)
        per = lambda k, t=t: t.seconds[k] / args.steps * 1e3  # noqa: E731  (ms per step)
        products = [k for k in t.seconds if k in t.flops]
        blas = sum(per(k) for k in products)
        gflop = sum(t.flops[k] for k in products) / args.steps / 1e9
        print(
            f"\n{name}: step {plain * 1e3:.2f} ms plain; timed per step: products {blas:.2f} ms "
            f"({gflop:.3f} Gflop, {gflop / blas * 1e3:.0f} GF/s), large elementwise "
            f"{per('large elementwise'):.2f} ms, small ops {per('small ops'):.2f} ms, views {per('views'):.2f} ms"
        )
        for k in sorted(products, key=lambda k: -t.seconds[k])[: args.top]:
            rate = t.flops[k] / t.seconds[k] / 1e9
            print(f"  {k:44s} {per(k) * 1e3:7.0f} µs/step {t.calls[k] / args.steps:5.1f} calls {rate:5.0f} GF/s")


if __name__ == "__main__":
    main()
