"""torch.optim citizenship: options survive copies, every real number type is a
hyper-parameter, settings are validated whenever they change, foreign state is refused at
load, and ``torch.compile`` traces the step."""

from __future__ import annotations

import copy
import io
import pickle
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounter

import fgd_fast
from fgd_fast.baselines import CayleyADAM, CayleySGD, LandingSGD
from helpers import assert_unchanged, backend_params, snapshot


def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.Conv2d(8, 8, 3), nn.Flatten(), nn.Linear(8 * 4 * 4, 5))


def _loss(net, seed):
    torch.manual_seed(100 + seed)
    return net(torch.randn(4, 3, 8, 8)).square().mean()


OPTIMIZERS = {
    "FGD": lambda groups: fgd_fast.FGD(groups, lr=0.01, backend="torch", max_distance=0.3, check_finite=False),
    "CayleySGD": lambda groups: CayleySGD(groups, lr=0.01, form="dense", qr_period=3),
    "CayleyADAM": lambda groups: CayleyADAM(groups, lr=0.01, form="dense", norm="one"),
}


def _copy(opt, net, how):
    """(copied net, copied optimizer) through ``how``, sharing nothing with the originals."""
    bundle = {"net": net, "opt": opt}
    if how == "deepcopy":
        out = copy.deepcopy(bundle)
    elif how == "pickle":
        out = pickle.loads(pickle.dumps(bundle))
    else:
        buffer = io.BytesIO()
        torch.save(bundle, buffer)
        buffer.seek(0)
        out = torch.load(buffer, weights_only=False)
    return out["net"], out["opt"]


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_copies_keep_the_options_and_continue_bit_identically(name, how):
    """Why 3: deepcopy/pickle/torch.save lost backend, the checks, max_distance (CayleySGD:
    form) and the next step raised AttributeError."""
    net = _net()
    opt = OPTIMIZERS[name](fgd_fast.stiefel_param_groups(net, "paper"))
    for k in range(2):
        opt.zero_grad()
        _loss(net, k).backward()
        opt.step()
    net2, opt2 = _copy(opt, net, how)
    for o in type(opt)._OPTIONS:
        assert getattr(opt2, o) == getattr(opt, o)
    for k in range(2, 5):
        for n, o in ((net, opt), (net2, opt2)):
            o.zero_grad()
            _loss(n, k).backward()
            o.step()
    for p, q in zip(net.parameters(), net2.parameters()):
        assert torch.equal(p, q)


