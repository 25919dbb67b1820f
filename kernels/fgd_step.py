"""Triton kernels of the two-pass FGD step on CUDA cores (``"ieee"`` products, and 16-bit or
float64 parameters), multi-tensor over ragged layers. The tensor-core step for float32
parameters is :mod:`.tc_step`.

Both kernels read the per-layer **metadata table** of :mod:`.meta` (``int64``, fields by name:
θ, Φ, g pointers, n, p, Gram and M offsets, rows per split) and an ``int32`` **work table** built
once per set of layer shapes, so one launch covers layers of any (n, p). Addresses come from
``data_ptr()`` and are cast with ``.to(tl.pointer_type(...))``. Every layer of a launch shares
the element type of θ and g (``DTYPE``; Φ is always ``ACC``, the accumulation type) and the
memory layout (``ROWS``):

* ``ROWS=True``: θ = W2ᵀ, memory holds ``R = θᵀ`` row-major, element θ[k, i] at ``i·n + k``;
* ``ROWS=False``: θ = W2, element θ[k, i] at ``k·p + i``.

Φ and g have θ's layout. 64-bit offsets throughout (n, p are loaded as int64).

``gram_kernel`` — pass 1, one launch per Gram block (``BLOCK`` = slot A, E, B, C, G or H):

    A = θᵀθ,  E = θᵀg,  B = θᵀΦ,  C = ΦᵀΦ,  G = gᵀg,  H = gᵀΦ     (each p × p; G, H for the guard)

Work item = (layer, tile row i, tile col j) of ``BP × BP`` output tiles; A, C and G are
symmetric, so their work tables hold only i ≤ j and the kernel stores each tile and its
mirror. ``program_id(1)`` picks a split of the n rows (``rows per split`` each, a multiple of
``BK``); split s writes its partial tile into slab ``s`` of the output (``split_stride``
apart) and the caller sums the slabs in a fixed order: deterministic, no atomics. Output per
layer: ``[A | E | B | C | G | H]``, each p × p row-major, starting at the Gram offset.

``update_kernel`` — pass 2. Persistent grid; work item = (layer, block of ``BR`` rows); a
program owns whole row blocks and sweeps all ``BN``-column blocks of them. ``MODE_PHI``:

    Φ₊ = U + θ M_Φ,   U = βΦ − ηg                    (θ is only read)

``MODE_THETA`` (after MODE_PHI when Φ is stored):

    θ₊ = θ + V + θ M,   V = Φ₊ and M = −α(A − I)      (with Φ)
                        V = −ηg and M = M_θ           (momentum = 0: no Φ)

θ₊ row r needs all of θ[r, :], so MODE_THETA first snapshots θ[rows, :] into the program's
private slab (``BR × P_MAX`` of ``ACC``) and reads θ only from there: the in-place write can
never feed another output. Per layer, the M matrices sit at the M offset: ``[M | M_Φ]``
(slots ``M_THETA``, ``M_PHI``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import meta


@triton.jit
def _offsets(rk, ci, n, p, ROWS: tl.constexpr):
    """Element offsets of θ[rk, ci] (rk: indices along n, ci: indices along p)."""
    if ROWS:
        return ci[None, :] * n + rk[:, None]
    return rk[:, None] * p + ci[None, :]


@triton.jit
def _offsets_t(ci, rk, n, p, ROWS: tl.constexpr):
    """Element offsets of θᵀ[ci, rk] = θ[rk, ci], shaped (len(ci), len(rk))."""
    if ROWS:
        return ci[:, None] * n + rk[None, :]
    return rk[None, :] * p + ci[:, None]


@triton.jit
def gram_kernel(
    meta_ptr,
    work_ptr,
    out_ptr,
    split_stride,
    BLOCK: tl.constexpr,
    DTYPE: tl.constexpr,
    ACC: tl.constexpr,
    ROWS: tl.constexpr,
    BP: tl.constexpr,
    BK: tl.constexpr,
    PRECISION: tl.constexpr,
):
    w = tl.program_id(0)
    split = tl.program_id(1)
    layer = tl.load(work_ptr + 3 * w)  # work rows: layer, tile i, tile j
    ti = tl.load(work_ptr + 3 * w + 1)
    tj = tl.load(work_ptr + 3 * w + 2)
    row = meta_ptr + layer * meta.META_FIELDS
    # left operand: Φ for C, g for G and H, θ otherwise; right: θ for A, g for E and G, Φ for B, C, H
    # (the slot H holds gᵀΦ = (Φᵀg)ᵀ: only H + Hᵀ enters the guard, and this operand order is B's,
    # which compiles without spilling for 16-bit g)
    if BLOCK == meta.SLOT_C:
        left = tl.load(row + meta.F_PHI).to(tl.pointer_type(ACC))
    elif BLOCK == meta.SLOT_G or BLOCK == meta.SLOT_H:
        left = tl.load(row + meta.F_GRAD).to(tl.pointer_type(DTYPE))
    else:
        left = tl.load(row + meta.F_THETA).to(tl.pointer_type(DTYPE))
    if BLOCK == meta.SLOT_A:
        right = tl.load(row + meta.F_THETA).to(tl.pointer_type(DTYPE))
    elif BLOCK == meta.SLOT_E or BLOCK == meta.SLOT_G:
        right = tl.load(row + meta.F_GRAD).to(tl.pointer_type(DTYPE))
    else:
        right = tl.load(row + meta.F_PHI).to(tl.pointer_type(ACC))
    n = tl.load(row + meta.F_N)
    p = tl.load(row + meta.F_P)
    out = out_ptr + split * split_stride + tl.load(row + meta.F_GRAM) + BLOCK * p * p
    chunk = tl.load(row + meta.F_CHUNK)
    r0 = split * chunk
    r1 = tl.minimum(r0 + chunk, n)

    oi = ti * BP + tl.arange(0, BP)
    oj = tj * BP + tl.arange(0, BP)
    mi = oi < p
    mj = oj < p
    acc = tl.zeros((BP, BP), dtype=ACC)
    for k0 in range(r0, r1, BK):
        rk = k0 + tl.arange(0, BK)
        mk = rk < r1
        lt = tl.load(left + _offsets_t(oi, rk, n, p, ROWS), mask=mi[:, None] & mk[None, :], other=0.0)
        rt = tl.load(right + _offsets(rk, oj, n, p, ROWS), mask=mk[:, None] & mj[None, :], other=0.0)
        acc += tl.dot(lt.to(ACC), rt.to(ACC), input_precision=PRECISION)  # X_ij += L_iᵀ R_j
    m = mi[:, None] & mj[None, :]
    tl.store(out + oi[:, None] * p + oj[None, :], acc, mask=m)
    if (
        BLOCK == meta.SLOT_A or BLOCK == meta.SLOT_C or BLOCK == meta.SLOT_G
    ):  # symmetric: the mirror tile is the transpose
        # (not on the diagonal: the same addresses, and (a, b) and (b, a) need not round alike)
        tl.store(out + oj[None, :] * p + oi[:, None], acc, mask=m & (ti != tj))


@triton.jit
def update_kernel(
    meta_ptr,
    hyper_ptr,
    work_ptr,
    n_items,
    m_ptr,
    scratch_ptr,
    P_MAX,
    MODE: tl.constexpr,
    HAS_PHI: tl.constexpr,
    DTYPE: tl.constexpr,
    ACC: tl.constexpr,
    ROWS: tl.constexpr,
    BR: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    slab = scratch_ptr + pid.to(tl.int64) * BR * P_MAX  # this program's BR × P_MAX snapshot
    rr = tl.arange(0, BR)
    for item in range(pid, n_items, tl.num_programs(0)):
        layer = tl.load(work_ptr + 2 * item)  # work rows: layer, row block
        rb = tl.load(work_ptr + 2 * item + 1)
        row = meta_ptr + layer * meta.META_FIELDS
        theta = tl.load(row + meta.F_THETA).to(tl.pointer_type(DTYPE))
        grad = tl.load(row + meta.F_GRAD).to(tl.pointer_type(DTYPE))
        n = tl.load(row + meta.F_N)
        p = tl.load(row + meta.F_P)
        mat = m_ptr + tl.load(row + meta.F_M)  # M_Φ (MODE_PHI) or the θ matrix: the launch's buffer
        lr = tl.load(hyper_ptr + layer * meta.HYPER_FIELDS + meta.H_LR)  # η
        beta = tl.load(hyper_ptr + layer * meta.HYPER_FIELDS + meta.H_BETA)  # β
        rows = rb * BR + rr
        mr = rows < n
        if HAS_PHI:
            phi = tl.load(row + meta.F_PHI).to(tl.pointer_type(ACC))

        if MODE == meta.MODE_THETA:  # snapshot θ[rows, :] into the private slab
            for c0 in range(0, p, BN):
                cols = c0 + tl.arange(0, BN)
                m = mr[:, None] & (cols < p)[None, :]
                t = tl.load(theta + _offsets(rows, cols, n, p, ROWS), mask=m, other=0.0).to(ACC)
                tl.store(slab + rr[:, None] * P_MAX + cols[None, :], t, mask=m)
            tl.debug_barrier()

        for c0 in range(0, p, BN):
            cols = c0 + tl.arange(0, BN)
            mc = cols < p
            m = mr[:, None] & mc[None, :]
            acc = tl.zeros((BR, BN), dtype=ACC)
            for k0 in range(0, p, BK):
                ks = k0 + tl.arange(0, BK)
                mk = ks < p
                ma = mr[:, None] & mk[None, :]
                if MODE == meta.MODE_THETA:
                    a = tl.load(slab + rr[:, None] * P_MAX + ks[None, :], mask=ma, other=0.0)
                else:
                    a = tl.load(theta + _offsets(rows, ks, n, p, ROWS), mask=ma, other=0.0).to(ACC)
                b = tl.load(mat + ks[:, None] * p + cols[None, :], mask=mk[:, None] & mc[None, :], other=0.0)
                acc += tl.dot(a, b, input_precision=PRECISION)  # θ M
            off = _offsets(rows, cols, n, p, ROWS)
            if MODE == meta.MODE_PHI:
                # a zero (guard-scaled) coefficient reads nothing: a reset over a non-finite g or
                # Φ writes the pull-back, not 0·Inf
                u = tl.where(lr == 0.0, 0.0, -lr * tl.load(grad + off, mask=m, other=0.0).to(ACC))  # U = −ηg …
                u += tl.where(beta == 0.0, 0.0, beta * tl.load(phi + off, mask=m, other=0.0))  # … + βΦ
                tl.store(phi + off, u + acc, mask=m)  # Φ₊ = U + θ M_Φ
            else:
                th = tl.load(slab + rr[:, None] * P_MAX + cols[None, :], mask=m, other=0.0)
                if HAS_PHI:
                    v = tl.load(phi + off, mask=m, other=0.0)  # V = Φ₊
                else:
                    v = tl.where(lr == 0.0, 0.0, -lr * tl.load(grad + off, mask=m, other=0.0).to(ACC))  # V = −ηg
                tl.store(theta + off, (th + v + acc).to(DTYPE), mask=m)  # θ₊ = θ + V + θ M
        if MODE == meta.MODE_THETA:
            tl.debug_barrier()  # every read of the slab is done before the next snapshot


# Tile sizes, warps and pipeline stages per (element type, precision); an element type
# without its own entry uses its accumulation type's (see ``kernel_config``). A selectable
# configuration must compile for sm_80 and sm_90 without spilling, with triton 3.6 and 3.8:
# kernels/aot.py compiles every one (tests/test_triton_aot.py runs it). float32 "ieee": the
# fastest spill-free candidates of a GPU sweep (benchmarks/gpu/triton_probe.py on an H200,
# WRN-28-10 "official"; benchmarks/results/gpu-h200-2026-11-26-triton-probe.md): Gram
# 12.3 ms and update 3.7 ms against 19.5 ms and 5.7 ms for the compile-only choice they
# replace, which fp16/bf16 parameters keep (converting from 16 bits, the new tiles spill a
# few bytes). The other entries: the largest tiles that keep STACK:0 (compile-only sweep,
# not yet timed on a GPU).
GRAM_CONFIG = {
    ("float32", "ieee"): dict(BP=64, BK=16, num_warps=4, num_stages=3),
    ("float16", "ieee"): dict(BP=64, BK=32, num_warps=8, num_stages=3),
    ("bfloat16", "ieee"): dict(BP=64, BK=32, num_warps=8, num_stages=3),
    ("float32", "tf32x3"): dict(BP=64, BK=16, num_warps=8, num_stages=3),
    ("float32", "tf32"): dict(BP=64, BK=32, num_warps=8, num_stages=3),
    ("float64", "ieee"): dict(BP=32, BK=16, num_warps=8, num_stages=3),
}
UPDATE_CONFIG = {
    ("float32", "ieee"): dict(BR=32, BN=64, BK=32, num_warps=4, num_stages=1),
    ("float16", "ieee"): dict(BR=64, BN=32, BK=32, num_warps=8, num_stages=1),
    ("bfloat16", "ieee"): dict(BR=64, BN=32, BK=32, num_warps=8, num_stages=1),
    ("float32", "tf32x3"): dict(BR=64, BN=32, BK=16, num_warps=8, num_stages=1),
    ("float32", "tf32"): dict(BR=64, BN=32, BK=32, num_warps=8, num_stages=1),
    ("float64", "ieee"): dict(BR=32, BN=32, BK=16, num_warps=8, num_stages=1),
}
#: parameter element type -> accumulation type (as fgd_fast.backends.base.compute_dtype)
ACC_OF = {"float32": "float32", "float16": "float32", "bfloat16": "float32", "float64": "float64"}


def kernel_config(table: dict, dtype: str, precision: str) -> dict:
    """The configuration of ``table`` for parameters of element type ``dtype``."""
    return table.get((dtype, precision)) or table[ACC_OF[dtype], precision]
