"""The Triton backend's work tables: what a launch class's kernels iterate over, from the layer
shapes alone (so cached per shape list; :mod:`.triton` keeps them).

* :func:`shapes` (CUDA-core class): Gram tiles — the upper triangle for the symmetric blocks A
  and C, every tile for B and E — the update's row blocks, each layer's offsets in the Gram
  slabs and the middle's buffers, and the split of n (the partial sums stay within
  :data:`SCRATCH_BYTES`).
* :func:`tc_shapes` (tensor-core class): the split pass's items, the Gram pass's tiles of every
  product hiᵀ[hi | lo | Φ | g] and ΦᵀΦ (and the guard's gᵀg, Φᵀg), sorted longest first for the
  persistent grid, and the update's tiles, largest p first.
* :func:`aligned`: whether a class may use the tensor-core kernels' 16-byte loads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fgd_fast.kernels import meta
from fgd_fast.kernels import tc_step as TC

from .base import device_table

__all__ = ["SCRATCH_BYTES", "Shapes", "TensorCoreShapes", "aligned", "cdiv", "shapes", "tc_shapes"]

#: the bound on the Gram pass's split partials (and the CUDA-core update's snapshot)
SCRATCH_BYTES = 64 << 20


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Shapes:
    """Everything about a CUDA-core launch class that depends only on the layer shapes."""

    gram_sym: torch.Tensor  # int32 (W, 3): layer, tile i, tile j, i <= j (A and C)
    gram_full: torch.Tensor  # int32 (W, 3): every (layer, i, j) (B and E)
    update_work: torch.Tensor  # int32 (I, 2): layer, row block
    gram_off: list[int]  # element offset of [A|E|B|C] per layer
    m_off: list[int]  # element offset of the layer's M_θ and M_Φ in the middle's (layout) buffers
    chunk: list[int]  # rows per split per layer
    splits: int
    gram_total: int


def shapes(np_list, device, wanted, bp, bk, br, acc_name, forced_splits: int | None = None) -> Shapes:
    """The CUDA-core class's work tables and offsets (``forced_splits``: the Gram pass's n-splits, else
    enough to give ``wanted`` programs work, at most 64 and within :data:`SCRATCH_BYTES`)."""
    acc_bytes = 8 if acc_name == "float64" else 4
    gram_sym, gram_full, update_work, gram_off, m_off = [], [], [], [], []
    g_total = m_total = 0
    for layer, (n, p) in enumerate(np_list):
        nt = cdiv(p, bp)
        gram_sym += [(layer, i, j) for i in range(nt) for j in range(i, nt)]
        gram_full += [(layer, i, j) for i in range(nt) for j in range(nt)]
        update_work += [(layer, r) for r in range(cdiv(n, br))]
        gram_off.append(g_total)
        m_off.append(m_total)
        g_total += meta.GRAM_SLOTS * p * p
        m_total += p * p  # M_θ and M_Φ: in the middle's two buffers, layout order
    splits = forced_splits or max(1, min(64, cdiv(wanted, len(gram_sym))))
    splits = max(1, min(splits, SCRATCH_BYTES // max(1, g_total * acc_bytes)))
    chunk = [cdiv(cdiv(n, splits), bk) * bk for n, _ in np_list]
    as_table = lambda rows, width: device_table(rows, torch.int32, device).reshape(-1, width)  # noqa: E731
    return Shapes(
        as_table(gram_sym, 3),
        as_table(gram_full, 3),
        as_table(update_work, 2),
        gram_off,
        m_off,
        chunk,
        splits,
        g_total,
    )


@dataclass
class TensorCoreShapes:
    """Everything about a tensor-core launch class that depends only on the layer shapes."""

    split_work: torch.Tensor  # int32 (S, SPLIT_WORK)
    gram_work: torch.Tensor  # int32 (W, GRAM_WORK), longest first
    update_work: torch.Tensor  # int32 (I, UPDATE_WORK), largest p first
    ld: list[int]  # padded rows of hi/lo per layer
    split_off: list[int]  # element offset of hi (and lo) per layer
    split_total: int
    gram_off: list[int]
    m_off: list[int]
    chunk: list[int]
    splits: int
    gram_total: int


def tc_shapes(
    np_list, device, wanted, has_phi, lo, cfg, ucfg, scfg, predict, forced_splits: int | None = None
) -> TensorCoreShapes:
    """The tensor-core class's work tables (split, Gram tiles longest first, update tiles largest
    p first) and offsets; ``forced_splits`` as in :func:`shapes`."""
    bm, bk = cfg["BM"], cfg["BK"]
    # the tiles below are square (i and j both in units of BM; the kernel steps j by BN and the
    # blocks' gather mirrors the upper tiles by BM): a BM ≠ BN configuration would leave tiles unwritten
    if cfg["BN"] != bm:
        raise ValueError(f"the tensor-core Gram kernel needs square tiles, got BM={bm}, BN={cfg['BN']}")
    ld = [cdiv(n, TC.LD_ALIGN) * TC.LD_ALIGN for n, _ in np_list]
    split_off, gram_off, m_off, tiles = [], [], [], []
    s_total = g_total = m_total = 0
    for layer, (_, p) in enumerate(np_list):
        split_off.append(s_total)
        gram_off.append(g_total)
        m_off.append(m_total)
        s_total += p * ld[layer]
        g_total += meta.TC_GRAM_SLOTS * p * p
        m_total += p * p  # M_θ and M_Φ: in the middle's two buffers, layout order
        nt = cdiv(p, bm)
        upper = [(i, j) for i in range(nt) for j in range(i, nt)]
        full = [(i, j) for i in range(nt) for j in range(nt)]
        products = [(meta.F_HI, meta.F_HI, meta.SLOT_A, upper), (meta.F_HI, meta.F_GRAD, meta.SLOT_E, full)]
        if lo:
            products.append((meta.F_HI, meta.F_LO, meta.SLOT_L, full))  # L = hiᵀlo
        if has_phi:
            products += [(meta.F_HI, meta.F_PHI, meta.SLOT_B, full), (meta.F_PHI, meta.F_PHI, meta.SLOT_C, upper)]
        if predict:  # the guard's G = gᵀg and H = Φᵀg (TF32: relative error ~2⁻¹¹ in UᵀU)
            products.append((meta.F_GRAD, meta.F_GRAD, meta.SLOT_G, upper))
            if has_phi:
                products.append((meta.F_GRAD, meta.F_PHI, meta.SLOT_H, full))  # gᵀΦ = Hᵀ: only H + Hᵀ enters
        tiles += [(layer, lf, rf, slot, i, j) for lf, rf, slot, ij in products for i, j in ij]
    # split n when the tiles cannot fill the GPU; the partials stay under the bound
    splits = forced_splits or max(1, min(64, cdiv(wanted, len(tiles)), min(cdiv(n, 4 * bk) for n, _ in np_list)))
    splits = max(1, min(splits, SCRATCH_BYTES // max(1, 4 * g_total)))
    chunk = [cdiv(cdiv(n, splits), bk) * bk for n, _ in np_list]
    gram_work = [(*t, s) for t in tiles for s in range(splits)]  # every split writes its slab (zeros if empty)
    gram_work.sort(key=lambda w: -min(chunk[w[0]], np_list[w[0]][0] - w[6] * chunk[w[0]]))  # longest first (LPT)
    bs, bl = scfg["BS"], scfg["BL"]
    split_work = [
        (layer, i, k)
        for layer, (n, p) in enumerate(np_list)
        for i in range(cdiv(p, bs))
        for k in range(ld[layer] // bl)
    ]
    br, bn = ucfg["BR"], ucfg["BN"]
    update_work = [
        (layer, r, c) for layer, (n, p) in enumerate(np_list) for r in range(cdiv(n, br)) for c in range(cdiv(p, bn))
    ]
    update_work.sort(key=lambda w: -np_list[w[0]][1])  # the largest p (the longest K) first
    as_table = lambda rows, width: device_table(rows, torch.int32, device).reshape(-1, width)  # noqa: E731
    return TensorCoreShapes(
        as_table(split_work, meta.SPLIT_WORK),
        as_table(gram_work, meta.GRAM_WORK),
        as_table(update_work, meta.UPDATE_WORK),
        ld,
        split_off,
        s_total,
        gram_off,
        m_off,
        chunk,
        splits,
        g_total,
    )


def aligned(tensors, np_list) -> bool:
    """Every address 16-byte aligned and both n and p multiples of 4 floats: what the tensor-core
    kernels' ``ALIGNED`` hints assert (``tl.multiple_of(n, 4)``, ``(p, 4)``; p also sets the
    offsets of the p × p blocks and the M loads' rows). A layer with only its contiguous
    dimension a multiple of 4 is not aligned: a hint that does not hold makes a wrong 16-byte
    access on a GPU."""
    return all(t.data_ptr() % 16 == 0 for t in tensors) and all(n % 4 == 0 and p % 4 == 0 for n, p in np_list)
