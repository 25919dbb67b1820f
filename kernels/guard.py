"""The step guard's blend (``fgd_fast/backends/guard_rule.py``) in three launches over every layer of
a middle, whatever its p (the layers' ``p × p`` blocks lie one after the other in flat buffers).

The middle has formed, per layer, ``D = A − I``, ``D²``, ``D³``, ``Z = K₀Y`` and ``V = Δᵀ(Y + T)``
(products) and the update's ``M_Φ``, ``M_θ``, ``F`` and ``Δ = M_θ − F₀``. The guard's distance
matrix of the step of weight t is ``D(t) = D₀ + tX₁ + t²X₂`` with

    D₀ = (1 − 2α)D + (α² − 2α)D² + α²D³       (the pull-back θ₊ = θ(I − αD), exact)
    X₁ = Z + Zᵀ,   X₂ = sym(V) + W,   W = s²UᵀU = η²G + β²C − βη(H + Hᵀ)  (blocks scaled by s)

``guard_sums_kernel`` — work item = (layer, tile i, tile j), ``BT × BT`` entries: one row of
partial sums per item, ``‖D(t_k)‖²`` for each of the 15 positive weights (the distances
themselves, not a quartic from inner products: no second, exact re-check is needed), ``‖D₀‖²``,
the Newton–Schulz pull-back's ``‖¼D³ − ¾D²‖²`` and ``Σ 0·X₂ + Σ 0·M_Φ`` (NaN where either has
an Inf or a NaN) and ``‖D‖²`` (the current distance, for the checks).

``guard_choose_kernel`` — one program per layer: sums its rows in a fixed order (deterministic,
no atomics) and applies the rule: the largest weight whose distance is within the target where
the step is movable, else 0, and at 0 the Newton–Schulz pull-back where the α pull-back is
beyond the target and farther. Writes per layer (float64) ``[‖D‖, movable, distance, fits,
code, t, newton, ts]`` (``meta.GB_R_*``): the current distance, the step's, whether θ₊ fits
the parameters' dtype, what the guard did (``guards.KEPT``, ``SCALED``, ``RESET``), and with
the trust scale s the update's total scale; with
``HYPER`` also the update kernel's hyper-parameter row ``[tsη, tsβ, α]``. Without ``GUARD`` (the
guard off, the step only predicted) every layer takes t = 1 and reports the full step's distance.

``guard_blend_kernel`` — work item as the sums': the step of the chosen weight, in place:
``M_Φ ← tM_Φ``, ``M_θ ← F₀' + tΔ``, ``F ← F₀' + t(F − F₀)`` (``F₀' = −α'D``, α' = ½ for the
Newton–Schulz reset), each left as it is where t = 1 (the full step); with ``FULL`` only
``M_Φ`` and ``M_θ``, written for every layer (the fused middle forms M_θ here: ``F₀ + tΔ`` with
``Δ = M_Φ`` at t = 1 too; with ``FEEDBACK`` ``F = M_θ − M_Φ = F₀'`` in its place, which the
CUDA-core update kernels read where Φ is).
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import meta

TILE = 32  # BT × BT entries per work item of the sums and the blend


@triton.jit
def _tile(ptr, ri, cj, p, m):
    """X[ri, cj] of a row-major ``p × p`` block at ``ptr``."""
    return tl.load(ptr + ri[:, None] * p + cj[None, :], mask=m, other=0.0)


@triton.jit
def _tile_t(ptr, ri, cj, p, m):
    """Xᵀ[ri, cj] = X[cj, ri]."""
    return tl.load(ptr + cj[None, :] * p + ri[:, None], mask=m, other=0.0)


@triton.jit
def _where_item(work_ptr, layer_ptr, item, BT: tl.constexpr):
    """(element offset, p, row indices, column indices, mask) of a work item's tile."""
    w = work_ptr + item * 3
    row = layer_ptr + tl.load(w) * meta.GB_LAYER_FIELDS
    off = tl.load(row + meta.GB_L_OFF)
    p = tl.load(row + meta.GB_L_P)
    ri = tl.load(w + 1) * BT + tl.arange(0, BT)
    cj = tl.load(w + 2) * BT + tl.arange(0, BT)
    return off, p, ri, cj, (ri < p)[:, None] & (cj < p)[None, :]


