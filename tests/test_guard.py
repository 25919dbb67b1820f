"""The step guard: spikes survive, nothing non-finite or off the manifold is ever written,
``guard=False`` raises before writing with advice that works, and the guard is invisible in
ordinary steps."""

from __future__ import annotations

import warnings

import pytest
import torch

import fgd_fast
from fgd_fast.guards import MAX_DISTANCE, TRUST_RADIUS
from helpers import backend_params

BACKENDS = backend_params(("reference", "torch", "triton", "cuda"))  # (cuda: on the CPU emulation where it cannot load)
# the 80-step spike runs: Triton's guard under spikes is proven against the reference in
# tests/test_guard_rule.py (same decisions, |Δθ| ≤ 1e-9); its interpreter is too slow to repeat it here
SPIKE_BACKENDS = backend_params(("reference", "torch"))


def _spike_run(backend="torch", *, spike=300.0, lr_spike=1.0, guard=True, steps=80, recover=False, seed=0):
    """The issue's repro: unit-norm random gradients, lr 0.01, one gradient ×``spike`` at step
    20 (or lr ×``lr_spike`` for steps 20–22). Returns (final distance, raises, the optimizer)."""
    torch.manual_seed(seed)
    w = torch.nn.Parameter(fgd_fast.orthogonalize_(torch.randn(16, 8, 3, 3)))
    opt = fgd_fast.FGD(
        [dict(params=[w], orthogonal=True)], lr=0.01, momentum=0.9, feedback=0.4, backend=backend, guard=guard
    )
    raises = []
    for k in range(steps):
        g = torch.randn_like(w)
        w.grad = g / g.norm() * (spike if k == 20 else 1.0)
        opt.param_groups[0]["lr"] = 0.01 * (lr_spike if 20 <= k < 23 else 1.0)
        try:
            opt.step()
        except (ValueError, FloatingPointError):
            raises.append(k)
            if not recover:
                raise
            opt.reset_parameter(w)  # what the message advises
        phi = opt.state[w].get("momentum_buffer", torch.zeros(()))  # (none right after a reset)
        assert torch.isfinite(w).all() and torch.isfinite(phi).all()
        assert fgd_fast.stiefel_distance(w) <= MAX_DISTANCE
    return fgd_fast.stiefel_distance(w), raises, opt


@pytest.fixture(scope="module")
def calm_distance():
    return _spike_run(spike=1.0)[0]


@pytest.mark.parametrize("backend", SPIKE_BACKENDS)
def test_gradient_spike_is_survived_by_default(backend, calm_distance):
    """Why 1: a ×300 gradient at step 20 used to write θ 2.2 off the manifold and end in NaN.
    Now every step stays within max_distance and 60 steps later θ is back near the calm run."""
    with pytest.warns(RuntimeWarning, match="guard bound"):
        final, raises, opt = _spike_run(backend)
    assert raises == [] and final <= 3 * calm_distance, (final, calm_distance)
    stats = opt.guard_stats()[0]
    assert stats["scaled"] + stats["reset"] >= 1


def test_lr_spike_is_survived_by_default(calm_distance):
    """Why 1: lr ×100 for 3 steps used to write θ up to 30 off the manifold."""
    with pytest.warns(RuntimeWarning, match="guard bound"):
        final, raises, opt = _spike_run(spike=1.0, lr_spike=100.0)
    assert raises == [] and final <= 3 * calm_distance


