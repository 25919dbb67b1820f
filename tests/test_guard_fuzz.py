"""Fuzz and soak of the step guard (hypothesis): over shapes, lr, momentum, feedback, gradient
spikes and lr spikes, no step ever writes a non-finite value or a θ beyond ``max_distance``,
and every step that raises leaves parameters and state bit-identical."""

from __future__ import annotations

import warnings

import pytest
import torch

import fgd_fast
from fgd_fast.guards import MAX_DISTANCE

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is not installed (.ci/setup-env installs it)")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

SPIKES = [1.0, 1e2, 1e4, 1e8, 1e20, 1e30, 3e38]
DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


@st.composite
def runs(draw):
    c_o = draw(st.integers(1, 7))
    m = draw(st.integers(1, 9))
    return dict(
        shape=(c_o, m) if draw(st.booleans()) else (max(c_o, m), min(c_o, m)),
        dtype=draw(st.sampled_from(DTYPES)),
        lr=draw(st.floats(1e-4, 2.0)),
        beta=draw(st.sampled_from([0.0, 0.5, 0.9, 0.99])),
        alpha=draw(st.floats(0.0, 0.99)),
        spikes=draw(st.lists(st.sampled_from(SPIKES), min_size=4, max_size=4)),
        lr_spikes=draw(st.lists(st.sampled_from([1.0, 10.0, 100.0, 1e10, 1e30]), min_size=4, max_size=4)),
        guard=draw(st.booleans()),
        check_finite=draw(st.booleans()),
        check_manifold=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


def _state_copy(opt, w):
    return {k: v.clone() for k, v in opt.state.get(w, {}).items()}


@pytest.mark.parametrize("backend", ["torch", "reference"])
@settings(
    max_examples=150, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(run=runs())
def test_no_step_writes_garbage_and_every_raise_changes_nothing(backend, run):
    """With the guard on no finite gradient ever makes a step raise, over every dtype and check
    flag; without it a raise changes nothing. Either way nothing non-finite or beyond
    ``max_distance`` is ever stored."""
    gen = torch.Generator().manual_seed(run["seed"])
    dtype = run["dtype"]
    w = torch.nn.Parameter(
        fgd_fast.orthogonalize_(torch.randn(run["shape"], generator=gen, dtype=torch.float64)).to(dtype)
    )
    opt = fgd_fast.FGD(
        [dict(params=[w], orthogonal=True)],
        lr=run["lr"],
        momentum=run["beta"],
        feedback=run["alpha"],
        backend=backend,
        guard=run["guard"],
        check_finite=run["check_finite"],
        check_manifold=run["check_manifold"],
    )
    top = torch.finfo(dtype).max / 4  # finite in the parameter's dtype
    for spike, lr_spike in zip(run["spikes"], run["lr_spikes"]):
        g = torch.randn(run["shape"], generator=gen, dtype=torch.float64)
        w.grad = (g / g.norm().clamp_min(1e-30)).mul_(min(spike, top)).to(dtype)
        opt.param_groups[0]["lr"] = run["lr"] * lr_spike
        before, state = w.detach().clone(), _state_copy(opt, w)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                opt.step()
        except (ValueError, FloatingPointError):
            assert not run["guard"], "with the guard on a finite gradient must never make a step raise"
            assert torch.equal(w, before)
            now = _state_copy(opt, w)
            assert now.keys() == state.keys() and all(torch.equal(now[k], state[k]) for k in state)
            opt.reset_parameter(w)
            continue
        if not (run["guard"] or run["check_finite"] or run["check_manifold"]):
            return  # nothing asked for: anything may be written
        assert torch.isfinite(w).all()
        assert all(torch.isfinite(v).all() for v in opt.state[w].values())
        if run["guard"] or run["check_manifold"]:
            assert fgd_fast.stiefel_distance(w) <= MAX_DISTANCE + 1e-6
