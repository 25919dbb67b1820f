"""The aten ops one optimizer step issues on each ``cpu``-scale workload: all of them (views
included: on a CPU each costs host time), the non-view ones (:mod:`benchmarks.opcount`), and
the flops of its matrix products.

    python -m benchmarks.studies.torch_calls [--contenders fgd-torch cayley-sgd-lowrank]
"""

from __future__ import annotations

import argparse
import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.contenders import contender
from benchmarks.machine import describe, environment
from benchmarks.measure import LR, gradient_pool
from benchmarks.opcount import is_view, product
from benchmarks.workloads import weight_shapes, workloads


class _AllOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        found = product(func.overloadpacket.__name__, args)
        if found is not None:
            self.flops += found[2]
        return func(*args, **(kwargs or {}))


def counts(name: str, w) -> tuple[int, int, int]:
    """(all aten ops, non-view aten ops, product flops) of the fourth step of ``name`` on ``w``."""
    device = torch.device("cpu")
    pool = gradient_pool(weight_shapes(w), device)
    case = contender(name).make(w.model(device), w.rule, LR)
    for r in range(3):
        case.set_grads(pool[r % len(pool)])
        case.step()
    case.set_grads(pool[3 % len(pool)])
    with _AllOps() as seen:
        case.step()
    views = sum(v for k, v in seen.ops.items() if is_view(k))
    total = sum(seen.ops.values())
    return total, total - views, seen.flops


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contenders", nargs="+", default=["fgd-torch", "cayley-sgd-lowrank"])
    args = ap.parse_args(argv)
    env = environment(torch.device("cpu"))
    print(f"{describe(env)} | per step: aten ops (not views), product Gflop")
    print("| workload | " + " | ".join(args.contenders) + " |")
    print("|---|" + "---:|" * len(args.contenders))
    for w in workloads("cpu"):
        cells = [counts(name, w) for name in args.contenders]
        print(f"| {w.description} | " + " | ".join(f"{a} ({b}), {f / 1e9:.3f}" for a, b, f in cells) + " |")


if __name__ == "__main__":
    main()
