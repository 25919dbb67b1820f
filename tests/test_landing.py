"""``fgd_fast.baselines.LandingSGD`` against a float64 oracle written from the Landing papers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fgd_fast
from fgd_fast.baselines import LandingSGD
from helpers import assert_unchanged, snapshot
from oracle import landing_step, random_stiefel, sgd_step, stiefel_dist

SHAPES = [(8, 4, 3, 3), (5, 40), (40, 5), (12, 12), (1, 7), (13, 7, 3)]


def _run(options, steps=15, lr=0.1, seed=0, scale=None):
    """LandingSGD and the oracle on one gradient stream (default: unit-norm gradients)."""
    rng = np.random.default_rng(seed)
    w0 = [random_stiefel(rng, s) for s in SHAPES]
    params = [torch.nn.Parameter(torch.tensor(w)) for w in w0]
    opt = LandingSGD([dict(params=params, orthogonal=True)], lr=lr, **options)
    ow, obuf = [w.copy() for w in w0], [None] * len(SHAPES)
    oracle_opts = dict(
        momentum=options.get("momentum", 0.9),
        attraction=options.get("attraction", 1.0),
        eps=options.get("safe_distance", 0.5),
        dampening=options.get("dampening", 0.0),
        nesterov=options.get("nesterov", False),
        weight_decay=options.get("weight_decay", 0.0),
    )
    for _ in range(steps):
        grads = [rng.standard_normal(s) * (scale or 1 / np.sqrt(np.prod(s))) for s in SHAPES]
        for p, g in zip(params, grads):
            p.grad = torch.tensor(g)
        opt.step()
        for i in range(len(SHAPES)):
            ow[i], obuf[i] = landing_step(ow[i], grads[i], obuf[i], lr=lr, **oracle_opts)
    return params, opt, ow, obuf


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(momentum=0.0),
        dict(momentum=0.8, nesterov=True),
        dict(momentum=0.5, dampening=0.3, weight_decay=1e-3, attraction=0.5),
        dict(safe_distance=None, attraction=2.0),
    ],
    ids=["default", "no-momentum", "nesterov", "dampening-wd", "no-safe-step"],
)
def test_float64_matches_the_oracle(options):
    params, opt, ow, obuf = _run(options)
    for p, w, b in zip(params, ow, obuf):
        np.testing.assert_allclose(p.detach().numpy(), w, rtol=0, atol=1e-12)
        buf = opt.state[p].get("momentum_buffer")
        if b is None:
            assert buf is None
        else:
            np.testing.assert_allclose(fgd_fast.as_stiefel(buf).numpy(), b, rtol=0, atol=1e-12)


def test_the_safe_step_binds_and_keeps_every_step_inside_the_safe_distance():
    """lr = 10 with gradients of norm ~3√(np): the plain step would leave the manifold at once;
    the safe step takes smaller steps (matching the oracle) and, without momentum (where the
    direction is tangent-like: θᵀψ is skew), every iterate stays within ε."""
    rng = np.random.default_rng(1)
    w0 = [random_stiefel(rng, s) for s in SHAPES]
    params = [torch.nn.Parameter(torch.tensor(w)) for w in w0]
    opt = LandingSGD([dict(params=params, orthogonal=True)], lr=10.0, momentum=0.0, safe_distance=0.3)
    for _ in range(30):
        for p in params:
            p.grad = torch.randn(p.shape, dtype=p.dtype) * 3
        opt.step()
        assert max(stiefel_dist(p.detach().numpy()) for p in params) <= 0.3 + 1e-12
    params2, _, ow, _ = _run(dict(safe_distance=0.3), steps=10, lr=10.0, scale=3.0)
    for p, w in zip(params2, ow):
        np.testing.assert_allclose(p.detach().numpy(), w, rtol=0, atol=1e-10)


def test_the_safe_step_caps_the_pull_at_half_over_lambda():
    """A review: with a small gradient and a large lr the authors' η* (no cap) is large, and the
    pull λθD overshot: θ 0.003 off went to 0.55, beyond ε = 0.5, without momentum (where the
    docstring promises every iterate within ε). η ≤ 1/(2λ) keeps it inside, and contracts D."""
    torch.manual_seed(0)
    for lam in (1.0, 3.0, 0.2):
        w = torch.nn.Parameter(fgd_fast.orthogonalize_(torch.randn(20, 1, dtype=torch.float64)) * 1.0014)
        before = fgd_fast.stiefel_distance(w)
        assert 0.002 < before < 0.004
        opt = LandingSGD([dict(params=[w], orthogonal=True)], lr=100.0, momentum=0.0, attraction=lam)
        w.grad = 1e-4 * torch.randn_like(w)
        opt.step()
        assert fgd_fast.stiefel_distance(w) < before  # (0.55 for λ = 1 without the cap)


def test_beyond_the_safe_distance_it_lands():
    """A θ already 0.6 off (ε = 0.5): the step is the attraction alone and the distance falls
    quadratically (D → O(D²) at η = 1/(2λ))."""
    w = torch.nn.Parameter(fgd_fast.orthogonalize_(torch.randn(6, 20, dtype=torch.float64)) * 1.2)
    before = fgd_fast.stiefel_distance(w)
    assert before > 0.5
    opt = LandingSGD([dict(params=[w], orthogonal=True)], lr=0.5, momentum=0.0)  # ηλ = ½: D → O(D²)
    w.grad = torch.randn_like(w)
    opt.step()
    assert fgd_fast.stiefel_distance(w) < 0.3 * before
    for _ in range(3):
        w.grad = torch.randn_like(w) * 1e-3
        opt.step()
    assert fgd_fast.stiefel_distance(w) < 1e-3


def test_euclidean_groups_are_torch_sgd():
    rng = np.random.default_rng(2)
    w0 = rng.standard_normal((4, 3))
    p = torch.nn.Parameter(torch.tensor(w0))
    opt = LandingSGD([dict(params=[p])], lr=0.1, momentum=0.9, weight_decay=0.01)
    w, buf = w0.copy(), None
    for _ in range(4):
        g = rng.standard_normal((4, 3))
        p.grad = torch.tensor(g)
        opt.step()
        w, buf = sgd_step(w, g, buf, lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.01, nesterov=False)
    np.testing.assert_allclose(p.detach().numpy(), w, rtol=0, atol=1e-14)


@pytest.mark.parametrize("poisoned", ["gradient", "momentum_buffer"])
def test_a_non_finite_gradient_or_buffer_raises_and_changes_nothing(poisoned):
    """The check covers the buffer too (a review's surviving mutant dropped it: no test failed)."""
    params = [torch.nn.Parameter(fgd_fast.orthogonalize_(torch.randn(s))) for s in [(4, 9), (8, 3)]]
    opt = LandingSGD([dict(params=params, orthogonal=True)], lr=0.1)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    if poisoned == "gradient":
        params[1].grad = torch.full_like(params[1], float("nan"))
    else:
        opt.state[params[0]]["momentum_buffer"][0, 0] = float("inf")
    net = torch.nn.ParameterList(params)
    snap = snapshot(net, opt)
    with pytest.raises(FloatingPointError, match="non-finite gradient or optimizer state"):
        opt.step()
    assert_unchanged(net, opt, snap)


@pytest.mark.parametrize("lr", [0.1, 0.0])
def test_beyond_the_safe_distance_the_pull_takes_the_smaller_of_lr_and_its_cap(lr):
    """Beyond the safe distance the step is θ₊ = θ − min(η, 1/(2λ))·λθ(θᵀθ − I): at an lr below
    the cap, the lr (a review: the cap alone survived every test, which ran at η = 1/(2λ); at
    lr = 0 it moved θ)."""
    torch.manual_seed(0)
    theta = fgd_fast.orthogonalize_(torch.randn(20, 6, dtype=torch.float64)) * 1.2
    w = torch.nn.Parameter(theta.clone())
    opt = LandingSGD([dict(params=[w], orthogonal=True)], lr=lr, momentum=0.0, attraction=1.0)
    w.grad = torch.randn_like(w)
    opt.step()
    expected = theta - lr * theta @ (theta.mT @ theta - torch.eye(6, dtype=torch.float64))
    torch.testing.assert_close(w.detach(), expected, rtol=0, atol=1e-13)


def test_options_are_checked_and_carried():
    p = torch.nn.Parameter(fgd_fast.orthogonalize_(torch.randn(4, 9)))
    with pytest.raises(ValueError, match="safe_distance"):
        LandingSGD([p], lr=0.1, safe_distance=1.5)
    with pytest.raises(ValueError, match="safe_distance"):  # (every θ would be outside: the pull alone, always)
        LandingSGD([p], lr=0.1, safe_distance=0.0)
    with pytest.raises(ValueError, match="attraction"):
        LandingSGD([dict(params=[p], orthogonal=True)], lr=0.1, attraction=0.0)
    opt = LandingSGD([dict(params=[p], orthogonal=True)], lr=0.1, safe_distance=None)
    p.grad = torch.randn_like(p)
    opt.step()
    other = LandingSGD([dict(params=[p], orthogonal=True)], lr=0.1)
    other.load_state_dict(opt.state_dict())
    assert other.safe_distance is None
    torch.testing.assert_close(other.state[p]["momentum_buffer"], opt.state[p]["momentum_buffer"])
    with pytest.raises(ValueError, match="LandingSGD"):
        other.load_state_dict(torch.optim.SGD([p], lr=0.1).state_dict())


def test_a_buffer_that_overflows_beyond_the_safe_distance_is_refused():
    """Beyond the safe distance the step is the pull alone, so θ₊ stays finite while ψ of a
    huge finite gradient overflows the momentum buffer: refused before any write (an Inf buffer
    was written)."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(fgd_fast.orthogonalize_(torch.randn(6, 20)) * 1.2)  # far: pull-only step
    opt = LandingSGD([dict(params=[w], orthogonal=True)], lr=0.1)
    w.grad = torch.full_like(w, 3e38)
    before = w.detach().clone()
    with pytest.raises(FloatingPointError):
        opt.step()
    assert torch.equal(w, before) and not opt.state[w]


def test_a_safe_distance_of_one_is_refused():
    w = torch.nn.Parameter(fgd_fast.orthogonalize_(torch.randn(4, 9)))
    with pytest.raises(ValueError, match="safe_distance"):
        LandingSGD([dict(params=[w], orthogonal=True)], lr=0.1, safe_distance=1.0)


def test_a_group_that_lost_a_key_is_refused_with_the_fix():
    w = torch.nn.Parameter(fgd_fast.orthogonalize_(torch.randn(4, 9)))
    opt = LandingSGD([dict(params=[w], orthogonal=True)], lr=0.1)
    del opt.param_groups[0]["attraction"]
    w.grad = torch.randn_like(w)
    with pytest.raises(ValueError, match="has no 'attraction'.*put the key"):
        opt.step()


def test_euclidean_groups_take_nesterov_and_dampening_as_torch_sgd():
    a, b = (torch.nn.Parameter(torch.ones(4, 3)) for _ in range(2))
    kw = dict(lr=0.1, momentum=0.9, weight_decay=0.01)
    ours = LandingSGD([dict(params=[a])], nesterov=True, **kw)
    theirs = torch.optim.SGD([b], nesterov=True, **kw)
    damped, damped_ref = (torch.nn.Parameter(torch.ones(4, 3)) for _ in range(2))
    ours_d = LandingSGD([dict(params=[damped])], dampening=0.3, **kw)
    theirs_d = torch.optim.SGD([damped_ref], dampening=0.3, **kw)
    for k in range(4):
        g = torch.full((4, 3), 0.5 + k)
        for p in (a, b, damped, damped_ref):
            p.grad = g.clone()
        for o in (ours, theirs, ours_d, theirs_d):
            o.step()
    assert torch.equal(a, b) and torch.equal(damped, damped_ref)


@pytest.mark.parametrize("shape", [(4, 9), (9, 4), (6, 2, 3, 3)])
def test_the_momentum_buffer_is_stored_contiguous_in_the_parameters_shape(shape):
    torch.manual_seed(0)
    w = torch.nn.Parameter(fgd_fast.orthogonalize_(torch.randn(shape)))
    opt = LandingSGD([dict(params=[w], orthogonal=True)], lr=0.1, momentum=0.9)
    w.grad = torch.randn_like(w)
    opt.step()
    buf = opt.state[w]["momentum_buffer"]
    assert buf.shape == w.shape and buf.is_contiguous()
