"""The functional entry point and the optimizer's edges, from a review of the torch.optim surface:
``fgd()`` checks what ``FGD`` checks before writing; state made under the other ``orthogonal``
flag is refused after a copy, an unpickling or a load too; inference tensors (a load inside
``torch.inference_mode``, a parameter made there) and overlapping parameters appended later are
refused before any write."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
from torch import nn

import fgd_fast
import fgd_fast.baselines  # (a test reads fgd_fast.baselines.<name>: run alone, nothing else imports it)
from helpers import backend_params


def _layers(seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    ps = [fgd_fast.orthogonalize_(torch.randn(n, 4, generator=gen)) for n in (8, 16)]
    return ps, [0.01 * torch.randn(p.shape, generator=gen) for p in ps]


@pytest.mark.parametrize(
    "bad",
    [
        dict(lr="0.1"),
        dict(lr=True),
        dict(momentum="0.9"),
        dict(feedback=True),
        dict(guard="yes"),
        dict(check_finite=None),
        dict(check_manifold="off"),
        dict(maximize=1),
        dict(gram_refresh=0),
    ],
    ids=lambda kw: "-".join(f"{k}={v!r}" for k, v in kw.items()),
)
def test_fgd_refuses_what_the_optimizer_refuses(bad):
    """A review: ``fgd()`` turned ``lr="0.1"``, ``True`` and ``momentum="0.9"`` into floats and
    took truthy flags as they came (``check_finite=None`` turned the check off). It checks the
    values as given now, as ``FGD`` does, and writes nothing."""
    ps, gs = _layers()
    before = [p.clone() for p in ps]
    kw = {**dict(lr=0.1, momentum=0.9, feedback=0.4), **bad}
    with pytest.raises((TypeError, ValueError)):
        fgd_fast.FGD([dict(params=[nn.Parameter(ps[0].clone())], orthogonal=True)], **kw)
    with pytest.raises((TypeError, ValueError)):
        fgd_fast.fgd(ps, gs, [None, None], **kw)
    assert all(torch.equal(a, b) for a, b in zip(ps, before))


def test_fgd_takes_the_values_its_checks_return():
    """A review: ``trust_radius=Fraction(4)`` passed the check, then the raw Fraction reached the
    arithmetic (TypeError); the checked float is what the step uses now."""
    from fractions import Fraction

    runs = []
    for radius in (Fraction(4), 4.0):
        ps, gs = _layers()
        fgd_fast.fgd(ps, gs, [None, None], lr=0.1, momentum=0.9, feedback=0.4, trust_radius=radius, backend="reference")
        runs.append(ps)
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("backend", backend_params(("reference", "torch")))
def test_fgd_refuses_malformed_inputs_before_any_write(backend):
    """A review: a tuple of buffers (the new Φ cannot be stored) wrote the parameters, then
    raised; a ``None`` or sparse gradient and short ``labels`` failed obscurely. All are refused
    first now, with the reason."""
    ps, gs = _layers()
    before = [p.clone() for p in ps]
    kw = dict(lr=0.1, momentum=0.9, feedback=0.4, backend=backend)
    with pytest.raises(TypeError, match="momentum_buffers must be a list"):
        fgd_fast.fgd(ps, gs, (None, None), **kw)
    with pytest.raises(ValueError, match="its gradient is None"):
        fgd_fast.fgd(ps, [gs[0], None], [None, None], **kw)
    with pytest.raises(ValueError, match="dense"):
        fgd_fast.fgd(ps, [gs[0], gs[1].to_sparse()], [None, None], **kw)
    with pytest.raises(ValueError, match="1 labels for 2 params"):
        fgd_fast.fgd(ps, gs, [None, None], labels=["a"], **kw)
    assert all(torch.equal(a, b) for a, b in zip(ps, before))


@pytest.mark.parametrize("backend", backend_params(("reference", "torch")))
def test_fgd_outside_no_grad_steps_leaf_parameters_alike(backend):
    """A review: called outside ``no_grad`` the torch backend wrote leaf parameters and the
    reference backend raised; ``fgd()`` runs under ``no_grad`` itself, as a step does."""
    ps, gs = _layers()
    leaves = [nn.Parameter(p.clone()) for p in ps]
    fgd_fast.fgd(leaves, gs, [None, None], lr=0.1, momentum=0.9, feedback=0.4, backend=backend)
    with torch.no_grad():
        fgd_fast.fgd(ps, gs, [None, None], lr=0.1, momentum=0.9, feedback=0.4, backend=backend)
    assert all(torch.equal(a.detach(), b) for a, b in zip(leaves, ps))


def _warmed_up():
    """An unconstrained warm-up step (plain momentum, gradient units), then the weight projected."""
    torch.manual_seed(0)
    net = nn.Linear(64, 8, bias=False)
    opt = fgd_fast.FGD([dict(params=[net.weight], orthogonal=False)], lr=0.1)
    net.weight.grad = torch.randn_like(net.weight)
    opt.step()
    with torch.no_grad():
        fgd_fast.orthogonalize_(net.weight)
    return net, opt


def _copies():
    net, opt = _warmed_up()
    yield "deepcopy", copy.deepcopy((net, opt))
    net, opt = _warmed_up()
    yield "pickle", pickle.loads(pickle.dumps((net, opt)))
    net, opt = _warmed_up()
    resumed = fgd_fast.FGD([dict(params=[net.weight], orthogonal=False)], lr=0.1)
    resumed.load_state_dict(opt.state_dict())
    yield "load", (net, resumed)


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "load"])
def test_state_made_under_the_other_flag_is_refused_after_a_copy_or_a_load(how):
    """A review: the record of the flag a state was made under lived outside the state, so a copy,
    an unpickled optimizer or a resumed one took a plain momentum as Φ once the flag was flipped
    (θ moved to 0.43 from the manifold in one step). They start from their groups' flags now."""
    net, opt = dict(_copies())[how]
    opt.param_groups[0]["orthogonal"] = True
    net.weight.grad = torch.randn_like(net.weight) * 0.01
    before = net.weight.detach().clone()
    with pytest.raises(ValueError, match="was made under orthogonal=False"):
        opt.step()
    assert torch.equal(net.weight.detach(), before)