@triton.jit
def guard_sums_kernel(
    work_ptr,
    layer_ptr,
    coef_ptr,
    weight_ptr,
    d_ptr,
    d2_ptr,
    d3_ptr,
    z_ptr,
    v_ptr,
    w_ptr,
    c_ptr,
    h_ptr,
    m_phi_ptr,
    part_ptr,
    n_items,
    ACC: tl.constexpr,
    W_MODE: tl.constexpr,
    BT: tl.constexpr,
):
    for item in range(tl.program_id(0), n_items, tl.num_programs(0)):
        off, p, ri, cj, m = _where_item(work_ptr, layer_ptr, item, BT)
        coef = coef_ptr + tl.load(work_ptr + item * 3) * meta.GB_COEF_FIELDS
        d = _tile(d_ptr + off, ri, cj, p, m)
        alpha = tl.load(coef + meta.GB_C_ALPHA).to(ACC)
        d2 = _tile(d2_ptr + off, ri, cj, p, m)
        d3 = _tile(d3_ptr + off, ri, cj, p, m)
        d0 = (1.0 - 2.0 * alpha) * d + (alpha * alpha - 2.0 * alpha) * d2 + (alpha * alpha) * d3  # D₀
        d_ns = 0.25 * d3 - 0.75 * d2  # the Newton–Schulz pull-back's −¾D² + ¼D³
        x1 = _tile(z_ptr + off, ri, cj, p, m) + _tile_t(z_ptr + off, ri, cj, p, m)  # X₁ = Z + Zᵀ
        x2 = 0.5 * (_tile(v_ptr + off, ri, cj, p, m) + _tile_t(v_ptr + off, ri, cj, p, m))  # sym(V)
        if W_MODE == meta.GB_W_GIVEN:
            x2 += _tile(w_ptr + off, ri, cj, p, m)  # + s²UᵀU
        else:
            eta = tl.load(coef + meta.GB_C_LR).to(ACC)
            x2 += (eta * eta) * _tile(w_ptr + off, ri, cj, p, m)  # + η²G
            if W_MODE == meta.GB_W_CHG:
                beta = tl.load(coef + meta.GB_C_BETA).to(ACC)
                x2 += (beta * beta) * _tile(c_ptr + off, ri, cj, p, m)  # + β²C
                hh = _tile(h_ptr + off, ri, cj, p, m) + _tile_t(h_ptr + off, ri, cj, p, m)
                x2 -= (beta * eta) * hh  # − βη(H + Hᵀ)
        bad = tl.sum(tl.sum(x2 * 0.0, 1), 0) + tl.sum(tl.sum(_tile(m_phi_ptr + off, ri, cj, p, m) * 0.0, 1), 0)
        out = part_ptr + item * meta.GB_PART
        for k in tl.static_range(15):  # meta.GB_WEIGHTS
            t = tl.load(weight_ptr + k).to(ACC)
            r = d0 + t * x1 + (t * t) * x2  # D(t) = D₀ + tX₁ + t²X₂
            tl.store(out + k, tl.sum(tl.sum(r * r, 1), 0).to(tl.float64))
        tl.store(out + meta.GB_WEIGHTS, tl.sum(tl.sum(d0 * d0, 1), 0).to(tl.float64))
        tl.store(out + meta.GB_WEIGHTS + 1, tl.sum(tl.sum(d_ns * d_ns, 1), 0).to(tl.float64))
        tl.store(out + meta.GB_WEIGHTS + 2, bad.to(tl.float64))
        tl.store(out + meta.GB_WEIGHTS + 3, tl.sum(tl.sum(d * d, 1), 0).to(tl.float64))  # ‖D‖² (the check's)


