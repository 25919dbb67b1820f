"""Bad input to FGD: a clear error, and nothing modified by a step that fails. (The contract
every optimizer shares, non-finite gradients and the like: ``test_failed_step_contract.py``.)"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from torch import nn

import fgd_fast
from fgd_fast.backends import BackendUnavailable, resolve_backend
from helpers import assert_unchanged, backend_params, device_for_tests, snapshot, step_then_fresh_grad


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.Conv2d(8, 8, 3), nn.Flatten(), nn.Linear(8 * 4 * 4, 5)).to(
        device_for_tests()
    )


def _loss(net):
    torch.manual_seed(1)
    return net(torch.randn(4, 3, 8, 8, device=device_for_tests())).square().mean()


def _trained(backend="auto", steps=2):
    net = _model()
    opt = fgd_fast.FGD(fgd_fast.stiefel_param_groups(net, "paper"), lr=0.01, backend=backend)
    return step_then_fresh_grad(net, opt, _loss, steps)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lr=-0.1), "lr"),
        (dict(lr=0.1, momentum=-0.1), "momentum"),
        (dict(lr=0.1, momentum=1.0), "momentum"),
        (dict(lr=0.1, feedback=1.0), "feedback"),
        (dict(lr=0.1, feedback=-0.5), "feedback"),
        (dict(lr=0.1, weight_decay=-1.0), "weight_decay"),
        (dict(lr=0.1, momentum=0.0, nesterov=True), "nesterov"),
        (dict(lr=0.1, backend="tritonn"), "backend"),
        (dict(lr=0.1, max_distance=1.5), "max_distance"),
        (dict(lr=0.1, max_distance=0.0), "max_distance"),
        (dict(lr=0.1, max_distance=-1.0), "max_distance"),
        (dict(lr=0.1, trust_radius=0.0), "trust_radius"),
        (dict(lr=0.1, trust_radius=-1.0), "trust_radius"),
        (dict(lr=0.1, momentum=0.9, dampening=0.5, nesterov=True), "nesterov"),
        (dict(lr=0.1, gram_refresh=0), "gram_refresh"),
        (dict(lr=float("nan")), "lr"),
        (dict(lr=0.1, precision="bf16"), "precision"),
        (dict(lr=0.1, weight_decay=float("inf")), "weight_decay must be finite"),
        (dict(lr=0.1, trust_radius=float("inf")), "trust_radius must be finite"),
        (dict(lr=0.1, max_distance=1.0), "max_distance"),  # (the documented range is open: 0 < d < 1)
    ],
)
def test_construction_rejects_bad_hyper_parameters(kwargs, match):
    net = _model()
    with pytest.raises(ValueError, match=match):
        fgd_fast.FGD(fgd_fast.stiefel_param_groups(net), **kwargs)


def test_construction_rejects_bad_types():
    net = _model()
    with pytest.raises(TypeError, match="lr"):
        fgd_fast.FGD(net.parameters(), lr="0.1")
    with pytest.raises(TypeError, match="orthogonal"):
        fgd_fast.FGD([dict(params=net.parameters(), orthogonal="yes")], lr=0.1)
    with pytest.raises(TypeError, match="gram_refresh"):  # (a bool is no count)
        fgd_fast.FGD(fgd_fast.stiefel_param_groups(net), lr=0.1, gram_refresh=True)
    # a hyper-parameter tensor holds one real number (a pair, or a flag, is no momentum)
    for bad in (torch.tensor([0.9, 0.1]), torch.tensor(True)):
        with pytest.raises(TypeError, match="momentum as a tensor must hold one real number on the CPU"):
            fgd_fast.FGD(fgd_fast.stiefel_param_groups(net), lr=0.1, momentum=bad)


def test_a_complex_parameter_is_refused_with_the_split_to_make_and_nothing_written():
    real = nn.Parameter(torch.randn(4))
    cplx = nn.Parameter(torch.randn(3, 2, dtype=torch.complex64))
    real.grad, cplx.grad = torch.ones(4), torch.ones(3, 2, dtype=torch.complex64)
    net = nn.ParameterList([real, cplx])
    opt = fgd_fast.FGD(net.parameters(), lr=0.1)
    before = snapshot(net, opt)
    with pytest.raises(ValueError, match=r"is complex \(torch.complex64\).*torch.view_as_real"):
        opt.step()
    assert_unchanged(net, opt, before)


def test_numpy_bools_are_flags_as_in_torch_optim():
    """A flag from a numpy array or config (``numpy.True_``: named ``bool`` from numpy 2 on) is
    taken as torch.optim takes it: the step equals the one with Python's True."""
    np = pytest.importorskip("numpy")
    steps = []
    for flag in (True, np.True_):
        net = _model()
        fgd_fast.orthogonalize_(net[0].weight)
        opt = fgd_fast.FGD([dict(params=[net[0].weight], orthogonal=np.True_)], lr=0.1, maximize=flag, guard=flag)
        _loss(net).backward()
        opt.step()
        steps.append(net[0].weight.detach().clone())
    assert torch.equal(*steps)


