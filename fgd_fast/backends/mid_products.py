"""The middle's ``p × p`` products as one Triton launch each over every layer of a layout
(``kernels/products.py``), for the Triton backend.

:func:`.algebra.middle` forms its products through the layout (``_mm``, ``_mm_add``,
``_i_plus_d``); with ``Layout.products`` set (by :func:`.base.middle_of_runs`, which the Triton
backend hands :func:`engine`) each is this one launch instead of one batched product per
distinct p plus the buffer it fills and, for per-layer α, two more ops.
"""

from __future__ import annotations

import torch

from . import triton_launch
from .layout import Layout

__all__ = ["engine", "tiles"]


def tiles(lay: Layout, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The work table ``(layer, i, j)`` of a kernel over every layer's block in ``tile × tile``
    items, and the per-layer table ``[offset, p]`` (``kernels/meta.py``'s ``MM_*`` fields) that
    the middle's product kernels and the fused middle's prologue read."""
    return lay.tiles(tile, ("products",), lambda k, at, p, first, items: [at, p])


def engine(precision: str):
    """``products(lay, x, y, *, z=None, alpha=1.0, tx=False) -> Z + α·op(X)Y`` (a new block of
    ``lay``; ``op(X) = Xᵀ`` with ``tx``; α a number or per-layer values), its products at
    ``precision`` (``"ieee"``, or TF32 tensor cores for ``"tf32"``/``"tf32x3"``). float32 blocks
    only: Triton 3.6 (the GPU machine's) cannot compile a float64 dot, so float64 middles keep
    torch's products."""

    def products(lay: Layout, x, y, *, z=None, alpha=1.0, tx: bool = False) -> torch.Tensor:
        import triton.language as tl

        from ..kernels import products as kernels

        config = kernels.CONFIG[max(p for _, p in lay.groups) >= kernels.BIG_P]
        work, layers = tiles(lay, config["BM"])
        x, y = x.contiguous(), y.contiguous()
        z = z.contiguous() if z is not None else None
        out = lay.empty(x.dtype)
        items = work.shape[0]
        if x.dtype != torch.float32:
            raise TypeError(f"the middle's product kernel takes float32 blocks, got {x.dtype}")
        triton_launch.launch(
            kernels.mid_mm_kernel,
            (triton_launch.persistent(items, lay.device),),
            work,
            layers,
            x,
            y,
            z if z is not None else out,
            lay.per_layer(alpha),
            out,
            items,
            ACC=tl.float32,
            TX=tx,
            HAS_Z=z is not None,
            PRECISION="ieee" if precision == "ieee" else "tf32",
            **config,
        )
        return out

    return products