def test_a_loaded_state_counts_as_made_under_the_groups_flag_it_was_checked_against():
    """The other way round: a warm-up's plain momentum, the flag then set to True and an orthogonal
    state loaded in its place: the loaded state is FGD's own (the load checked its flag), and the
    steps take it, with no memory of the momentum it replaced."""
    net, opt = _warmed_up()
    source = fgd_fast.FGD([dict(params=[net.weight], orthogonal=True)], lr=0.1)
    net.weight.grad = torch.randn_like(net.weight) * 0.01
    source.step()
    opt.param_groups[0]["orthogonal"] = True
    opt.load_state_dict(copy.deepcopy(source.state_dict()))
    net.weight.grad = torch.randn_like(net.weight) * 0.01
    opt.step()
    assert fgd_fast.stiefel_distance(net.weight) < 1e-3


@pytest.mark.parametrize("backend", backend_params(("reference", "torch")))
def test_a_load_inside_inference_mode_makes_ordinary_state(backend):
    """A review: ``load_state_dict`` inside ``torch.inference_mode`` rebuilt ``guard_count`` (and
    a bfloat16 parameter's float32 Φ) as inference tensors; the next step where the guard bound
    wrote θ and Φ, then raised on the in-place update. The load leaves the mode for its state."""
    gen = torch.Generator().manual_seed(0)
    ws = [nn.Parameter(fgd_fast.orthogonalize_(torch.randn(24, 6, generator=gen)).to(dt)) for dt in (torch.float32,)]
    ws.append(nn.Parameter(fgd_fast.orthogonalize_(torch.randn(12, 4, generator=gen)).bfloat16()))
    opt = fgd_fast.FGD([dict(params=ws, orthogonal=True)], lr=0.5, backend=backend)
    for w in ws:
        w.grad = 0.01 * torch.randn(w.shape, generator=gen).to(w.dtype)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    with torch.inference_mode():
        opt.load_state_dict(saved)
    assert not any(t.is_inference() for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor))
    for w in ws:
        w.grad = torch.full_like(w, 1e3)  # (the guard binds: it counts in guard_count)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.step()
    assert sum(s["scaled"] + s["reset"] for s in opt.guard_stats().values()) >= 1