def test_dampening_of_one_is_accepted_as_torch_sgd_accepts_it():
    """The Euclidean groups' dampening is in [0, 1], as torch.optim.SGD's: 1 included."""
    a, b = (nn.Parameter(torch.ones(3)) for _ in range(2))
    ours = fgd_fast.FGD([a], lr=0.1, momentum=0.9, dampening=1.0)
    theirs = torch.optim.SGD([b], lr=0.1, momentum=0.9, dampening=1.0)
    for k in range(3):
        a.grad, b.grad = torch.full((3,), 0.5 + k), torch.full((3,), 0.5 + k)
        ours.step()
        theirs.step()
    assert torch.equal(a, b)


def test_group_overrides_are_validated_and_a_bad_group_is_not_added():
    net = _model()
    with pytest.raises(ValueError, match="feedback"):
        fgd_fast.FGD([dict(params=[net[0].weight], orthogonal=True, feedback=2.0)], lr=0.1)
    opt = fgd_fast.FGD([dict(params=[net[0].weight], orthogonal=True)], lr=0.1)
    with pytest.raises(ValueError, match="at least 2 dims"):
        opt.add_param_group(dict(params=[net[0].bias], orthogonal=True))
    assert len(opt.param_groups) == 1


def test_orthogonal_parameter_with_one_dim():
    net = _model()
    with pytest.raises(ValueError, match="at least 2 dims"):
        fgd_fast.FGD([dict(params=[net[0].weight, net[0].bias], orthogonal=True)], lr=0.1)


def test_an_orthogonal_group_of_named_parameters_names_the_one_refused():
    """A review: a group of ``(name, tensor)`` pairs (torch's named parameters) was refused with
    the parameter's index in the group, not its name."""
    named = list(_model()[0].named_parameters())
    with pytest.raises(ValueError, match=r"orthogonal parameter 'bias' has shape \(8,\)"):
        fgd_fast.FGD([dict(params=named, orthogonal=True)], lr=0.1)


@pytest.mark.parametrize("backend", backend_params())
def test_far_from_manifold_raises_and_changes_nothing(backend):
    net, opt = _trained(backend)
    with torch.no_grad():
        net[1].weight.mul_(2.0)  # ‖θᵀθ − I‖ = 3√p
    snap = snapshot(net, opt)
    with pytest.raises(ValueError, match="orthogonalize_"):
        opt.step()
    assert_unchanged(net, opt, snap)
    with torch.no_grad():
        fgd_fast.orthogonalize_(net[1].weight)
    opt.step()  # the advice works


def test_nan_parameter_is_reported():
    net, opt = _trained()
    with torch.no_grad():
        net[0].weight[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="not finite"):
        opt.step()


def test_explicit_backend_that_cannot_run_fails_loudly(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(BackendUnavailable, match="CUDA tensors"):
        resolve_backend("triton", torch.device("cpu"))
    with pytest.raises(BackendUnavailable, match="CUDA tensors"):
        resolve_backend("cuda", torch.device("cpu"))
    assert resolve_backend("auto", torch.device("cpu"))[0] == "torch"  # auto never raises


@pytest.mark.parametrize("version", ["3.5.0", "3.3.1+git0a1b2c", "2.3.0", ""])
def test_a_triton_older_than_the_tested_one_is_refused_with_the_reason(monkeypatch, version):
    """An explicit ``backend="triton"`` with a Triton older than 3.6 (what a torch of before 2.11
    pulls in) names the version and the fix; ``"auto"`` falls back to the torch backend quietly."""
    import types

    import fgd_fast.backends as registry

    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__=version))
    monkeypatch.setattr(registry, "_tf32_tensor_cores", lambda device: True)  # ("auto" tries Triton first)
    with pytest.raises(BackendUnavailable, match=r"needs Triton >= 3\.6.*found .*pip install 'triton>=3\.6'"):
        resolve_backend("triton", torch.device("cuda"))
    assert registry.resolve_backend("auto", torch.device("cuda"), "tf32x3")[0] == "torch"


@pytest.mark.parametrize(
    "version, release", [("3.6.0", (3, 6, 0)), ("3.10.0rc1", (3, 10, 0)), ("3.5.0+git9a", (3, 5, 0)), ("x", ())]
)
def test_triton_release_numbers(version, release):
    from fgd_fast.backends import _release

    assert _release(version) == release


def test_triton_on_cpu_tensors_without_triton_says_to_install_it(monkeypatch):
    import importlib.util

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(
        BackendUnavailable, match=r"install Triton \(pip install 'fgd_fast\[triton\]'\) and set TRITON_INTERPRET=1"
    ):
        resolve_backend("triton", torch.device("cpu"))