@triton.jit
def guard_choose_kernel(
    layer_ptr,
    coef_ptr,
    weight_ptr,
    movable_ptr,
    scale_ptr,
    part_ptr,
    result_ptr,
    hyper_ptr,
    hyper_out_ptr,
    n_layers,
    top,
    ACC: tl.constexpr,
    HYPER: tl.constexpr,
    GUARD: tl.constexpr,
):
    for layer in range(tl.program_id(0), n_layers, tl.num_programs(0)):
        row = layer_ptr + layer * meta.GB_LAYER_FIELDS
        first = tl.load(row + meta.GB_L_FIRST)
        idx = tl.arange(0, meta.GB_PART_PAD)
        sums = tl.zeros_like(idx).to(tl.float64)
        for r in range(first, first + tl.load(row + meta.GB_L_ITEMS)):  # the layer's rows, in order
            sums += tl.load(part_ptr + r * meta.GB_PART + idx, mask=idx < meta.GB_PART, other=0.0)
        target = tl.load(coef_ptr + layer * meta.GB_COEF_FIELDS + meta.GB_C_TARGET)
        bad = tl.sum(tl.where(idx == meta.GB_WEIGHTS + 2, sums, 0.0), 0)
        movable = (tl.load(movable_ptr + layer) != 0) & (bad == 0.0)  # (NaN compares False)
        if GUARD:
            fits = (idx < meta.GB_WEIGHTS) & (sums <= target * target) & movable  # NaN compares False
        else:  # the full step (t = 1) whatever its distance: only its prediction
            fits = idx == 0
        first_fit = tl.min(tl.where(fits, idx, idx + meta.GB_PART_PAD), 0)  # the largest weight that fits
        some = first_fit < meta.GB_WEIGHTS
        weight = tl.where(some, tl.load(weight_ptr + first_fit % meta.GB_WEIGHTS), 0.0)
        # ‖D(t)‖ of the weight chosen; at 0, of the α pull-back D₀
        pick = tl.where(some, first_fit, first_fit * 0 + meta.GB_WEIGHTS)
        dist = tl.sqrt(tl.sum(tl.where(idx == pick, sums, 0.0), 0))
        d_ns = tl.sqrt(tl.sum(tl.where(idx == meta.GB_WEIGHTS + 1, sums, 0.0), 0))
        newton = (weight == 0.0) & ~(dist <= target) & (d_ns < dist)
        dist = tl.where(newton, d_ns, dist)
        scale = tl.load(scale_ptr + layer) * weight  # U → tsU
        code = (scale < 1.0).to(tl.float64) + (scale <= 0.0).to(tl.float64)  # KEPT / SCALED / RESET
        # θ₊ fits the parameters' dtype: its largest entry ≤ ‖θ₊‖_F ≤ √(p + √p·d) (top: its max, or inf)
        p = tl.load(row + meta.GB_L_P).to(tl.float64)
        top64 = tl.cast(top, tl.float64)
        fits = (dist - dist == 0.0) & (dist * tl.sqrt(p) + p < top64 * top64)
        if not GUARD:  # (with the guard a non-finite M_Φ is not movable: reset, Φ₊ = 0)
            fits = fits & (bad == 0.0)
        out = result_ptr + layer * meta.GB_RESULT_FIELDS
        tl.store(out + meta.GB_R_WEIGHT, weight)
        tl.store(out + meta.GB_R_NEWTON, newton.to(tl.float64))
        tl.store(out + meta.GB_R_DIST, dist)
        tl.store(out + meta.GB_R_SCALE, scale)
        tl.store(out + meta.GB_R_CODE, code)
        tl.store(out + meta.GB_R_FITS, fits.to(tl.float64))
        tl.store(out + meta.GB_R_DIST0, tl.sqrt(tl.sum(tl.where(idx == meta.GB_WEIGHTS + 3, sums, 0.0), 0)))
        tl.store(out + meta.GB_R_FINITE, (tl.load(movable_ptr + layer) != 0).to(tl.float64))
        if HYPER:  # the update kernel's table [tsη, tsβ, α] (its U = βΦ − ηg becomes tsU)
            h_in = hyper_ptr + layer * meta.HYPER_FIELDS
            h_out = hyper_out_ptr + layer * meta.HYPER_FIELDS
            ts = scale.to(ACC)
            # a reset (ts = 0) stores exact zeros, even for an η that is not finite (0·NaN would be NaN)
            tl.store(h_out + meta.H_LR, tl.where(ts == 0.0, 0.0, ts * tl.load(h_in + meta.H_LR)))
            tl.store(h_out + meta.H_BETA, tl.where(ts == 0.0, 0.0, ts * tl.load(h_in + meta.H_BETA)))
            tl.store(h_out + meta.H_ALPHA, tl.load(h_in + meta.H_ALPHA))


