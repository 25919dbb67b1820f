"""The Triton backend's middle and step guard in nine launches over every layer of a launch class.

:func:`.algebra.middle` is the middle's definition (and the other backends' implementation);
with the official update, a prediction (the guard on, or off with the checks' limit) and float32
blocks (the defaults; every launch class but float64 parameters), the Triton backend runs this
one instead: the same matrices and the same rule, in launches over every layer of a layout
whatever its p, all in one buffer of ``meta.MP_SLOTS`` blocks (kept from step to step: no
allocation, fixed addresses), and no torch op but the result's table.

1. ``mid_prep_kernel`` (``kernels/middle.py``): per layer the trust scale s and the inputs'
   finiteness; per entry D = A − I, B' = sB, S' = sym(B'), Q = η sym(sE) − s²C − (β−1)S' − αB',
   T = βsB − ηsE and W = s²UᵀU.
2. five launches of ``mid_jobs_kernel`` (``kernels/products.py``), each one or two products
   with their elementwise terms fused in (N = 2I − A = I − D, so N·X = X − D·X):

   ====  ==========================================================================
   1     NB = B' − D·B'  (= N B'),  D² = D·D
   2     P = Q − α·NBᵀ + NB·S'  (the bracket of M_Φ),  D³ = D²·D
   3     M_Φ = P − D·P  (= N P),  and Y₀ = M_Φ + T
   4     Y = Y₀ + D·M_Φ  (= AΔ + T, Δ = M_Φ),  and Y + T
   5     Z = Y − α·D·Y  (= K₀Y),  V = M_Φᵀ(Y + T)
   ====  ==========================================================================

3. the guard's three launches (``kernels/guard.py``): every weight's distance, the rule per
   layer (with the update's scaled hyper-parameters ``[tsη, tsβ, α]`` and the checks' table),
   and M_Φ, M_θ = F₀' + tΔ of the weight chosen, in place (the CUDA-core classes' θ pass, which
   reads Φ₊, takes F = M_θ − M_Φ = F₀' instead). With the guard off, t = s = 1: the full step
   and its predicted distance, by the same arithmetic (a guard that does not bind changes no bit).

Without Φ (no momentum yet) B', S', NB and the B-terms drop: P = Q = η sym(sE), T = −ηsE.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import mid_products, triton_launch
from .layout import Layout

__all__ = ["FusedMiddle", "applies", "buffers", "run"]


def applies(*, dtype: torch.dtype, variant: str, max_distance) -> bool:
    """Whether a middle runs fused: float32 blocks (the product kernels' dtype; Triton 3.6 cannot
    compile a float64 dot), the official update, a prediction (a limit; the guard on or off)."""
    return dtype == torch.float32 and variant == "official" and max_distance is not None


@dataclass
class Buffers:
    """A launch class's fused-middle memory, kept from step to step (fixed addresses)."""

    blocks: torch.Tensor  # (MP_SLOTS · numel,) the blocks; the Gram blocks gathered into slots 0–5
    scale: torch.Tensor  # (L,) float64 the trust scale s
    finite: torch.Tensor  # (L,) bool the inputs' finiteness
    coef: torch.Tensor  # (L, 4) float64 the guard kernels' [α, target, η, β]; η, β unread (W given)
    part: torch.Tensor  # the guard's partial sums
    hyper: torch.Tensor  # (L, 3) the update kernel's [tsη, tsβ, α]


def buffers(lay: Layout, hyper_dtype: torch.dtype) -> Buffers:
    """New fused-middle memory for ``lay`` (the caller keeps it per launch class)."""
    from ..kernels import meta
    from .guard_blend import tiles

    count, device = lay.count, lay.device
    items = tiles(lay)[0].shape[0]  # the guard's partial sums: a row per work item
    return Buffers(
        torch.empty(meta.MP_SLOTS * lay.numel, dtype=torch.float32, device=device),
        torch.empty(count, dtype=torch.float64, device=device),
        torch.empty(count, dtype=torch.bool, device=device),
        torch.empty((count, meta.GB_COEF_FIELDS), dtype=torch.float64, device=device),
        torch.empty((items, meta.GB_PART), dtype=torch.float64, device=device),
        torch.empty((count, meta.HYPER_FIELDS), dtype=hyper_dtype, device=device),
    )


