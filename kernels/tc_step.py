"""Tensor-core (TF32) kernels of the two-pass FGD step, for float32 parameters.

Three launches per step cover every layer of a launch class (metadata fields, Gram slots and
work-table columns are named in :mod:`.meta`):

``tc_split_kernel`` — θ = hi + lo with hi = tf32(θ) and lo = tf32(θ − hi) (round to nearest,
ties to even, as ``fgd_fast.backends.tf32.split_tf32``), written once into scratch in θ's layout with the
n dimension padded to ``ld`` rows of zeros (``lo`` only for ``"tf32x3"``). Memory-bound.

``tc_gram_kernel`` — pass 1 as ONE TF32 GEMM per layer, hiᵀ[hi | lo | Φ | g] plus ΦᵀΦ:

    A ≈ H + L + Lᵀ,  H = hiᵀhi,  L = hiᵀlo       (3×TF32 of θᵀθ: lo·lo dropped, loᵀhi = Lᵀ)
    E = hiᵀg,  B = hiᵀΦ,  C = ΦᵀΦ                (single TF32)

Only A sets the distance to the manifold the feedback reaches, so only A gets the split
(``"tf32"``: A = H). The operands are pre-split, so every product is a plain TF32 ``tl.dot``
(asynchronous wgmma on sm_90, mma.sync on sm_80) and the K loop is the plain GEMM loop:
no conversion between load and dot. Work item = (layer, left field, right field, slot, tile i,
tile j, split), ``BM × BN`` output tiles over a split of n; the symmetric H and C only get tiles
with i ≤ j and store them as they are (no mirror store: the launcher reads the lower tiles as
the transposes of the upper ones). A persistent grid strides over the items, which the
launcher sorts longest first. Split s writes slab s (``split_stride`` apart); the launcher sums
the slabs in a fixed order: deterministic, no atomics. The K loop runs over whole ``BK``
steps with no K mask, then one masked tail; with ``ALIGNED`` (16-byte aligned tensors, n and p
multiples of 4) the loads are 16-byte vectors.

The tensor cores convert an fp32 operand to TF32 by truncating its 13 low mantissa bits (wgmma
and mma.sync alike; no rounding instruction is emitted): hi and lo are exact TF32, so A is
exact to the split, but Φ and g here, and M_θ, M_Φ in the update, lose up to 2⁻¹⁰ of their
value, toward zero (round to nearest, which the CPU emulation models, loses up to 2⁻¹¹,
unbiased). Rounding them in the kernels would put a conversion between load and dot; not done
until a GPU run measures whether the bias shows (the feedback fixes θ's distance through A).

``tc_update_kernel`` — pass 2, one launch for Φ₊ and θ₊ (U = βΦ − ηg, or −ηg without Φ):

    Φ₊ = U + hi M_Φ,   θ₊ = θ + U + hi M_θ

Work item = (layer, row block, column block). Both products read the same hi tile per K step
(hi = tf32(θ) is exactly what a TF32 product of θ sees) and hi is never written, so θ and Φ
are updated in place tile by tile with no snapshot: each item reads θ, Φ, g only at the
elements it writes. M_θ and M_Φ are read where the middle left them, row-major in its two
buffers (``M[k, c]`` at the layer's offset + ``k·p + c``).

Layouts (``ROWS``): ``True``: θ = W2ᵀ, memory holds θᵀ row-major, θ[k, i] at ``i·n + k``
(hi/lo at ``i·ld + k``); ``False``: θ = W2, θ[k, i] at ``k·p + i`` (hi/lo likewise, ld rows).
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import meta

LD_ALIGN = meta.LD_ALIGN  # hi/lo rows are padded to a multiple of this (≥ every BK and BR used)
_LD_ALIGN = tl.constexpr(LD_ALIGN)  # (as the kernels read it)


@triton.jit
def _tf32(x):
    """x rounded to TF32 (10-bit mantissa), to nearest, ties to even; fp32 storage. Inf and NaN
    are kept as they are. Bit for bit ``fgd_fast.backends.tf32.round_tf32`` (tests/test_tf32_split.py compares them)."""
    bits = x.to(tl.uint32, bitcast=True)
    lsb = (bits >> 13) & 1  # the lowest kept bit: ties to even
    rounded = ((bits + 0xFFF + lsb) >> 13) << 13
    special = (bits & 0x7F800000) == 0x7F800000  # Inf / NaN
    return tl.where(special, bits, rounded).to(tl.float32, bitcast=True)


@triton.jit
def _at(rk, ci, ld, p, ROWS: tl.constexpr):
    """Offsets of X[rk, ci] (rk along n, ci along p), shaped (len(rk), len(ci)); ``ld`` is the
    row stride of the ``p × ·`` memory in the ROWS layout."""
    if ROWS:
        return ci[None, :] * ld + rk[:, None]
    return rk[:, None] * p + ci[None, :]


@triton.jit
def _load_t(ptr, ci, rk, ld, p, r1, ROWS: tl.constexpr, K_MASK: tl.constexpr):
    """Xᵀ[ci, rk] for a K step. Along p, ROWS clamps the indices into range (the extra rows
    are computed and never stored; no mask, so the K-contiguous loads stay 16 bytes wide);
    the other layout masks (p is the contiguous dimension there)."""
    if ROWS:
        off = tl.minimum(ci, p - 1)[:, None] * ld + rk[None, :]
        if K_MASK:
            return tl.load(ptr + off, mask=(rk < r1)[None, :], other=0.0)
        return tl.load(ptr + off)
    off = rk[None, :] * p + ci[:, None]
    m = (ci < p)[:, None]
    if K_MASK:
        m = m & (rk < r1)[None, :]
    return tl.load(ptr + off, mask=m, other=0.0)


@triton.jit
def _load(ptr, rk, cj, ld, p, r1, ROWS: tl.constexpr, K_MASK: tl.constexpr):
    """X[rk, cj] for a K step (as :func:`_load_t`)."""
    if ROWS:
        off = tl.minimum(cj, p - 1)[None, :] * ld + rk[:, None]
        if K_MASK:
            return tl.load(ptr + off, mask=(rk < r1)[:, None], other=0.0)
        return tl.load(ptr + off)
    off = rk[:, None] * p + cj[None, :]
    m = (cj < p)[None, :]
    if K_MASK:
        m = m & (rk < r1)[:, None]
    return tl.load(ptr + off, mask=m, other=0.0)


@triton.jit
def tc_split_kernel(
    meta_ptr,
    work_ptr,
    n_items,
    ROWS: tl.constexpr,
    ALIGNED: tl.constexpr,
    LO: tl.constexpr,
    BS: tl.constexpr,
    BL: tl.constexpr,
):
    for item in range(tl.program_id(0), n_items, tl.num_programs(0)):
        w = work_ptr + item * meta.SPLIT_WORK
        row = meta_ptr + tl.load(w + meta.S_LAYER) * meta.META_FIELDS
        theta = tl.load(row + meta.F_THETA).to(tl.pointer_type(tl.float32))
        hi_ptr = tl.load(row + meta.F_HI).to(tl.pointer_type(tl.float32))
        n = tl.load(row + meta.F_N)
        p = tl.load(row + meta.F_P)
        # hi/lo: scratch at offsets Σ p·ld, ld a multiple of LD_ALIGN: 16-byte aligned in every class
        hi_ptr = tl.multiple_of(hi_ptr, 16)
        ld = tl.multiple_of(tl.load(row + meta.F_LD), _LD_ALIGN)
        if ALIGNED:
            theta = tl.multiple_of(theta, 16)
            n = tl.multiple_of(n, 4)
            p = tl.multiple_of(p, 4)
        rk = tl.load(w + meta.S_TK) * BL + tl.arange(0, BL)
        ci = tl.load(w + meta.S_TI) * BS + tl.arange(0, BS)
        inside = (rk < ld)[:, None] & (ci < p)[None, :]
        x = tl.load(theta + _at(rk, ci, n, p, ROWS), mask=(rk < n)[:, None] & (ci < p)[None, :], other=0.0)
        hi = _tf32(x)  # hi = tf32(θ); the padding rows n ≤ k < ld are zeros
        tl.store(hi_ptr + _at(rk, ci, ld, p, ROWS), hi, mask=inside)
        if LO:
            lo_ptr = tl.multiple_of(tl.load(row + meta.F_LO).to(tl.pointer_type(tl.float32)), 16)
            tl.store(lo_ptr + _at(rk, ci, ld, p, ROWS), _tf32(x - hi), mask=inside)  # lo = tf32(θ − hi)


@triton.jit
def tc_gram_kernel(
    meta_ptr,
    work_ptr,
    n_items,
    out_ptr,
    split_stride,
    ROWS: tl.constexpr,
    ALIGNED: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    PRECISION: tl.constexpr,
):
    for item in range(tl.program_id(0), n_items, tl.num_programs(0)):
        w = work_ptr + item * meta.GRAM_WORK
        row = meta_ptr + tl.load(w + meta.G_LAYER) * meta.META_FIELDS
        lf = tl.load(w + meta.G_LEFT)  # field of the left operand: hi, or Φ for C
        rf = tl.load(w + meta.G_RIGHT)  # field of the right operand: hi, lo, Φ or g
        left = tl.load(row + lf).to(tl.pointer_type(tl.float32))
        right = tl.load(row + rf).to(tl.pointer_type(tl.float32))
        n = tl.load(row + meta.F_N)
        p = tl.load(row + meta.F_P)
        ld = tl.load(row + meta.F_LD)
        chunk = tl.multiple_of(tl.load(row + meta.F_CHUNK), BK)
        # row stride (ROWS layout) of each operand: ld for the padded split buffers, n for Φ, g
        ld_l = tl.where(lf >= meta.F_HI, ld, n)
        ld_r = tl.where(rf >= meta.F_HI, ld, n)
        if ALIGNED:  # every address 16-byte aligned, n and p multiples of 4: 16-byte loads
            left = tl.multiple_of(left, 16)
            right = tl.multiple_of(right, 16)
            ld_l = tl.multiple_of(ld_l, 4)
            ld_r = tl.multiple_of(ld_r, 4)
            n = tl.multiple_of(n, 4)
            p = tl.multiple_of(p, 4)
        split = tl.load(w + meta.G_SPLIT)
        r0 = tl.multiple_of(split * chunk, BK)
        r1 = tl.maximum(tl.minimum(r0 + chunk, n), r0)  # an empty split writes zeros
        r_full = r0 + (r1 - r0) // BK * BK  # whole BK steps, unmasked
        oi = tl.load(w + meta.G_TI) * BM + tl.arange(0, BM)
        oj = tl.load(w + meta.G_TJ) * BN + tl.arange(0, BN)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        # Tensor cores add into their accumulator with truncation (round toward zero), a bias of
        # ~½ ulp of the running sum per instruction: summed over n rows into A ≈ I that is ~1e-5 on
        # A's diagonal, which the feedback then writes into θ (measured on an H200: 74× the IEEE
        # distance). So every K-step's product starts from zero and is added to the fp32 sum by a
        # rounded add. `fresh` is a zero the compiler cannot prove: from a literal zero Triton
        # would fold `acc + dot(a, b, 0)` back into `dot(a, b, acc)`.
        fresh = tl.zeros((BM, BN), dtype=tl.float32) + n.to(tl.float32) * 0.0
        for k0 in range(r0, r_full, BK):
            rk = k0 + tl.arange(0, BK)
            a = _load_t(left, oi, rk, ld_l, p, r1, ROWS, False)  # Xᵀ[i-tile, k-step]
            b = _load(right, rk, oj, ld_r, p, r1, ROWS, False)  # Y[k-step, j-tile]
            acc += tl.dot(a, b, fresh, input_precision=PRECISION)  # X_ij += X_iᵀ Y_j (rounded add)
        if r_full < r1:  # the last partial step
            rk = r_full + tl.arange(0, BK)
            a = _load_t(left, oi, rk, ld_l, p, r1, ROWS, True)
            b = _load(right, rk, oj, ld_r, p, r1, ROWS, True)
            acc += tl.dot(a, b, fresh, input_precision=PRECISION)
        out = out_ptr + split * split_stride + tl.load(row + meta.F_GRAM) + tl.load(w + meta.G_SLOT) * p * p
        if ALIGNED:  # every block offset a sum of multiples of p² (p a multiple of 4): 16-byte stores
            out = tl.multiple_of(out, 16)
        tl.store(out + oi[:, None] * p + oj[None, :], acc, mask=(oi < p)[:, None] & (oj < p)[None, :])


@triton.jit
def tc_update_kernel(
    meta_ptr,
    hyper_ptr,
    work_ptr,
    n_items,
    mt_ptr,
    mp_ptr,
    HAS_PHI: tl.constexpr,
    ROWS: tl.constexpr,
    ALIGNED: tl.constexpr,
    BR: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    PRECISION: tl.constexpr,
):
    for item in range(tl.program_id(0), n_items, tl.num_programs(0)):
        w = work_ptr + item * meta.UPDATE_WORK
        layer = tl.load(w + meta.U_LAYER)
        row = meta_ptr + layer * meta.META_FIELDS
        theta = tl.load(row + meta.F_THETA).to(tl.pointer_type(tl.float32))
        grad = tl.load(row + meta.F_GRAD).to(tl.pointer_type(tl.float32))
        # hi: 16-byte aligned with rows of a multiple of LD_ALIGN in every class (the split's scratch)
        hi = tl.multiple_of(tl.load(row + meta.F_HI).to(tl.pointer_type(tl.float32)), 16)
        n = tl.load(row + meta.F_N)
        p = tl.load(row + meta.F_P)
        ld = tl.multiple_of(tl.load(row + meta.F_LD), _LD_ALIGN)
        m_at = tl.load(row + meta.F_M)  # the layer's M_θ and M_Φ: row-major in the middle's buffers
        m_theta = mt_ptr + m_at
        m_phi = mp_ptr + m_at
        if ALIGNED:
            theta = tl.multiple_of(theta, 16)
            grad = tl.multiple_of(grad, 16)
            m_theta = tl.multiple_of(m_theta, 16)  # offsets: sums of p² (p a multiple of 4)
            m_phi = tl.multiple_of(m_phi, 16)
            n = tl.multiple_of(n, 4)
            p = tl.multiple_of(p, 4)
        rows = tl.load(w + meta.U_RB) * BR + tl.arange(0, BR)  # < ld: hi rows past n are zeros
        cols = tl.load(w + meta.U_CB) * BN + tl.arange(0, BN)
        mc = cols < p
        acc_t = tl.zeros((BR, BN), dtype=tl.float32)
        acc_p = tl.zeros((BR, BN), dtype=tl.float32)
        for k0 in range(0, p, BK):
            ks = k0 + tl.arange(0, BK)
            mk = ks < p
            a = tl.load(hi + _at(rows, ks, ld, p, ROWS), mask=mk[None, :], other=0.0)  # hi[rows, k-step]
            mb = mk[:, None] & mc[None, :]
            bt = tl.load(m_theta + ks[:, None] * p + cols[None, :], mask=mb, other=0.0)  # M_θ[k-step, cols]
            acc_t = tl.dot(a, bt, acc_t, input_precision=PRECISION)  # hi M_θ
            if HAS_PHI:
                bp = tl.load(m_phi + ks[:, None] * p + cols[None, :], mask=mb, other=0.0)
                acc_p = tl.dot(a, bp, acc_p, input_precision=PRECISION)  # hi M_Φ
        off = _at(rows, cols, n, p, ROWS)
        m = (rows < n)[:, None] & (cols < p)[None, :]
        eta = tl.load(hyper_ptr + layer * meta.HYPER_FIELDS + meta.H_LR)  # η
        # a term whose (guard-scaled) coefficient is 0 is not read: a reset (s = 0) over a
        # non-finite g or Φ writes the pull-back, not 0·Inf
        u = tl.where(eta == 0.0, 0.0, -eta * tl.load(grad + off, mask=m, other=0.0))  # U = −ηg …
        if HAS_PHI:
            phi = tl.load(row + meta.F_PHI).to(tl.pointer_type(tl.float32))
            if ALIGNED:
                phi = tl.multiple_of(phi, 16)
            beta = tl.load(hyper_ptr + layer * meta.HYPER_FIELDS + meta.H_BETA)  # β
            u += tl.where(beta == 0.0, 0.0, beta * tl.load(phi + off, mask=m, other=0.0))  # … + βΦ
            tl.store(phi + off, u + acc_p, mask=m)  # Φ₊ = U + θ M_Φ
        th = tl.load(theta + off, mask=m, other=0.0)
        tl.store(theta + off, th + u + acc_t, mask=m)  # θ₊ = θ + U + θ M_θ


# Tile sizes per (precision, ALIGNED), float32 parameters only. A configuration must compile for
# sm_80 and sm_90 without spilling and use tensor-core instructions for its products
# (kernels/aot.py, tests/test_triton_aot.py). Aligned: 128 × 128 Gram tiles with 16-byte loads;
# unaligned (scalar loads need more registers): 64 × 64, the largest square tile that does not
# spill. Compile-only choices, not yet timed on a GPU (benchmarks/gpu/triton_probe.py sweeps them).
SPLIT_CONFIG = dict(BS=32, BL=64, num_warps=8, num_stages=1)
_GRAM_ALIGNED = dict(BM=128, BN=128, BK=32, num_warps=8, num_stages=3)
_GRAM_UNALIGNED = dict(BM=64, BN=64, BK=32, num_warps=8, num_stages=3)
_UPDATE_ALIGNED = dict(BR=128, BN=64, BK=32, num_warps=8, num_stages=3)
_UPDATE_UNALIGNED = dict(BR=64, BN=64, BK=32, num_warps=8, num_stages=3)
PRECISIONS = ("tf32x3", "tf32")
GRAM_CONFIG = {
    (p, aligned): _GRAM_ALIGNED if aligned else _GRAM_UNALIGNED for p in PRECISIONS for aligned in (True, False)
}
UPDATE_CONFIG = {
    (p, aligned): _UPDATE_ALIGNED if aligned else _UPDATE_UNALIGNED for p in PRECISIONS for aligned in (True, False)
}