@pytest.mark.parametrize("backend", SPIKE_BACKENDS)
def test_without_guard_the_spike_raises_before_writing_and_the_advice_recovers(backend, calm_distance):
    """Why 1: the error came one step late and its advice (orthogonalise) left the runaway Φ."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(fgd_fast.orthogonalize_(torch.randn(16, 8, 3, 3)))
    opt = fgd_fast.FGD([dict(params=[w], orthogonal=True)], lr=0.01, backend=backend, guard=False)
    for k in range(21):
        g = torch.randn_like(w)
        w.grad = g / g.norm() * (300.0 if k == 20 else 1.0)
        if k < 20:
            opt.step()
    before_w, before_phi = w.detach().clone(), opt.state[w]["momentum_buffer"].clone()
    with pytest.raises(ValueError, match="reset_parameter") as info:
        opt.step()
    assert "would move" in str(info.value)
    assert torch.equal(w, before_w) and torch.equal(opt.state[w]["momentum_buffer"], before_phi)
    final, raises, _ = _spike_run(backend, guard=False, recover=True)
    assert raises == [20] and final <= 3 * calm_distance, (final, calm_distance)


@pytest.mark.parametrize("backend", BACKENDS)
def test_huge_finite_gradient_never_writes_non_finite(backend):
    """Why 2: a finite gradient of 3e38 wrote NaN θ and Φ."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(fgd_fast.orthogonalize_(torch.randn(12, 5)))
    opt = fgd_fast.FGD([dict(params=[w], orthogonal=True)], lr=0.01, backend=backend)
    w.grad = torch.randn_like(w) * 0.01
    opt.step()
    w.grad = torch.full_like(w, 3e38)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.step()
    assert torch.isfinite(w).all() and torch.isfinite(opt.state[w]["momentum_buffer"]).all()
    assert fgd_fast.stiefel_distance(w) <= MAX_DISTANCE
    # without the guard the same step is refused before writing: it would overflow (the gradient
    # itself is finite, so this is the prediction's check, not the inputs')
    opt.guard = False
    before = w.detach().clone()
    with pytest.raises(FloatingPointError, match="would write non-finite values"):
        opt.step()
    assert torch.equal(w, before)


@pytest.mark.parametrize("gram_refresh", [1, 2])  # the velocity Gram formed later (1) or in the Gram pass (2)
@pytest.mark.parametrize("momentum", [0.9, 0.0])  # UᵀU with Φ, G = gᵀg without
@pytest.mark.parametrize("spike", [1e20, 1e36])
def test_a_huge_finite_gradient_is_scaled_as_the_reference_scales_it(spike, momentum, gram_refresh):
    """Review: the torch backend formed the guard's velocity Gram (UᵀU, or gᵀg) in float32 from
    the unscaled U, so a finite gradient with ‖ηg‖ > ~1.8e19 overflowed it and the layer was
    reset (Φ₊ = 0), where the reference scales Φ and g into the safety radius and steps. Now the
    scaled layers' Gram is formed from sU: the same step, the same decisions."""
    runs = {}
    for backend in ("reference", "torch"):
        torch.manual_seed(0)
        ws = [torch.nn.Parameter(fgd_fast.orthogonalize_(torch.randn(24, 6))) for _ in range(3)]
        opt = fgd_fast.FGD(
            [dict(params=ws, orthogonal=True)], lr=0.5, momentum=momentum, backend=backend, gram_refresh=gram_refresh
        )
        for k in range(3):
            for i, w in enumerate(ws):  # the middle layer stays calm: a batch of scaled and unscaled layers
                w.grad = torch.randn(w.shape) * (spike if k == 1 and i != 1 else 0.01)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                opt.step()
        runs[backend] = (ws, opt)
    (ref, ref_opt), (got, opt) = runs["reference"], runs["torch"]
    assert opt.guard_stats() == ref_opt.guard_stats()
    assert [s["reset"] for s in opt.guard_stats().values()] == [0, 0, 0]
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0)
        if momentum:
            torch.testing.assert_close(
                opt.state[b]["momentum_buffer"], ref_opt.state[a]["momentum_buffer"], atol=1e-6, rtol=0
            )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("momentum", [0.9, 0.0])