class FusedMiddle:
    """The fused middle's outputs: M_θ and M_Φ (blocks of the layout, in the buffer), the update
    kernel's hyper-parameter table, and the per-layer checks (:class:`.algebra.Checks` fields)."""

    def __init__(self, m_theta, m_phi, hyper, result, finite, guarded: bool):
        from ..kernels import meta

        self.m_theta, self.m_phi, self.hyper = m_theta, m_phi, hyper
        self.dist = result[:, meta.GB_R_DIST0]
        self.finite = finite
        self.scale = result[:, meta.GB_R_SCALE] if guarded else None
        self.dist_next = result[:, meta.GB_R_DIST]
        self.finite_next = result[:, meta.GB_R_FITS] != 0
        self.guarded = result[:, meta.GB_R_CODE].to(torch.int8) if guarded else None
        self.check_table = result[:, : meta.GB_R_CHECKS]  # the same five values as one table


def _jobs(meta, has_phi: bool) -> list[list[tuple]]:
    """The products' launches, each a list of jobs ``(X, Y, Z, ZT, OUT, OUT2, ADD2, TX, α, γ)``
    (slots of the buffer, −1 for none; α, γ as ``meta.COEF_*`` codes)."""
    one, minus_one, minus_alpha = meta.COEF_ONE, meta.COEF_MINUS_ONE, meta.COEF_MINUS_ALPHA
    d, w = meta.SLOT_A, meta.SLOT_G  # D = A − I and W = s²UᵀU, in A's and G's places
    b, s, q, t = meta.MP_B, meta.MP_S, meta.MP_Q, meta.MP_T
    # the dead blocks reused: E, B, C, H after the prologue; B', S', Q after the products read them
    nb, d2, p_blk, d3 = meta.SLOT_E, meta.SLOT_B, meta.SLOT_C, meta.SLOT_H
    m_phi, y0, y, y_t, z, v = meta.MP_B, meta.MP_S, meta.MP_Q, meta.SLOT_E, meta.SLOT_C, meta.MP_S
    bracket = p_blk if has_phi else q  # without Φ: P = Q
    launches = [
        ([(d, b, b, -1, nb, -1, -1, 0, minus_one, one)] if has_phi else [])  # NB = B' − D·B'
        + [(d, d, -1, -1, d2, -1, -1, 0, one, one)],  # D²
        ([(nb, s, q, nb, p_blk, -1, -1, 0, one, minus_alpha)] if has_phi else [])  # P = Q − αNBᵀ + NB·S'
        + [(d2, d, -1, -1, d3, -1, -1, 0, one, one)],  # D³
        [(d, bracket, bracket, -1, m_phi, y0, t, 0, minus_one, one)],  # M_Φ = P − D·P; Y₀ = M_Φ + T
        [(d, m_phi, y0, -1, y, y_t, t, 0, one, one)],  # Y = Y₀ + D·M_Φ; Y + T
        [(d, y, y, -1, z, -1, -1, 0, minus_alpha, one), (m_phi, y_t, -1, -1, v, -1, -1, 1, one, one)],  # Z, V
    ]
    assert w not in {job[4] for jobs in launches for job in jobs}
    for jobs in launches:  # no launch reads a slot it writes (its programs read other programs' tiles)
        written = {slot for job in jobs for slot in (job[4], job[5]) if slot >= 0}
        read = {slot for job in jobs for slot in (*job[:4], job[6]) if slot >= 0}
        assert not written & read, (jobs, written & read)
    return launches


def _tables(lay: Layout, has_phi: bool, bm: int):
    """``(jobs, [(work, items)] per launch, layer table)`` of the products (cached per layout)."""
    from ..kernels import meta

    def build():
        launches = _jobs(meta, has_phi)
        job_rows, works = [], []
        tiles, layers = mid_products.tiles(lay, bm)
        for jobs in launches:
            parts = []
            for job in jobs:
                ids = torch.full((tiles.shape[0], 1), len(job_rows), dtype=torch.int32, device=lay.device)
                parts.append(torch.cat([ids, tiles], 1))
                job_rows.append(list(job))
            work = torch.cat(parts).contiguous()
            works.append((work, work.shape[0]))
        return torch.tensor(job_rows, dtype=torch.int64).to(lay.device), works, layers

    return lay.cached(("fused-products", has_phi, bm), build)


def _rule(lay: Layout, radius: float, limit: float, unit: float) -> torch.Tensor:
    """``(L, 2)`` float64 per layer: ρ (∞: the guard off) and the guard's target (cached per
    layout and rule)."""
    from .guard_rule import guard_target

    def build():
        p = lay.p_per_layer()
        target = torch.tensor([guard_target(limit, int(x), unit) for x in p.tolist()], dtype=torch.float64)
        return torch.stack([torch.full_like(target, float(radius)), target], 1).to(lay.device)

    return lay.cached(("fused-rule", float(radius), float(limit), float(unit)), build)