@triton.jit
def guard_blend_kernel(
    work_ptr,
    layer_ptr,
    coef_ptr,
    result_ptr,
    d_ptr,
    m_phi_ptr,
    m_theta_ptr,
    delta_ptr,
    feedback_ptr,
    n_items,
    ACC: tl.constexpr,
    FULL: tl.constexpr,
    FEEDBACK: tl.constexpr,
    BT: tl.constexpr,
):
    for item in range(tl.program_id(0), n_items, tl.num_programs(0)):
        off, p, ri, cj, m = _where_item(work_ptr, layer_ptr, item, BT)
        layer = tl.load(work_ptr + item * 3)
        res = result_ptr + layer * meta.GB_RESULT_FIELDS
        weight = tl.load(res + meta.GB_R_WEIGHT)
        if FULL:  # M_θ of every layer (the fused middle leaves it to this kernel; F is not kept)
            d = _tile(d_ptr + off, ri, cj, p, m)
            t = weight.to(ACC)
            alpha = tl.load(coef_ptr + layer * meta.GB_COEF_FIELDS + meta.GB_C_ALPHA).to(ACC)
            base = d * -tl.where(tl.load(res + meta.GB_R_NEWTON) != 0.0, 0.5, alpha)  # F₀' = −α'D
            at = off + ri[:, None] * p + cj[None, :]
            # Δ = M_θ − F₀ = M_Φ here (the official update): the value loaded, not a second read of
            # the slot this program writes (delta_ptr is not read in this branch)
            m_phi = tl.load(m_phi_ptr + at, mask=m, other=0.0)
            moving = t > 0.0
            tl.store(m_phi_ptr + at, tl.where(moving, m_phi * t, 0.0), mask=m)  # tM_Φ (a reset: Φ₊ = 0)
            if FEEDBACK:  # F = M_θ − M_Φ = F₀' + tΔ − tM_Φ = F₀' (Δ = M_Φ): the CUDA-core θ pass's
                tl.store(m_theta_ptr + at, base, mask=m)
            else:
                tl.store(m_theta_ptr + at, tl.where(moving, base + m_phi * t, base), mask=m)  # F₀' + tΔ
        elif weight != 1.0:  # t = 1: the full step, left as it is
            d = _tile(d_ptr + off, ri, cj, p, m)
            t = weight.to(ACC)
            alpha = tl.load(coef_ptr + layer * meta.GB_COEF_FIELDS + meta.GB_C_ALPHA).to(ACC)
            newton = tl.load(res + meta.GB_R_NEWTON) != 0.0
            base = d * -tl.where(newton, 0.5, alpha)  # F₀' = −α'D (α' = ½: Newton–Schulz)
            at = off + ri[:, None] * p + cj[None, :]
            m_phi = tl.load(m_phi_ptr + at, mask=m, other=0.0)
            delta = tl.load(delta_ptr + at, mask=m, other=0.0)
            fb = tl.load(feedback_ptr + at, mask=m, other=0.0)
            moving = t > 0.0
            tl.store(m_phi_ptr + at, tl.where(moving, m_phi * t, 0.0), mask=m)  # tM_Φ (a reset: Φ₊ = 0)
            tl.store(m_theta_ptr + at, tl.where(moving, base + delta * t, base), mask=m)  # F₀' + tΔ
            pull_back = -alpha * d  # F₀ = −αD
            tl.store(feedback_ptr + at, tl.where(moving, base + (fb - pull_back) * t, base), mask=m)