def test_explicit_cuda_backend_on_cpu_tensors_raises_at_step():
    net = _model().cpu()
    opt = fgd_fast.FGD(fgd_fast.stiefel_param_groups(net), lr=0.01, backend="cuda")
    net(torch.randn(2, 3, 8, 8)).square().mean().backward()
    snap = snapshot(net, opt)
    with pytest.raises(BackendUnavailable, match="cuda"):
        opt.step()
    assert_unchanged(net, opt, snap)


@pytest.mark.parametrize("backend", backend_params(("reference", "torch", "triton", "cuda")))
def test_zero_size_orthogonal_parameter_is_skipped(backend):
    dev = device_for_tests()
    w = nn.Parameter(fgd_fast.orthogonalize_(torch.randn(4, 3, 3, 3, device=dev)))
    empty = nn.Parameter(torch.zeros(5, 0, device=dev))
    opt = fgd_fast.FGD([dict(params=[w, empty], orthogonal=True)], lr=0.01, backend=backend)
    w.grad, empty.grad = torch.randn_like(w), torch.zeros_like(empty)
    before = w.detach().clone()
    opt.step()
    assert not torch.equal(w, before)
    assert opt.orthogonality()[1] == 0.0


def test_mismatched_euclidean_state_is_refused_at_load():
    """A state dict from a model that differs in a layer: load_state_dict refuses it with the
    reason and changes nothing (before, it loaded and the next step raised)."""
    net, opt = _trained()
    other = _model()
    other[3] = nn.Linear(8 * 4 * 4, 4).to(device_for_tests())  # 4 classes instead of 5
    opt_other = fgd_fast.FGD(fgd_fast.stiefel_param_groups(other, "paper"), lr=0.01)
    opt_other.zero_grad()
    _loss(other).backward()
    opt_other.step()
    snap = snapshot(net, opt)
    with pytest.raises(ValueError, match="momentum_buffer"):
        opt.load_state_dict(opt_other.state_dict())
    assert_unchanged(net, opt, snap)
    opt.step()  # the optimizer still works


@pytest.mark.parametrize("grad", [torch.randn(6, 3), torch.randn(3, 6, dtype=torch.float16)], ids=["dtype", "shape"])
def test_gradient_of_another_dtype_or_shape_is_refused(grad):
    """(torch refuses such a .grad itself; the functional form must refuse it too.)"""
    p = fgd_fast.orthogonalize_(torch.randn(6, 3, dtype=torch.float16))
    before = p.clone()
    bufs = [None]
    with pytest.raises(ValueError, match="does not match the parameter"):
        fgd_fast.fgd([p], [grad], bufs, lr=0.01, momentum=0.9, feedback=0.4)
    assert torch.equal(p, before) and bufs == [None]


@pytest.mark.parametrize(
    "kwargs, match", [(dict(max_distance=5.0), "max_distance"), (dict(trust_radius=-1.0), "trust_radius")]
)
def test_functional_step_rejects_bad_guard_settings(kwargs, match):
    """``fgd()`` called directly checks the guard's settings as ``FGD`` does (a negative
    radius or a limit past the Neumann series' radius would steer the guard wrong)."""
    p = fgd_fast.orthogonalize_(torch.randn(6, 3))
    before, bufs = p.clone(), [None]
    with pytest.raises(ValueError, match=match):
        fgd_fast.fgd([p], [torch.randn(6, 3)], bufs, lr=0.01, momentum=0.9, feedback=0.4, **kwargs)
    assert torch.equal(p, before) and bufs == [None]


@pytest.mark.parametrize(
    "backend, chosen", [("torch", fgd_fast.backends.DEFAULT_PRECISION), ("reference", "ieee"), ("auto", None)]
)
def test_functional_step_takes_precision_as_fgd_does(monkeypatch, backend, chosen):
    """A review: ``fgd()`` defaulted to ``precision="ieee"`` where ``FGD`` takes the library's
    default (on a GPU, ``fgd(backend="auto")`` ran the torch backend in IEEE fp32 while ``FGD``
    ran the tensor-core step), and took ``"tf32x3"`` with a backend that ignores it. Both take
    it alike now: the default follows the backend, a precision it cannot honour is refused."""
    opt = fgd_fast.FGD([dict(params=[torch.zeros(6, 3)], orthogonal=True)], lr=0.01, backend=backend)
    seen = []
    real = fgd_fast.functional._cached_backend
    monkeypatch.setattr(fgd_fast.functional, "_cached_backend", lambda *a: (seen.append(a[2]), real(*a))[1])
    p = fgd_fast.orthogonalize_(torch.randn(6, 3))
    fgd_fast.fgd([p], [torch.randn(6, 3)], [None], lr=0.01, momentum=0.9, feedback=0.4, backend=backend)
    assert seen == [opt.precision] and (chosen is None or opt.precision == chosen)
    if backend == "reference":
        before, bufs = p.clone(), [None]
        with pytest.raises(ValueError, match="precision='tf32x3' needs backend='torch', 'triton' or 'auto'"):
            fgd_fast.fgd(
                [p],
                [torch.randn(6, 3)],
                bufs,
                lr=0.01,
                momentum=0.9,
                feedback=0.4,
                **dict(backend=backend, precision="tf32x3"),
            )
        assert torch.equal(p, before) and bufs == [None]