@pytest.mark.parametrize("lr", [1e4, 2e4])
def test_a_trust_scale_below_float32s_square_root_range_still_counts_the_velocity(backend, momentum, lr):
    """A guard fuzz: with ‖g‖ = 1.5e19 and a huge lr the trust scale s = ρ/(η‖g‖) fell below
    ~1e-19, where s² is subnormal (lr 1e4: another decision) or 0 in float32 (lr 2e4: the
    velocity term dropped out of the guard's exact distance, and θ was stored 3.4 off the
    manifold, counted as scaled). s is now applied twice, never squared: the reference's step."""
    stored = {}
    for name in ("reference", backend):
        torch.manual_seed(0)
        w = torch.nn.Parameter(fgd_fast.orthogonalize_(torch.randn(6, 24)))
        opt = fgd_fast.FGD(  # (IEEE fp32 products: differences are the guard's, not TF32's)
            [dict(params=[w], orthogonal=True)], lr=lr, momentum=momentum, backend=name, precision="ieee"
        )
        g = torch.randn(6, 24, generator=torch.Generator().manual_seed(1))
        w.grad = g / g.norm() * 1.5e19
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt.step()
        stored[name] = (fgd_fast.stiefel_distance(w), opt.guard_stats()[0], w.detach().clone())
    (d_ref, stats_ref, w_ref), (d, stats, w) = stored["reference"], stored[backend]
    assert d <= MAX_DISTANCE and stats == stats_ref, (d, stats, stats_ref)
    assert abs(d - d_ref) <= 1e-5 and torch.allclose(w, w_ref, atol=1e-5, rtol=0), (d, d_ref)


# (shape, lr, |g| entry): s = ρ/(η‖g‖) is 0 in float32 (~1e-50), or subnormal (~6e-45)
TINY_SCALES = {"zero-scale": ((4, 4), 1e30, 1e20), "subnormal-scale": ((64, 16), 3.4e38, 6e4)}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(TINY_SCALES))
def test_a_trust_scale_float32_cannot_carry_resets_the_layer(backend, case):
    """Review: with η‖g‖ beyond ρ·2¹²⁶ the trust scale s is 0 or subnormal in float32. The torch
    backend's guard predicted the step with s rounded to 0 while writing it with the exact sη (θ
    stored 8.5 from the manifold, counted as scaled; the next step raised), and the Triton kernel's
    subnormal s stored 0.85. Below ``MIN_TRUST_SCALE`` every backend now resets the layer, as for a
    non-finite input: the pull-back, within ``max_distance``, and the next step runs."""
    shape, lr, big = TINY_SCALES[case]
    stored = {}
    for name in ("reference", backend):
        w = torch.nn.Parameter(fgd_fast.orthogonalize_(torch.randn(shape, generator=torch.Generator().manual_seed(0))))
        opt = fgd_fast.FGD([dict(params=[w], orthogonal=True)], lr=lr, backend=name, precision="ieee")
        g = torch.full(shape, big)
        g[::2] *= -1
        w.grad = g
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt.step()
        stored[name] = (fgd_fast.stiefel_distance(w), opt.guard_stats()[0], w.detach().clone())
        opt.param_groups[0]["lr"] = 0.01
        w.grad = torch.randn(shape, generator=torch.Generator().manual_seed(1))
        opt.step()  # (raised "… is ‖θᵀθ − I‖_F = 8.485 from the manifold")
        assert fgd_fast.stiefel_distance(w) <= MAX_DISTANCE
    (d_ref, stats_ref, w_ref), (d, stats, w) = stored["reference"], stored[backend]
    assert stats == stats_ref == {"scaled": 0, "reset": 1}, (stats, stats_ref)
    assert d <= MAX_DISTANCE and torch.allclose(w, w_ref, atol=1e-6, rtol=0), (d, d_ref)