@pytest.mark.parametrize("backend", backend_params(("reference", "torch")))
def test_a_parameter_the_step_cannot_write_is_refused_before_any_write(backend):
    """A review: an inference-tensor parameter, or one whose entries share memory (``expand()``)
    appended to a group's list after it was added, failed in the middle of the step after the
    other parameters were written. Both are refused first now (and when added)."""
    torch.manual_seed(0)
    a = nn.Parameter(fgd_fast.orthogonalize_(torch.randn(32, 8)))
    bias = nn.Parameter(torch.randn(8))
    opt = fgd_fast.FGD([dict(params=[a], orthogonal=True), dict(params=[bias])], lr=0.1, backend=backend)
    with torch.inference_mode():
        frozen = nn.Parameter(torch.randn(8))  # (a model built inside the mode)
    for late, why in ((nn.Parameter(torch.randn(1).expand(8)), "share"), (frozen, "inference tensor")):
        opt.param_groups[1]["params"].append(late)
        for p in (a, bias, late):
            p.grad = torch.randn(p.shape) * 0.01
        before = [a.detach().clone(), bias.detach().clone()]
        with pytest.raises(ValueError, match=why):
            opt.step()
        assert torch.equal(a.detach(), before[0]) and torch.equal(bias.detach(), before[1])
        opt.param_groups[1]["params"].pop()
        with pytest.raises(ValueError, match=why):
            opt.add_param_group(dict(params=[late]))


def test_an_inference_tensor_state_is_refused_before_any_write():
    """A momentum buffer put into the state inside ``torch.inference_mode`` cannot be updated in
    place by a step: refused with the fix, nothing written."""
    torch.manual_seed(0)
    ws = [nn.Parameter(fgd_fast.orthogonalize_(torch.randn(32, 8))) for _ in range(2)]
    opt = fgd_fast.FGD([dict(params=ws, orthogonal=True)], lr=0.1, backend="reference")
    for w in ws:
        w.grad = torch.randn(w.shape) * 0.01
    opt.step()
    with torch.inference_mode():
        opt.state[ws[1]]["momentum_buffer"] = opt.state[ws[1]]["momentum_buffer"].clone()
    before = [w.detach().clone() for w in ws]
    with pytest.raises(ValueError, match="inference tensor"):
        opt.step()
    assert all(torch.equal(w.detach(), b) for w, b in zip(ws, before))


def test_a_state_dict_made_inside_inference_mode_loads_as_ordinary_state():
    """A diff review: a state_dict whose tensors were made inside ``torch.inference_mode`` (of the
    parameters' dtype and device, so kept as they are) loaded outside it, and every later step
    refused its Φ. The load copies such tensors: the next step runs."""
    torch.manual_seed(0)
    w = nn.Parameter(fgd_fast.orthogonalize_(torch.randn(32, 8)))
    opt = fgd_fast.FGD([dict(params=[w], orthogonal=True)], lr=0.1, backend="reference")
    w.grad = torch.randn(w.shape) * 0.01
    opt.step()
    with torch.inference_mode():
        saved = copy.deepcopy(opt.state_dict())
        saved["state"] = {k: {n: t.clone() for n, t in v.items()} for k, v in saved["state"].items()}
    assert saved["state"][0]["momentum_buffer"].is_inference()
    opt.load_state_dict(saved)
    assert not opt.state[w]["momentum_buffer"].is_inference()
    opt.step()