@pytest.mark.parametrize("where", ["orthogonal", "euclidean"])
@pytest.mark.parametrize("bad", ["shape", "integer"])
def test_unusable_momentum_buffer_in_state_raises_before_any_write(where, bad):
    """A ``momentum_buffer`` put into ``opt.state`` by hand (not through ``load_state_dict``,
    which checks it) that does not fit its parameter: the step raises with the buffer's name,
    and no parameter — orthogonal or Euclidean, before it or after it — nor any state changed."""
    net, opt = _trained()
    param = net[1].weight if where == "orthogonal" else net[3].bias  # stepped after net[0] / the orthogonal group
    buf = opt.state[param]["momentum_buffer"]
    opt.state[param]["momentum_buffer"] = buf.reshape(-1)[1:].clone() if bad == "shape" else buf.to(torch.int64)
    snap = snapshot(net, opt)
    with pytest.raises(ValueError, match="momentum_buffer"):
        opt.step()
    assert_unchanged(net, opt, snap)


def test_a_failed_step_creates_no_state_for_a_group_at_lr_0():
    """A group at lr = 0 only gets its state made (Φ = 0, the guard's counters); when another
    group's step then fails, not even that."""
    torch.manual_seed(0)
    a = nn.Parameter(fgd_fast.orthogonalize_(torch.randn(6, 3)))
    b = nn.Parameter(fgd_fast.orthogonalize_(torch.randn(6, 3)))
    opt = fgd_fast.FGD([dict(params=[a], orthogonal=True, lr=0.0), dict(params=[b], orthogonal=True)], lr=0.1)
    a.grad, b.grad = torch.randn(6, 3), torch.full((6, 3), float("nan"))
    with pytest.raises(FloatingPointError):
        opt.step()
    assert len(opt.state) == 0
    b.grad = torch.randn(6, 3)
    opt.step()
    assert set(opt.state[a]) == {"momentum_buffer", "guard_count"} and not opt.state[a]["momentum_buffer"].any()


def test_stiefel_param_groups_checks_every_choice_before_projecting_any():
    net = nn.Linear(4, 3)
    before = net.weight.detach().clone()
    with pytest.raises(ValueError, match="selected 'bias'.*return False for p.dim"):
        fgd_fast.stiefel_param_groups(net, rule=lambda name, p: True)
    assert torch.equal(net.weight, before)


