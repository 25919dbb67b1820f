"""The middle's ``p × p`` products over every layer of a layout in one launch (``mid_mm_kernel``).

The middle (``fgd_fast/backends/algebra.py``) forms eight products per step, each per layer:
``Z + α·XY`` or ``Z + α·XᵀY`` with α per layer (``N·X = X − D·X`` and ``A·X = X + D·X`` are of
this form, so only the small correction ``D·X`` is a product). torch runs one batched product
per distinct p; this kernel runs every layer of a layout, whatever its p (the blocks lie one
after the other in flat buffers), in one launch. Work item = (layer, tile i, tile j), ``BM × BM``
entries of the result, a K loop of ``BK`` steps over the layer's p.

``PRECISION``: the products' (``"ieee"``, or ``"tf32"`` where the middle runs on tensor cores:
its ``X ∓ D·X`` forms keep fp32 accuracy, as with torch's TF32 products).
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import meta

BIG_P = 256  # a layout whose largest p is at least this takes the larger tiles (fewer, fuller)
CONFIG = {False: dict(BM=32, BK=32, num_warps=4), True: dict(BM=64, BK=32, num_warps=8)}  # by p ≥ BIG_P


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
        row = layer_ptr + layer * meta.MM_FIELDS
        off = tl.load(row + meta.MM_OFF)
        p = tl.load(row + meta.MM_P)
        ri = tl.load(w + 1) * BM + tl.arange(0, BM)
        cj = tl.load(w + 2) * BM + tl.arange(0, BM)
        x = x_ptr + off
        y = y_ptr + off
        acc = tl.zeros((BM, BM), dtype=ACC)
        for k0 in range(0, p, BK):
            ks = k0 + tl.arange(0, BK)
            mx = (ri < p)[:, None] & (ks < p)[None, :]
            if TX:  # Xᵀ[i, k] = X[k, i]
                a = tl.load(x + ks[None, :] * p + ri[:, None], mask=mx, other=0.0)
            else:
                a = tl.load(x + ri[:, None] * p + ks[None, :], mask=mx, other=0.0)
            b = tl.load(y + ks[:, None] * p + cj[None, :], mask=(ks < p)[:, None] & (cj < p)[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)  # op(X)Y
        alpha = tl.load(alpha_ptr + layer).to(ACC)
        at = off + ri[:, None] * p + cj[None, :]
        m = (ri < p)[:, None] & (cj < p)[None, :]
        res = alpha * acc
        if HAS_Z:
            res = tl.load(z_ptr + at, mask=m, other=0.0) + res  # Z + α·op(X)Y
        tl.store(out_ptr + at, res, mask=m)