def run(
    lay: Layout,
    bufs: Buffers,
    *,
    hyper: torch.Tensor,
    g_norm: torch.Tensor,
    has_phi: bool,
    radius: float | None,
    limit: float,
    unit: float,
    stored: torch.dtype | None,
    precision: str,
    feedback: bool = False,
) -> FusedMiddle:
    """The middle of the layers of ``lay`` from their Gram blocks in ``bufs.blocks`` (slots
    ``meta.SLOT_A`` … ``SLOT_H``, float32; G and H formed), ``hyper`` ``(L, 3)`` ``[η, β, α]``
    and ``g_norm`` ``(L,)`` float64 ‖g‖_F: see the module docstring. ``radius=None``: the guard off
    (s = t = 1 for every layer, the full step's distance predicted; ``guarded`` is None).
    ``feedback``: ``F = M_θ − M_Φ`` where M_θ would be (the CUDA-core θ pass reads Φ₊ and F)."""
    from ..kernels import meta, middle, products
    from . import guard_blend

    numel, device, blocks = lay.numel, lay.device, bufs.blocks
    if blocks.dtype != torch.float32:
        raise TypeError(f"the fused middle takes float32 blocks, got {blocks.dtype}")
    work, layers = mid_products.tiles(lay, middle.TILE)
    items = work.shape[0]
    triton_launch.launch(
        middle.mid_prep_kernel,
        (triton_launch.persistent(items, device),),
        work,
        layers,
        hyper,
        g_norm,
        blocks,
        numel,
        _rule(lay, float("inf") if radius is None else radius, limit, unit),
        bufs.scale,
        bufs.finite,
        bufs.coef,
        items,
        HAS_PHI=has_phi,
        **middle.CONFIG,
    )
    config = products.CONFIG[max(p for _, p in lay.groups) >= products.BIG_P]
    jobs, works, layers = _tables(lay, has_phi, config["BM"])
    for work, items in works:
        triton_launch.launch(
            products.mid_jobs_kernel,
            (triton_launch.persistent(items, device),),
            work,
            layers,
            jobs,
            hyper,
            blocks,
            numel,
            items,
            PRECISION="ieee" if precision == "ieee" else "tf32",
            **config,
        )
    slot = lambda k: blocks[k * numel : (k + 1) * numel]  # noqa: E731
    m_phi, m_theta = slot(meta.MP_B), slot(meta.MP_T)
    result = guard_blend.launches(
        lay,
        bufs.coef,
        meta.GB_W_GIVEN,
        dict(
            d=slot(meta.SLOT_A),
            d2=slot(meta.SLOT_B),
            d3=slot(meta.SLOT_H),
            z=slot(meta.SLOT_C),
            v=slot(meta.MP_S),
            w=slot(meta.SLOT_G),
            m_phi=m_phi,
            m_theta=m_theta,  # (Δ = M_θ − F₀ = M_Φ, the official update: the blend reads it from M_Φ)
        ),
        movable=bufs.finite,
        scale=bufs.scale,
        stored=stored,
        hyper=hyper,
        hyper_out=bufs.hyper,
        part=bufs.part,
        guard=radius is not None,
        write_feedback=feedback,
    )
    if radius is None:  # the unguarded prediction: where the write's rounding could pass the limit, that bound
        from .guard_rule import TF32_UNIT, with_write_rounding

        # ‖M_θ‖ ≤ ‖M_Φ‖ + |α|‖D‖ (the blend forms M_θ = M_Φ − αD, or F in its place, so its slot is no
        # measure of M_θ) and ‖U‖ = √tr W, from the blocks the blend leaves as they were (guard off)
        p = lay.groups[0][1] if lay.single else lay.p_per_layer()
        shaped = (lambda x: x.view(lay.groups[0][0], p, p)) if lay.single else (lambda x: x)  # (flat slots)
        alpha = hyper[:, 2].to(torch.float64).abs()
        m_norm = lay.norm(shaped(m_phi)).to(torch.float64) + alpha * result[:, meta.GB_R_DIST0]
        u_norm = lay.trace(shaped(slot(meta.SLOT_G))).to(torch.float64).clamp_min(0.0).sqrt()
        dist = result[:, meta.GB_R_DIST]
        unit, operand_unit = torch.finfo(torch.float32).eps / 2, TF32_UNIT if precision == "tf32" else 0.0
        result[:, meta.GB_R_DIST] = with_write_rounding(dist, m_norm, u_norm, p, unit, limit, operand_unit)
    return FusedMiddle(m_theta, m_phi, bufs.hyper, result, bufs.finite, guarded=radius is not None)