def test_stiefel_param_groups_refuses_a_non_finite_weight_before_projecting_any():
    """A README review: a NaN in the second weight was found by orthogonalize_ on its turn, after
    the first weight had been projected, and the message did not name the weight."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 16, 3), nn.Conv2d(16, 16, 3))
    with torch.no_grad():
        m[1].weight[0, 0, 0, 0] = float("nan")
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(ValueError, match="'1.weight' has NaN or Inf entries.*nothing was projected"):
        fgd_fast.stiefel_param_groups(m)
    for p, q in zip(m.parameters(), before):
        assert torch.equal(p.nan_to_num(), q.nan_to_num())


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_parameter_is_not_projected_and_reset_parameter_says_how_to_recover(bad):
    """A QR of NaN/Inf is NaN: orthogonalize_ refuses it (before writing) instead of writing NaN,
    so opt.reset_parameter (the step errors' advice) keeps the momentum and says what to do."""
    torch.manual_seed(0)
    w = nn.Parameter(fgd_fast.orthogonalize_(torch.randn(6, 3)))
    opt = fgd_fast.FGD([dict(params=[w], orthogonal=True)], lr=0.1)
    w.grad = torch.randn(6, 3) * 0.01
    opt.step()
    with torch.no_grad():
        w[0, 0] = bad
    snap = w.detach().clone(), opt.state[w]["momentum_buffer"].clone()
    with pytest.raises(ValueError, match="not finite.*re-initialise"):
        opt.step()
    with pytest.raises(ValueError, match="NaN or Inf.*re-initialise"):
        opt.reset_parameter(w)
    assert torch.equal(w.nan_to_num(), snap[0].nan_to_num()) and torch.equal(w.isnan(), snap[0].isnan())  # unchanged
    assert torch.equal(opt.state[w]["momentum_buffer"], snap[1])
    with torch.no_grad():
        torch.nn.init.orthogonal_(w)
    opt.reset_parameter(w)
    assert "momentum_buffer" not in opt.state[w]
    opt.step()  # recovered


def test_reset_parameter_projects_and_clears_the_momentum_so_the_next_step_is_a_first_step():
    """The step errors' advice, after a θ knocked off the manifold: reset_parameter puts it back
    on (QR) and clears Φ, so the next step is exactly a fresh optimizer's first step from the
    projected θ. (A review: a reset that skipped the projection, or kept the momentum, passed.)"""
    torch.manual_seed(0)
    w = nn.Parameter(fgd_fast.orthogonalize_(torch.randn(12, 5)))
    opt = fgd_fast.FGD([dict(params=[w], orthogonal=True)], lr=0.1)
    for _ in range(2):
        w.grad = torch.randn(12, 5) * 0.1
        opt.step()
    with torch.no_grad():
        w.mul_(1.5)  # far off the manifold: the step refuses it
    grad = torch.randn(12, 5) * 0.1
    w.grad = grad.clone()
    with pytest.raises(ValueError, match="reset_parameter"):
        opt.step()
    opt.reset_parameter(w)
    assert fgd_fast.stiefel_distance(w) < 1e-5 and "momentum_buffer" not in opt.state[w]
    fresh = nn.Parameter(w.detach().clone())
    other = fgd_fast.FGD([dict(params=[fresh], orthogonal=True)], lr=0.1)
    for p in (w, fresh):
        p.grad = grad.clone()
    opt.step()
    other.step()
    assert torch.equal(w, fresh) and torch.equal(opt.state[w]["momentum_buffer"], other.state[fresh]["momentum_buffer"])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lr=-0.1), "maximize=True"),
        (dict(lr=[0.1, float("nan")]), "lr must be finite"),
        (dict(momentum=1.0), "momentum"),
        (dict(feedback=1.5), "feedback"),
    ],
)
def test_functional_step_rejects_bad_hyper_parameters(kwargs, match):
    """``fgd()`` called directly checks lr, momentum and feedback as ``FGD`` does."""
    ps = [fgd_fast.orthogonalize_(torch.randn(6, 3)) for _ in range(2)]
    before, bufs = [p.clone() for p in ps], [None, None]
    hyper = {**dict(lr=0.1, momentum=0.9, feedback=0.4), **kwargs}
    with pytest.raises(ValueError, match=match):
        fgd_fast.fgd(ps, [torch.randn(6, 3) for _ in ps], bufs, **hyper)
    assert all(torch.equal(p, q) for p, q in zip(ps, before)) and bufs == [None, None]


def test_errors_name_the_values_and_the_fix():
    net = _model()
    with pytest.raises(ValueError, match=r"got momentum=0.0, dampening=0.0: set momentum"):
        fgd_fast.FGD(net.parameters(), lr=0.1, momentum=0.0, nesterov=True)
    with pytest.raises(ValueError, match=r"float8_e4m3fn: only real floating-point parameters \(float16,"):
        fgd_fast.FGD([dict(params=[nn.Parameter(torch.eye(3).to(torch.float8_e4m3fn))], orthogonal=True)], lr=0.1)
    opt = fgd_fast.FGD(fgd_fast.stiefel_param_groups(net, "paper"), lr=0.01)
    with pytest.raises(ValueError, match=r"reset_parameter\('3.bias'\).*without orthogonal=True"):
        opt.reset_parameter(net[3].bias)
    with pytest.raises(ValueError, match=r"shape \(8, 3, 3, 3\).*the nn.Parameter object itself"):
        opt.reset_parameter(net[0].weight.data)
    with pytest.raises(ValueError, match="got 1 params, 2 grads and 1 momentum_buffers"):
        fgd_fast.fgd([torch.eye(3)], [torch.eye(3)] * 2, [None], lr=0.1, momentum=0.9, feedback=0.4)
    with pytest.raises(ValueError, match="2 entries for 1 parameters: pass one value per parameter"):
        fgd_fast.fgd([torch.eye(3)], [torch.eye(3)], [None], lr=[0.1, 0.2], momentum=0.9, feedback=0.4)
    with pytest.raises(TypeError, match="expects a torch.Tensor"):
        fgd_fast.stiefel_distance([[1.0, 0.0], [0.0, 1.0]])
    with pytest.raises(ValueError, match="at least 2 dims"):
        fgd_fast.orthogonalize_(torch.randn(3))


def test_a_parameter_listed_twice_in_an_orthogonal_group_is_refused():
    """A new user's review: torch.optim only warns about a repeated parameter; FGD stepped it twice
    per step, stored θ ~2× max_distance off the manifold, and refused the next step."""
    gen = torch.Generator().manual_seed(0)
    p = nn.Parameter(fgd_fast.orthogonalize_(torch.randn(10, 4, generator=gen)))
    q = nn.Parameter(fgd_fast.orthogonalize_(torch.randn(6, 3, generator=gen)))
    with pytest.raises(ValueError, match="listed twice"):
        fgd_fast.FGD([dict(params=[p, q, p], orthogonal=True)], lr=0.1)
    opt = fgd_fast.FGD([dict(params=[q], orthogonal=True)], lr=0.1)
    with pytest.raises(ValueError, match="listed twice"):
        opt.add_param_group(dict(params=[p, p], orthogonal=True))
    assert len(opt.param_groups) == 1  # nothing added
    before, g = p.detach().clone(), torch.randn(p.shape, generator=gen)
    with torch.no_grad(), pytest.raises(ValueError, match="listed twice"):
        fgd_fast.fgd([p, p], [g, g], [None, None], lr=0.1, momentum=0.9, feedback=0.4)
    assert torch.equal(p, before)
    fgd_fast.FGD([dict(params=[p], orthogonal=True), dict(params=[q])], lr=0.1)  # once each: accepted