def test_fgd_inside_inference_mode_takes_buffers_made_there():
    """A diff review: the inference-tensor refusal also refused ``fgd()`` called inside the mode
    with buffers made there, which it can update in place; only a step outside the mode refuses."""
    ps, gs = _layers()
    with torch.inference_mode():
        bufs = [torch.zeros_like(p) for p in ps]
        fgd_fast.fgd(ps, gs, bufs, lr=0.1, momentum=0.9, feedback=0.4, backend="reference")
    assert all(b.abs().sum() > 0 for b in bufs)


def _orthonormal():
    torch.manual_seed(0)
    return nn.Parameter(fgd_fast.orthogonalize_(torch.randn(8, 4)))


def _gradient():
    return 0.1 * torch.randn(8, 4)


# -- from a mutation review: the options, the saved counters, construction, the feedback warning
def test_precision_none_set_on_an_optimizer_is_refused():
    opt = fgd_fast.FGD([{"params": [_orthonormal()], "orthogonal": True}], lr=0.1, backend="torch")
    before = opt.precision
    with pytest.raises(ValueError, match="precision"):
        opt.precision = None
    assert opt.precision == before
    sd = copy.deepcopy(opt.state_dict())
    for g in sd["param_groups"]:
        g["precision"] = None
    with pytest.raises(ValueError, match="precision"):
        opt.load_state_dict(sd)
    assert opt.precision == before


def test_a_bool_guard_count_is_refused_at_load():
    p = _orthonormal()
    opt = fgd_fast.FGD([{"params": [p], "orthogonal": True}], lr=0.1)
    p.grad = _gradient()
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0]["guard_count"] = torch.tensor([True, False])
    with pytest.raises(ValueError, match="guard_count"):
        opt.load_state_dict(sd)
    assert opt.state[p]["guard_count"].dtype == torch.int64


def test_invalid_optimizer_wide_defaults_are_refused_even_when_every_group_overrides_them():
    with pytest.raises(ValueError, match="lr"):
        fgd_fast.FGD([{"params": [_orthonormal()], "orthogonal": True, "lr": 0.1}], lr=-1.0)
    with pytest.raises(ValueError, match="feedback"):
        fgd_fast.FGD([{"params": [_orthonormal()], "orthogonal": True, "feedback": 0.4}], lr=0.1, feedback=1.5)


@pytest.mark.parametrize("alpha,warns", [(0.07, True), (0.93, True), (0.1, False), (0.9, False)])
def test_feedback_range_edges(alpha, warns):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        fgd_fast.FGD([{"params": [_orthonormal()], "orthogonal": True}], lr=0.1, feedback=alpha)
    assert any(issubclass(x.category, RuntimeWarning) and "feedback" in str(x.message) for x in w) == warns


def test_resolved_backend_without_orthogonal_parameters_names_the_cpu():
    opt = fgd_fast.FGD([torch.nn.Parameter(torch.ones(3))], lr=0.1, backend="cuda")
    with pytest.raises(fgd_fast.backends.BackendUnavailable, match="cpu tensors"):
        opt.resolved_backend()


@pytest.mark.parametrize("make", ["FGD", "CayleySGD", "LandingSGD"])
def test_a_groups_params_given_as_a_generator_are_all_kept(make):
    """A group's ``params`` may be a generator (``dict(params=model.parameters())``, as torch
    takes it): the checks read it once, and the group still holds every parameter."""
    cls = getattr(fgd_fast, make, None) or getattr(fgd_fast.baselines, make)
    net = nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 4))
    opt = cls([dict(params=(p for p in net.parameters()))], lr=0.1)
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in net.parameters()]
    opt.add_param_group(dict(params=(nn.Parameter(torch.randn(3)) for _ in range(2))))
    assert len(opt.param_groups[1]["params"]) == 2