def test_the_trust_scale_resets_below_the_smallest_scale_float32_carries():
    from fgd_fast.backends.guard_rule import MIN_TRUST_SCALE, trust_scale
    from fgd_fast.kernels import meta

    assert meta.MIN_TRUST_SCALE == MIN_TRUST_SCALE == torch.finfo(torch.float32).tiny  # (the kernel's copy)
    g_norm = torch.tensor([4.0 / MIN_TRUST_SCALE, 4.0 / MIN_TRUST_SCALE * 1.01, 8.0], dtype=torch.float64)
    s, _ = trust_scale(torch.zeros(3, dtype=torch.float64), g_norm, 1.0, 4.0)
    assert s.tolist() == [MIN_TRUST_SCALE, 0.0, 0.5]


# (shape, dtype, gradient norm): the step's terms cancel (a gradient normal to the manifold)
CANCELLING = {
    "1x1-float32": ((1, 1), torch.float32, 1e12),
    "1x1-float64": ((1, 1), torch.float64, 1e20),
    "1x1-float32-1e9": ((1, 1), torch.float32, 1e9),
    "normal-16x4-float32": ((16, 4), torch.float32, 1e9),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(CANCELLING))
def test_without_the_guard_a_step_whose_rounding_could_leave_the_manifold_is_refused(backend, case):
    """A fuzz find: without the guard, the check predicts the exact distance after the step, but
    a gradient normal to the manifold (g = θS; every gradient of a 1 × 1 layer) makes a step whose
    huge terms cancel: exact distance ~0, while the write's rounding stored θ 110 from the manifold
    (torch, float32, ‖ηg‖ = 7e8; float64 at 7e19: 7.9e5; Triton's tf32x3 step at 7e11: θ = 0).
    Where the write's rounding bound reaches past
    ``max_distance`` the step is refused now, changing nothing."""
    shape, dtype, big = CANCELLING[case]
    gen = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(fgd_fast.orthogonalize_(torch.randn(shape, generator=gen, dtype=torch.float64)).to(dtype))
    opt = fgd_fast.FGD(
        [dict(params=[w], orthogonal=True)],
        lr=0.74,
        momentum=0.5,
        feedback=0.0,
        backend=backend,
        guard=False,
    )
    for _ in range(3):
        w.grad = 0.01 * torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
        opt.step()
    sym = torch.randn(shape[1], shape[1], generator=gen, dtype=torch.float64)
    g = w.detach().double() @ (sym + sym.t())  # θS: normal to the manifold
    w.grad = (g / g.norm() * big).to(dtype)
    before, buf = w.detach().clone(), opt.state[w]["momentum_buffer"].clone()
    try:
        opt.step()
    except ValueError as exc:  # refused (the fused backends: their prediction is algebraic)
        assert "would move orthogonal parameter" in str(exc)
        assert torch.equal(w.detach(), before) and torch.equal(opt.state[w]["momentum_buffer"], buf)
    else:  # (the reference measures the θ₊ it writes, rounding included)
        assert backend == "reference" and fgd_fast.stiefel_distance(w) <= MAX_DISTANCE


@pytest.mark.parametrize("big", [1e6, 1.35e6])
def test_a_step_the_torch_backend_refuses_for_its_rounding_triton_refuses_too(big):
    """A review: with momentum the Triton fused middle read ‖M_θ‖ from a slot its blend had
    already overwritten with F = M_θ − M_Φ, so its rounding bound lacked the product's terms: at
    ‖g‖ = 1e6 the torch backend refused a 1 × 1 step that Triton took. (Triton may refuse more:
    its float32 prediction of such a step carries rounding of its own.)"""
    pytest.importorskip("triton", reason="Triton is not installed")
    decisions = {}
    for name in ("torch", "triton"):
        if name == "triton" and backend_params(("triton",))[0].marks:
            pytest.skip("the Triton backend cannot run here (a GPU or TRITON_INTERPRET=1)")
        gen = torch.Generator().manual_seed(0)
        w = torch.nn.Parameter(torch.ones(1, 1))
        opt = fgd_fast.FGD(
            [dict(params=[w], orthogonal=True)], lr=0.74, momentum=0.5, feedback=0.0, backend=name, guard=False
        )
        w.grad = 0.01 * torch.randn(1, 1, generator=gen)
        opt.step()
        w.grad = torch.full((1, 1), big)
        try:
            opt.step()
            decisions[name] = "stepped"
        except ValueError as exc:
            decisions[name] = f"refused at {float(str(exc).split('= ')[1].split(' ')[0]):.3g}"
    assert decisions["torch"] != "stepped" and decisions["triton"] != "stepped", decisions


