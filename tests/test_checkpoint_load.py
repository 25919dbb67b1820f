"""Loading checkpoints: what ``load_state_dict`` refuses (with the reason, nothing changed) and
what it leaves behind when a warning is raised as an error (found by a review of checkpoints;
each case was accepted, or failed half-way, before)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import fgd_fast
from fgd_fast.baselines import CayleyADAM, CayleySGD, LandingSGD
from helpers import assert_unchanged, snapshot

OPTIMIZERS = {"FGD": fgd_fast.FGD, "CayleySGD": CayleySGD, "CayleyADAM": CayleyADAM, "LandingSGD": LandingSGD}


def _stepped(make=fgd_fast.FGD, dtype=torch.float32, **kw):
    """A two-layer net (one orthogonal weight, one plain bias) and an optimizer after one step."""
    torch.manual_seed(0)
    net = nn.Linear(8, 16).to(dtype)
    fgd_fast.orthogonalize_(net.weight.data)
    opt = make([dict(params=[net.weight], orthogonal=True), dict(params=[net.bias], orthogonal=False)], **kw)
    net.weight.grad = (0.1 * torch.randn(16, 8)).to(dtype)
    net.bias.grad = (0.1 * torch.randn(16)).to(dtype)
    opt.step()
    return net, opt


def _refused(net, opt, sd, match, error=ValueError):
    snap = snapshot(net, opt)
    with pytest.raises(error, match=match):
        opt.load_state_dict(sd)
    assert_unchanged(net, opt, snap)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("key", ["lr", "weight_decay"])
def test_a_group_without_a_hyper_parameter_is_refused(name, key):
    """Accepted before (the validation merged this optimizer's group under the saved one, which
    torch then installed alone): every later step raised that the group has no such key."""
    net, opt = _stepped(OPTIMIZERS[name], lr=0.01)
    sd = copy.deepcopy(opt.state_dict())
    del sd["param_groups"][0][key]
    _refused(net, opt, sd, rf"param_groups\[0\] has no '{key}'")


MALFORMED = {  # edit → what the refusal says
    "state_not_a_dict": "its 'state' is a list",
    "entry_not_a_dict": r"state_dict\['state'\]\[0\] is a Tensor",
    "entry_none": r"state_dict\['state'\]\[0\] is a NoneType",
    "no_state": "expected a dict with 'state' and 'param_groups'",
    "group_without_params": "each with 'params'",
    "stray_key": "which its param_groups do not list",
    "meta_buffer": "meta device",
    "negative_count": "guard_count",
    "meta_count": "guard_count",
}


@pytest.mark.parametrize("edit", list(MALFORMED))
def test_a_malformed_state_dict_is_refused_with_the_reason(edit):
    """Each failed half-way (AttributeError/KeyError after torch had installed part of it, or
    RuntimeError on a meta tensor) or loaded what no step can use (a stray key's entry, negative
    guard counts, which ``guard_stats`` then reported)."""
    net, opt = _stepped(lr=0.01, momentum=0.9)
    sd = copy.deepcopy(opt.state_dict())
    if edit == "state_not_a_dict":
        sd["state"] = list(sd["state"].values())
    elif edit == "entry_not_a_dict":
        sd["state"][0] = sd["state"][0]["momentum_buffer"]
    elif edit == "entry_none":
        sd["state"][0] = None
    elif edit == "no_state":
        del sd["state"]
    elif edit == "group_without_params":
        del sd["param_groups"][1]["params"]
    elif edit == "stray_key":
        sd["state"]["0"] = sd["state"].pop(0)
    elif edit == "meta_buffer":
        sd["state"][0]["momentum_buffer"] = sd["state"][0]["momentum_buffer"].to("meta")
    elif edit == "negative_count":
        sd["state"][0]["guard_count"] = torch.tensor([-7, -1])
    else:
        sd["state"][0]["guard_count"] = torch.zeros(2, dtype=torch.int64, device="meta")
    _refused(net, opt, sd, MALFORMED[edit])


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_buffer_that_overflows_the_parameters_dtype_is_refused(name):
    """A float32 momentum of 1e5 loaded into a float16 plain parameter became Inf on the cast
    after the check; the next step wrote −Inf into the weights. It is checked in the dtype it
    will have (an orthogonal float16 parameter's state is float32: it loads)."""
    net, opt = _stepped(OPTIMIZERS[name], dtype=torch.float16, lr=0.01)
    sd = copy.deepcopy(opt.state_dict())
    key = next(k for k in ("momentum_buffer", "exp_avg") if k in sd["state"][1])
    big = torch.full_like(sd["state"][1][key], 1e5, dtype=torch.float32)
    sd["state"][1][key] = big
    _refused(net, opt, sd, "once cast to torch.float16")
    orth = copy.deepcopy(opt.state_dict())
    if "momentum_buffer" in orth["state"][0]:
        orth["state"][0]["momentum_buffer"] = torch.full((16, 8), 1e5)
        opt.load_state_dict(orth)
        assert opt.state[net.weight]["momentum_buffer"].dtype == torch.float32


def test_a_warning_raised_as_an_error_leaves_a_whole_optimizer():
    """The options' warning came after torch's load and before the float32 and int64 fix-ups:
    under ``warnings.simplefilter("error")`` a bfloat16 parameter's Φ was left bfloat16 and its
    counters bfloat16, and the next step raised. The warning comes last now: the load is whole
    when it is raised, and the next step runs."""
    net, saved = _stepped(dtype=torch.bfloat16, lr=0.01, max_distance=0.3)
    _, opt = _stepped(dtype=torch.bfloat16, lr=0.01)
    opt.param_groups[0]["params"], opt.param_groups[1]["params"] = [net.weight], [net.bias]
    opt.state.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="options replace"):
            opt.load_state_dict(saved.state_dict())
    state = opt.state[net.weight]
    assert state["momentum_buffer"].dtype == torch.float32 and state["guard_count"].dtype == torch.int64
    assert opt.max_distance == 0.3
    net.weight.grad = torch.full_like(net.weight, 0.01)
    opt.step()


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_load_pre_hook_that_replaces_a_key_leaves_the_callers_dict_alone(name):
    """As torch.optim's: the pre-hooks see a shallow copy of the caller's state_dict."""
    net, opt = _stepped(OPTIMIZERS[name], lr=0.01)
    sd = opt.state_dict()
    saved_state, saved_groups = sd["state"], sd["param_groups"]
    opt.register_load_state_dict_pre_hook(lambda o, state_dict: state_dict.update(state={}))
    opt.load_state_dict(sd)
    assert sd["state"] is saved_state and sd["param_groups"] is saved_groups


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_load_hooks_run_at_every_load(name):
    """The load pre- and post-hooks run once per load_state_dict, at every load (the load
    sets torch's own aside for its inner call and puts them back)."""
    net, opt = _stepped(OPTIMIZERS[name], lr=0.01)
    calls = []
    opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append("pre"))
    opt.register_load_state_dict_post_hook(lambda o: calls.append("post"))
    sd = opt.state_dict()
    opt.load_state_dict(sd)
    opt.load_state_dict(sd)
    assert calls == ["pre", "post", "pre", "post"]


