"""The baselines' input checks and state contracts, each found missing by a mutation review
(a check turned off in a copy of the source, and no test failed): Landing's hyper-parameter
checks, the optional flags' types, a bad default that every group overrides, saved and hand-set
Cayley ADAM moments, ``safe_step_size``'s contract, state updated in place, and the adapters
refusing bad options (and frozen weights) before they touch the model."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

import fgd_fast
from fgd_fast.baselines import CayleyADAM, LandingSGD, geoopt_stiefel_sgd, torch_orthogonal_sgd
from fgd_fast.baselines.landing import safe_step_size
from helpers import assert_unchanged, snapshot
from test_baselines_state import BASELINES, _grads, _net


def _weight(seed=0, shape=(4, 9)):
    torch.manual_seed(seed)
    return nn.Parameter(fgd_fast.orthogonalize_(torch.randn(shape)))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(lr=-0.1), ValueError, "lr"),
        (dict(momentum=1.0), ValueError, "momentum"),
        (dict(dampening=1.5), ValueError, "dampening"),
        (dict(weight_decay=-1e-4), ValueError, "weight_decay"),
        (dict(momentum=0.0, nesterov=True), ValueError, "nesterov"),
        (dict(orthogonal="yes"), TypeError, "orthogonal"),
    ],
    ids=["lr", "momentum", "dampening", "weight_decay", "nesterov", "orthogonal"],
)
def test_landing_refuses_bad_hyper_parameters(kwargs, error, match):
    """Every hyper-parameter of a Landing group is checked (the tests tried λ and ε only): as an
    optimizer keyword, in a group, or in a group added later, which is then not added."""
    w = _weight()
    if "orthogonal" not in kwargs:  # (an optimizer keyword: every group's default)
        with pytest.raises(error, match=match):
            LandingSGD([dict(params=[w], orthogonal=True)], **{"lr": 0.1, **kwargs})
    with pytest.raises(error, match=match):
        LandingSGD([dict(params=[w], **{"orthogonal": True, **kwargs})], lr=0.1)
    opt = LandingSGD([dict(params=[_weight(1)], orthogonal=True)], lr=0.1)
    with pytest.raises(error, match=match):
        opt.add_param_group(dict(params=[w], **{"orthogonal": True, **kwargs}))
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("option", ["check_finite", "maximize"])
@pytest.mark.parametrize("name", list(BASELINES))
def test_the_flags_must_be_booleans(name, option):
    """A truthy non-bool (``check_finite="no"``, ``maximize=1``) is refused, at construction and
    when set later (the option keeps its value)."""
    with pytest.raises(TypeError, match=f"{option} must be True or False"):
        BASELINES[name]([dict(params=[_weight()], orthogonal=True)], lr=0.1, **{option: "no"})
    opt = BASELINES[name]([dict(params=[_weight()], orthogonal=True)], lr=0.1)
    with pytest.raises(TypeError, match=f"{option} must be True or False"):
        setattr(opt, option, 1)
    assert getattr(opt, option) is (option == "check_finite")


@pytest.mark.parametrize("name", ["CayleySGD", "CayleyADAM"])
def test_public_code_compat_set_later_must_be_a_boolean(name):
    opt = BASELINES[name]([dict(params=[_weight()], orthogonal=True)], lr=0.1)
    with pytest.raises(TypeError, match="public_code_compat must be True or False"):
        opt.public_code_compat = "yes"
    assert opt.public_code_compat is False


@pytest.mark.parametrize("name", list(BASELINES))
def test_a_bad_default_is_refused_even_when_every_group_overrides_it(name):
    """As ``torch.optim.SGD``: ``lr=-1`` is refused at construction, though the one group sets
    its own lr (the default would reach the next group added without one)."""
    with pytest.raises(ValueError, match="lr"):
        BASELINES[name]([dict(params=[_weight()], orthogonal=True, lr=0.1)], lr=-1.0)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda st: st.update(step=True), "step is True"),
        (lambda st: st.update(exp_avg_sq=torch.tensor(5)), "exp_avg_sq is 5"),
    ],
    ids=["bool-step", "integer-v"],
)
def test_cayley_adam_refuses_a_boolean_step_or_an_integer_second_moment(edit, match):
    """Loaded unchecked, an integer v stays integer: every later average is truncated into it in
    place (seen with the check planted off: v stayed int64)."""
    w = _weight()
    opt = CayleyADAM([dict(params=[w], orthogonal=True)], lr=0.1)
    for seed in range(2):
        w.grad = torch.randn(w.shape, generator=torch.Generator().manual_seed(seed))
        opt.step()
    sd = copy.deepcopy(opt.state_dict())
    edit(sd["state"][0])
    fresh = CayleyADAM([dict(params=[w], orthogonal=True)], lr=0.1)
    with pytest.raises(ValueError, match=match):
        fresh.load_state_dict(sd)
    assert not fresh.state


@pytest.mark.parametrize("lost", ["exp_avg", "exp_avg_sq"])
def test_cayley_adam_refuses_moments_removed_by_hand_after_steps(lost):
    """Moments dropped from opt.state after steps: the step refuses them with the fix before any
    write (without the check, a bare KeyError)."""
    net, opt = _net(CayleyADAM)
    for seed in range(2):
        _grads(net, seed)
        opt.step()
    del opt.state[net.weight][lost]
    _grads(net, 2)
    snap = snapshot(net, opt)
    with pytest.raises(ValueError, match="moments do not fit.*opt.state\\[param\\].clear"):
        opt.step()
    assert_unchanged(net, opt, snap)


def test_safe_step_size_keeps_its_documented_contract():
    """``safe_step_size`` is public: 1/(2λ) where nothing moves (a = d = 0, where η* is 0/0)
    and ``nan`` outside the safe region; LandingSGD masks both, so only this test sees them."""
    d = torch.tensor([0.0, 0.5, 0.7, 0.1], dtype=torch.float64)
    a = torch.tensor([0.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    eta = safe_step_size(d, a, attraction=2.0, eps=0.5)
    assert eta[0] == 0.25  # 1/(2λ)
    assert torch.isnan(eta[1]) and torch.isnan(eta[2])  # d ≥ ε
    assert 0 < eta[3] <= 0.25  # inside: a step, at most 1/(2λ)


@pytest.mark.parametrize("name", list(BASELINES))
def test_state_tensors_are_updated_in_place(name):
    """As ``torch.optim.SGD``'s momentum: a step writes into the state tensors it made, so a
    reference held to them (or a captured CUDA graph's address) sees the new values."""
    net, opt = _net(BASELINES[name])
    held = {}
    for seed in range(3):
        _grads(net, seed)
        opt.step()
        state = {k: v for k, v in opt.state[net.weight].items() if isinstance(v, torch.Tensor)}
        assert state, "the orthogonal parameter has tensor state"
        if held:
            assert all(state[k] is held[k][0] for k in held), "a state tensor was replaced"
            assert any(not torch.equal(state[k], held[k][1]) for k in held), "the state did not change"
        held = {k: (v, v.clone()) for k, v in state.items()}


_BAD_SGD = [dict(lr=-0.1), dict(momentum=1.0), dict(weight_decay=-1e-4), dict(momentum=0.0, nesterov=True)]


@pytest.mark.parametrize(
    "make, kwargs, error",
    [("torch", kw, ValueError) for kw in _BAD_SGD]
    + [("geoopt", kw, ValueError) for kw in _BAD_SGD]
    + [("geoopt", dict(canonical="yes"), TypeError)],
    ids=[f"{m}-{k}" for m in ("torch", "geoopt") for k in ("lr", "momentum", "weight_decay", "nesterov")]
    + ["geoopt-canonical"],
)
def test_the_adapters_refuse_bad_options_before_touching_the_model(make, kwargs, error):
    """torch's SGD refuses a negative lr too, but only after the weights are projected and
    parametrized: the adapters check first, so the model comes back unchanged."""
    if make == "geoopt":
        pytest.importorskip("geoopt")
    build = geoopt_stiefel_sgd if make == "geoopt" else torch_orthogonal_sgd
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(9, 4), nn.Linear(4, 3))
    before = [t.detach().clone() for t in net.parameters()]
    with pytest.raises(error):
        build(net, "all", **{"lr": 0.1, **kwargs})
    assert not any(parametrize.is_parametrized(m) for m in net)
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), before))