def test_a_float64_layer_is_scaled_where_float32_blocks_could_not_carry_its_scale():
    """A review: the trust scale's floor (float32's smallest normal number) also reset float64
    layers, whose blocks carry a scale of 1e-40; the floor is the blocks' dtype's own."""
    stats = {}
    for name in ("reference", "torch"):
        gen = torch.Generator().manual_seed(0)
        w = torch.nn.Parameter(fgd_fast.orthogonalize_(torch.randn(8, 4, generator=gen, dtype=torch.float64)))
        opt = fgd_fast.FGD([dict(params=[w], orthogonal=True)], lr=1.0, momentum=0.9, backend=name)
        w.grad = 0.01 * torch.randn(8, 4, generator=gen, dtype=torch.float64)
        opt.step()
        g = torch.randn(8, 4, generator=gen, dtype=torch.float64)
        w.grad = g / g.norm() * 1e40  # s = ρ/‖g‖ ≈ 4e-40: below float32's normal range, not float64's
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt.step()
        stats[name] = opt.guard_stats()[0]
        assert fgd_fast.stiefel_distance(w) <= MAX_DISTANCE
    assert stats["reference"] == stats["torch"] == {"scaled": 1, "reset": 0}, stats


@pytest.mark.parametrize("backend", backend_params(("triton",), "cpu"))
@pytest.mark.parametrize("seed", [0, 5])
def test_the_guard_at_single_pass_tf32_keeps_room_for_its_measurement(backend, seed):
    """A Triton fuzz: at ``precision="tf32"`` θᵀθ and the guard's blocks come from single TF32
    passes, which read the distance only to ~2⁻¹¹; with no feedback the guard kept landing θ at the
    boundary and stored it 2.5e-4 past ``max_distance`` (seed 5), or the next step's check read a θ
    within it as beyond and raised (seed 0). The guard's margin now takes TF32's rounding."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.nn.Parameter(fgd_fast.orthogonalize_(torch.randn(6, 3, generator=gen, dtype=torch.float64)).float())
    opt = fgd_fast.FGD(
        [dict(params=[w], orthogonal=True)], lr=10.0, momentum=0.9, feedback=0.0, backend=backend, precision="tf32"
    )
    for _ in range(8):
        w.grad = torch.randn(6, 3, generator=gen)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt.step()
        assert fgd_fast.stiefel_distance(w.detach().double()) <= MAX_DISTANCE


def test_the_write_rounding_bound_changes_only_a_distance_it_takes_past_the_limit():
    from fgd_fast.backends.guard_rule import with_write_rounding

    dist = torch.tensor([1e-6, 1e-6, 0.4], dtype=torch.float64)
    m_norm = torch.tensor([1e-2, 1e9, 1e-2], dtype=torch.float64)
    got = with_write_rounding(dist, m_norm, m_norm, 64, 2.0**-24, 0.5)
    assert got[0] == dist[0] and got[2] == dist[2]  # (within: the exact distance, as reported)
    assert got[1] > 0.5  # (the rounding of a 1e9 cancellation could leave: refused)
    assert torch.equal(with_write_rounding(dist, m_norm, m_norm, 64, 2.0**-24, None), dist)
    # TF32 operands: a product's rounding ~2·2⁻¹¹·√p‖M‖ (p = 4096, ‖M‖ = 10: 0.63, refused);
    # ordinary training's ‖M‖ ~ 0.1 stays within
    m = torch.tensor([10.0, 0.1], dtype=torch.float64)
    tf32 = with_write_rounding(torch.tensor([0.01, 0.01], dtype=torch.float64), m, m, 4096, 2.0**-24, 0.5, 2.0**-11)
    assert tf32[0] > 0.5 and tf32[1] == 0.01


@pytest.mark.parametrize("shape", [(24, 6), (6, 24)])
def test_carried_grams_after_a_normal_gradient_do_not_reset(shape):
    """A guard fuzz: with ``gram_refresh=2`` a gradient normal to the manifold (g = θ: Φ₊ ≈ 0)
    left a carried C₊ = W + sym(M_Φᵀ(Y + T)) whose trace rounded below zero; ‖Φ‖ = √tr C was NaN
    and the guard reset the next steps (momentum lost). The trace is clamped at 0 now: the
    reference's decisions and step."""
    runs = {}
    for backend, refresh in (("reference", 1), ("torch", 2)):
        torch.manual_seed(0)
        w = torch.nn.Parameter(fgd_fast.orthogonalize_(torch.randn(shape)))
        opt = fgd_fast.FGD(
            [dict(params=[w], orthogonal=True)], lr=0.05, momentum=0.9, backend=backend, gram_refresh=refresh
        )
        gen = torch.Generator().manual_seed(2)
        for k in range(3):
            w.grad = w.detach().clone() if k == 0 else 0.1 * torch.randn(shape, generator=gen)
            opt.step()
        runs[backend] = (opt.guard_stats()[0], w.detach().clone())
    assert runs["torch"][0] == runs["reference"][0] == {"scaled": 0, "reset": 0}
    torch.testing.assert_close(runs["torch"][1], runs["reference"][1], atol=1e-6, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_check_manifold_alone_refuses_an_overflowing_step(backend):
    """Issue: guard=False, check_finite=False and g = 1e30 wrote θ at distance 2.6e57 —
    check_manifold only refused a *finite* predicted distance above the limit."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(fgd_fast.orthogonalize_(torch.randn(12, 5)))
    opt = fgd_fast.FGD([dict(params=[w], orthogonal=True)], lr=0.1, backend=backend, guard=False, check_finite=False)
    w.grad = torch.randn_like(w) * 0.01
    opt.step()
    w.grad = torch.full_like(w, 1e30)
    before, buf = w.detach().clone(), opt.state[w]["momentum_buffer"].clone()
    with pytest.raises(ValueError, match="max_distance"):
        opt.step()
    assert torch.equal(w, before) and torch.equal(opt.state[w]["momentum_buffer"], buf)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_momentum_buffer_is_refused_before_writing(backend):
    """Why 2: a NaN in momentum_buffer with a finite gradient made θ NaN; no check covered Φ."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(fgd_fast.orthogonalize_(torch.randn(12, 5)))
    opt = fgd_fast.FGD([dict(params=[w], orthogonal=True)], lr=0.01, backend=backend)
    w.grad = torch.randn_like(w) * 0.01
    opt.step()
    opt.state[w]["momentum_buffer"][0, 0] = float("nan")
    before = w.detach().clone()
    with pytest.raises(FloatingPointError, match="momentum_buffer"):
        opt.step()
    assert torch.equal(w, before)
    opt.reset_parameter(w)  # the advice: clears Φ
    opt.step()
    assert torch.isfinite(w).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_guard_does_not_change_an_ordinary_step(backend):
    """Where the guard does not bind, the update is bit-identical to the unguarded one."""
    torch.manual_seed(3)
    shapes = [(8, 4, 3, 3), (20, 7), (6, 30)]
    runs = []
    for guard in (True, False):
        torch.manual_seed(3)
        ws = [torch.nn.Parameter(fgd_fast.orthogonalize_(torch.randn(s))) for s in shapes]
        opt = fgd_fast.FGD([dict(params=ws, orthogonal=True)], lr=0.05, backend=backend, guard=guard)
        for _ in range(4):
            for w in ws:
                g = torch.randn_like(w)
                w.grad = g / g.norm() * 0.5
            opt.step()
        runs.append([w.detach().clone() for w in ws] + [opt.state[w]["momentum_buffer"].clone() for w in ws])
        if guard:
            assert all(v == {"scaled": 0, "reset": 0} for v in opt.guard_stats().values())
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_guard_counts_without_checks_and_warns_only_at_the_check_sync():
    torch.manual_seed(0)
    w = torch.nn.Parameter(fgd_fast.orthogonalize_(torch.randn(10, 4)))
    opt = fgd_fast.FGD([dict(params=[w], orthogonal=True)], lr=1.0, check_finite=False, check_manifold=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no check, no sync: no warning
        for _ in range(3):
            w.grad = torch.randn_like(w) * 10
            opt.step()
    stats = opt.guard_stats()[0]
    assert stats["scaled"] + stats["reset"] == 3
    opt.check_manifold = True
    w.grad = torch.randn_like(w) * 10
    with pytest.warns(RuntimeWarning, match="guard_stats"):
        opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per optimizer
        w.grad = torch.randn_like(w) * 10
        opt.step()


def test_reset_parameter_projects_and_clears_momentum():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(10, 4))
    opt = fgd_fast.FGD([dict(params=[w], orthogonal=True)], lr=0.01, check_manifold=False)
    w.grad = torch.randn_like(w)
    opt.step()
    opt.reset_parameter(w)
    assert fgd_fast.stiefel_distance(w) < 1e-5 and "momentum_buffer" not in opt.state[w]
    with pytest.raises(ValueError, match="not one of this optimizer's parameters"):
        opt.reset_parameter(torch.nn.Parameter(torch.randn(3, 3)))


@pytest.mark.parametrize("precision", ["ieee", "tf32x3"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_reset_over_a_non_finite_gradient_writes_the_pull_back(backend, bad, precision):
    """Issue: check_finite=False, guard on, an Inf/NaN in g: the reference wrote the pull-back
    θ(I − αD), Φ₊ = 0, but torch and Triton wrote NaN (the reset's s = 0 times Inf). Every
    backend now writes what the reference does (to TF32 rounding of θF at "tf32x3": the
    tensor-core update kernel)."""
    if backend in ("reference", "cuda") and precision != "ieee":
        pytest.skip(f"the {backend} backend computes in IEEE precision only")
    out = {}
    for name in ("reference", backend):
        torch.manual_seed(0)
        w = torch.nn.Parameter(fgd_fast.orthogonalize_(torch.randn(12, 5)))
        prec = "ieee" if name == "reference" else precision
        opt = fgd_fast.FGD(
            [dict(params=[w], orthogonal=True)], lr=0.05, backend=name, check_finite=False, precision=prec
        )
        for k in range(3):
            w.grad = torch.randn(w.shape, generator=torch.Generator().manual_seed(k)) * 0.1
            opt.step()
        w.grad[0, 0] = bad
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt.step()
        out[name] = (w.detach().clone(), opt.state[w]["momentum_buffer"].clone())
    (w_ref, phi_ref), (w_b, phi_b) = out["reference"], out[backend]
    assert torch.isfinite(w_b).all() and torch.equal(phi_b, torch.zeros_like(phi_b))
    tol = 3e-7 if precision == "ieee" else 2e-5  # float32 rounding (a few ulps of 1), or TF32 of θF
    torch.testing.assert_close(w_b, w_ref, rtol=0, atol=tol)
    assert torch.equal(phi_ref, torch.zeros_like(phi_ref))


@pytest.mark.parametrize("backend", BACKENDS)
def test_guard_stats_count_each_kind_of_step_apart(backend):
    """A step the guard scales counts as ``scaled`` only; a step it resets (a NaN gradient with
    the finite check off) as ``reset`` only; a step it keeps as neither."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(fgd_fast.orthogonalize_(torch.randn(16, 8)))
    opt = fgd_fast.FGD([dict(params=[w], orthogonal=True)], lr=1.0, momentum=0.9, backend=backend, check_finite=False)
    counts = []
    for g in (10 * torch.randn(16, 8), torch.full((16, 8), float("nan")), 1e-6 * torch.randn(16, 8)):
        w.grad = g
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # (the guard's one warning)
            opt.step()
        counts.append(dict(opt.guard_stats()[0]))
    assert counts == [{"scaled": 1, "reset": 0}, {"scaled": 1, "reset": 1}, {"scaled": 1, "reset": 1}]


def _table(rows):
    """One backend call's checks as its ``(L, 5)`` float64 table: dist, finite, dist₊, finite₊, guarded."""
    return torch.tensor(rows, dtype=torch.float64)


@pytest.mark.parametrize("bad", ["finite", "dist_next", "none"])
def test_every_table_of_calls_sharing_a_device_is_read(bad):
    """Two backend calls on one device, each with its own checks table (a sharded layer's call
    beside a plain layer's): the second call's rows are read too: its non-finite gradient or its
    step beyond max_distance raises naming its layer, and its guard decisions come back."""
    from fgd_fast.guards import RESET, SCALED, raise_if_invalid

    second = {"finite": [0.1, 0.0, 0.1, 1.0, 0.0], "dist_next": [0.1, 1.0, 0.9, 1.0, 0.0]}
    second = second.get(bad, [0.1, 1.0, 0.1, 1.0, RESET])
    tables = [_table([[0.0, 1.0, 0.0, 1.0, SCALED]]), _table([second])]
    kwargs = dict(
        dist=[t[:, 0] for t in tables],
        finite=[t[:, 1] for t in tables],
        index=[[0], [1]],
        labels=["'a'", "'b'"],
        check_finite=True,
        check_manifold=True,
        dist_next=[t[:, 2] for t in tables],
        finite_next=[t[:, 3] for t in tables],
        guarded=[t[:, 4] for t in tables],
        tables=tables,
    )
    if bad == "none":
        assert raise_if_invalid(**kwargs) == [SCALED, RESET]
        return
    error = FloatingPointError if bad == "finite" else ValueError
    with pytest.raises(error, match="'b'"):
        raise_if_invalid(**kwargs)


@pytest.mark.parametrize("backend", SPIKE_BACKENDS)
def test_the_optimizers_trust_radius_reaches_the_step(backend):
    """``FGD(trust_radius=ρ)`` steps as ``fgd(trust_radius=ρ)`` does: a small ρ scales the inputs
    (‖Φ‖ + η‖g‖ ≈ 0.1–0.2 here), so the steps differ from the default radius's."""

    def run(radius, functional):
        gen = torch.Generator().manual_seed(0)
        w = torch.nn.Parameter(fgd_fast.orthogonalize_(torch.randn(16, 8, generator=gen, dtype=torch.float64)))
        kw = dict(lr=0.1, momentum=0.9, feedback=0.4, backend=backend, trust_radius=radius)
        opt = None if functional else fgd_fast.FGD([dict(params=[w], orthogonal=True)], **kw)
        bufs = [None]
        for _ in range(3):
            g = torch.randn(w.shape, generator=gen, dtype=torch.float64)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # (the guard's one warning)
                if opt is None:
                    with torch.no_grad():
                        fgd_fast.fgd([w], [g / g.norm()], bufs, **kw)
                else:
                    w.grad = g / g.norm()
                    opt.step()
        return w.detach()

    small = run(0.05, functional=False)
    assert torch.equal(small, run(0.05, functional=True))
    assert (small - run(TRUST_RADIUS, functional=False)).abs().max() > 1e-4
