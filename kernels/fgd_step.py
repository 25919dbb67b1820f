"""Triton kernels of the two-pass FGD step, multi-tensor over ragged layers.

Both kernels read a per-layer **metadata table** (``int64``, ``META_FIELDS`` entries per layer):

    [θ ptr, Φ ptr, g ptr, n, p, gram offset, M offset, rows per split]

and a per-program **work table** (``int32``) built once per set of layer shapes, so that one
launch covers layers of any (n, p). Addresses come from ``data_ptr()`` and are cast with
``.to(tl.pointer_type(...))``. Every layer of a launch shares the element type (``DTYPE``),
whether Φ exists (``HAS_PHI``) and the memory layout of θ, Φ and g (``ROWS``):

* ``ROWS=True``: θ = W2ᵀ, memory holds ``R = θᵀ`` row-major, element θ[k, i] at ``i·n + k``;
* ``ROWS=False``: θ = W2, element θ[k, i] at ``k·p + i``.

``gram_kernel`` — pass 1. Work item = (layer, tile pair i ≤ j of ``BP × BP`` tiles of the
p × p output); ``program_id(1)`` selects a split of the n rows (``rows per split`` of them).
Per BK-row slab it loads θ_i, θ_j, g_i, g_j (and Φ_i, Φ_j) once and accumulates

    A_ij = θ_iᵀθ_j,  E_ij = θ_iᵀg_j,  E_ji = θ_jᵀg_i   (+ B_ij = θ_iᵀΦ_j, B_ji = θ_jᵀΦ_i, C_ij = Φ_iᵀΦ_j)

then stores A and C twice (tile and mirror: both are symmetric, each pair computed once) and
B, E at both positions. Output per layer: ``[A | B | C | E]``, each p × p row-major, at
``gram offset`` inside the slab of its split (``split · total``); the caller sums the splits
in a fixed order (deterministic, no atomics).

``update_kernel`` — pass 2. Persistent grid; work item = (layer, block of ``BR`` rows). A
program owns whole row blocks: it first snapshots θ[rows, :] into its private scratch slab
(``BR × P_MAX`` of the accumulation type), then for every ``BN``-column block forms

    U  = βΦ − ηg
    Φ₊ = U + θ M_Φ
    θ₊ = θ + U + θ M_θ

reading θ only from the snapshot, so writing θ₊ in place can never feed another output.
Scratch = programs × BR × P_MAX elements, bounded by the caller.
"""
from __future__ import annotations

import triton
import triton.language as tl

META_FIELDS = 8
F_THETA, F_PHI, F_GRAD, F_N, F_P, F_GRAM, F_M, F_CHUNK = range(META_FIELDS)


@triton.jit
def _offsets(rk, ci, n, p, ROWS: tl.constexpr):
    """Element offsets of θ[rk, ci] (rk: rows along n, ci: columns along p)."""
    if ROWS:
        return ci[None, :] * n + rk[:, None]
    return rk[:, None] * p + ci[None, :]


@triton.jit
def _store_pair(base, acc, oi, oj, p, mi, mj, MIRROR: tl.constexpr):
    """Store acc (BP × BP, rows oi, cols oj) of a p × p row-major block; also its transpose."""
    tl.store(base + oi[:, None] * p + oj[None, :], acc, mask=mi[:, None] & mj[None, :])
    if MIRROR:
        tl.store(base + oj[None, :] * p + oi[:, None], acc, mask=mi[:, None] & mj[None, :])


