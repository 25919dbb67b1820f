"""The benchmark: one optimizer step of every contender on every workload (pytest-benchmark).

Run with ``bash benchmarks/run.sh`` (set-up, run, report) or ``python -m pytest benchmarks``;
the default ``python -m pytest`` runs ``tests/`` only. Cases run in two passes over the
workloads: first the quick contenders (``fgd-auto`` first, so the denominator of every ratio
comes before its contenders), then the slow ones (``SLOW``), so a run that is cut off loses
the slow cases of the last workloads rather than whole workloads.
Each case records, in ``benchmark.extra_info``: stability after the gradient stream, peak
extra memory, the cost model and the floor (see :mod:`measure`, :mod:`costmodel`).
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.contenders import CONTENDERS, contender
from benchmarks.measure import LR, measure_case

WORKLOADS = ("wrn-28-10", "resnet-50", "vgg-16", "transformer")
SLOW = ("cayley-sgd-dense", "geoopt-canonical", "torch-orthogonal")
CASES = [(w, c.name) for w in WORKLOADS for c in CONTENDERS if c.name not in SLOW] + [
    (w, name) for w in WORKLOADS for name in SLOW
]


@pytest.mark.parametrize(("workload_name", "contender_name"), CASES, ids=[f"{w}/{c}" for w, c in CASES])
def test_step(benchmark, bench, workload_name, contender_name):
    w, c = bench.workloads[workload_name], contender(contender_name)
    benchmark.group = f"{w.name} ({w.description}, rule {w.rule!r})"
    reason = bench.skip_reason(w, c)
    if reason:
        bench.record_skip(w, c, reason)
        pytest.skip(reason)
    torch.manual_seed(0)  # torch's orthogonal parametrization draws a random completion
    case = c.make(w.model(bench.device), w.rule, LR)
    info = bench.case_info(w, c)
    info.update(measure_case(benchmark, case, bench.pool(w), bench.device, bench.budget, bench.stability_skip(c)))
    benchmark.extra_info.update(info)
    bench.record_case(benchmark, info)
