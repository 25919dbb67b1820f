"""The Gram pass's blocks gathered into the middle's layout in one Triton launch
(``kernels/blocks.py``), for the Triton backend's launch classes.

Without it the middle takes each run's blocks as views and copies them into the layout's flat
buffers, after torch has summed the splits of n and (tensor cores) mirrored the symmetric
blocks' upper tiles and added ``L + Lᵀ`` to A: ~40 small ops per step on a three-p model, one
launch here.
"""

from __future__ import annotations

import torch

from . import triton_launch
from .layout import Layout

__all__ = ["gather"]


def gather(
    lay: Layout,
    sources: tuple[int, ...],
    slabs: torch.Tensor,
    splits: int,
    *,
    has_phi: bool,
    predict: bool,
    mirror: bool,
    lo: bool = False,
    upper: int = 1,
    out: torch.Tensor | None = None,
) -> list[torch.Tensor | None]:
    """``[A, E, B, C, G, H]`` of the layers of ``lay`` (``None`` where not formed: B, C, H
    without Φ, G and H without a prediction), each a block of ``lay`` in its own buffer.
    ``slabs``: the Gram kernel's output, ``splits`` slabs of equal size one after the other;
    ``sources``: each layer's element offset in a slab. ``mirror``: symmetric blocks hold only
    their upper tiles of ``upper`` rows; ``lo``: A = hiᵀhi + L + Lᵀ (the tensor cores' split).
    ``out``: the buffer to write (block k at ``k·numel``; at least six blocks), else a new one."""
    import triton.language as tl

    from ..kernels import blocks

    # per layer: the block's offset in the layout, p, and its blocks' offset in a slab
    work, layers = lay.tiles(blocks.TILE, ("gather", sources), lambda k, at, p, first, items: [at, p, sources[k]])
    numel = lay.numel
    dst = out if out is not None else torch.empty(6 * numel, dtype=slabs.dtype, device=slabs.device)
    items = work.shape[0]
    triton_launch.launch(
        blocks.gram_gather_kernel,
        (triton_launch.persistent(items, slabs.device),),
        work,
        layers,
        slabs,
        slabs.numel() // splits,
        splits,
        dst,
        numel,
        items,
        ACC={torch.float32: tl.float32, torch.float64: tl.float64}[slabs.dtype],
        HAS_PHI=has_phi,
        PREDICT=predict,
        MIRROR=mirror,
        LO=lo,
        UPPER=upper,
        **blocks.CONFIG[str(slabs.dtype).removeprefix("torch.")],
    )
    n, p = lay.groups[0]
    shaped = (lambda x: x.view(n, p, p)) if lay.single else (lambda x: x)  # noqa: E731
    out = [shaped(dst[k * numel : (k + 1) * numel]) for k in range(6)]
    present = [True, True, has_phi, has_phi, predict, predict and has_phi]  # A, E, B, C, G, H
    return [x if keep else None for x, keep in zip(out, present)]
