"""The step's parts as profiler ranges: ``fgd::gram``, ``fgd::middle``, ``fgd::update``.

A profile of one step splits its time by these ranges (``benchmarks/gpu/first_phase.py``'s
breakdown reads them: on the torch backend every product is a cuBLAS kernel, so kernel names
alone cannot tell the Gram pass from the middle or the update). Outside a profiler the step
issues no range at all: a range is an operator of its own, which the op count and a CUDA graph
would pay for.
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import profile

import fgd_fast
from fgd_fast.backends.base import PHASES, phase
from helpers import backend_params

SHAPES = [(12, 5, 3, 3), (12, 5, 3, 3), (7, 19)]  # two p-classes, W2 and W2ᵀ layouts


def _stepped(backend: str, steps: int = 2):
    gen = torch.Generator().manual_seed(3)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    params = [torch.nn.Parameter(fgd_fast.orthogonalize_(torch.randn(s, generator=gen)).to(dev)) for s in SHAPES]
    opt = fgd_fast.FGD([dict(params=params, orthogonal=True)], lr=0.05, backend=backend)

    def step():
        for p in params:
            p.grad = (torch.randn(p.shape, generator=gen) * 0.1).to(dev)
        opt.step()

    for _ in range(steps):  # Φ exists: the Gram pass reads it
        step()
    return step


def _ranges(prof) -> dict[str, list]:
    out: dict[str, list] = {}
    for e in prof.events():
        if e.name.startswith("fgd::"):
            out.setdefault(e.name.removeprefix("fgd::"), []).append(e)
    return out


@pytest.mark.parametrize("backend", backend_params(("torch", "triton", "cuda")))
def test_a_profiled_step_has_its_three_parts(backend):
    step = _stepped(backend)
    with profile() as prof:
        step()
    ranges = _ranges(prof)
    assert set(ranges) == set(PHASES), sorted(ranges)
    for name, events in ranges.items():
        assert sum(e.cpu_time_total for e in events) > 0, name


def test_the_torch_backends_products_fall_in_their_parts():
    """The Gram pass's products inside ``fgd::gram``, the update's inside ``fgd::update``: the
    ranges enclose what they name (a range closed too early would hold nothing)."""
    step = _stepped("torch")
    with profile() as prof:
        step()

    def ops_under(events) -> set[str]:
        seen, todo = set(), list(events)
        while todo:
            e = todo.pop()
            seen.add(e.name)
            todo.extend(e.cpu_children)
        return seen

    ranges = _ranges(prof)
    gram, update = ops_under(ranges["gram"]), ops_under(ranges["update"])
    assert "aten::bmm" in gram, sorted(gram)  # A = θᵀθ, E = θᵀg, B, C
    assert "aten::baddbmm_" in update or "aten::baddbmm" in update, sorted(update)  # Φ₊ = sβΦ + θM_Φ …
    assert "aten::bmm" not in update, sorted(update)


@pytest.mark.parametrize("backend", backend_params(("torch", "triton")))
def test_an_unprofiled_step_records_no_range(backend, monkeypatch):
    step = _stepped(backend)
    opened = []
    real = torch.profiler.record_function

    def record_function(name, *args, **kwargs):
        opened.append(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(torch.profiler, "record_function", record_function)
    step()
    assert not [n for n in opened if n.startswith("fgd::")], opened
    with profile():  # (and the ranges are what the profiler sees: opened through the same function)
        step()
    assert sorted({n for n in opened if n.startswith("fgd::")}) == [f"fgd::{p}" for p in sorted(PHASES)], opened


def test_an_unknown_phase_is_refused():
    with pytest.raises(ValueError, match="expected one of"):
        phase("grams")