def test_a_parameter_appended_twice_after_construction_is_refused_at_the_step():
    """A guard review: a parameter appended to an orthogonal group's list after it was added (so
    never checked) was stepped twice by the torch backend (neither one step nor two); the step
    now refuses it, changing nothing."""
    gen = torch.Generator().manual_seed(0)
    p = nn.Parameter(fgd_fast.orthogonalize_(torch.randn(10, 4, generator=gen)))
    opt = fgd_fast.FGD([dict(params=[p], orthogonal=True)], lr=0.1, backend="torch")
    opt.param_groups[0]["params"].append(p)
    p.grad = torch.randn(p.shape, generator=gen)
    before = p.detach().clone()
    with pytest.raises(ValueError, match="listed twice"):
        opt.step()
    assert torch.equal(p.detach(), before) and not opt.state[p]


@pytest.mark.parametrize("orthogonal", [True, False])
def test_a_parameter_whose_entries_share_memory_is_refused_when_added(orthogonal):
    """A guard review: a parameter made by expand() failed the step in torch's in-place SGD after
    the orthogonal parameters were written (a raw RuntimeError, the failed-step contract broken);
    it is refused when added, with the fix."""
    w = nn.Parameter(fgd_fast.orthogonalize_(torch.randn(3, 6)))
    shared = nn.Parameter(torch.zeros(1, 3).expand(4, 3))
    groups = [dict(params=[w], orthogonal=True), dict(params=[shared], orthogonal=orthogonal)]
    with pytest.raises(ValueError, match=r"share memory.*clone\(\)"):
        fgd_fast.FGD(groups, lr=0.1, momentum=0.0)
    opt = fgd_fast.FGD(groups[:1], lr=0.1)
    with pytest.raises(ValueError, match="share memory"):
        opt.add_param_group(groups[1])
    assert len(opt.param_groups) == 1
    fgd_fast.FGD([dict(params=[nn.Parameter(torch.zeros(4, 3).t())])], lr=0.1)  # (strided, no overlap: accepted)


def test_switching_to_a_full_precision_backend_says_how():
    """A new user's review: opt.backend = "reference" on an optimizer built with the default
    precision was told to "drop precision=", which the user never passed."""
    p = nn.Parameter(fgd_fast.orthogonalize_(torch.randn(10, 4)))
    opt = fgd_fast.FGD([dict(params=[p], orthogonal=True)], lr=0.1)
    with pytest.raises(ValueError, match=r"set opt.precision = 'ieee' before opt.backend"):
        opt.backend = "reference"
    assert opt.backend == "auto"  # refused: unchanged
    opt.precision = "ieee"
    opt.backend = "reference"  # the advice works
    assert opt.backend == "reference"


def test_meta_tensors_are_refused_with_what_to_do():
    """A new user's review: a meta-device model failed with torch's "item() on meta tensors"."""
    for fn in (fgd_fast.orthogonalize_, fgd_fast.stiefel_distance):
        with pytest.raises(ValueError, match="meta device.*to_empty"):
            fn(torch.empty(4, 3, device="meta"))
    with torch.device("meta"):
        net = nn.Sequential(nn.Conv2d(4, 8, 3), nn.Conv2d(8, 8, 3))
    with pytest.raises(ValueError, match=r"stiefel_param_groups\(orthogonalize=True\) got a tensor on the meta"):
        fgd_fast.stiefel_param_groups(net)
    net.to_empty(device="cpu")  # the advice: materialise, initialise, then build the groups
    for m in net:
        nn.init.orthogonal_(m.weight)
    opt = fgd_fast.FGD(fgd_fast.stiefel_param_groups(net), lr=0.1)
    for p in net.parameters():
        p.grad = torch.randn_like(p) * 0.01
    opt.step()
    assert max(opt.orthogonality().values()) < 1e-2  # stepped, on the manifold


