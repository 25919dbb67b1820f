"""The baselines' state and edge cases found by a review: state that does not fit an orthogonal
parameter is refused before any write (Landing wrote θ, then failed on the buffer), ``None``
entries are fresh state, a finite gradient whose Landing step overflows raises and changes
nothing, a huge finite gradient still moves θ, tied weights are refused by the adapters, and a
mistyped optimizer-wide option in a checkpoint is a ``ValueError``."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fgd_fast
from fgd_fast.baselines import CayleyADAM, CayleySGD, LandingSGD, torch_orthogonal_sgd
from helpers import assert_unchanged, snapshot

BASELINES = {"CayleySGD": CayleySGD, "CayleyADAM": CayleyADAM, "LandingSGD": LandingSGD}


def _net(make, **kw):
    torch.manual_seed(0)
    net = nn.Linear(9, 4, bias=True)  # weight 4 × 9: θ is its 9 × 4 transpose
    fgd_fast.orthogonalize_(net.weight.data)
    opt = make([dict(params=[net.weight], orthogonal=True), dict(params=[net.bias], orthogonal=False)], lr=0.1, **kw)
    return net, opt


def _grads(net, seed, scale=0.1):
    g = torch.Generator().manual_seed(seed)
    net.weight.grad = scale * torch.randn(net.weight.shape, generator=g)
    net.bias.grad = 0.1 * torch.randn(net.bias.shape, generator=g)


@pytest.mark.parametrize("name", list(BASELINES))
def test_state_that_does_not_fit_an_orthogonal_parameter_is_refused_before_any_write(name):
    """Landing computed with a transposed buffer put into opt.state by hand, wrote θ (and the
    bias), then failed on the buffer copy; Cayley raised bare errors. A ValueError names it now,
    before anything is written."""
    net, opt = _net(BASELINES[name])
    _grads(net, 0)
    opt.step()
    key = "exp_avg" if name == "CayleyADAM" else "momentum_buffer"
    opt.state[net.weight][key] = opt.state[net.weight][key].T.contiguous()
    _grads(net, 1)
    snap = snapshot(net, opt)
    with pytest.raises(ValueError, match=key):
        opt.step()
    assert_unchanged(net, opt, snap)


@pytest.mark.parametrize("name", list(BASELINES))
def test_a_none_state_entry_is_fresh_state(name):
    """A state_dict with ``momentum_buffer: None`` (or ADAM's moments None before its first step)
    loaded, and Landing's next step wrote θ, then failed (``None.copy_``); Cayley's raised. None
    is no state: the step equals a fresh optimizer's. Cayley ADAM's moments None after steps are
    refused at load (they are needed)."""
    net, opt = _net(BASELINES[name])
    fresh_net, fresh = _net(BASELINES[name])
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0] = {"momentum_buffer": None} if name != "CayleyADAM" else {"exp_avg": None, "exp_avg_sq": None}
    opt.load_state_dict(sd)
    for n, o in ((net, opt), (fresh_net, fresh)):
        _grads(n, 0)
        o.step()
    assert torch.equal(net.weight, fresh_net.weight)
    if name == "CayleyADAM":
        sd = copy.deepcopy(opt.state_dict())
        sd["state"][0]["exp_avg"] = None
        snap = snapshot(net, opt)
        with pytest.raises(ValueError, match="exp_avg"):
            opt.load_state_dict(sd)
        assert_unchanged(net, opt, snap)


@pytest.mark.parametrize("safe_distance", [0.5, None])
def test_a_finite_gradient_whose_landing_step_overflows_raises_and_changes_nothing(safe_distance):
    """max |g| = 3e38 (finite float32): the step wrote NaN into θ and its buffer without a word,
    and every later step raised. The new θ and buffer join the step's one finiteness check."""
    net, opt = _net(LandingSGD, momentum=0.9, safe_distance=safe_distance)
    _grads(net, 0)
    opt.step()
    _grads(net, 1)
    net.weight.grad = torch.ones(4, 9)
    net.weight.grad[:, ::2] = -1.0
    net.weight.grad *= 3e38  # (finite; ψ = ½(GA − θGᵀθ) overflows)
    snap = snapshot(net, opt)
    with pytest.raises(FloatingPointError, match="would write non-finite values"):
        opt.step()
    assert_unchanged(net, opt, snap)


def test_a_huge_finite_gradient_still_moves_theta_in_float32_as_in_float64():
    """‖ψ‖ of a 1e20 gradient overflowed float32 in the safe step's norms: η* was NaN, taken as 0,
    and θ stayed put where float64 moved it. The norms are float64 now."""
    moved = {}
    for dtype in (torch.float32, torch.float64):
        torch.manual_seed(0)
        w = nn.Parameter(fgd_fast.orthogonalize_(torch.randn(16, 4, dtype=torch.float64)).to(dtype))
        opt = LandingSGD([dict(params=[w], orthogonal=True)], lr=0.1, momentum=0.0)
        w.grad = (1e20 * torch.randn(16, 4, dtype=torch.float64)).to(dtype)
        before = w.detach().clone()
        opt.step()
        assert torch.isfinite(w).all()
        moved[dtype] = float((w.detach() - before).abs().max())
    assert moved[torch.float64] > 0.01
    assert moved[torch.float32] == pytest.approx(moved[torch.float64], rel=1e-4)


def test_the_adapters_refuse_tied_weights_and_change_nothing():
    """A parametrization replaced a tied weight on its first owner only: the second kept a stale
    copy nothing trained, and the weights were untied without a word."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False))
    model[1].weight = model[0].weight
    before = model[0].weight.detach().clone()
    with pytest.raises(ValueError, match="tied weights"):
        torch_orthogonal_sgd(model, "all", lr=0.1)
    assert model[0].weight is model[1].weight and torch.equal(model[0].weight, before)
    assert not any(hasattr(m, "parametrizations") for m in model)


@pytest.mark.parametrize(
    "name, option, value", [("CayleySGD", "qr_period", 2.0), ("LandingSGD", "safe_distance", "0.5")]
)
def test_a_mistyped_optimizer_wide_option_in_a_checkpoint_is_a_value_error(name, option, value):
    """Raised TypeError (nothing loaded), unlike every other refusal of a state_dict."""
    net, opt = _net(BASELINES[name])
    sd = copy.deepcopy(opt.state_dict())
    for group in sd["param_groups"]:
        group[option] = value
    snap = snapshot(net, opt)
    with pytest.raises(ValueError, match=f"cannot load this state_dict: its optimizer-wide options.*{option}"):
        opt.load_state_dict(sd)
    assert_unchanged(net, opt, snap)


@pytest.mark.filterwarnings("ignore:.*has no orthogonal=True group")
@pytest.mark.parametrize("name", ["FGD", *BASELINES])
@pytest.mark.parametrize("made_orthogonal", [False, True])
def test_a_group_flag_flipped_between_steps_does_not_reuse_the_state(name, made_orthogonal):
    """A review: a group trained unconstrained, then set orthogonal=True, read torch SGD's
    momentum (+G accumulated) as Cayley's M = βM − G: the next steps went uphill. The other way,
    Φ became a plain momentum. load_state_dict refused this mismatch; the step now does too,
    before any write; cleared state steps."""
    make = fgd_fast.FGD if name == "FGD" else BASELINES[name]
    net, opt = _net(make, momentum=0.9) if name != "CayleyADAM" else _net(make)
    opt.param_groups[0]["orthogonal"] = made_orthogonal
    if not made_orthogonal:
        with torch.no_grad():
            net.weight.add_(0.01)  # (trained unconstrained: off the manifold, reprojected below)
    _grads(net, 0)
    opt.step()
    opt.param_groups[0]["orthogonal"] = not made_orthogonal
    if made_orthogonal is False:
        fgd_fast.orthogonalize_(net.weight.data)
    _grads(net, 1)
    snap = snapshot(net, opt)
    with pytest.raises(ValueError, match=f"was made under orthogonal={made_orthogonal}"):
        opt.step()
    assert_unchanged(net, opt, snap)
    opt.state[net.weight].clear()
    opt.step()
    # back again: the state the cleared step made is of the flipped kind (a review: the record of
    # the state's kind was kept from before the clearing, and this flip was not refused)
    opt.param_groups[0]["orthogonal"] = made_orthogonal
    if made_orthogonal:
        fgd_fast.orthogonalize_(net.weight.data)
    _grads(net, 2)
    snap = snapshot(net, opt)
    with pytest.raises(ValueError, match=f"was made under orthogonal={not made_orthogonal}"):
        opt.step()
    assert_unchanged(net, opt, snap)


@pytest.mark.parametrize("name", list(BASELINES))
def test_orthogonality_measures_the_orthogonal_parameters_only(name):
    """``orthogonality()`` of a baseline, as FGD's: the orthogonal parameters' distances, keyed
    by flat index (no bias, which has no manifold)."""
    net, opt = _net(BASELINES[name])
    distances = opt.orthogonality()
    assert list(distances) == [0] and distances[0] < 1e-5
