"""The functional entry point ``fgd_fast.functional.fgd`` as a caller sees it: its argument
checks, the ``momentum_buffers`` list it writes back (only after a step that succeeded;
left alone at momentum 0, as ``torch.optim``'s functional SGD does), the guard report indexed by
parameter (zero-size layers skipped), the caller's labels in errors, and ``check_finite``
alone refusing a step that would overflow."""

from __future__ import annotations

import pytest
import torch

from fgd_fast import orthogonalize_
from fgd_fast.functional import fgd


def _orth(n=8, p=4, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = orthogonalize_(torch.randn(n, p, dtype=torch.float64, generator=g))
    return torch.nn.Parameter(w.to(dtype))


def _grad(n=8, p=4, seed=1, scale=0.1):
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(n, p, generator=g)


def _call(**kw):
    a = _orth()
    base = dict(lr=0.1, momentum=0.9, feedback=0.4, backend="reference")
    base.update(kw)
    return fgd([a], [_grad()], [None], **base)


# -- argument checks --------------------------------------------------------------
@pytest.mark.parametrize(
    "kw",
    [dict(variant="bogus"), dict(sharding="bogus"), dict(gram_refresh=True)],
    ids=["variant", "sharding", "gram_refresh_bool"],
)
def test_fgd_refuses_unknown_variant_sharding_and_bool_gram_refresh(kw):
    a = _orth()
    a0 = a.detach().clone()
    bufs = [None]
    with pytest.raises(ValueError, match=next(iter(kw))):
        fgd([a], [_grad()], bufs, lr=0.1, momentum=0.9, feedback=0.4, backend="reference", **kw)
    assert torch.equal(a, a0) and bufs == [None]


@pytest.mark.parametrize("bufs", [[], [None, None]], ids=["fewer", "more"])
def test_fgd_refuses_a_momentum_buffer_list_of_another_length(bufs):
    a = _orth()
    a0 = a.detach().clone()
    with pytest.raises(ValueError, match="momentum_buffers"):
        fgd([a], [_grad()], bufs, lr=0.1, momentum=0.9, feedback=0.4, backend="reference")
    assert torch.equal(a, a0)


# -- momentum_buffers write-back ---------------------------------------------------------------
@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_a_failed_functional_step_leaves_the_buffer_list_alone(backend):
    a = _orth()
    a0 = a.detach().clone()
    bufs = [None]
    g = _grad()
    g[0, 0] = float("nan")
    with pytest.raises(FloatingPointError):
        fgd([a], [g], bufs, lr=0.1, momentum=0.9, feedback=0.4, backend=backend)
    assert bufs == [None] and torch.equal(a, a0)


def test_momentum_zero_leaves_a_given_buffer_in_the_list():
    a = _orth()
    buf = torch.zeros(8, 4)
    bufs = [buf]
    fgd([a], [_grad()], bufs, lr=0.1, momentum=0.0, feedback=0.4, backend="reference")
    assert bufs[0] is buf  # (as torch.optim.sgd with momentum=0: the list is not touched)


# -- guard report --------------------------------------------------------------------------------
def test_the_torch_backend_reports_no_distance_it_may_only_have_bounded():
    rep_t = _call(backend="torch")
    rep_r = _call(backend="reference")
    assert rep_t.distance == [None]
    assert rep_r.distance[0] is not None


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_a_zero_size_layer_is_skipped_and_the_report_is_indexed_by_parameter(backend):
    e = torch.nn.Parameter(torch.zeros(8, 0))
    a = _orth()
    b = _orth()
    g = _grad()
    bufs = [None, None]
    rep = fgd([e, a], [torch.zeros(8, 0), g.clone()], bufs, lr=0.1, momentum=0.9, feedback=0.4, backend=backend)
    fgd([b], [g.clone()], [None], lr=0.1, momentum=0.9, feedback=0.4, backend=backend)
    assert torch.equal(a, b)
    assert rep.guarded[0] is None and rep.guarded[1] is not None
    assert bufs[1] is not None


# -- messages ------------------------------------------------------------------------------------
def test_the_functional_step_names_the_layer_by_its_label():
    a = _orth()
    g = _grad()
    g[0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="encoder.w"):
        fgd([a], [g], [None], lr=0.1, momentum=0.9, feedback=0.4, backend="reference", labels=["encoder.w"])


# -- the checks' prediction ------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_check_finite_alone_refuses_a_step_that_would_overflow(backend):
    a = _orth()
    a0 = a.detach().clone()
    bufs = [None]
    g = torch.full((8, 4), 3e38)
    with pytest.raises(FloatingPointError, match="non-finite"):
        fgd(
            [a],
            [g],
            bufs,
            lr=10.0,
            momentum=0.9,
            feedback=0.4,
            backend=backend,
            guard=False,
            check_manifold=False,
            check_finite=True,
        )
    assert torch.equal(a, a0) and bufs == [None]
