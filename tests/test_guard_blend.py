"""The guard's blend as Triton kernels (``kernels/guard.py``, ``fgd_fast/backends/guard_blend.py``)
against the torch ops of :func:`fgd_fast.backends.algebra.middle` it replaces.

Every layer blended (as on a GPU, where no host read lets the middle skip it), on Gram blocks
of random near-orthonormal θ whose steps the guard keeps, scales, resets and resets by
Newton–Schulz, in one ``p`` and in a layout of several (odd p included), float32 and float64,
with and without Φ, with per-layer hyper-parameters and with ``UᵀU`` given as one block. The
decisions must be the same and the matrices equal to rounding (the kernels sum every weight's
distance directly, so only a distance within rounding of the target could choose otherwise).
"""

from __future__ import annotations

import zlib

import pytest
import torch

from fgd_fast.backends import algebra, guard_rule
from fgd_fast.backends.layout import Layout
from helpers import backend_reason, device_for_tests, gram_blocks, record_launches

REASON = backend_reason("triton")
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"triton backend unavailable: {REASON}")

# (gradient and Φ scale, distance of θ from the manifold, max_distance): together they make the
# guard keep (K), scale (S), reset (R) and reset by Newton–Schulz (Rn) layers, with Φ and without
CASES = [(1e-3, 0.0, 1e-2), (3e-2, 0.0, 1e-3), (3e-2, 3e-2, 1e-3), (0.3, 1e-3, 1e-2), (1e-3, 0.1, 1e-2)]
LAYOUTS = {"one-p": [(3, 5)], "three-p": [(2, 5), (3, 17), (2, 40)]}


def _blocks(groups, dtype, scale, off, gen):
    """The layout of ``groups``, its Gram blocks and ‖g‖² per layer (:func:`helpers.gram_blocks`)."""
    lay = Layout(groups, device_for_tests())
    return (lay, *gram_blocks(lay, dtype, gen, scale=scale, off=off))


