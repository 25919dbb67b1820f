"""The Triton backend's fused middle (``fgd_fast/backends/fused_middle.py``: ``kernels/middle.py``,
``mid_jobs_kernel``, the guard's kernels) against the torch ops of
:func:`fgd_fast.backends.algebra.middle`, the middle's definition.

On Gram blocks of random near-orthonormal θ whose steps the guard keeps, scales, resets and
resets by Newton–Schulz, in one ``p`` and in a layout of several (odd p, p above the 32-entry
tile), with and without Φ, with per-layer hyper-parameters, and with a non-finite layer: the
same decisions, the update's matrices and hyper-parameters and every check equal to float32
rounding. Both sides are float32 evaluations of the same formulas (sums of at most p products
in another order), so they may differ by a few p·u relative to the matrices' size: the
tolerance is 2e-5 of the largest entry (p ≤ 40 here, u = 6e-8: p·u ≈ 2.4e-6).
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

# (gradient and Φ scale, distance of θ from the manifold, max_distance): keep, scale, reset and
# Newton–Schulz reset (as in tests/test_guard_blend.py)
CASES = [(1e-3, 0.0, 1e-2), (3e-2, 0.0, 1e-3), (3e-2, 3e-2, 1e-3), (0.3, 1e-3, 1e-2), (1e-3, 0.1, 1e-2), (10.0, 0, 0.5)]
LAYOUTS = {"one-p": [(3, 5)], "three-p": [(2, 5), (3, 17), (2, 40)]}
RADIUS = 4.0
TOL = 2e-5


def _hyper(count: int, per_layer: bool) -> torch.Tensor:
    """The ``(L, 3)`` float32 table ``[η, β, α]`` of a launch class."""
    if per_layer:
        lr = torch.linspace(0.05, 0.15, count)
        return torch.stack([lr, torch.full((count,), 0.9), torch.linspace(0.3, 0.45, count)], 1)
    return torch.tensor([[0.1, 0.9, 0.4]]).expand(count, 3).contiguous()


def _both(
    lay,
    blocks,
    g_sq,
    hyper,
    *,
    momentum: bool,
    limit: float,
    radius: float | None = RADIUS,
    feedback: bool = False,
    unit: float | None = None,
):
    """``(torch ops' Middle, fused result, fused buffers)`` of the same blocks (``radius=None``:
    the guard off, only the prediction; ``feedback``: F in M_θ's place; ``unit``: the guard's
    rounding unit, float32's by default)."""
    from fgd_fast.backends import fused_middle

    unit = guard_rule.store_unit(torch.float32) if unit is None else unit
    a, e, b, c, gg, h = (x.clone() for x in blocks)
    if not momentum:
        b = c = h = None
    ref = algebra.middle(
        a,
        b,
        c,
        e,
        lr=hyper[:, 0],
        beta=hyper[:, 1],
        alpha=hyper[:, 2],
        g_sq=g_sq.clone(),
        h=h,
        gg=gg,
        radius=radius,
        limit=limit,
        unit=unit,
        stored=torch.float32,
        layout=lay,
    )
    bufs = fused_middle.buffers(lay, torch.float32)
    bufs.blocks.fill_(float("nan"))  # nothing the prologue does not write may be read
    for k, x in enumerate(blocks):
        if momentum or k in (0, 1, 4):  # A, E, G (and B, C, H with Φ)
            bufs.blocks[k * lay.numel : (k + 1) * lay.numel] = x.reshape(-1)
    got = fused_middle.run(
        lay,
        bufs,
        hyper=hyper.to(lay.device),
        g_norm=g_sq.sqrt(),
        has_phi=momentum,
        radius=radius,
        limit=limit,
        unit=unit,
        stored=torch.float32,
        precision="ieee",
        feedback=feedback,
    )
    return ref, got, bufs


def _close(have: torch.Tensor, want: torch.Tensor, name: str) -> None:
    have, want = have.reshape(-1).double().cpu(), want.reshape(-1).double().cpu()
    assert (have - want).abs().max() <= TOL * max(1.0, float(want.abs().max())), name


def _same_step(got, ref, names, case=None) -> None:
    """The fused middle's guard decisions are the torch ops', and its ``names`` (fields of both)
    equal to float32 rounding."""
    assert got.guarded.tolist() == ref.guarded.tolist(), case
    for name in names:
        _close(getattr(got, name), getattr(ref, name), name)


@pytest.mark.parametrize("momentum", [True, False], ids=["phi", "no-phi"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_fused_middle_writes_the_step_and_checks_of_the_torch_ops(momentum, layout, monkeypatch):
    monkeypatch.setattr(guard_rule, "HOST_READ_DEVICES", ())  # every layer blended, as on a GPU
    gen = torch.Generator().manual_seed(zlib.crc32(f"fused {momentum} {layout}".encode()))
    seen = set()
    for k, (scale, off, limit) in enumerate(CASES):
        lay = Layout(LAYOUTS[layout], device_for_tests())
        blocks, g_sq = gram_blocks(lay, torch.float32, gen, scale=scale, off=off)
        hyper = _hyper(lay.count, per_layer=k % 2 == 1)
        ref, got, _ = _both(lay, blocks, g_sq, hyper, momentum=momentum, limit=limit)
        case = (scale, off, limit)
        assert got.guarded.tolist() == ref.guarded.tolist(), case
        assert torch.allclose(got.scale.cpu(), ref.scale.cpu(), rtol=1e-6, atol=0), case
        _close(got.m_theta, ref.m_theta, "m_theta")
        _close(got.m_phi, ref.m_phi, "m_phi")
        _close(got.dist_next, ref.dist_next, "dist_next")
        _close(got.dist, ref.dist, "dist")
        assert got.finite.tolist() == ref.finite.tolist()
        assert got.finite_next.tolist() == ref.finite_next.tolist()
        # the update kernel's table: [tsη, tsβ, α]
        _close(got.hyper, algebra.scaled_hyper(hyper, ref.scale.cpu()), "hyper")
        seen.update("KSR"[code] for code in ref.guarded.tolist())
        scales = ref.scale.cpu()
        seen.update("s" for s, code in zip(scales.tolist(), ref.guarded.tolist()) if 0 < s < 1 and code == 1)
    assert {"K", "S", "R"} <= seen, seen  # every outcome of the rule compared


@pytest.mark.parametrize("momentum", [True, False], ids=["phi", "no-phi"])
def test_without_the_guard_the_fused_middle_predicts_the_full_step(momentum, monkeypatch):
    """The guard off (``trust_radius=None``, a limit): every layer's full step, unscaled, and its
    predicted distance, as the torch ops' prediction; no guard outcome; the hyper table as given."""
    monkeypatch.setattr(guard_rule, "HOST_READ_DEVICES", ())
    gen = torch.Generator().manual_seed(11)
    for scale, off in ((1e-3, 0.0), (0.3, 1e-2), (10.0, 0.0)):  # (the guard would scale or reset the last two)
        lay = Layout(LAYOUTS["three-p"], device_for_tests())
        blocks, g_sq = gram_blocks(lay, torch.float32, gen, scale=scale, off=off)
        hyper = _hyper(lay.count, per_layer=True)
        # (a limit no distance reaches: the distances themselves; below, one they pass, where both
        # report the write's rounding bound, formed from float32 blocks each: agreeing less closely)
        ref, got, _ = _both(lay, blocks, g_sq, hyper, momentum=momentum, limit=1e30, radius=None)
        assert got.guarded is None and got.scale is None and ref.guarded is None
        for name in ("m_theta", "m_phi", "dist_next", "dist"):
            _close(getattr(got, name), getattr(ref, name), name)
        assert got.finite.tolist() == ref.finite.tolist()
        assert got.finite_next.tolist() == ref.finite_next.tolist()
        assert torch.equal(got.hyper.cpu(), hyper)
        exact = [x.dist_next.double().cpu() for x in (ref, got)]
        ref, got, _ = _both(lay, blocks, g_sq, hyper, momentum=momentum, limit=1e-3, radius=None)
        bounded = [x.dist_next.double().cpu() for x in (ref, got)]
        for b, d in zip(bounded, exact):  # (past the limit: the bound; within it: the distance itself)
            past = d > 1e-3
            assert bool((b[past] > d[past]).all()) and torch.equal(b[~past], d[~past])
        torch.testing.assert_close(bounded[1], bounded[0], rtol=1e-3, atol=0)


def test_for_the_cuda_core_classes_the_fused_middle_writes_the_feedback_term(monkeypatch):
    """``feedback=True`` (the CUDA-core θ pass reads Φ₊ and F = M_θ − M_Φ): F in M_θ's place,
    the torch ops' ``feedback``, where the guard keeps, scales and resets."""
    monkeypatch.setattr(guard_rule, "HOST_READ_DEVICES", ())
    gen = torch.Generator().manual_seed(13)
    for scale, off, limit in CASES[1:4]:
        lay = Layout(LAYOUTS["three-p"], device_for_tests())
        blocks, g_sq = gram_blocks(lay, torch.float32, gen, scale=scale, off=off)
        ref, got, _ = _both(lay, blocks, g_sq, _hyper(lay.count, True), momentum=True, limit=limit, feedback=True)
        assert got.guarded.tolist() == ref.guarded.tolist()
        _close(got.m_theta, ref.feedback, "feedback")
        _close(got.m_phi, ref.m_phi, "m_phi")


def test_each_layer_keeps_its_own_p_s_rounding_margin(monkeypatch):
    """A coarse rounding unit (0.01: the targets under the limit 0.5 are 0.44, 0.39 and 0.34 for
    p = 5, 17 and 40) and spikes that the guard scales to just within each layer's target: each
    layer's weight, decision and matrices are the torch ops' (which take each layer's own p), so
    a target of one p for all shows."""
    monkeypatch.setattr(guard_rule, "HOST_READ_DEVICES", ())
    gen = torch.Generator().manual_seed(19)
    seen = set()
    for scale in (0.3, 1.0, 3.0):
        lay = Layout(LAYOUTS["three-p"], device_for_tests())
        blocks, g_sq = gram_blocks(lay, torch.float32, gen, scale=scale, off=1e-3)
        ref, got, _ = _both(lay, blocks, g_sq, _hyper(lay.count, True), momentum=True, limit=0.5, unit=0.01)
        _same_step(got, ref, ("m_theta", "m_phi", "dist_next", "scale"), scale)  # (scale: the weight chosen)
        seen.update(ref.guarded.tolist())
    assert 1 in seen, seen


def test_the_rule_follows_each_calls_radius_limit_and_unit(monkeypatch):
    """The per-layer rule table (ρ and the target) is cached with the layout, which every
    optimizer with these shapes shares: calls with another ρ, limit or rounding unit over the
    same layers each follow their own rule (the torch ops' decisions and matrices)."""
    from fgd_fast.backends import layout

    monkeypatch.setattr(guard_rule, "HOST_READ_DEVICES", ())
    monkeypatch.setattr(layout, "_indices", {})  # (no table from an earlier test)
    gen = torch.Generator().manual_seed(23)
    lay = Layout(LAYOUTS["three-p"], device_for_tests())
    blocks, g_sq = gram_blocks(lay, torch.float32, gen, scale=0.3, off=1e-3)
    hyper = _hyper(lay.count, True)
    scales = []
    for radius, limit, unit in ((RADIUS, 0.5, None), (0.05, 0.5, None), (RADIUS, 0.1, None), (RADIUS, 0.5, 0.01)):
        ref, got, _ = _both(lay, blocks, g_sq, hyper, momentum=True, limit=limit, radius=radius, unit=unit)
        _same_step(got, ref, ("m_theta", "m_phi", "dist_next", "scale"), (radius, limit, unit))
        scales.append(tuple(ref.scale.tolist()))
    assert len(set(scales)) == len(scales)  # each rule binds differently


def test_p_of_one_and_above_the_large_tile_threshold(monkeypatch):
    """p = 1 and 3 beside p = 257 (the products take their 64-entry tiles from p = 256 on, and a
    257 leaves a one-entry edge): the torch ops' decisions and matrices."""
    monkeypatch.setattr(guard_rule, "HOST_READ_DEVICES", ())
    gen = torch.Generator().manual_seed(17)
    lay = Layout([(1, 1), (2, 3), (1, 257)], device_for_tests())
    blocks, g_sq = gram_blocks(lay, torch.float32, gen, scale=0.3, off=1e-3)
    ref, got, _ = _both(lay, blocks, g_sq, _hyper(lay.count, True), momentum=True, limit=1e-2)
    _same_step(got, ref, ("m_theta", "m_phi", "dist_next"))


def test_a_non_finite_layer_is_reset_as_by_the_torch_ops(monkeypatch):
    """A layer whose ‖g‖ is infinite and one whose Φ holds a NaN (tr C): both flagged and reset,
    with finite matrices; the others stepped."""
    monkeypatch.setattr(guard_rule, "HOST_READ_DEVICES", ())
    gen = torch.Generator().manual_seed(5)
    lay = Layout(LAYOUTS["three-p"], device_for_tests())
    blocks, g_sq = gram_blocks(lay, torch.float32, gen, scale=1e-3, off=0.0)
    g_sq[2] = float("inf")
    blocks[1][lay.spans[1][0] + 3] = float("inf")  # E of the first p = 17 layer (its g: Inf)
    c_at = lay.spans[2][0] + 40 * 40  # C of the second p = 40 layer: a NaN on the diagonal
    blocks[3][c_at] = float("nan")
    ref, got, _ = _both(lay, blocks, g_sq, _hyper(lay.count, False), momentum=True, limit=1e-2)
    assert got.guarded.tolist() == ref.guarded.tolist()
    assert got.finite.tolist() == ref.finite.tolist() == [True, True, False, True, True, True, False]
    assert ref.guarded[2] == 2 and ref.guarded[6] == 2 and (ref.guarded == 0).any()
    # the optimizer reads the checks from the fused middle's one table: the same five values
    table = got.check_table.cpu()
    assert table[:, 1].tolist() == [float(f) for f in ref.finite.tolist()]
    for k, values in enumerate((got.dist, got.finite, got.dist_next, got.finite_next, got.guarded)):
        assert torch.equal(table[:, k], values.cpu().to(torch.float64)), k
    for name in ("m_theta", "m_phi"):
        assert torch.isfinite(getattr(got, name)).all(), name
        _close(getattr(got, name), getattr(ref, name), name)


def test_the_triton_step_keeps_its_fused_buffers_from_step_to_step(monkeypatch):
    """The tensor-core step runs the fused middle (its prologue, five product launches, the guard's
    three) in memory kept per launch class: the same addresses every step (a captured step
    replays them) and the reference's step."""
    import fgd_fast
    from fgd_fast.backends import layout
    from fgd_fast.backends import triton as tb

    monkeypatch.setattr(layout, "_indices", {})
    launches = record_launches(monkeypatch)
    gen = torch.Generator().manual_seed(3)
    shapes = [(8, 4, 3, 3), (12, 6, 3, 3), (40, 36)]
    dev = device_for_tests()
    params = [torch.nn.Parameter(fgd_fast.orthogonalize_(torch.randn(s, generator=gen)).to(dev)) for s in shapes]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    kw = dict(lr=0.05, momentum=0.9)
    opt = fgd_fast.FGD([dict(params=params, orthogonal=True)], backend="triton", precision="tf32x3", **kw)
    ref = fgd_fast.FGD([dict(params=twins, orthogonal=True)], backend="reference", **kw)
    addresses = []
    for _ in range(3):
        for p, t in zip(params, twins):
            p.grad = torch.randn(p.shape, generator=gen).to(dev)
            t.grad = p.grad.clone()
        launches.clear()
        opt.step()
        ref.step()
        addresses.append(sorted(b.blocks.data_ptr() for b in tb._fused_buffers.values()))
        launched = [name for name, _ in launches]
        classes = launched.count("tc_update_kernel")  # (aligned layers apart from the others)
        assert classes >= 2 and launched.count("mid_prep_kernel") == classes
        assert launched.count("mid_jobs_kernel") == 5 * classes
        assert "mid_mm_kernel" not in launched
    assert addresses[1] == addresses[2]
    for p, t in zip(params, twins):
        assert (p - t).abs().max() < 1e-4
    # a memory review: the layouts' per-element index tensors (transpose, per-layer broadcast:
    # 8 bytes per block element, kept with the layout) are never built for the fused middle
    indices = [i for key, i in layout._indices.items() if key[1] == str(torch.device(dev))]
    assert indices and all(i._perm is None and i._layer is None for i in indices)


@pytest.mark.parametrize("has_phi", [False, True], ids=["no-phi", "phi"])
def test_no_product_launch_reads_a_slot_it_writes(has_phi):
    """A race review: each of the fused middle's five product launches reads other programs' tiles
    of its inputs, so a launch that wrote a slot it reads (or its second output into its added
    input) would race on a GPU, unseen by the sequential interpreter. ``_jobs`` asserts it; this
    checks the table independently."""
    pytest.importorskip("triton", reason="the kernels' slot constants live beside the Triton kernels")
    from fgd_fast.backends import fused_middle
    from fgd_fast.kernels import meta

    launches = fused_middle._jobs(meta, has_phi)
    assert len(launches) == 5
    for jobs in launches:
        written = [slot for job in jobs for slot in (job[4], job[5]) if slot >= 0]
        read = {slot for job in jobs for slot in (*job[:4], job[6]) if slot >= 0}
        assert len(written) == len(set(written)) and not set(written) & read, jobs


def test_the_tensor_core_tables_refuse_tiles_that_are_not_square():
    """The work table counts j in units of BM and the gather mirrors by BM, while the kernel steps j
    by BN: a BM ≠ BN configuration would leave Gram tiles unwritten (a race review's trap)."""
    from fgd_fast.backends import triton_tables

    cfg = dict(BM=64, BN=128, BK=32)
    with pytest.raises(ValueError, match="square tiles, got BM=64, BN=128"):
        triton_tables.tc_shapes([(96, 64)], torch.device("cpu"), None, False, True, cfg, {}, {}, False)
