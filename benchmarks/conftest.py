"""pytest set-up of the benchmark suite (``python -m pytest benchmarks``; see ``run.sh``).

Options: ``--bench-scale full|cpu|tiny`` (default: ``FGD_BENCH_SCALE``, else ``full`` on a
GPU and ``cpu`` without), ``--bench-record FILE`` (default ``FGD_BENCH_RECORD``: a JSON-lines
file that gets one line per case as soon as it finishes, so a run that is cut off keeps
what it measured), ``--bench-allow-interpreter`` (run ``fgd-triton`` under the Triton
interpreter on a CPU; for the smoke test only). ``FGD_BENCH_DEVICE=cpu`` benchmarks the CPU
on a GPU machine; ``FGD_BENCH_THREADS=k`` sets torch's CPU threads (default: torch's).

The session fixture :func:`bench` measures the machine's rates once, before the first case,
and collects the skipped cases; :func:`pytest_benchmark_update_json` adds all of it to the
pytest-benchmark JSON under the key ``"fgd_bench"``, which ``report.py`` reads.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

from benchmarks.contenders import FEEDBACK, MOMENTUM, Contender
from benchmarks.costmodel import floor_seconds, step_cost
from benchmarks.machine import bench_device, device_rates, environment
from benchmarks.measure import LR, POOL, gradient_pool
from benchmarks.plan import BUDGETS, planned_skip, stability_skip
from benchmarks.workloads import SCALES, Workload, default_scale, layer_shapes, weight_shapes, workloads
from fgd_fast.backends import DEFAULT_PRECISION, checked_precision
from fgd_fast.functional import backend_for


def pytest_configure(config):
    # geoopt's import calls torch.jit.script, deprecated in this torch: noise, not a finding
    config.addinivalue_line("filterwarnings", "ignore:`torch.jit.script` is deprecated:DeprecationWarning")
    threads = os.environ.get("FGD_BENCH_THREADS")
    if threads:
        if not threads.isdigit() or int(threads) < 1:
            raise pytest.UsageError(f"FGD_BENCH_THREADS={threads!r}: give a thread count >= 1 (1, or the core count)")
        torch.set_num_threads(int(threads))


def pytest_addoption(parser):
    group = parser.getgroup("fgd_fast benchmarks")
    group.addoption(
        "--bench-scale",
        choices=SCALES,
        default=None,
        help="workload sizes (default: FGD_BENCH_SCALE, else full on a GPU, cpu without)",
    )
    group.addoption(
        "--bench-record", default=os.environ.get("FGD_BENCH_RECORD"), help="JSON-lines file, one line per finished case"
    )
    group.addoption(
        "--bench-allow-interpreter",
        action="store_true",
        help="time fgd-triton under the Triton interpreter on a CPU (smoke test only)",
    )


class BenchSession:
    """Device, scale, budgets, machine rates, skipped cases and the JSON-lines record."""

    def __init__(self, config):
        self.device = bench_device()
        self.scale = config.getoption("--bench-scale") or default_scale()
        self.budget = BUDGETS[self.scale]
        self.allow_interpreter = config.getoption("--bench-allow-interpreter")
        self.workloads = {w.name: w for w in workloads(self.scale)}
        self.record_path = config.getoption("--bench-record")
        self.skips: list[dict] = []
        self.environment = environment(self.device)
        self.rates = device_rates(self.device, small=self.scale == "tiny")
        self._pool: tuple[str, list] | None = None
        self._write({"kind": "session", **self.summary()})

    def summary(self, final: bool = False) -> dict:
        """Everything about the run except the cases; ``final`` adds the load at the end."""
        return {
            "environment": self.environment,
            "rates": self.rates,
            "scale": self.scale,
            "budget": dataclasses.asdict(self.budget),
            "settings": {
                "lr": LR,
                "momentum": MOMENTUM,
                "feedback": FEEDBACK,
                "grad_sets": POOL,
                "grad_norm": "unit Frobenius norm per layer",
                "fgd_auto_resolves_to": backend_for("auto", self.device, DEFAULT_PRECISION),
            },
            "workloads": {
                w.name: {"description": w.description, "rule": w.rule, "shapes": layer_shapes(w)}
                for w in self.workloads.values()
            },
            "skips": self.skips,
            "load_average_end": [round(x, 2) for x in os.getloadavg()] if final and hasattr(os, "getloadavg") else None,
        }

    def _write(self, entry: dict) -> None:
        if self.record_path:
            Path(self.record_path).parent.mkdir(parents=True, exist_ok=True)
            with open(self.record_path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(entry, default=str) + "\n")

    def skip_reason(self, w: Workload, c: Contender) -> str | None:
        return planned_skip(self.scale, w.name, c, self.device, allow_interpreter=self.allow_interpreter)

    def stability_skip(self, c: Contender) -> dict | None:
        return stability_skip(self.scale, c, self.device)

    def record_skip(self, w: Workload, c: Contender, reason: str) -> None:
        entry = {"workload": w.name, "contender": c.name, "reason": reason}
        self.skips.append(entry)
        self._write({"kind": "skip", **entry})

    def pool(self, w: Workload) -> list[list[torch.Tensor]]:
        """The gradient sets of ``w`` (only the current workload's are kept in memory)."""
        if self._pool is None or self._pool[0] != w.name:
            self._pool = None  # free the previous workload's sets before making the next
            self._pool = (w.name, gradient_pool(weight_shapes(w), self.device))
        return self._pool[1]

    def case_info(self, w: Workload, c: Contender) -> dict:
        shapes = layer_shapes(w)
        info = {
            "workload": w.name,
            "description": w.description,
            "rule": w.rule,
            "contender": c.name,
            "family": c.family,
            "layers": len(shapes),
            "sum_np2": float(sum(n * p * p for n, p in shapes)),
            "sum_np": float(sum(n * p for n, p in shapes)),
        }
        if c.backend:
            info["precision"] = checked_precision(c.precision, c.backend)  # (what FGD runs at: "ieee" for some)
            info["backend"] = backend_for(c.backend, self.device, info["precision"])
        info["constrained_bytes"] = 4.0 * info["sum_np"]  # the workloads' weights are float32
        cost = step_cost(c.family, shapes)
        if cost:
            info["cost"] = {**cost, **floor_seconds(cost, self.rates)}
        fgd_cost = step_cost("fgd", shapes)
        info["fgd_floor"] = floor_seconds(fgd_cost, self.rates)
        return info

    def record_case(self, benchmark, info: dict) -> None:
        entry = benchmark.stats.as_dict(include_data=False) if benchmark.stats else {"extra_info": info}
        self._write({"kind": "case", **entry})


@pytest.fixture(scope="session")
def bench(request) -> BenchSession:
    session = BenchSession(request.config)
    request.config._fgd_bench = session
    return session


def pytest_benchmark_update_json(config, benchmarks, output_json):
    session = getattr(config, "_fgd_bench", None)
    if session is not None:
        output_json["fgd_bench"] = session.summary(final=True)
