"""The step guard's blend as three Triton launches (``kernels/guard.py``) for the Triton backend.

:func:`.algebra.middle` hands its blocks to :func:`blend` where the Triton backend asked for it
(``middle(blend_kernels=...)``): instead of ~90 small torch ops (the pull-back polynomial, X₁ and X₂,
six inner products per layer, the weight rule, the masked blend of three matrices), one launch
sums every layer's distances per tile, one applies the rule per layer, one writes the blended
matrices in place. The rule is :func:`.algebra.choose_weight`'s, with one difference for the
better: every weight's distance is summed directly (not a quartic from inner products, then
re-checked), so the weight chosen is the largest whose distance is within the target.
"""

from __future__ import annotations

import torch

from .layout import Layout

__all__ = ["blend"]


def _kernels():
    import triton.language as tl

    from ..kernels import guard, meta

    return guard, meta, tl


def _weights(lay: Layout) -> torch.Tensor:
    from .algebra import WEIGHTS

    return lay.cached(("guard-weights",), lambda: torch.tensor(WEIGHTS[:-1], dtype=torch.float64).to(lay.device))


def blend(
    lay: Layout,
    *,
    d,
    d2,
    d3,
    z,
    v,
    w=None,
    gg=None,
    c=None,
    h=None,
    m_phi,
    m_theta,
    delta,
    feedback,
    movable,
    scale,
    stored,
    alpha,
    target,
    lr,
    beta,
):
    """The guard's step of the largest weight that fits, per layer, written in place into
    ``m_phi``, ``m_theta`` and ``feedback``; returns ``(scale, dist, fits, codes)`` per layer:
    the update's total scale ``ts`` and the step's distance (float64), whether θ₊ fits ``stored``
    (:func:`.algebra.storable`) and what the guard did (int8, :func:`.algebra.guard_codes`).
    ``scale``: the trust scale s per layer (float64). Blocks in ``lay`` (contiguous): ``d = A −
    I``, ``d2 = D²``, ``d3 = D³``, ``z = K₀Y``, ``v = Δᵀ(Y + T)``, and ``w = s²UᵀU`` or its parts
    (``gg = s²G``, with Φ ``c = s²C`` and ``h = s²H``). ``alpha``, ``target``, ``lr``, ``beta``:
    floats or per-layer values; ``movable``: ``(L,)`` bool."""
    from . import triton as backend

    guard, meta, tl = _kernels()
    count, device = lay.count, lay.device
    # the Gram blocks are read where they are when contiguous (views of one slot: a copy otherwise)
    w, gg, c, h = (x.contiguous() if x is not None else None for x in (w, gg, c, h))
    if not all(x.is_contiguous() for x in (d, d2, d3, z, v, m_phi, m_theta, delta, feedback)):
        raise RuntimeError("the guard's blend kernels write the middle's own (contiguous) blocks")
    # per layer: the block's offset, p, its first work item and how many
    work, layers = lay.tiles(guard.TILE, ("guard",), lambda k, at, p, first, items: [at, p, first, items])
    coef = torch.stack([lay.per_layer(x) for x in (alpha, target, lr, beta)], 1)
    weights = _weights(lay)
    if w is not None:
        mode, w_block = meta.GB_W_GIVEN, w
    else:
        mode, w_block = (meta.GB_W_CHG if c is not None else meta.GB_W_G), gg
    acc = {torch.float32: tl.float32, torch.float64: tl.float64}[d.dtype]  # the blocks' (compute) dtype
    items = work.shape[0]
    programs = backend._persistent(items, device)
    part = torch.empty((items, meta.GB_PART), dtype=torch.float64, device=device)
    backend._launch(
        guard.guard_sums_kernel,
        (programs,),
        work,
        layers,
        coef,
        weights,
        d,
        d2,
        d3,
        z,
        v,
        w_block,
        c if c is not None else w_block,
        h if h is not None else w_block,
        m_phi,
        part,
        items,
        ACC=acc,
        W_MODE=mode,
        BT=guard.TILE,
    )
    result = torch.empty((count, meta.GB_RESULT_FIELDS), dtype=torch.float64, device=device)
    backend._launch(
        guard.guard_choose_kernel,
        (backend._persistent(count, device),),
        layers,
        coef,
        weights,
        movable,
        scale,
        part,
        result,
        count,
        _top(stored),
    )
    backend._launch(
        guard.guard_blend_kernel,
        (programs,),
        work,
        layers,
        coef,
        result,
        d,
        m_phi,
        m_theta,
        delta,
        feedback,
        items,
        ACC=acc,
        BT=guard.TILE,
    )
    scale, dist, fits, codes = (result[:, k] for k in (meta.GB_R_SCALE, meta.GB_R_DIST, meta.GB_R_FITS, meta.GB_R_CODE))
    return scale, dist, fits != 0, codes.to(torch.int8)


def _top(stored: torch.dtype | None) -> float:
    """The largest value ``stored`` holds (inf where a finite θ₊ always fits: float32, float64)."""
    if stored is None or stored in (torch.float32, torch.float64):
        return float("inf")
    return float(torch.finfo(stored).max)