@pytest.mark.parametrize("shape", [(7, 3), (3, 7), (8, 3, 3, 3), (2, 5, 3)])
def test_from_stiefel_inverts_as_stiefel(shape):
    """``from_stiefel`` (public: ``as_stiefel``'s docstring sends writers to it) puts θ back into
    the weight's shape, so ``w.copy_(from_stiefel(θ, w.shape))`` round-trips every layout."""
    w = torch.randn(shape)
    theta = fgd_fast.as_stiefel(w)
    n, p, _ = fgd_fast.stiefel_shape(shape)
    assert theta.shape == (n, p) and n >= p
    assert torch.equal(fgd_fast.from_stiefel(theta.clone(), shape), w)
    assert "from_stiefel" in fgd_fast.__all__


def _public_callables():
    import fgd_fast.baselines as baselines

    for module in (fgd_fast, baselines):
        for name in module.__all__:
            obj = getattr(module, name)
            if callable(obj) and not (isinstance(obj, type) and issubclass(obj, Exception)):
                yield f"{module.__name__}.{name}", obj


@pytest.mark.parametrize("name, obj", list(_public_callables()), ids=lambda v: v if isinstance(v, str) else "")
def test_every_public_argument_is_documented(name, obj):
    """A review found public arguments that no docstring described (``fgd``'s ``grads`` and
    ``labels``, the adapters' SGD options, ``stiefel_param_groups``'s ``model``): each keyword of a
    public callable appears in its docstring (the class's or its ``__init__``'s)."""
    import inspect

    try:
        params = inspect.signature(obj).parameters
    except (TypeError, ValueError):
        pytest.skip(f"{name} has no signature to read")
    doc = (obj.__doc__ or "") + ((obj.__init__.__doc__ or "") if inspect.isclass(obj) else "")
    missing = [p for p in params if not p.startswith("_") and p not in ("self", "args", "kwargs") and p not in doc]
    assert not missing, f"{name}: arguments not in the docstring: {missing}"


def test_fgd_takes_any_list_like_collection():
    """A review: the functional step's new argument check refused an nn.ParameterList (and a
    numpy array of labels), which it had taken before."""
    import numpy as np

    ps = nn.ParameterList([nn.Parameter(fgd_fast.orthogonalize_(torch.randn(6, 3))) for _ in range(2)])
    with torch.no_grad():
        fgd_fast.fgd(
            ps,
            [torch.randn(6, 3) for _ in ps],
            [None, None],
            lr=0.1,
            momentum=0.9,
            feedback=0.4,
            labels=np.array(["a", "b"]),
        )


def test_a_fraction_lr_steps_the_plain_groups_too():
    """A review: any numbers.Real is an lr; a Fraction reached torch's SGD as it was and failed there."""
    from fractions import Fraction

    w = nn.Parameter(fgd_fast.orthogonalize_(torch.randn(6, 3)))
    b = nn.Parameter(torch.randn(3))
    opt = fgd_fast.FGD([dict(params=[w], orthogonal=True), dict(params=[b])], lr=Fraction(1, 10))
    w.grad, b.grad = torch.randn(6, 3), torch.ones(3)
    before = b.detach().clone()
    opt.step()
    torch.testing.assert_close(b.detach(), before - 0.1)


def test_stiefel_shape_keeps_a_compiled_steps_sizes_symbolic():
    """A review: the shape check's operator.index turned a SymInt of a dynamic compile into a
    constant (a recompile per shape; with mark_dynamic, an error)."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()

    @torch.compile(backend=counter, dynamic=True, fullgraph=True)
    def theta_of(w):
        return fgd_fast.from_stiefel(fgd_fast.as_stiefel(w) * 2, (w.shape[0], w.shape[1]))

    torch._dynamo.reset()
    for rows in (5, 7, 9):
        w = torch.randn(rows, 3)
        torch.testing.assert_close(theta_of(w), 2 * w)
    assert counter.frame_count == 1