def _middles(lay, blocks, g_sq, *, momentum, limit, per_layer, given_uu):
    """The middle by torch ops and by the blend kernels, on copies of the same blocks."""
    from fgd_fast.backends import guard_blend

    count = lay.count
    if per_layer:  # per-layer η, β, α as the fused backends' hyper table gives them
        kw = dict(dtype=blocks[0].dtype, device=blocks[0].device)
        lr = torch.linspace(0.05, 0.15, count, **kw)
        beta = torch.full((count,), 0.9, **kw)
        alpha = torch.linspace(0.3, 0.45, count, **kw)
    else:
        lr, beta, alpha = 0.1, 0.9, 0.4
    out = []
    for kernels in (None, guard_blend.blend):
        a, e, b, c, gg, h = (x.clone() for x in blocks)
        if not momentum:
            b = c = h = None
        uu = None
        if given_uu:  # UᵀU as one block (the torch backend's form)
            uu = guard_rule.velocity_gram(c, h, gg, lay.col(beta), lay.col(lr), lay)
            gg = h = None
        mid = algebra.middle(
            a,
            b,
            c,
            e,
            lr=lr,
            beta=beta,
            alpha=alpha,
            g_sq=g_sq.clone(),
            h=h,
            gg=gg,
            uu=uu,
            radius=4.0,
            limit=limit,
            unit=guard_rule.store_unit(blocks[0].dtype),
            stored=blocks[0].dtype,
            layout=lay,
            blend_kernels=kernels,
        )
        out.append(mid)
    return out, lay.col(alpha) if per_layer else alpha


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("momentum", [True, False], ids=["phi", "no-phi"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_blend_kernels_choose_and_write_the_step_of_the_torch_ops(dtype, momentum, layout, monkeypatch):
    monkeypatch.setattr(guard_rule, "HOST_READ_DEVICES", ())  # every layer blended, as on a GPU
    gen = torch.Generator().manual_seed(zlib.crc32(f"{dtype} {momentum} {layout}".encode()))
    tol = 2e-5 if dtype == torch.float32 else 1e-12
    seen = set()
    for k, (scale, off, limit) in enumerate(CASES):
        lay, blocks, g_sq = _blocks(LAYOUTS[layout], dtype, scale, off, gen)
        (ref, got), alpha = _middles(
            lay, blocks, g_sq, momentum=momentum, limit=limit, per_layer=k % 2 == 1, given_uu=k == 2
        )
        assert got.guarded.tolist() == ref.guarded.tolist(), (scale, off, limit)
        assert torch.equal(got.scale, ref.scale)
        for name in ("m_theta", "m_phi", "feedback", "dist_next"):
            want, have = getattr(ref, name), getattr(got, name)
            assert (have - want).abs().max() <= tol * max(1.0, float(want.abs().max())), name
        assert torch.equal(got.finite_next, ref.finite_next)
        # which decisions this case exercised (Newton–Schulz: a reset whose M_θ is −½D)
        d = blocks[0] - lay.eye(dtype)
        per_layer = [p * p for n, p in lay.groups for _ in range(n)]
        resets_ns = [
            torch.allclose(mt, -0.5 * dl, rtol=1e-4, atol=0.0)
            for mt, dl in zip(torch.split(ref.m_theta.reshape(-1), per_layer), torch.split(d.reshape(-1), per_layer))
        ]
        for code, ns in zip(ref.guarded.tolist(), resets_ns):
            seen.add("Rn" if code == 2 and ns else "KSR"[code])
    assert seen == {"K", "S", "R", "Rn"}, seen  # every branch of the rule compared


def test_a_non_finite_layer_is_reset_by_the_kernels_as_by_torch(monkeypatch):
    """A layer whose ‖g‖ overflows (s = 0) and one whose E holds a NaN: both reset, the others
    stepped, the same as the torch ops."""
    monkeypatch.setattr(guard_rule, "HOST_READ_DEVICES", ())
    gen = torch.Generator().manual_seed(5)
    lay, blocks, g_sq = _blocks(LAYOUTS["three-p"], torch.float32, 1e-3, 0.0, gen)
    g_sq[1] = float("inf")
    blocks[1][lay.spans[1][0] + 3] = float("nan")  # E of the first p = 17 layer
    (ref, got), _ = _middles(lay, blocks, g_sq, momentum=True, limit=1e-2, per_layer=False, given_uu=False)
    assert got.guarded.tolist() == ref.guarded.tolist()
    assert ref.guarded[1] == 2 and ref.guarded[2] == 2 and (ref.guarded == 0).any()
    for name in ("m_theta", "m_phi", "feedback"):
        assert torch.isfinite(getattr(got, name)).all()
        assert torch.allclose(getattr(got, name), getattr(ref, name), atol=1e-6, rtol=0)


@pytest.mark.filterwarnings("ignore:the FGD step guard bound")
def test_the_triton_backend_blends_by_the_kernels(monkeypatch):
    """Where the guard binds, the Triton step launches the three blend kernels (not the torch
    ops) and writes the step the reference writes."""
    import fgd_fast

    monkeypatch.setattr(guard_rule, "HOST_READ_DEVICES", ())
    launches = record_launches(monkeypatch)
    gen = torch.Generator().manual_seed(3)
    shapes = [(8, 4, 3, 3), (12, 6, 3, 3)]
    dev = device_for_tests()
    params = [torch.nn.Parameter(fgd_fast.orthogonalize_(torch.randn(s, generator=gen)).to(dev)) for s in shapes]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    kw = dict(lr=0.5, momentum=0.9, max_distance=1e-3)  # large steps: the guard scales them
    opt = fgd_fast.FGD([dict(params=params, orthogonal=True)], backend="triton", precision="ieee", **kw)
    ref = fgd_fast.FGD([dict(params=twins, orthogonal=True)], backend="reference", **kw)
    for _ in range(3):
        for p, t in zip(params, twins):
            p.grad = torch.randn(p.shape, generator=gen).to(dev)
            t.grad = p.grad.clone()
        opt.step()
        ref.step()
    assert {"guard_sums_kernel", "guard_choose_kernel", "guard_blend_kernel"} <= {name for name, _ in launches}
    for p, t in zip(params, twins):
        assert (p - t).abs().max() < 1e-4


def _launch_on(p: int, *, w: float, bad_m_phi: bool, movable: bool, guard: bool, stored=torch.float32):
    """The three guard kernels on one ``p × p`` layer of θ on the manifold (D = 0, so D², D³, Z and
    V are 0) with ``W = w·I`` (the step's distance ``‖D(t)‖ = t²w√p``) and a small M_Φ, one
    entry ``Inf`` with ``bad_m_phi``: ``(result row, M_Φ, M_θ)`` (α = 0.4, target 1e-2)."""
    from fgd_fast.backends import guard_blend
    from fgd_fast.kernels import meta

    dev = device_for_tests()
    lay = Layout([(1, p)], dev)
    zero = lambda: torch.zeros(lay.numel, dtype=torch.float32, device=dev)  # noqa: E731
    m_phi = torch.full((lay.numel,), 1e-3, dtype=torch.float32, device=dev)
    if bad_m_phi:
        m_phi[p + 1] = float("inf")
    blocks = dict(d=zero(), d2=zero(), d3=zero(), z=zero(), v=zero(), m_theta=zero(), m_phi=m_phi, delta=m_phi)
    blocks["w"] = (w * torch.eye(p, dtype=torch.float32)).reshape(-1).to(dev)
    coef = torch.tensor([[0.4, 1e-2, 0.1, 0.9]], dtype=torch.float64, device=dev)  # [α, target, η, β]
    result = guard_blend.launches(
        lay,
        coef,
        meta.GB_W_GIVEN,
        blocks,
        movable=torch.tensor([movable], device=dev),
        scale=torch.ones(1, dtype=torch.float64, device=dev),
        stored=stored,
        guard=guard,
    )
    return result[0].cpu(), m_phi.cpu(), blocks["m_theta"].cpu()


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # (the interpreter's Inf·0)
def test_the_rule_resets_a_layer_not_movable_or_with_a_non_finite_m_phi_whatever_its_distances():
    """The kernels' own finite checks: a layer the middle marks not movable, or whose M_Φ holds an
    Inf, is reset (t = 0, Φ₊ = 0, M_θ the pull-back's) even where every distance is finite and
    within the target — with real blocks a non-finite M_Φ makes the distances non-finite too, so
    only these checks see it here. Without the guard such a step is reported as not fitting."""
    from fgd_fast.kernels import meta

    row, m_phi, _ = _launch_on(5, w=0.0, bad_m_phi=False, movable=True, guard=True)
    assert row[meta.GB_R_CODE] == 0 and row[meta.GB_R_WEIGHT] == 1.0 and (m_phi == 1e-3).all()  # kept
    for movable, bad in ((False, False), (True, True)):
        row, m_phi, m_theta = _launch_on(5, w=0.0, bad_m_phi=bad, movable=movable, guard=True)
        assert row[meta.GB_R_CODE] == 2 and row[meta.GB_R_WEIGHT] == 0.0, (movable, bad)
        assert not m_phi.any() and not m_theta.any(), (movable, bad)  # Φ₊ = 0; F₀' = −αD = 0
        assert row[meta.GB_R_FINITE] == float(movable)  # the inputs' flag, as the middle gave it
    row, _, _ = _launch_on(5, w=0.0, bad_m_phi=True, movable=True, guard=False)
    assert row[meta.GB_R_WEIGHT] == 1.0 and row[meta.GB_R_FITS] == 0.0


@pytest.mark.parametrize("p", [5, 16])
def test_a_float16_step_fits_by_the_bound_of_the_frobenius_norm(p):
    """θ₊ fits float16 where ‖θ₊‖_F ≤ √(p + √p·d) is below its largest value (``guard_rule.storable``):
    a step of distance d = 0.8·max² does not (√p·d is past max², although d + p is not), one of
    d = 0.8·(max² − p)/√p does; the kernels' flag is the rule's, the guard off (nothing scaled)."""
    from fgd_fast.kernels import meta

    top2 = float(torch.finfo(torch.float16).max) ** 2
    for dist, fits in ((0.8 * top2, False), (0.8 * (top2 - p) / p**0.5, True)):
        row, _, _ = _launch_on(p, w=dist / p**0.5, bad_m_phi=False, movable=True, guard=False, stored=torch.float16)
        assert abs(row[meta.GB_R_DIST] - dist) <= 1e-6 * dist
        want = guard_rule.storable(row[meta.GB_R_DIST : meta.GB_R_DIST + 1], p, torch.float16)
        assert bool(row[meta.GB_R_FITS]) == bool(want) == fits, dist
