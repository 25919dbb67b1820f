"""The middle's ``p × p`` products over every layer of a layout in one launch (``mid_mm_kernel``).

The middle (``fgd_fast/backends/algebra.py``) forms eight products per step, each per layer:
``Z + α·XY`` or ``Z + α·XᵀY`` with α per layer (``N·X = X − D·X`` and ``A·X = X + D·X`` are of
this form, so only the small correction ``D·X`` is a product). torch runs one batched product
per distinct p; this kernel runs every layer of a layout, whatever its p (the blocks lie one
after the other in flat buffers), in one launch. Work item = (layer, tile i, tile j), ``BM × BM``
entries of the result, a K loop of ``BK`` steps over the layer's p.

``PRECISION``: the products' (``"ieee"``, or ``"tf32"`` where the middle runs on tensor cores:
its ``X ∓ D·X`` forms keep fp32 accuracy, as with torch's TF32 products).

``mid_jobs_kernel`` — the Triton backend's fused middle (``fgd_fast/backends/fused_middle.py``):
several independent products in one launch, each a *job* (a row of ``meta.MJ_*`` fields) over
blocks of one buffer (slot k of every layer at ``k·numel``): ``out = Z + γ·ZTᵀ + α·op(X)Y``
and optionally ``out2 = out + ADD2``, α and γ one of 1, −1 or the layer's −α. Work item = (job,
layer, tile i, tile j).
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import meta

BIG_P = 256  # a layout whose largest p is at least this takes the larger tiles (fewer, fuller)
CONFIG = {False: dict(BM=32, BK=32, num_warps=4), True: dict(BM=64, BK=32, num_warps=8)}  # by p ≥ BIG_P


@triton.jit
def _block(layer_ptr, layer):
    """(offset, p) of a layer's ``p × p`` block in the layout (its row of ``meta.MM_*`` fields)."""
    row = layer_ptr + layer * meta.MM_FIELDS
    return tl.load(row + meta.MM_OFF), tl.load(row + meta.MM_P)


@triton.jit
def _product(x, y, ri, cj, p, TX: tl.constexpr, PRECISION: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """``op(X)Y`` of the ``BM × BM`` tile at rows ``ri``, columns ``cj`` of ``p × p`` blocks
    (row-major at ``x``, ``y``): a K loop of ``BK`` steps, fp32 accumulation."""
    acc = tl.zeros((BM, BM), dtype=tl.float32)
    for k0 in range(0, p, BK):
        ks = k0 + tl.arange(0, BK)
        mx = (ri < p)[:, None] & (ks < p)[None, :]
        if TX:  # Xᵀ[i, k] = X[k, i]
            a = tl.load(x + ks[None, :] * p + ri[:, None], mask=mx, other=0.0)
        else:
            a = tl.load(x + ri[:, None] * p + ks[None, :], mask=mx, other=0.0)
        b = tl.load(y + ks[:, None] * p + cj[None, :], mask=(ks < p)[:, None] & (cj < p)[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)  # op(X)Y
    return acc


@triton.jit
def mid_mm_kernel(
    work_ptr,
    layer_ptr,
    x_ptr,
    y_ptr,
    z_ptr,
    alpha_ptr,
    out_ptr,
    n_items,
    ACC: tl.constexpr,
    TX: tl.constexpr,
    HAS_Z: tl.constexpr,
    PRECISION: tl.constexpr,
    BM: tl.constexpr,
    BK: tl.constexpr,
):
    for item in range(tl.program_id(0), n_items, tl.num_programs(0)):
        w = work_ptr + item * 3
        layer = tl.load(w)
        off, p = _block(layer_ptr, layer)
        ri = tl.load(w + 1) * BM + tl.arange(0, BM)
        cj = tl.load(w + 2) * BM + tl.arange(0, BM)
        acc = _product(x_ptr + off, y_ptr + off, ri, cj, p, TX, PRECISION, BM, BK).to(ACC)
        alpha = tl.load(alpha_ptr + layer).to(ACC)
        at = off + ri[:, None] * p + cj[None, :]
        m = (ri < p)[:, None] & (cj < p)[None, :]
        res = alpha * acc
        if HAS_Z:
            res = tl.load(z_ptr + at, mask=m, other=0.0) + res  # Z + α·op(X)Y
        tl.store(out_ptr + at, res, mask=m)


@triton.jit
def _coef(code, alpha):
    """A product's coefficient from its code (``meta.COEF_*``): 1, −1 or −α."""
    return tl.where(code == meta.COEF_ONE, 1.0, tl.where(code == meta.COEF_MINUS_ONE, -1.0, -alpha))


@triton.jit
def mid_jobs_kernel(
    work_ptr,
    layer_ptr,
    job_ptr,
    hyper_ptr,
    buf_ptr,
    numel,
    n_items,
    PRECISION: tl.constexpr,
    BM: tl.constexpr,
    BK: tl.constexpr,
):
    for item in range(tl.program_id(0), n_items, tl.num_programs(0)):
        w = work_ptr + item * meta.MJ_WORK
        job = job_ptr + tl.load(w) * meta.MJ_FIELDS
        layer = tl.load(w + 1)
        off, p = _block(layer_ptr, layer)
        ri = tl.load(w + 2) * BM + tl.arange(0, BM)
        cj = tl.load(w + 3) * BM + tl.arange(0, BM)
        block = buf_ptr + off  # the layer's block in slot 0; slot k at + k·numel
        x = block + tl.load(job + meta.MJ_X) * numel
        y = block + tl.load(job + meta.MJ_Y) * numel
        if tl.load(job + meta.MJ_TX) != 0:
            acc = _product(x, y, ri, cj, p, True, PRECISION, BM, BK)  # XᵀY
        else:
            acc = _product(x, y, ri, cj, p, False, PRECISION, BM, BK)  # XY
        alpha = tl.load(hyper_ptr + layer * meta.HYPER_FIELDS + meta.H_ALPHA)
        res = _coef(tl.load(job + meta.MJ_ALPHA), alpha) * acc
        at = ri[:, None] * p + cj[None, :]
        m = (ri < p)[:, None] & (cj < p)[None, :]
        z = tl.load(job + meta.MJ_Z)
        if z >= 0:
            res += tl.load(block + z * numel + at, mask=m, other=0.0)  # Z + α·op(X)Y
        zt = tl.load(job + meta.MJ_ZT)
        if zt >= 0:  # + γ·ZTᵀ
            gamma = _coef(tl.load(job + meta.MJ_GAMMA), alpha)
            res += gamma * tl.load(block + zt * numel + cj[None, :] * p + ri[:, None], mask=m, other=0.0)
        tl.store(block + tl.load(job + meta.MJ_OUT) * numel + at, res, mask=m)
        out2 = tl.load(job + meta.MJ_OUT2)
        if out2 >= 0:  # out2 = out + ADD2
            add = tl.load(block + tl.load(job + meta.MJ_ADD2) * numel + at, mask=m, other=0.0)
            tl.store(block + out2 * numel + at, res + add, mask=m)
