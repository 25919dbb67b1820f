"""The Gram pass's blocks handed to the middle in one launch (``gram_gather_kernel``).

The Gram kernels write, per layer, ``[A | E | B | C | G | H (| L)]`` blocks into one slab per
split of n (tensor cores: only the upper tiles of the symmetric hiᵀhi, ΦᵀΦ and gᵀg, and the
split's ``L = hiᵀlo``). The middle wants each block of every layer of a chain in one flat
buffer (``fgd_fast/backends/layout.py``). Work item = (layer, tile i, tile j), ``BT × BT``
entries: for each block the kernel sums the splits in a fixed order (deterministic), reads a
symmetric block's lower tiles as the transposes of its upper ones (``MIRROR``: tiles of
``UPPER`` rows, the Gram kernel's), adds ``L + Lᵀ`` to A (``LO``: 3×TF32) and writes the entry
into the block's buffer: ``dst[slot·numel + offset + i·p + j]``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import meta

TILE = 32  # BT × BT entries per work item
# per accumulation type: float32 with 4 warps spilled 8 bytes (Triton 3.6, sm_80 and sm_90), float64
# with 8 warps (both Triton versions, sm_90)
CONFIG = {"float32": dict(BT=TILE, num_warps=8), "float64": dict(BT=TILE, num_warps=4)}


@triton.jit
def _summed(ptr, at, m, split_stride, n_splits, ACC: tl.constexpr):
    """Σ over the splits of the entries at ``ptr + at`` (in split order), in ``ACC``."""
    acc = tl.load(ptr + at, mask=m, other=0.0).to(ACC)
    for s in range(1, n_splits):
        acc += tl.load(ptr + s * split_stride + at, mask=m, other=0.0)
    return acc


@triton.jit
def gram_gather_kernel(
    work_ptr,
    layer_ptr,
    src_ptr,
    split_stride,
    n_splits,
    dst_ptr,
    numel,
    n_items,
    ACC: tl.constexpr,
    HAS_PHI: tl.constexpr,
    PREDICT: tl.constexpr,
    MIRROR: tl.constexpr,
    LO: tl.constexpr,
    UPPER: tl.constexpr,
    BT: tl.constexpr,
):
    numel = tl.cast(numel, tl.int64)  # slot·Σp² in 64 bits: past 2³¹ from Σp² ≈ 2.4e8 (an i32 argument)
    for item in range(tl.program_id(0), n_items, tl.num_programs(0)):
        w = work_ptr + item * 3
        row = layer_ptr + tl.load(w) * meta.GG_FIELDS
        off = tl.load(row + meta.GG_OFF)
        p = tl.load(row + meta.GG_P)
        src = src_ptr + tl.load(row + meta.GG_SRC)
        ri = tl.load(w + 1) * BT + tl.arange(0, BT)
        cj = tl.load(w + 2) * BT + tl.arange(0, BT)
        m = (ri < p)[:, None] & (cj < p)[None, :]
        straight = ri[:, None] * p + cj[None, :]  # X[i, j]
        swapped = cj[None, :] * p + ri[:, None]  # X[j, i]
        if MIRROR:  # symmetric blocks: the upper tiles as stored, the lower ones as their transposes
            sym = tl.where((ri // UPPER)[:, None] <= (cj // UPPER)[None, :], straight, swapped)
        else:
            sym = straight
        pp = p * p
        out = dst_ptr + off + straight
        a = _summed(src + meta.SLOT_A * pp, sym, m, split_stride, n_splits, ACC)  # A = θᵀθ (hiᵀhi)
        if LO:
            low = src + meta.SLOT_L * pp
            lt = _summed(low, swapped, m, split_stride, n_splits, ACC)  # Lᵀ
            a += _summed(low, straight, m, split_stride, n_splits, ACC) + lt  # + L + Lᵀ
        tl.store(out + meta.SLOT_A * numel, a, mask=m)  # A (+ L + Lᵀ)
        e = _summed(src + meta.SLOT_E * pp, straight, m, split_stride, n_splits, ACC)
        tl.store(out + meta.SLOT_E * numel, e, mask=m)  # E = θᵀg
        if HAS_PHI:
            b = _summed(src + meta.SLOT_B * pp, straight, m, split_stride, n_splits, ACC)
            tl.store(out + meta.SLOT_B * numel, b, mask=m)  # B = θᵀΦ
            c = _summed(src + meta.SLOT_C * pp, sym, m, split_stride, n_splits, ACC)
            tl.store(out + meta.SLOT_C * numel, c, mask=m)  # C = ΦᵀΦ
        if PREDICT:
            g = _summed(src + meta.SLOT_G * pp, sym, m, split_stride, n_splits, ACC)
            tl.store(out + meta.SLOT_G * numel, g, mask=m)  # G = gᵀg
            if HAS_PHI:
                h = _summed(src + meta.SLOT_H * pp, straight, m, split_stride, n_splits, ACC)
                tl.store(out + meta.SLOT_H * numel, h, mask=m)  # H (gᵀΦ: only H + Hᵀ enters)