def test_an_integer_parameter_with_a_gradient_is_refused_before_any_write():
    """A review: an integer tensor with a ``.grad`` in a plain group (after an orthogonal one)
    reached torch's SGD after the orthogonal layers were written, which then raised: a failed
    step that changed the weights. Refused with the others' checks, before any write."""
    torch.manual_seed(0)
    w = nn.Parameter(fgd_fast.orthogonalize_(torch.randn(8, 4)))
    counter = torch.zeros(3, dtype=torch.int64)
    counter.grad = torch.ones(3, dtype=torch.int64)
    opt = fgd_fast.FGD([dict(params=[w], orthogonal=True), dict(params=[counter])], lr=0.1)
    w.grad = torch.randn(8, 4)
    before = w.detach().clone()
    with pytest.raises(ValueError, match="torch.int64 and has a gradient"):
        opt.step()
    assert torch.equal(w, before) and not opt.state


def test_a_meta_device_orthogonal_parameter_is_refused_at_the_step():
    """A review: the step failed deep inside with "Cannot copy out of meta tensor"; it says
    what to do now (a Euclidean one steps as torch.optim.SGD's would)."""
    m = nn.Conv2d(8, 16, 3, device="meta")
    opt = fgd_fast.FGD(fgd_fast.stiefel_param_groups(m, rule="paper", orthogonalize=False), lr=0.1)
    m.weight.grad, m.bias.grad = torch.zeros_like(m.weight), torch.zeros_like(m.bias)
    with pytest.raises(ValueError, match=r"meta device.*model.to_empty"):
        opt.step()
    assert not opt.state


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
@pytest.mark.parametrize("backend", backend_params(("reference", "torch", "triton", "cuda")))
def test_a_non_finite_parameter_is_named_first_whatever_its_gradient(backend, value):
    """A mutation review: θ with an Inf entry and a NaN gradient raised FloatingPointError ("skip
    this step") on the reference and torch backends, whose ‖θᵀθ − I‖ is Inf there, and
    ValueError ("re-initialise it") on the Triton backend, whose is NaN: the check meant to name
    a non-finite parameter first skipped an Inf distance. Every backend names the parameter now;
    nothing changes."""
    w = torch.nn.Parameter(fgd_fast.orthogonalize_(torch.randn(8, 4, generator=torch.Generator().manual_seed(0))))
    with torch.no_grad():
        w[0, 0] = value
    opt = fgd_fast.FGD([dict(params=[w], orthogonal=True)], lr=0.1, backend=backend)
    w.grad = torch.randn(8, 4)
    w.grad[1, 1] = float("nan")
    before = w.detach().clone()
    with pytest.raises(ValueError, match="is not finite"):
        opt.step()
    torch.testing.assert_close(w.detach(), before, rtol=0, atol=0, equal_nan=True)  # (unchanged)
    assert not opt.state[w]


def _q():
    return torch.linalg.qr(torch.randn(6, 3))[0].T.contiguous()


def _expanded_model():
    m = nn.Module()
    m.a = nn.Parameter(torch.randn(4, 6))
    m.b = nn.Parameter(torch.ones(1, 6).expand(4, 6))
    return m


def _stepped(grad):
    w = nn.Parameter(_q())
    opt = fgd_fast.FGD([dict(params=[w], orthogonal=True)], lr=0.1)
    w.grad_dtype = None  # (newer torch: a gradient of another dtype may be set once this is None)
    try:
        w.grad = grad
    except RuntimeError:
        pytest.skip("this torch refuses a gradient of another dtype itself")
    return lambda: opt.step()


def _load(edit):
    w = nn.Parameter(_q())
    opt = fgd_fast.FGD([dict(params=[w], orthogonal=True)], lr=0.1)
    w.grad = torch.randn(3, 6)
    opt.step()
    sd = opt.state_dict()
    edit(sd)
    return lambda: opt.load_state_dict(sd)


def _sparse_buffer(sd):
    sd["state"][0]["momentum_buffer"] = torch.zeros(3, 6).to_sparse()


