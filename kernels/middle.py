"""The middle's elementwise prologue in one launch over every layer of a layout (``mid_prep_kernel``).

The Triton backend's fused middle (``fgd_fast/backends/fused_middle.py``) starts from the Gram
blocks ``A, E, B, C, G, H`` of every layer (one flat buffer per block, ``fgd_fast/backends/layout.py``)
and ‖g‖ per layer. Before its products it needs, per layer, the guard's trust scale and
finiteness of the inputs

    r = ‖Φ‖_F + η‖g‖_F  (‖Φ‖² = tr C),   s = min(1, ρ/r)  (0 where r is not finite)

and, with the inputs scaled (B → sB, C → s²C, E → sE, G → s²G, H → s²H), the blocks

    D  = A − I
    B' = sB,   S' = sym(sB)
    Q  = η sym(sE) − s²C − (β − 1)S' − αB'      (the M_Φ bracket less its two product terms)
    T  = βsB − ηsE                               (θᵀ(sU))
    W  = s²(η²G + β²C − βη(H + Hᵀ))             (s²UᵀU, in G's place)

Work item = (layer, tile i, tile j), ``BT × BT`` entries. Every item of a layer computes the
layer's s itself (tr C: p loads), so no second launch is needed; the layer's first item stores
s, the finiteness flag and the guard kernels' α and target (``GB_C_ALPHA``, ``GB_C_TARGET`` of
their per-layer row; its η and β are read only by a guard that forms W itself). ρ and the target
come from the per-layer table ``rule``; ρ = ∞ where the guard is off: s = 1. D and W
overwrite A and G (each read only at its own entry); the others go to their own blocks (E, B,
H are read transposed by other items, C's diagonal by every item of the layer): slots
``meta.MP_B``, ``MP_S``, ``MP_Q``, ``MP_T`` of the same buffer.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import meta
from .guard import _tile, _tile_t
from .products import _block

TILE = 32  # BT × BT entries per work item
CONFIG = dict(BT=TILE, num_warps=8)


@triton.jit
def mid_prep_kernel(
    work_ptr,
    layer_ptr,
    hyper_ptr,
    g_norm_ptr,
    blocks_ptr,
    numel,
    rule_ptr,
    scale_ptr,
    finite_ptr,
    coef_ptr,
    n_items,
    HAS_PHI: tl.constexpr,
    BT: tl.constexpr,
):
    numel = tl.cast(numel, tl.int64)  # slot·Σp² in 64 bits: past 2³¹ from Σp² ≈ 2.4e8 (an i32 argument)
    for item in range(tl.program_id(0), n_items, tl.num_programs(0)):
        w = work_ptr + item * 3
        layer = tl.load(w)
        off, p = _block(layer_ptr, layer)
        ti = tl.load(w + 1)
        tj = tl.load(w + 2)
        ri = ti * BT + tl.arange(0, BT)
        cj = tj * BT + tl.arange(0, BT)
        m = (ri < p)[:, None] & (cj < p)[None, :]
        at = ri[:, None] * p + cj[None, :]  # entry (i, j) of the layer's block
        hyper = hyper_ptr + layer * meta.HYPER_FIELDS
        eta = tl.load(hyper + meta.H_LR)
        beta = tl.load(hyper + meta.H_BETA)
        alpha = tl.load(hyper + meta.H_ALPHA)
        a_blk = blocks_ptr + meta.SLOT_A * numel + off
        e_blk = blocks_ptr + meta.SLOT_E * numel + off
        b_blk = blocks_ptr + meta.SLOT_B * numel + off
        c_blk = blocks_ptr + meta.SLOT_C * numel + off
        g_blk = blocks_ptr + meta.SLOT_G * numel + off
        h_blk = blocks_ptr + meta.SLOT_H * numel + off
        # the layer's trust scale: r = ‖Φ‖ + η‖g‖ (float64), s = min(1, ρ/r), 0 where r is not finite
        g_norm = tl.load(g_norm_ptr + layer)  # ‖g‖_F (float64)
        phi_sq = g_norm * 0.0
        if HAS_PHI:
            for k0 in range(0, p, BT):  # ‖Φ‖² = tr C
                kk = k0 + tl.arange(0, BT)
                phi_sq += tl.sum(tl.load(c_blk + kk * (p + 1), mask=kk < p, other=0.0).to(tl.float64), 0)
        r = tl.sqrt(phi_sq) + eta.to(tl.float64) * g_norm
        rule = rule_ptr + layer * meta.MP_RULE_FIELDS
        radius = tl.load(rule + meta.MP_RULE_RADIUS)
        s64 = tl.minimum(radius / r, 1.0)  # ρ/0 = inf → 1
        # 0 (a reset) where r is not finite or s is too small for float32 blocks to carry
        s64 = tl.where((r - r == 0.0) & (s64 >= meta.MIN_TRUST_SCALE), s64, 0.0)
        s64 = tl.where(radius - radius == 0.0, s64, 1.0)  # ρ = ∞: the guard off, no scaling whatever r
        if (ti == 0) & (tj == 0):  # the layer's per-layer values, once
            tl.store(scale_ptr + layer, s64)
            tl.store(finite_ptr + layer, (g_norm - g_norm == 0.0) & (phi_sq - phi_sq == 0.0))
            coef = coef_ptr + layer * meta.GB_COEF_FIELDS  # the guard kernels' α and target (W is given)
            tl.store(coef + meta.GB_C_ALPHA, alpha.to(tl.float64))
            tl.store(coef + meta.GB_C_TARGET, tl.load(rule + meta.MP_RULE_TARGET))
        s = s64.to(tl.float32)  # (applied twice, never s² formed: it underflows float32 below s ~ 1e-19)
        eye = (ri[:, None] == cj[None, :]).to(tl.float32)
        tl.store(a_blk + at, _tile(a_blk, ri, cj, p, m) - eye, mask=m)  # D = A − I (in A's place)
        e = s * _tile(e_blk, ri, cj, p, m)  # sE
        q = (0.5 * eta) * (e + s * _tile_t(e_blk, ri, cj, p, m))  # η sym(sE)
        t = -eta * e  # T = −ηsE (+ βsB)
        # W = s²UᵀU from (sη) and (sβ): η²G alone overflows float32 for a huge η where s²η²G does not
        s_eta = s * eta
        w_blk = s_eta * (s_eta * _tile(g_blk, ri, cj, p, m))  # (sη)²G
        out = blocks_ptr + off + at
        if HAS_PHI:
            b = s * _tile(b_blk, ri, cj, p, m)  # B' = sB
            sb = 0.5 * (b + s * _tile_t(b_blk, ri, cj, p, m))  # S' = sym(sB)
            c = _tile(c_blk, ri, cj, p, m)
            q = q - s * (s * c) - (beta - 1.0) * sb - alpha * b  # Q = η sym(sE) − s²C − (β−1)S' − αB'
            t += beta * b  # T = βsB − ηsE
            hh = _tile(h_blk, ri, cj, p, m) + _tile_t(h_blk, ri, cj, p, m)
            s_beta = s * beta
            w_blk += s_beta * (s_beta * c) - s_beta * (s_eta * hh)  # + (sβ)²C − (sβ)(sη)(H + Hᵀ)
            tl.store(out + meta.MP_B * numel, b, mask=m)
            tl.store(out + meta.MP_S * numel, sb, mask=m)
        tl.store(out + meta.MP_Q * numel, q, mask=m)
        tl.store(out + meta.MP_T * numel, t, mask=m)
        tl.store(g_blk + at, w_blk, mask=m)  # W = s²UᵀU (in G's place)