@triton.jit
def gram_kernel(
    meta_ptr, work_ptr, out_ptr, split_stride,
    DTYPE: tl.constexpr, ACC: tl.constexpr, HAS_PHI: tl.constexpr, ROWS: tl.constexpr,
    BP: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr,
):
    w = tl.program_id(0)
    split = tl.program_id(1)
    layer = tl.load(work_ptr + 3 * w)
    ti = tl.load(work_ptr + 3 * w + 1)
    tj = tl.load(work_ptr + 3 * w + 2)
    row = meta_ptr + layer * 8
    theta = tl.load(row + 0).to(tl.pointer_type(DTYPE))
    grad = tl.load(row + 2).to(tl.pointer_type(DTYPE))
    n = tl.load(row + 3)
    p = tl.load(row + 4)
    out = out_ptr + split * split_stride + tl.load(row + 5)
    chunk = tl.load(row + 7)
    r0 = split * chunk
    r1 = tl.minimum(r0 + chunk, n)

    oi = ti * BP + tl.arange(0, BP)
    oj = tj * BP + tl.arange(0, BP)
    mi = oi < p
    mj = oj < p
    acc_a = tl.zeros((BP, BP), dtype=ACC)
    acc_eij = tl.zeros((BP, BP), dtype=ACC)
    acc_eji = tl.zeros((BP, BP), dtype=ACC)
    acc_bij = tl.zeros((BP, BP), dtype=ACC)
    acc_bji = tl.zeros((BP, BP), dtype=ACC)
    acc_c = tl.zeros((BP, BP), dtype=ACC)
    if HAS_PHI:
        phi = tl.load(row + 1).to(tl.pointer_type(ACC))
    for k0 in range(r0, r1, BK):
        rk = k0 + tl.arange(0, BK)
        mk = rk < r1
        off_i = _offsets(rk, oi, n, p, ROWS)
        off_j = _offsets(rk, oj, n, p, ROWS)
        m_i = mk[:, None] & mi[None, :]
        m_j = mk[:, None] & mj[None, :]
        th_i = tl.load(theta + off_i, mask=m_i, other=0.0).to(ACC)  # θ[k, i-block]
        th_j = tl.load(theta + off_j, mask=m_j, other=0.0).to(ACC)
        g_i = tl.load(grad + off_i, mask=m_i, other=0.0).to(ACC)
        g_j = tl.load(grad + off_j, mask=m_j, other=0.0).to(ACC)
        th_it = tl.trans(th_i)
        th_jt = tl.trans(th_j)
        acc_a += tl.dot(th_it, th_j, input_precision=PRECISION)  # A_ij += θ_iᵀθ_j
        acc_eij += tl.dot(th_it, g_j, input_precision=PRECISION)  # E_ij += θ_iᵀg_j
        acc_eji += tl.dot(th_jt, g_i, input_precision=PRECISION)  # E_ji += θ_jᵀg_i
        if HAS_PHI:
            ph_i = tl.load(phi + off_i, mask=m_i, other=0.0)
            ph_j = tl.load(phi + off_j, mask=m_j, other=0.0)
            acc_bij += tl.dot(th_it, ph_j, input_precision=PRECISION)  # B_ij += θ_iᵀΦ_j
            acc_bji += tl.dot(th_jt, ph_i, input_precision=PRECISION)  # B_ji += θ_jᵀΦ_i
            acc_c += tl.dot(tl.trans(ph_i), ph_j, input_precision=PRECISION)  # C_ij += Φ_iᵀΦ_j

    pp = p * p
    _store_pair(out, acc_a, oi, oj, p, mi, mj, True)  # A (symmetric: tile and mirror)
    _store_pair(out + 3 * pp, acc_eij, oi, oj, p, mi, mj, False)  # E_ij
    _store_pair(out + 3 * pp, acc_eji, oj, oi, p, mj, mi, False)  # E_ji
    if HAS_PHI:
        _store_pair(out + pp, acc_bij, oi, oj, p, mi, mj, False)  # B_ij
        _store_pair(out + pp, acc_bji, oj, oi, p, mj, mi, False)  # B_ji
        _store_pair(out + 2 * pp, acc_c, oi, oj, p, mi, mj, True)  # C (symmetric)


@triton.jit
def update_kernel(
    meta_ptr, hyper_ptr, work_ptr, n_items, m_ptr, scratch_ptr, P_MAX,
    DTYPE: tl.constexpr, ACC: tl.constexpr, HAS_PHI: tl.constexpr, ROWS: tl.constexpr,
    BR: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    slab = scratch_ptr + pid.to(tl.int64) * BR * P_MAX  # this program's BR × P_MAX snapshot
    rr = tl.arange(0, BR)
    for item in range(pid, n_items, tl.num_programs(0)):
        layer = tl.load(work_ptr + 2 * item)
        rb = tl.load(work_ptr + 2 * item + 1)
        row = meta_ptr + layer * 8
        theta = tl.load(row + 0).to(tl.pointer_type(DTYPE))
        grad = tl.load(row + 2).to(tl.pointer_type(DTYPE))
        n = tl.load(row + 3)
        p = tl.load(row + 4)
        mats = m_ptr + tl.load(row + 6)  # [M_θ | M_Φ], each p × p row-major
        lr = tl.load(hyper_ptr + 3 * layer)  # η (hyper rows: η, β, α)
        beta = tl.load(hyper_ptr + 3 * layer + 1)  # β
        rows = rb * BR + rr
        mr = rows < n
        if HAS_PHI:
            phi = tl.load(row + 1).to(tl.pointer_type(ACC))

        # snapshot θ[rows, :] (in the accumulation type) into the private slab
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
            acc_t = tl.zeros((BR, BN), dtype=ACC)
            acc_f = tl.zeros((BR, BN), dtype=ACC)
            for k0 in range(0, p, BK):
                ks = k0 + tl.arange(0, BK)
                mk = ks < p
                a = tl.load(slab + rr[:, None] * P_MAX + ks[None, :], mask=mr[:, None] & mk[None, :], other=0.0)
                mm = mk[:, None] & mc[None, :]
                m_t = tl.load(mats + ks[:, None] * p + cols[None, :], mask=mm, other=0.0)
                m_f = tl.load(mats + p * p + ks[:, None] * p + cols[None, :], mask=mm, other=0.0)
                acc_t += tl.dot(a, m_t, input_precision=PRECISION)  # θ M_θ
                acc_f += tl.dot(a, m_f, input_precision=PRECISION)  # θ M_Φ
            off = _offsets(rows, cols, n, p, ROWS)
            th = tl.load(slab + rr[:, None] * P_MAX + cols[None, :], mask=m, other=0.0)
            u = -lr * tl.load(grad + off, mask=m, other=0.0).to(ACC)  # U = −ηg …
            if HAS_PHI:
                u += beta * tl.load(phi + off, mask=m, other=0.0)  # … + βΦ
                tl.store(phi + off, u + acc_f, mask=m)  # Φ₊ = U + θ M_Φ
            tl.store(theta + off, (th + u + acc_t).to(DTYPE), mask=m)  # θ₊ = θ + U + θ M_θ
        tl.debug_barrier()  # every read of the slab is done before the next snapshot


# Tile sizes: a selectable configuration must compile for sm_80/sm_90 without spilling
# (tests/test_triton_aot.py checks every one of them).
GRAM_BLOCKS = dict(BP=32, BK=32)
UPDATE_BLOCKS = dict(BR=64, BN=64, BK=32)