def test_state_dict_carries_the_options():
    """Restored, and (a new user's review) said so where they change this optimizer's: a GPU run's
    checkpoint brought backend="triton" and checks that were off to a CPU run without a word."""
    net = _net()
    opt = fgd_fast.FGD(fgd_fast.stiefel_param_groups(net), lr=0.01, max_distance=0.3, guard=False)
    other = fgd_fast.FGD(fgd_fast.stiefel_param_groups(_net()), lr=0.01)
    with pytest.warns(UserWarning, match=r"max_distance 0.5 → 0.3, guard True → False; .*opt.max_distance = 0.5") as w:
        other.load_state_dict(opt.state_dict())
    assert len(w) == 1 and w[0].filename == __file__  # one warning, at the caller
    assert other.max_distance == 0.3 and other.guard is False
    assert all(g["max_distance"] == 0.3 for g in other.param_groups)
    same = fgd_fast.FGD(fgd_fast.stiefel_param_groups(_net()), lr=0.02, max_distance=0.3, guard=False)
    with warnings.catch_warnings():  # a resume with the same options: silent
        warnings.simplefilter("error")
        same.load_state_dict(opt.state_dict())
    legacy = opt.state_dict()  # a checkpoint written before the options were in the groups
    for g in legacy["param_groups"]:
        for o in fgd_fast.FGD._OPTIONS:
            del g[o]
    fresh = fgd_fast.FGD(fgd_fast.stiefel_param_groups(_net()), lr=0.01, max_distance=0.2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh.load_state_dict(legacy)
    assert fresh.max_distance == 0.2  # missing options keep their current value


@pytest.mark.parametrize("value", [np.float32(0.01), np.float64(0.01), np.int64(0), torch.tensor(0.01)])
def test_every_real_number_type_is_a_hyper_parameter(value):
    """Why 5: numpy scalars were refused as "not a real number"."""
    net = _net()
    opt = fgd_fast.FGD(
        fgd_fast.stiefel_param_groups(net),
        lr=value,
        momentum=np.float32(0.9),
        feedback=np.float64(0.4),
        max_distance=np.float32(0.5),
    )
    _loss(net, 0).backward()
    opt.step()
    same = _net()  # the same step with Python floats: the value was used, not just accepted
    plain = fgd_fast.FGD(
        fgd_fast.stiefel_param_groups(same), lr=float(value), momentum=0.9, feedback=0.4, max_distance=0.5
    )
    _loss(same, 0).backward()
    plain.step()
    for p, q in zip(net.parameters(), same.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-7)


@pytest.mark.parametrize(
    "make",
    [
        lambda groups: fgd_fast.FGD(
            groups, lr=np.float64(0.01), feedback=np.float32(0.4), maximize=np.bool_(False), guard=np.bool_(True)
        ),
        lambda groups: CayleyADAM(groups, lr=np.float64(0.01), betas=(np.float32(0.9), np.float64(0.99))),
    ],
    ids=["FGD", "CayleyADAM"],
)
def test_numpy_hyper_parameters_save_a_checkpoint_that_loads_with_weights_only(make):
    """A review: numpy scalars, which the optimizers take, stayed numpy scalars in ``state_dict``,
    and ``torch.load``'s default ``weights_only=True`` refused the checkpoint (and a float32 β₁
    computed Cayley ADAM's bias correction in float32). They are Python numbers once added, and
    saved as such when set later; the loaded optimizer resumes bit for bit."""
    net = _net()
    opt = make(fgd_fast.stiefel_param_groups(net))
    _loss(net, 0).backward()
    opt.step()
    assert all(type(v).__module__ != "numpy" for g in opt.param_groups for v in g.values())  # converted when added
    opt.param_groups[0]["lr"] = np.float64(0.01)  # (set later, as a sweep might: converted by state_dict)
    buffer = io.BytesIO()
    torch.save({"net": net.state_dict(), "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)  # weights_only=True
    assert all(type(v).__module__ != "numpy" for g in saved["opt"]["param_groups"] for v in g.values())
    twin = _net(seed=1)
    twin.load_state_dict(saved["net"])
    resumed = make(fgd_fast.stiefel_param_groups(twin, orthogonalize=False))
    resumed.load_state_dict(saved["opt"])
    for model, o in ((net, opt), (twin, resumed)):
        o.zero_grad()
        _loss(model, 1).backward()
        o.step()
    assert all(torch.equal(p, q) for p, q in zip(net.parameters(), twin.parameters()))


def test_bools_and_device_tensors_are_not_hyper_parameters():
    """lr alone may be a tensor (one floating-point number, on any device: tests/test_device_lr.py)."""
    net = _net()
    with pytest.raises(TypeError, match="lr"):
        fgd_fast.FGD(net.parameters(), lr=True)
    with pytest.raises(TypeError, match="one floating-point number"):
        fgd_fast.FGD(net.parameters(), lr=torch.tensor([0.1, 0.2]))
    with pytest.raises(TypeError, match="on the CPU"):
        fgd_fast.FGD(net.parameters(), lr=0.1, momentum=torch.tensor(0.9, device="meta"))


@pytest.mark.parametrize("dampening", [-0.1, 1.5])
def test_dampening_is_range_checked(dampening):
    """Why 5: dampening was never range-checked."""
    for cls in (fgd_fast.FGD, CayleySGD):
        with pytest.raises(ValueError, match="dampening"):
            cls(_net().parameters(), lr=0.1, dampening=dampening)


def test_a_missing_group_key_is_named():
    """Why 5: a group missing feedback gave a bare KeyError."""
    net = _net()
    opt = fgd_fast.FGD(fgd_fast.stiefel_param_groups(net), lr=0.01)
    del opt.param_groups[0]["feedback"]
    _loss(net, 0).backward()
    snap = snapshot(net, opt)
    with pytest.raises(ValueError, match="'feedback'"):
        opt.step()
    assert_unchanged(net, opt, snap)


def test_options_changed_after_construction_are_validated():
    """Why 5: max_distance/precision changed after construction were not re-validated."""
    net = _net()
    opt = fgd_fast.FGD(fgd_fast.stiefel_param_groups(net), lr=0.01, backend="reference")
    with pytest.raises(ValueError, match="max_distance"):
        opt.max_distance = 2.0
    with pytest.raises(ValueError, match="precision"):
        opt.precision = "tf32"  # the reference backend computes in full precision only
    assert opt.max_distance == 0.5 and opt.precision == "ieee"
    opt.max_distance = 0.3
    assert all(g["max_distance"] == 0.3 for g in opt.param_groups)
    _loss(net, 0).backward()
    for edit in ({"max_distance": 2.0}, {"precision": "bf16"}):
        for g in opt.param_groups:  # behind the setter's back: caught at the next step
            g.update(edit)
        opt.defaults.update(edit)
        snap = snapshot(net, opt)
        with pytest.raises(ValueError, match=f"invalid {next(iter(edit))}|unknown {next(iter(edit))}"):
            opt.step()
        assert_unchanged(net, opt, snap)
        opt.defaults.update(max_distance=0.3, precision="ieee")
        for g in opt.param_groups:
            g.update(max_distance=0.3, precision="ieee")
    with pytest.raises(ValueError, match="optimizer-wide"):
        opt.add_param_group({"params": [nn.Parameter(torch.randn(3))], "backend": "torch"})


def test_an_sgd_state_dict_is_refused_at_load():
    """Why 5: torch SGD's state_dict loaded into FGD and its first step wrote distance 1.4e7."""
    net = _net()
    sgd = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    _loss(net, 0).backward()
    sgd.step()
    opt = fgd_fast.FGD([dict(params=list(net.parameters()), orthogonal=False)], lr=0.01)
    with pytest.raises(ValueError, match="not saved by FGD"):
        opt.load_state_dict(sgd.state_dict())
    assert len(opt.state) == 0


@pytest.mark.parametrize("bad", ["nan", "integer"])
def test_a_state_dict_with_unusable_buffers_is_refused(bad):
    net = _net()
    opt = fgd_fast.FGD(fgd_fast.stiefel_param_groups(net), lr=0.01)
    _loss(net, 0).backward()
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    buf = sd["state"][0]["momentum_buffer"]
    sd["state"][0]["momentum_buffer"] = buf.fill_(float("nan")) if bad == "nan" else buf.to(torch.int64)
    snap = snapshot(net, opt)
    with pytest.raises(ValueError, match="momentum_buffer"):
        opt.load_state_dict(sd)
    assert_unchanged(net, opt, snap)


@pytest.mark.parametrize(
    "edit, match",
    [
        ("guard_count_fraction", "guard_count"),
        ("guard_count_shape", "guard_count"),
        ("guard_count_list", "guard_count"),
        ("guard_count_complex", "guard_count"),
        ("guard_count_past_2_53", "guard_count"),
        ("guard_count_negative", "guard_count"),
        ("max_distance", "max_distance"),
        ("trust_radius", "trust_radius"),
        ("groups_disagree", "optimizer-wide option max_distance"),
        ("orthogonal_a_string", r"param_groups\[0\]\['orthogonal'\] must be True or False, got str"),
        ("a_key_listed_twice", r"list the parameter key\(s\) \[0\] more than once"),
    ],
)
def test_a_state_dict_with_unusable_guard_state_or_options_is_refused(edit, match):
    """The guard's counters and the optimizer-wide options a state_dict brings are checked at
    load (not at the next step): refused with the reason, nothing loaded."""
    net = _net()
    opt = fgd_fast.FGD(fgd_fast.stiefel_param_groups(net), lr=0.01, max_distance=0.3)
    _loss(net, 0).backward()
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    assert "guard_count" in sd["state"][0]
    if edit == "guard_count_fraction":
        sd["state"][0]["guard_count"] = torch.tensor([0.5, 0.0])
    elif edit == "guard_count_shape":
        sd["state"][0]["guard_count"] = torch.zeros(3, dtype=torch.int64)
    elif edit == "guard_count_list":
        sd["state"][0]["guard_count"] = [0, 0]
    elif edit == "guard_count_complex":
        sd["state"][0]["guard_count"] = torch.zeros(2, dtype=torch.complex64)
    elif edit == "guard_count_negative":  # (floating, as an earlier version saved them)
        sd["state"][0]["guard_count"] = torch.tensor([-1.0, 0.0])
    elif edit == "guard_count_past_2_53":  # (float64 counts no longer exact: not what a run saved)
        sd["state"][0]["guard_count"] = torch.tensor([2.0**53, 0.0], dtype=torch.float64)
    elif edit in ("max_distance", "trust_radius"):
        for group in sd["param_groups"]:
            group[edit] = 2.0 if edit == "max_distance" else -1.0
    elif edit == "orthogonal_a_string":  # (was: "saved with orthogonal='True', this optimizer's has True")
        sd["param_groups"][0]["orthogonal"] = "True"
    elif edit == "a_key_listed_twice":  # (was: "state has entries for [1], which its groups do not list")
        sd["param_groups"][0]["params"] = [0, 0]
    else:
        sd["param_groups"][1]["max_distance"] = 0.2
    snap = snapshot(net, opt)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(sd)
    assert_unchanged(net, opt, snap)
    assert opt.max_distance == 0.3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_resumed_run_resumes_again(dtype):
    """A review: torch's load casts every state tensor but ``step`` to the parameter's dtype,
    so a resumed run's guard counters were float32 (bfloat16: they stopped counting at 256),
    and its own next checkpoint was refused ("guard_count ... expected an integer tensor").
    They load as the int64 they were saved as; counters saved as whole floats by an earlier
    build load too, as int64."""
    torch.manual_seed(0)
    w = nn.Parameter(fgd_fast.orthogonalize_(torch.randn(16, 8)).to(dtype))

    def run(state=None):
        opt = fgd_fast.FGD([dict(params=[w], orthogonal=True)], lr=0.01)
        if state is not None:
            opt.load_state_dict(state)
        w.grad = (0.1 * torch.randn(16, 8)).to(dtype)
        opt.step()
        return opt

    first = run()
    first.state[w]["guard_count"] += torch.tensor([3, 1])  # (counts to carry through)
    second = run(_saved(first.state_dict()))
    third = run(_saved(second.state_dict()))
    assert third.state[w]["guard_count"].dtype == torch.int64
    assert third.state[w]["guard_count"].tolist() == [3, 1]
    assert third.state[w]["momentum_buffer"].dtype == torch.float32
    old = _saved(third.state_dict())
    old["state"][0]["guard_count"] = old["state"][0]["guard_count"].to(torch.float32)
    fourth = fgd_fast.FGD([dict(params=[w], orthogonal=True)], lr=0.01)
    fourth.load_state_dict(old)
    assert fourth.state[w]["guard_count"].dtype == torch.int64 and fourth.state[w]["guard_count"].tolist() == [3, 1]


@pytest.mark.parametrize("cls", ["FGD", "CayleySGD", "CayleyADAM", "LandingSGD"])
@pytest.mark.parametrize("saved_orthogonal", [False, True])
def test_a_state_dict_whose_group_was_the_other_kind_is_refused(cls, saved_orthogonal):
    """A review: a checkpoint whose group was saved with ``orthogonal=False`` (a warm-up
    phase, say) loaded into an orthogonal group turned the constraint off without a word (the
    weight 579 from the manifold 20 steps later); the other way, a plain SGD momentum (gradient
    units) became FGD's velocity Φ. Refused now, nothing loaded."""
    make = getattr(fgd_fast, cls, None) or getattr(fgd_fast.baselines, cls)
    torch.manual_seed(0)
    w = nn.Parameter(fgd_fast.orthogonalize_(torch.randn(16, 8)))
    saved = make([dict(params=[w], orthogonal=saved_orthogonal)], lr=0.01)
    w.grad = 0.1 * torch.randn(16, 8)
    saved.step()
    opt = make([dict(params=[w], orthogonal=not saved_orthogonal)], lr=0.01)
    with pytest.raises(ValueError, match=f"saved with orthogonal={saved_orthogonal}"):
        opt.load_state_dict(saved.state_dict())
    assert opt.param_groups[0]["orthogonal"] is (not saved_orthogonal) and not opt.state


def _saved(state_dict):
    """``state_dict`` through ``torch.save`` / ``torch.load`` (a checkpoint file)."""
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_feedback_near_0_or_1_warns_once():
    """Why 4: α = 0.9999 ran 150 steps 0.1–0.34 off the manifold without a word."""
    net = _net()
    with pytest.warns(RuntimeWarning, match=r"\|1 − 2α\|"):  # at construction
        opt = fgd_fast.FGD(fgd_fast.stiefel_param_groups(net), lr=0.01, feedback=0.97)
    _loss(net, 0).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()  # once per optimizer
        opt.step()
        fgd_fast.FGD(fgd_fast.stiefel_param_groups(net), lr=0.01, feedback=0.4).step()  # in range: silent


def _compiled_setup(checks: bool):
    torch.manual_seed(0)
    w = nn.Parameter(fgd_fast.orthogonalize_(torch.randn(8, 4, 3, 3)))
    b = nn.Parameter(torch.randn(8))
    opt = fgd_fast.FGD(
        [dict(params=[w], orthogonal=True), dict(params=[b])],
        lr=0.01,
        backend="torch",
        check_finite=checks,
        check_manifold=checks,
    )
    w.grad, b.grad = torch.randn_like(w) * 0.01, torch.randn_like(b)
    opt.step()  # state exists: the traced step is the steady one
    return w, opt


def test_compiled_step_has_no_graph_break_with_checks_off():
    """Why 5: torch.compile(step, fullgraph=True) failed on get_float32_matmul_precision.
    (The "eager" compiler backend: Dynamo's tracing is what is tested, without Inductor's
    minutes of code generation on this CPU.)"""
    torch._dynamo.reset()
    w, opt = _compiled_setup(checks=False)
    expected = copy.deepcopy((w, opt.state[w]["momentum_buffer"]))
    eager_opt = copy.deepcopy(opt)
    ew, eb = eager_opt.param_groups[0]["params"][0], eager_opt.param_groups[1]["params"][0]
    ew.grad, eb.grad = w.grad.clone(), opt.param_groups[1]["params"][0].grad.clone()
    eager_opt.step()
    torch.compile(opt.step, fullgraph=True, backend="eager")()
    assert not torch.equal(w, expected[0])
    torch.testing.assert_close(w, ew, rtol=0, atol=1e-6)


def _compiled_step_matches_eager(net: nn.Module) -> None:
    """A second step of ``net``'s FGD (torch backend, checks off), compiled with fullgraph=True,
    equals the eager one."""
    torch._dynamo.reset()
    opt = fgd_fast.FGD(
        fgd_fast.stiefel_param_groups(net), lr=0.01, backend="torch", check_finite=False, check_manifold=False
    )
    for p in net.parameters():
        p.grad = torch.randn_like(p) * 0.01
    opt.step()
    eager_net, eager_opt = copy.deepcopy((net, opt))
    for p, q in zip(net.parameters(), eager_net.parameters()):
        q.grad = p.grad.clone()
    eager_opt.step()
    torch.compile(opt.step, fullgraph=True, backend="eager")()
    for p, q in zip(net.parameters(), eager_net.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def test_compiled_step_with_named_groups_has_no_graph_break():
    """Issue 19: with groups from stiefel_param_groups, fullgraph=True failed on the names'
    WeakIdKeyDictionary."""
    torch.manual_seed(0)
    _compiled_step_matches_eager(nn.Sequential(nn.Conv2d(4, 8, 3), nn.Conv2d(8, 8, 3)))


def test_compiled_step_over_several_widths_has_no_graph_break():
    """Layers of several p share one middle (a multi-group layout): fullgraph=True failed inside
    Dynamo on the layout's index cache, keyed by a torch.device (found while reviewing the CPU
    host path; the test above has one p)."""
    torch.manual_seed(0)
    _compiled_step_matches_eager(nn.Sequential(nn.Conv2d(4, 8, 3), nn.Conv2d(8, 16, 3), nn.Linear(20, 6)))


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")  # (compiled: the wrapper unseen)
@pytest.mark.parametrize("tensor_lr", [False, True], ids=["float-lr", "tensor-lr"])
def test_compiled_step_follows_a_scheduler_without_a_graph_break(tensor_lr):
    """A new user's review: a fullgraph-compiled step failed at the second step of a StepLR —
    Dynamo traces the changed lr as a SymFloat, which the lr check's math.isfinite cannot take.
    And with lr a CPU tensor that the scheduler changes in place (what torch recommends for
    compiled optimizers) it broke at the optimizer's host read of the tensor, and the torch
    backend read it on the host. Four scheduled steps, compiled, equal the eager ones (each lr
    used, none refused); with a tensor lr, no recompilation after the first steady step."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(4, 8, 3), nn.Conv2d(8, 16, 3), nn.Linear(20, 6))
    lr = torch.tensor(0.01) if tensor_lr else 0.01
    kw = dict(backend="torch", check_finite=False, check_manifold=False)
    opt = fgd_fast.FGD(fgd_fast.stiefel_param_groups(net), lr=lr, **kw)
    eager_net = copy.deepcopy(net)
    eager_opt = fgd_fast.FGD(fgd_fast.stiefel_param_groups(eager_net), lr=0.01, **kw)
    counter = CompileCounter()  # (no code generation: Dynamo's tracing is what is tested)
    step = torch.compile(opt.step, fullgraph=True, backend=counter)  # (before the scheduler wraps opt.step)
    scheds = [torch.optim.lr_scheduler.StepLR(o, 1, 0.5) for o in (opt, eager_opt)]
    frames = []
    steps = 10 if tensor_lr else 4  # (a tensor lr past Dynamo's recompile limit of 8; a float recompiles per value)
    for _ in range(steps):
        for p, q in zip(net.parameters(), eager_net.parameters()):
            p.grad = torch.randn_like(p) * 0.01
            q.grad = p.grad.clone()
        step()
        eager_opt.step()
        for sched in scheds:
            sched.step()
        frames.append(counter.frame_count)
    assert opt.param_groups[0]["lr"] is lr or not tensor_lr  # (changed in place)
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(eager_opt.param_groups[0]["lr"]) == 0.01 / 2**steps
    if tensor_lr:  # (the first step, which makes Φ, and the steady one: then no recompilation)
        assert frames[1] == frames[-1]
    for p, q in zip(net.parameters(), eager_net.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def _reachable(root) -> list:
    """Objects reachable from ``root`` through containers, closures and fgd_fast's own objects."""
    import gc
    import types

    seen, todo, out = set(), [root], []
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (torch.Tensor, type, types.ModuleType)):
            continue
        seen.add(id(obj))
        out.append(obj)
        ours = type(obj).__module__.startswith("fgd_fast")
        if ours or isinstance(obj, (list, tuple, dict, set, types.FunctionType, types.MethodType, types.CellType)):
            todo.extend(gc.get_referents(obj))
    return out


def test_a_prepared_step_holds_no_named_tuple_of_ours():
    """What the torch backend's plan keeps until ``apply`` (live across a compiled step's graph
    break at the checks' host read) holds no NamedTuple made by the step: torch 2.11's Dynamo
    cannot rebuild one there (an internal assertion, so ``torch.compile(opt.step)`` with the
    checks on raised; seen with torch 2.11.0, fixed in later releases)."""
    from fgd_fast.backends.torch_batched import prepare_torch

    torch.manual_seed(0)
    shapes = [(8, 4, 3, 3), (8, 4, 3, 3), (6, 20), (16, 5)]
    params = [fgd_fast.orthogonalize_(torch.randn(s)) for s in shapes]
    grads = [0.01 * torch.randn(s) for s in shapes]
    bufs = [0.001 * torch.randn(s) for s in shapes]
    count = len(shapes)
    plan = prepare_torch(
        params, grads, bufs, [False] * count, lr=[0.01] * count, momentum=[0.9] * count, feedback=[0.4] * count,
        check_finite=True, trust_radius=4.0, max_distance=0.5,
    )  # fmt: skip
    held = _reachable(plan)
    assert any(type(o).__name__ == "Bucket" for o in held)  # (the walk reaches the plan's buckets)
    ours = [o for o in held if type(o).__module__.startswith("fgd_fast")]
    assert not [type(o).__name__ for o in ours if isinstance(o, tuple)]  # (a NamedTuple is a tuple)
    plan.apply()


def test_compiled_step_breaks_only_at_the_check_sync():
    torch._dynamo.reset()
    w, opt = _compiled_setup(checks=True)
    explained = torch._dynamo.explain(opt.step)()
    assert explained.graph_break_count >= 1
    for reason in explained.break_reasons:
        frames = [f.name for f in reason.user_stack]
        assert "raise_if_invalid" in frames, (reason.reason, frames)


@pytest.mark.parametrize(
    "name, unknown, chosen, miscased, default, listed",
    [
        ("variant", "algorithm1", "paper", "Paper", "official", "'official', 'paper'"),
        ("sharding", "owners", "owner", "Rows", "auto", "'auto', 'rows', 'owner', 'gather'"),
    ],
)
def test_an_optimizer_wide_choice_is_validated_and_carried(name, unknown, chosen, miscased, default, listed):
    with pytest.raises(ValueError, match=listed):
        fgd_fast.FGD(fgd_fast.stiefel_param_groups(_net()), lr=0.01, **{name: unknown})
    opt = fgd_fast.FGD(fgd_fast.stiefel_param_groups(_net()), lr=0.01, **{name: chosen})
    with pytest.raises(ValueError, match=name):
        setattr(opt, name, miscased)
    assert getattr(opt, name) == chosen
    other = fgd_fast.FGD(fgd_fast.stiefel_param_groups(_net()), lr=0.01)
    assert getattr(other, name) == default  # (variant: the authors' code)
    with pytest.warns(UserWarning, match=f"{name} '{default}' → '{chosen}'"):
        other.load_state_dict(opt.state_dict())
    assert getattr(other, name) == chosen and all(g[name] == chosen for g in other.param_groups)
    with pytest.raises(ValueError, match=name):
        fgd_fast.functional.fgd([], [], [], lr=0.1, momentum=0.9, feedback=0.4, **{name: "nope"})


def test_a_one_element_tensor_lr_steps_both_group_kinds():
    """Issue: lr=torch.tensor([0.1]) wrote the orthogonal parameters, then the Euclidean step
    raised TypeError (every step). It is a real number: both kinds step as with lr=0.1."""
    nets = [_net(), _net()]
    opts = [
        fgd_fast.FGD(fgd_fast.stiefel_param_groups(nets[0]), lr=torch.tensor([0.1]), weight_decay=torch.tensor(1e-3)),
        fgd_fast.FGD(fgd_fast.stiefel_param_groups(nets[1]), lr=0.1, weight_decay=1e-3),
    ]
    for net, opt in zip(nets, opts):
        for k in range(2):
            opt.zero_grad()
            _loss(net, k).backward()
            opt.step()
    for p, q in zip(nets[0].parameters(), nets[1].parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_load_state_dict_refuses_bad_hyper_parameters_and_orthogonal_flags():
    net = _net()
    opt = fgd_fast.FGD(fgd_fast.stiefel_param_groups(net), lr=0.01)
    _loss(net, 0).backward()
    opt.step()
    good = opt.state_dict()
    bad = copy.deepcopy(good)
    bad["param_groups"][0]["feedback"] = 1.5
    snap = snapshot(net, opt)
    with pytest.raises(ValueError, match=r"param_groups\[0\].*feedback"):
        opt.load_state_dict(bad)
    assert_unchanged(net, opt, snap)
    flipped = copy.deepcopy(good)  # the Euclidean group (biases, 1-D) marked orthogonal
    flipped["param_groups"][1]["orthogonal"] = True
    with pytest.raises(ValueError, match=r"param_groups\[1\]"):
        opt.load_state_dict(flipped)
    assert_unchanged(net, opt, snap)
    opt.load_state_dict(good)  # the good one still loads


def test_a_dcp_load_keeps_16_bit_parameters_float32_momentum_and_checks_it():
    """A distributed review: torch.distributed.checkpoint's set_optimizer_state_dict keys the state
    by parameter name, which FGD's load_state_dict looked up by flat index — so a bfloat16
    parameter's float32 momentum came back rounded to bfloat16 (the next step refused it) and a
    NaN buffer was let in. Both now go as through opt.load_state_dict (one process: no group needed)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    torch.manual_seed(0)
    model = nn.Linear(16, 8, bias=False).to(torch.bfloat16)
    opt = fgd_fast.FGD(fgd_fast.stiefel_param_groups(model, "all"), lr=0.05)
    model.weight.grad = 0.01 * torch.randn_like(model.weight)
    opt.step()
    saved = get_optimizer_state_dict(model, opt)
    phi = saved["state"]["weight"]["momentum_buffer"].clone()
    assert phi.dtype == torch.float32
    again = fgd_fast.FGD(fgd_fast.stiefel_param_groups(model, "all", orthogonalize=False), lr=0.05)
    set_optimizer_state_dict(model, again, saved)
    assert torch.equal(again.state[model.weight]["momentum_buffer"], phi)  # float32, bit for bit
    again.step()  # (the step accepts it)
    bad = get_optimizer_state_dict(model, opt)
    bad["state"]["weight"]["momentum_buffer"][0, 0] = float("nan")
    fresh = fgd_fast.FGD(fgd_fast.stiefel_param_groups(model, "all", orthogonalize=False), lr=0.05)
    with pytest.raises(ValueError, match="NaN/Inf"):
        set_optimizer_state_dict(model, fresh, bad)
    assert not fresh.state


def _bf16_opt(**kw):
    torch.manual_seed(0)
    model = nn.Linear(16, 8, bias=False).to(torch.bfloat16)
    opt = fgd_fast.FGD(fgd_fast.stiefel_param_groups(model, "all"), lr=0.05, **kw)
    model.weight.grad = 0.01 * torch.randn_like(model.weight)
    opt.step()
    return model, opt


def test_load_pre_hooks_choose_what_is_checked_and_loaded():
    """A review as a torch user: FGD checked the dict it was given, and for a 16-bit parameter wrote
    that dict's float32 state back after torch's load, so a pre-hook that dropped the state was
    undone, and one that upgraded an old checkpoint never got to run before the check refused it."""
    model, opt = _bf16_opt()
    saved = opt.state_dict()
    fresh = fgd_fast.FGD(fgd_fast.stiefel_param_groups(model, "all", orthogonalize=False), lr=0.05)
    fresh.register_load_state_dict_pre_hook(lambda o, sd: {**sd, "state": {}})
    fresh.load_state_dict(saved)
    assert not fresh.state  # the hook's dict, not the one passed

    old = opt.state_dict()  # a checkpoint without a key this version needs, upgraded by a hook
    for g in old["param_groups"]:
        del g["feedback"]

    def upgrade(o, sd):
        for g in sd["param_groups"]:
            g.setdefault("feedback", 0.5)

    again = fgd_fast.FGD(fgd_fast.stiefel_param_groups(model, "all", orthogonalize=False), lr=0.05)
    again.register_load_state_dict_pre_hook(upgrade)
    again.load_state_dict(old)
    assert again.param_groups[0]["feedback"] == 0.5
    assert again.state[model.weight]["momentum_buffer"].dtype == torch.float32


def test_load_post_hooks_see_the_finished_load():
    """The same review: post-hooks ran inside torch's load, before FGD restored the options and
    the float32 state, so a post-hook that set an option back (the load warning's advice) was undone."""
    model, opt = _bf16_opt()
    fresh = fgd_fast.FGD(fgd_fast.stiefel_param_groups(model, "all", orthogonalize=False), lr=0.05, backend="reference")
    seen = {}

    def post(o):
        seen["dtype"] = o.state[model.weight]["momentum_buffer"].dtype
        o.precision = "ieee"
        o.backend = "reference"

    fresh.register_load_state_dict_post_hook(post)
    with pytest.warns(UserWarning, match="optimizer-wide options replace"):
        fresh.load_state_dict(opt.state_dict())
    assert seen["dtype"] == torch.float32
    assert fresh.backend == "reference" and all(g["backend"] == "reference" for g in fresh.param_groups)


def test_the_load_warnings_advice_works_as_written():
    """The same review: the warning named one assignment (opt.backend = 'reference'), which fails
    while the loaded precision is tf32x3; it now lists every change, in an order that is valid."""
    model, opt = _bf16_opt(backend="torch", precision="tf32x3")
    fresh = fgd_fast.FGD(fgd_fast.stiefel_param_groups(model, "all", orthogonalize=False), lr=0.05, backend="reference")
    with pytest.warns(UserWarning) as w:
        fresh.load_state_dict(opt.state_dict())
    advice = str(w[0].message).split("set them again after loading: ")[1]
    assert advice == "opt.precision = 'ieee'; opt.backend = 'reference'"
    exec(advice, {"opt": fresh})  # (what a user pastes)
    assert (fresh.backend, fresh.precision) == ("reference", "ieee")


def test_group_dicts_reused_for_a_second_optimizer_carry_nothing_over():
    """The same review: torch writes the optimizer's options into the group dicts it is given, so
    the dicts reused for a second FGD with another backend were refused as giving a group its own."""
    groups = fgd_fast.stiefel_param_groups(_net(), "all")
    before = [dict(g) for g in groups]
    fgd_fast.FGD(groups, lr=0.1)
    assert groups == before  # (the caller's dicts untouched)
    second = fgd_fast.FGD(groups, lr=0.2, backend="reference")
    assert second.backend == "reference" and second.param_groups[0]["lr"] == 0.2


def test_a_cast_model_gets_advice_that_keeps_the_momentum():
    """The same review: after model.double() following a step, the message's only fix dropped the
    momentum; the cast it now names first keeps it, and the next step runs."""
    net = _net()
    opt = fgd_fast.FGD(fgd_fast.stiefel_param_groups(net, "paper"), lr=0.01, backend="torch")
    _loss(net, 0).backward()
    opt.step()
    net.double()
    opt.zero_grad()
    net(torch.randn(4, 3, 8, 8, dtype=torch.float64)).square().mean().backward()
    with pytest.raises(ValueError, match=r"\.to\(device='cpu', dtype=torch.float64\)\), or drop it") as exc:
        opt.step()
    assert "momentum_buffer" in str(exc.value)
    for st in opt.state.values():
        st["momentum_buffer"] = st["momentum_buffer"].to(device="cpu", dtype=torch.float64)
    opt.step()


@pytest.mark.parametrize("cls", ["FGD", "CayleySGD", "LandingSGD"])
def test_a_misspelled_group_key_warns_with_the_option_it_resembles(cls):
    """A review: ``dict(params=..., orthogonl=True)`` was kept and ignored, as torch keeps
    unknown keys: the constraint silently off. A key close to an option warns, naming it;
    keys of other uses (a name, a scheduler's initial_lr, a logger's own) stay silent."""
    make = getattr(fgd_fast, cls, None) or getattr(fgd_fast.baselines, cls)
    w = nn.Parameter(fgd_fast.orthogonalize_(torch.randn(8, 4)))
    with pytest.warns(UserWarning, match="'orthogonl' is not an option.*did you mean 'orthogonal'"):
        make([dict(params=[w], orthogonl=True)], lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make([dict(params=[w], orthogonal=True, name="w", names=["w"], initial_lr=0.1, lr_scale=2.0)], lr=0.1)
        # a scheduler's own keys (OneCycleLR's max_momentum, base_momentum) and others extending an option,
        # also those as close to it as a typo (a schedule's starting values momentum0, weight_decay0)
        make([dict(params=[w], max_momentum=0.95, base_momentum=0.85, lr0=0.1, weight_decay_rate=0.1)], lr=0.1)
        make([dict(params=[w], momentum0=0.9, weight_decay0=0.0)], lr=0.1)


def test_a_step_with_nothing_orthogonal_warns_once():
    """A review: ``FGD(model.parameters(), lr=...)`` (the torch.optim habit) is plain SGD with
    FGD's momentum 0.9, silently. The first step says so, once."""
    net = _net()
    opt = fgd_fast.FGD(net.parameters(), lr=0.01)
    _loss(net, 0).backward()
    with pytest.warns(UserWarning, match="no orthogonal=True group.*stiefel_param_groups"):
        opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()
        fgd_fast.FGD(fgd_fast.stiefel_param_groups(net), lr=0.01).step()


@pytest.mark.parametrize("backend", backend_params(("reference", "torch", "triton", "cuda")))
def test_a_first_step_in_inference_mode_makes_state_later_steps_can_update(backend):
    """A review: a step under ``torch.inference_mode`` made Φ (and the guard's counters) as
    inference tensors; the next step outside it raised "Inplace update to inference tensor" with
    the reference backend after writing the first layer (and any backend on a spike, where the
    counters are updated). The state is made outside inference mode: both steps run, the second
    one guarded, and nothing is an inference tensor."""
    torch.manual_seed(0)
    ws = [torch.nn.Parameter(fgd_fast.orthogonalize_(torch.randn(s))) for s in [(8, 24), (16, 3, 3, 3), (3, 1)]]
    opt = fgd_fast.FGD([dict(params=ws, orthogonal=True)], lr=0.1, backend=backend)
    for w in ws:
        w.grad = 0.01 * torch.randn(w.shape)
    with torch.inference_mode():
        opt.step()
    assert not any(t.is_inference() for w in ws for t in opt.state[w].values())
    for w in ws:
        w.grad = 1e3 * torch.randn(w.shape)  # a spike: the guard binds and its counters are added to
    with pytest.warns(RuntimeWarning, match="guard bound"):
        opt.step()
    assert sum(s["scaled"] + s["reset"] for s in opt.guard_stats().values()) >= 1


@pytest.mark.parametrize("cls", [fgd_fast.FGD, CayleySGD, CayleyADAM])
def test_plain_groups_and_baselines_after_a_step_in_inference_mode(cls):
    """A diff review: the plain groups' momentum (torch's SGD, inside the mode) and the Cayley
    baselines' moments were still inference tensors; the next step outside the mode raised after
    writing the orthogonal layers. Every step runs outside inference mode now (under no_grad)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Conv2d(8, 8, 3), torch.nn.Linear(8, 4))
    opt = cls(fgd_fast.stiefel_param_groups(net), lr=0.01)
    for step in range(2):
        for p in net.parameters():
            p.grad = 0.01 * torch.randn(p.shape)
        with torch.inference_mode(step == 0):
            opt.step()
        assert not any(t.is_inference() for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor))
    assert all(p.requires_grad and not p.is_inference() for p in net.parameters())


BACKENDS = ("reference", "torch", "triton")


def _autocast_twins(cls, backend):
    """Two equal nets (two equal 3 × 3 convolutions: one p, the torch backend's one bucket, and a
    plain Linear) with their optimizers, and the same gradients for both."""
    nets = [_net(seed=3) for _ in range(2)]
    kw = dict(backend=backend) if cls is fgd_fast.FGD else {}
    opts = [cls(fgd_fast.stiefel_param_groups(net), lr=0.05, **kw) for net in nets]
    return nets, opts


@pytest.mark.parametrize(
    "cls,backend",
    [pytest.param(fgd_fast.FGD, *b.values, marks=b.marks, id=f"FGD-{b.id}") for b in backend_params(BACKENDS, "cpu")]
    + [pytest.param(cls, None, id=cls.__name__) for cls in (CayleySGD, CayleyADAM, LandingSGD)],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_a_step_inside_autocast_is_the_step_outside_it(cls, backend, dtype):
    """A review: a loop that wraps ``opt.step()`` in ``torch.autocast`` (as ``torch.optim.SGD``
    allows) made the torch backend raise an internal dtype error at every step where its layers
    shared one p (its in-place products mixed float32 and bfloat16), and the reference backend's
    products ran in 16 bits (θ 1e-3 off after 30 steps). Every optimizer now steps with autocast
    off: the same bits as outside it; the closure still runs under the caller's autocast, which is
    on again after the step."""
    (inside, outside), (opt_in, opt_out) = _autocast_twins(cls, backend)
    seen = []

    def closure():
        seen.append(torch.randn(2, 2) @ torch.randn(2, 2))  # the caller's autocast: 16-bit products
        return torch.tensor(1.0)

    for step in range(3):
        for a, b in zip(inside.parameters(), outside.parameters()):
            a.grad = 0.05 * torch.randn(a.shape, generator=torch.Generator().manual_seed(step))
            b.grad = a.grad.clone()
        with torch.autocast("cpu", dtype=dtype):
            opt_in.step(closure)
            assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == dtype
        opt_out.step()
        assert seen[-1].dtype == dtype
    for a, b in zip(inside.parameters(), outside.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(opt_in.state.values(), opt_out.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in a if isinstance(a[k], torch.Tensor))


def test_the_functional_step_inside_autocast_is_the_step_outside_it():
    """``fgd_fast.fgd`` called directly under autocast computes in the parameters' dtypes too."""
    gen = torch.Generator().manual_seed(1)
    ws = [fgd_fast.orthogonalize_(torch.randn(16, 3, 3, 3, generator=gen)) for _ in range(2)]
    twins = [w.clone() for w in ws]
    grads = [0.05 * torch.randn(w.shape, generator=gen) for w in ws]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fgd_fast.fgd(ws, grads, [None, None], lr=0.1, momentum=0.9, feedback=0.4, backend="torch")
    fgd_fast.fgd(twins, grads, [None, None], lr=0.1, momentum=0.9, feedback=0.4, backend="torch")
    assert all(torch.equal(a, b) for a, b in zip(ws, twins))


_SWITCHES = ("", "cuda.matmul", "mkldnn", "mkldnn.matmul", "cudnn", "cudnn.conv")  # torch.backends.<…>.fp32_precision


def _switch_objects():
    out = []
    for path in _SWITCHES:
        obj = torch.backends
        for part in filter(None, path.split(".")):
            obj = getattr(obj, part)
        if hasattr(obj, "fp32_precision"):
            out.append(obj)
    return out


@pytest.fixture
def torch_precision_switches():
    """torch's fp32 precision switches (the per-backend ones and the legacy ones) restored after."""
    legacy = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    saved = [(obj, obj.fp32_precision) for obj in _switch_objects()]
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = legacy
    for obj, value in saved:
        obj.fp32_precision = value
    assert torch.get_float32_matmul_precision() == "highest"


def _switch_states():  # (the legacy switches read the same state: reading them raises where both APIs were set)
    return [obj.fp32_precision for obj in _switch_objects()]


@pytest.mark.parametrize(
    "setting",
    [
        "torch.backends.fp32_precision = 'tf32'",
        "torch.backends.cuda.matmul.fp32_precision = 'tf32'",
        "torch.backends.mkldnn.matmul.fp32_precision = 'bf16'",
        "torch.backends.cuda.matmul.allow_tf32 = True",
        "torch.set_float32_matmul_precision('high')",
    ],
)
@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_torchs_precision_switches_neither_break_nor_change_the_step(setting, backend, torch_precision_switches):
    """A review: with torch's per-backend precision switches set (``torch.backends.fp32_precision``
    and the like, torch >= 2.9), ``torch.get_float32_matmul_precision()`` raises, and every step
    raised with it (the step read and set the legacy switch); a step also left the per-backend
    switches changed. The step computes as with torch's defaults (a CPU: IEEE fp32; oneDNN's bf16
    switch included) and leaves every switch as it found it."""
    gen = torch.Generator().manual_seed(0)
    w = fgd_fast.orthogonalize_(torch.randn(20, 3, 3, 3, generator=gen))
    g = 0.05 * torch.randn(w.shape, generator=gen)

    def step():
        p = torch.nn.Parameter(w.clone())
        p.grad = g.clone()
        fgd_fast.FGD([dict(params=[p], orthogonal=True)], lr=0.1, backend=backend).step()
        return p.detach()

    expected = step()
    exec(setting)
    before = _switch_states()
    assert torch.equal(step(), expected)
    assert _switch_states() == before


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_amp_grad_scaler_skips_an_overflowed_step_and_unscales_the_others(name):
    """Mixed-precision training's loop (``torch.amp.GradScaler``), an integration check: a step
    whose scaled gradients overflowed is skipped (by the scaler, which then never calls
    ``step``) with nothing of the optimizer touched, and the others are the steps of the unscaled
    gradients, bit for bit (the scale is a power of two). Fails if a step ran on the scaled
    gradients (an optimizer declaring ``_step_supports_amp_scaling`` gets them still scaled, to
    unscale itself)."""
    scaled, plain = _net(), _net()
    opts = {
        "scaled": OPTIMIZERS[name](fgd_fast.stiefel_param_groups(scaled, "paper")),
        "plain": OPTIMIZERS[name](fgd_fast.stiefel_param_groups(plain, "paper")),
    }
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=1000)
    for k in range(4):
        opt = opts["scaled"]
        opt.zero_grad()
        scaler.scale(_loss(scaled, k)).backward()
        if k == 1:  # an overflow: the scaler must skip this step
            scaled[0].weight.grad[0, 0, 0, 0] = float("inf")
            snap = snapshot(scaled, opt)
        scaler.step(opt)
        scaler.update()
        if k == 1:
            assert_unchanged(scaled, opt, snap)
            assert scaler.get_scale() == 2.0**11
            continue
        opts["plain"].zero_grad()
        _loss(plain, k).backward()
        opts["plain"].step()
    for p, q in zip(scaled.parameters(), plain.parameters()):
        assert torch.equal(p, q)
