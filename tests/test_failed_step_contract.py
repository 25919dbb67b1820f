"""A step that fails raises a clear error and changes nothing (no parameter, no state), for
every optimizer we ship: FGD on each backend this machine has (skipped per parameter, with
the reason), CayleySGD and CayleyADAM in both forms."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fgd_fast
from fgd_fast.baselines import CayleyADAM, CayleySGD, LandingSGD
from helpers import assert_unchanged, backend_params, device_for_tests, snapshot, step_then_fresh_grad


def _optimizers():
    """pytest params of ``(optimizer class, keyword arguments)``."""
    out = []
    for backend in backend_params():
        name = backend.values[0]
        out.append(pytest.param((fgd_fast.FGD, dict(backend=name)), marks=backend.marks, id=f"FGD-{backend.id}"))
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
    with pytest.raises(FloatingPointError, match="non-finite") as raised:
        opt.step()
    assert_unchanged(net, opt, snap)  # Euclidean parameters and all state (Φ, M, v, steps) included
    # the advice is this optimizer's: a baseline has no reset_parameter (its state is cleared by hand)
    advice = "opt.reset_parameter(param)" if hasattr(opt, "reset_parameter") else "opt.state[param].clear()"
    assert advice in str(raised.value) and ("reset_parameter" in str(raised.value)) == hasattr(opt, "reset_parameter")


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


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("kind", ["expanded", "inference"])
def test_the_functional_step_refuses_an_unwritable_parameter_before_writing_any(backend, kind):
    """``fgd_fast.functional.fgd`` with a parameter no in-place update can write (entries that
    share memory; an inference tensor, outside ``torch.inference_mode``) after a writable one:
    the step raises before writing the first (the reference wrote it, then failed; the torch
    backend wrote the inference tensor), with both checks off so no other check stops it first."""
    from fgd_fast.functional import fgd

    name = backend
    device = device_for_tests()
    first = torch.linalg.qr(torch.randn(8, 4, device=device))[0]
    if kind == "expanded":
        second = torch.randn(1, 4, device=device).expand(8, 4)
    else:
        with torch.inference_mode():
            second = torch.linalg.qr(torch.randn(8, 4, device=device))[0]
    before = first.clone()
    bufs = [None, None]
    with pytest.raises(ValueError, match=r"params\[1\].*(share memory|inference tensor)"):
        fgd(
            [first, second],
            [torch.randn(8, 4, device=device) for _ in range(2)],
            bufs,
            lr=0.1,
            momentum=0.9,
            feedback=0.4,
            backend=name,
            check_finite=False,
            check_manifold=False,
            guard=False,
        )
    assert torch.equal(first, before) and bufs == [None, None]


def test_the_functional_step_writes_inference_tensors_inside_inference_mode():
    """Inside ``torch.inference_mode`` an inference tensor can be written in place: the
    functional step takes it there (FGD's step always runs outside the mode)."""
    from fgd_fast.functional import fgd

    with torch.inference_mode():
        theta = torch.linalg.qr(torch.randn(8, 4))[0]
        before = theta.clone()
        fgd([theta], [torch.randn(8, 4)], [None], lr=0.1, momentum=0.9, feedback=0.4)
    assert not torch.equal(theta, before)


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("bad", ["shape", "float", "device", "inference"])
def test_guard_counters_that_do_not_fit_are_refused_before_any_write(backend, bad):
    """The guard's counters (``guard_count``) are added to after θ and Φ are written: counters
    that do not fit (put there by hand, left on another device when the model moved after a
    step without momentum — the meta device stands in for it on a CPU) raised after the write.
    The step refuses them first, says how to move or drop them, and changes nothing."""
    net, opt = _trained((fgd_fast.FGD, dict(backend=backend)), check_finite=False, check_manifold=False)
    param = net[1].weight
    counts = opt.state[param]["guard_count"]
    if bad == "shape":
        opt.state[param]["guard_count"] = torch.zeros(3, dtype=torch.int64, device=counts.device)
    elif bad == "float":
        opt.state[param]["guard_count"] = counts.to(torch.float32)
    elif bad == "device":
        opt.state[param]["guard_count"] = counts.to("meta")
    else:
        with torch.inference_mode():
            opt.state[param]["guard_count"] = counts.clone()
    snap = snapshot(net, opt)
    with pytest.raises(ValueError, match="guard_count.*nothing changed.*pop"):
        opt.step()
    assert_unchanged(net, opt, snap)


def test_a_momentum_buffer_on_another_device_is_refused_with_the_move():
    """An orthogonal ``momentum_buffer`` on another device (the meta device stands in for a GPU
    on a CPU) is refused before any write, with where it must be."""
    net, opt = _trained((fgd_fast.FGD, dict(backend="reference")))
    param = net[1].weight
    opt.state[param]["momentum_buffer"] = opt.state[param]["momentum_buffer"].to("meta")
    snap = snapshot(net, opt)
    with pytest.raises(ValueError, match=f"momentum_buffer.*on {device_for_tests().type}"):
        opt.step()
    assert_unchanged(net, opt, snap)


@pytest.mark.parametrize("steps", [0, 2], ids=["first-step", "steady"])
@pytest.mark.parametrize("optimizer", OPTIMIZERS + [pytest.param((LandingSGD, {}), id="LandingSGD")])
def test_out_of_memory_in_the_plain_groups_step_leaves_the_orthogonal_layers_as_they_were(
    optimizer, steps, monkeypatch
):
    """A review: the plain groups' SGD (torch's, whose weight decay allocates a temporary every
    step, and its momentum buffers at the first) ran after the orthogonal layers were written, so
    running out of memory there left a half-taken step. It runs after the checks and before any
    orthogonal write; the first step's own state (the guard's counters) is stored after it."""
    from fgd_fast import _stiefel_optimizer

    cls, kwargs = optimizer
    net = _model()
    groups = fgd_fast.stiefel_param_groups(net, "paper")
    groups[1]["weight_decay"] = 5e-4  # (the plain group, as in the README's quick start)
    opt = cls(groups, lr=0.01, **kwargs)
    if steps:
        net, opt = step_then_fresh_grad(net, opt, _loss, steps)
    else:
        _loss(net).backward()
    snap = snapshot(net, opt)

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("simulated: the plain groups' step ran out of memory")

    monkeypatch.setattr(_stiefel_optimizer, "sgd", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError, match="simulated"):
        opt.step()
    assert_unchanged(net, opt, snap)
    assert bool(opt.state) == bool(steps)  # (a first step made no state)