_KW = dict(lr=0.1, momentum=0.9, feedback=0.4)
_REVIEW_CASES = {  # a review's inputs that ended in torch's or Python's own errors, or blamed the wrong cause
    "groups-over-expanded-weight": (
        lambda: fgd_fast.stiefel_param_groups(_expanded_model(), rule="all"),
        ValueError,
        "'b'.*share memory",
    ),
    "complex-gradient": (
        lambda: _stepped(torch.randn(3, 6, dtype=torch.complex64))(),
        ValueError,
        "gradient is complex",
    ),
    "sparse-parameter": (
        lambda: fgd_fast.FGD([nn.Parameter(torch.eye(3, 6).to_sparse())], lr=0.1),
        ValueError,
        "sparse tensor",
    ),
    "meta-lr": (lambda: fgd_fast.FGD([nn.Parameter(_q())], lr=torch.tensor(0.1, device="meta")), TypeError, "on meta"),
    "fgd-meta-param": (
        lambda: fgd_fast.fgd([torch.empty(3, 6, device="meta")], [torch.empty(3, 6, device="meta")], [None], **_KW),
        ValueError,
        "meta device",
    ),
    "fgd-numpy-param": (
        lambda: fgd_fast.fgd([np.eye(3, 6)], [torch.randn(3, 6)], [None], **_KW),
        TypeError,
        r"params\[0\] must be a torch.Tensor, got ndarray",
    ),
    "fgd-numpy-grad": (
        lambda: fgd_fast.fgd([_q()], [np.ones((3, 6))], [None], **_KW),
        TypeError,
        "gradient must be a torch.Tensor, got ndarray",
    ),
    "fgd-int-labels": (
        lambda: fgd_fast.fgd([_q()], [torch.randn(3, 6)], [None], labels=5, **_KW),
        TypeError,
        "labels must be a list",
    ),
    "fgd-none-params": (lambda: fgd_fast.fgd(None, [], [], **_KW), TypeError, "params must be a list"),
    "load-none": (
        lambda: fgd_fast.FGD([nn.Parameter(_q())], lr=0.1).load_state_dict(None),
        ValueError,
        "expected a dict with 'state' and 'param_groups', got NoneType",
    ),
    "load-sparse-buffer": (lambda: _load(_sparse_buffer)(), ValueError, "sparse_coo.*dense floating tensor"),
    "groups-of-a-parameter": (
        lambda: fgd_fast.stiefel_param_groups(nn.Linear(3, 4).weight),
        TypeError,
        "expected the model .an nn.Module., got Parameter",
    ),
    "orthogonalize-sparse": (lambda: fgd_fast.orthogonalize_(torch.eye(3, 6).to_sparse()), ValueError, "sparse"),
    "orthogonalize-expanded": (
        lambda: fgd_fast.orthogonalize_(torch.ones(1, 6).expand(3, 6)),
        ValueError,
        "share memory",
    ),
    "distance-complex": (
        lambda: fgd_fast.stiefel_distance(1j * torch.eye(3, 6, dtype=torch.complex64)),
        ValueError,
        "real floating-point",
    ),
    "distance-int": (lambda: fgd_fast.stiefel_distance(torch.eye(3, 6, dtype=torch.int64)), ValueError, "int64"),
    "as-stiefel-str": (lambda: fgd_fast.as_stiefel("x"), TypeError, "expects a torch.Tensor, got str"),
    "from-stiefel-shape": (lambda: fgd_fast.from_stiefel(torch.randn(3, 6), (4, 5)), ValueError, "θ of 5 × 4"),
    "stiefel-shape-negative": (lambda: fgd_fast.stiefel_shape((-1, 4)), TypeError, "ints >= 0"),
    "stiefel-shape-str": (lambda: fgd_fast.stiefel_shape("ab"), TypeError, "expects a shape"),
}


@pytest.mark.parametrize("case", list(_REVIEW_CASES))
def test_bad_input_a_review_found_gets_the_librarys_own_error(case):
    """Each of these ended in an AttributeError, a torch RuntimeError or NotImplementedError, or a
    message naming the wrong cause (a complex gradient blamed on the parameter, a sparse one on
    expand(), numpy gradients called missing); one (the groups over an expand()ed weight)
    projected the model's first weight before failing."""
    torch.manual_seed(0)
    call, error, match = _REVIEW_CASES[case]
    with pytest.raises(error, match=match):
        call()


def test_the_groups_project_nothing_when_a_later_weight_cannot_be_written():
    m = _expanded_model()
    before = m.a.detach().clone()
    with pytest.raises(ValueError, match="share memory"):
        fgd_fast.stiefel_param_groups(m, rule="all")
    assert torch.equal(m.a, before)


@pytest.mark.parametrize("name", ["CayleySGD", "CayleyADAM", "LandingSGD"])
def test_a_baselines_nan_parameter_is_named_as_such(name):
    """A review: a NaN weight was refused as an overflow of the step, advising a smaller lr."""
    import fgd_fast.baselines

    w = nn.Parameter(torch.full((3, 6), float("nan")))
    opt = getattr(fgd_fast.baselines, name)([dict(params=[w], orthogonal=True)], lr=0.1)
    w.grad = torch.randn(3, 6)
    with pytest.raises(ValueError, match="is not finite .NaN or Inf entries.*nothing changed"):
        opt.step()
    assert not opt.state[w]


@pytest.mark.parametrize("name", ["FGD", "CayleySGD", "LandingSGD"])
def test_an_orthogonal_weight_made_1d_after_construction_is_named(name):
    """An error review: the step's message for a weight whose ``.data`` became 1-D came from
    ``stiefel_shape`` and named no parameter."""
    import fgd_fast.baselines

    cls = getattr(fgd_fast, name, None) or getattr(fgd_fast.baselines, name)
    w = nn.Parameter(fgd_fast.orthogonalize_(torch.randn(6, 3)))
    opt = cls([dict(params=[w], orthogonal=True)], lr=0.1)
    w.data = torch.randn(5)
    w.grad = torch.randn(5)
    with pytest.raises(ValueError, match=r"orthogonal parameter #0 has shape \(5,\) now.*nothing changed"):
        opt.step()
    assert not opt.state[w]
