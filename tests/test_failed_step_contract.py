"""A step that fails raises a clear error and changes nothing (no parameter, no state), for
every optimizer we ship: FGD on each backend this machine has (skipped per parameter, with
the reason), CayleySGD and CayleyADAM in both forms."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fgd_fast
from fgd_fast.baselines import CayleyADAM, CayleySGD
from helpers import assert_unchanged, backend_params, device_for_tests, snapshot, step_then_fresh_grad


def _optimizers():
    """pytest params of ``(optimizer class, keyword arguments)``."""
    out = []
    for backend in backend_params():
        name = backend.values[0]
        out.append(pytest.param((fgd_fast.FGD, dict(backend=name)), marks=backend.marks, id=f"FGD-{name}"))
    for cls in (CayleySGD, CayleyADAM):
        for form in ("lowrank", "dense"):
            out.append(pytest.param((cls, dict(form=form)), id=f"{cls.__name__}-{form}"))
    return out


OPTIMIZERS = _optimizers()


def _model():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Conv2d(8, 8, 3), nn.Flatten(), nn.Linear(8 * 4 * 4, 5))
    return net.to(device_for_tests())


def _loss(net):
    torch.manual_seed(1)
    return net(torch.randn(4, 3, 8, 8, device=device_for_tests())).square().mean()


def _trained(optimizer, steps=2, **extra):
    """A model after ``steps`` steps (so momentum state exists), with a fresh gradient."""
    cls, kwargs = optimizer
    net = _model()
    opt = cls(fgd_fast.stiefel_param_groups(net, "paper"), lr=0.01, **kwargs, **extra)
    return step_then_fresh_grad(net, opt, _loss, steps)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy sees the Inf
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_gradient_raises_and_changes_nothing(optimizer, bad):
    net, opt = _trained(optimizer)
    net[1].weight.grad[0, 0, 0, 0] = bad
    snap = snapshot(net, opt)
    with pytest.raises(FloatingPointError, match="non-finite"):
        opt.step()
    assert_unchanged(net, opt, snap)  # Euclidean parameters and all state (Φ, M, v, steps) included


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_non_finite_gradient_on_first_step_creates_no_state(optimizer):
    cls, kwargs = optimizer
    net = _model()
    opt = cls(fgd_fast.stiefel_param_groups(net), lr=0.01, **kwargs)
    _loss(net).backward()
    net[0].weight.grad.view(-1)[-1] = float("nan")
    snap = snapshot(net, opt)
    with pytest.raises(FloatingPointError):
        opt.step()
    assert_unchanged(net, opt, snap)
    assert len(opt.state) == 0


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_finite_check_turned_off_lets_a_nan_through(optimizer):
    net, opt = _trained(optimizer, check_finite=False)
    if hasattr(type(opt), "guard"):
        opt.guard = False  # (FGD's guard may replace such a step by the pull-back instead)
        opt.check_manifold = False  # (which refuses a step predicted to leave the manifold, NaN included)
    net[1].weight.grad[0, 0, 0, 0] = float("nan")
    opt.step()  # no exception: the user asked for no check
    assert torch.isnan(net[1].weight).any()


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_sparse_and_complex_gradients_raise_and_change_nothing(optimizer):
    cls, kwargs = optimizer
    emb = nn.Embedding(10, 4, sparse=True).to(device_for_tests())
    opt = cls(emb.parameters(), lr=0.1, **kwargs)
    emb(torch.tensor([1, 2], device=device_for_tests())).sum().backward()
    before = emb.weight.detach().clone()
    with pytest.raises(ValueError, match="sparse"):
        opt.step()
    assert torch.equal(emb.weight, before)

    z = nn.Parameter(torch.randn(3, 3, dtype=torch.complex64, device=device_for_tests()))
    opt = cls([z], lr=0.1, **kwargs)
    z.grad = torch.ones_like(z)
    before = z.detach().clone()
    with pytest.raises(ValueError, match="complex"):
        opt.step()
    assert torch.equal(z, before)
    with pytest.raises(ValueError, match="real floating"):
        cls([dict(params=[z], orthogonal=True)], lr=0.1, **kwargs)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_hyper_parameter_changed_after_construction_is_checked_at_step(optimizer):
    net, opt = _trained(optimizer)
    opt.param_groups[0]["lr"] = -1.0
    snap = snapshot(net, opt)
    with pytest.raises(ValueError, match="lr"):
        opt.step()
    assert_unchanged(net, opt, snap)