def test_an_option_missing_from_the_first_saved_group_takes_one_value_in_every_group():
    """A checkpoint from before an optimizer-wide option existed (its first group lacks it; a
    later group edited to hold another value): every group and the defaults hold the current
    default after the load, and the next step runs (groups that disagree on an optimizer-wide
    option are refused at the step)."""
    net, opt = _stepped(lr=0.01)
    sd = copy.deepcopy(opt.state_dict())
    del sd["param_groups"][0]["max_distance"]
    sd["param_groups"][1]["max_distance"] = 0.3
    opt.load_state_dict(sd)
    assert {g["max_distance"] for g in opt.param_groups} == {opt.defaults["max_distance"]} == {0.5}
    net.weight.grad, net.bias.grad = 0.1 * torch.randn(16, 8), 0.1 * torch.randn(16)
    opt.step()


def test_guard_counts_of_a_16_bit_parameter_load_exactly():
    """torch's load casts floating state to the parameter's dtype; the guard's int64 counters
    are moved, never cast (bfloat16 holds whole numbers exactly only up to 256)."""
    net, opt = _stepped(dtype=torch.bfloat16, lr=0.01)
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0]["guard_count"] = torch.tensor([1001, 3], dtype=torch.int64)
    opt.load_state_dict(sd)
    assert opt.guard_stats()[0] == {"scaled": 1001, "reset": 3}
    assert opt.state[net.weight]["guard_count"].dtype == torch.int64


def test_an_optimizer_pickled_before_an_option_existed_unpickles_with_its_default():
    """Unpickling state saved before an optimizer-wide option existed fills in its default,
    in the defaults and in every group, instead of a KeyError at the next step."""
    import pickle

    net, opt = _stepped(lr=0.01)
    state = copy.deepcopy(opt.__getstate__())
    del state["defaults"]["gram_refresh"]
    for group in state["param_groups"]:
        del group["gram_refresh"]
    old = fgd_fast.FGD.__new__(fgd_fast.FGD)
    old.__setstate__(state)
    new = pickle.loads(pickle.dumps(old))
    default = fgd_fast.FGD._OPTIONS["gram_refresh"]
    assert new.defaults["gram_refresh"] == default
    assert all(g["gram_refresh"] == default for g in new.param_groups)


def test_a_state_dict_of_another_group_count_names_both_counts():
    """torch's own refusal ('a different number of parameter groups') gave no counts and no fix."""
    w = torch.nn.Parameter(fgd_fast.orthogonalize_(torch.randn(6, 3)))
    b = torch.nn.Parameter(torch.randn(3))
    saved = fgd_fast.FGD([dict(params=[w], orthogonal=True), dict(params=[b])], lr=0.1).state_dict()
    opt = fgd_fast.FGD([dict(params=[w], orthogonal=True)], lr=0.1)
    with pytest.raises(ValueError, match=r"it has 2 param group\(s\), this FGD 1; nothing was loaded"):
        opt.load_state_dict(saved)
