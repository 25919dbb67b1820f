"""The device operations of one FGD step on the 21-layer WRN-style set of
``tests/test_op_count.py`` (:func:`benchmarks.opcount.count_wrn_style_step`), per backend: the
non-view aten ops (by name) and, for Triton, its kernel launches, counted on the CPU as a GPU
would run the step. The numbers the README quotes for the host's launch budget.

    TRITON_INTERPRET=1 python -m benchmarks.studies.op_counts [--backends torch triton]

(On a CPU, Triton runs under its interpreter only with ``TRITON_INTERPRET=1``; without it the
Triton row says why it was not run.)
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.machine import describe, environment
from benchmarks.opcount import count_wrn_style_step
from fgd_fast.backends import BackendUnavailable


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", nargs="+", default=["torch", "triton"], choices=["torch", "triton"])
    args = ap.parse_args(argv)
    print(describe(environment(torch.device("cpu"))))
    print()
    print("| backend | aten ops (not views) | Triton launches | device operations | the most frequent ops |")
    print("|---|---:|---:|---:|---|")
    for backend in args.backends:
        try:
            ops, launches = count_wrn_style_step(backend)
        except BackendUnavailable as error:
            print(f"| {backend} | – | – | – | not run: {error} |")
            continue
        total = sum(ops.values())
        top = ", ".join(f"{name.removeprefix('aten.')} {n}" for name, n in ops.most_common(8))
        print(f"| {backend} | {total} | {launches} | {total + launches} | {top} |")


if __name__ == "__main__":
    main()