@pytest.mark.parametrize("make", [torch_orthogonal_sgd, geoopt_stiefel_sgd])
def test_the_adapters_leave_frozen_weights_alone(make):
    """A frozen weight the rule selects is neither parametrized nor trained (parametrized, it
    would become a trainable parameter again)."""
    if make is geoopt_stiefel_sgd:
        pytest.importorskip("geoopt")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(9, 4), nn.Linear(4, 3))
    net[0].weight.requires_grad_(False)
    frozen = net[0].weight.detach().clone()
    opt = make(net, "all", lr=0.1)
    assert not parametrize.is_parametrized(net[0], "weight") and parametrize.is_parametrized(net[1], "weight")
    trained = {id(p) for g in opt.param_groups for p in g["params"]}
    assert id(net[0].weight) not in trained and torch.equal(net[0].weight, frozen)


@pytest.mark.parametrize("canonical", [False, True])
def test_the_geoopt_adapter_passes_its_manifold_and_stabilize_on(canonical):
    geoopt = pytest.importorskip("geoopt")
    net = nn.Sequential(nn.Linear(9, 4), nn.Linear(4, 3))
    opt = geoopt_stiefel_sgd(net, "all", lr=0.1, canonical=canonical, stabilize=7)
    manifold = geoopt.CanonicalStiefel if canonical else geoopt.EuclideanStiefel
    assert all(type(p.manifold) is manifold for p in opt.param_groups[0]["params"])
    assert all(g["stabilize"] == 7 for g in opt.param_groups)


def test_the_torch_adapter_passes_its_orthogonal_map_on():
    net = nn.Sequential(nn.Linear(9, 4), nn.Linear(4, 3))
    torch_orthogonal_sgd(net, "all", lr=0.1, orthogonal_map="cayley")
    assert all(str(m.parametrizations.weight[0].orthogonal_map).endswith("cayley") for m in net)
