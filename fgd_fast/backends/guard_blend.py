"""The step guard's blend as three Triton launches (``kernels/guard.py``) for the Triton backend.

:func:`.algebra.middle` hands its blocks to :func:`blend` where the Triton backend asked for it
(``middle(blend_kernels=...)``): instead of ~90 small torch ops (the pull-back polynomial, X₁ and X₂,
six inner products per layer, the weight rule, the masked blend of three matrices), one launch
sums every layer's distances per tile, one applies the rule per layer, one writes the blended
matrices in place. The rule is :func:`.guard_rule.choose_weight`'s, with one difference for the
better: every weight's distance is summed directly (not a quartic from inner products, then
re-checked), so the weight chosen is the largest whose distance is within the target.
"""

from __future__ import annotations

import torch

from . import triton_launch
from .layout import Layout

__all__ = ["blend", "launches", "tiles"]


def _kernels():
    import triton.language as tl

    from ..kernels import guard, meta

    return guard, meta, tl


def tiles(lay: Layout) -> tuple[torch.Tensor, torch.Tensor]:
    """The guard kernels' work table ``(layer, i, j)`` and per-layer table ``[offset, p, first
    item, items]`` (``kernels/meta.py``'s ``GB_L_*`` fields) of a layout (built once)."""
    guard, _, _ = _kernels()
    return lay.tiles(guard.TILE, ("guard",), lambda k, at, p, first, items: [at, p, first, items])


def _weights(lay: Layout) -> torch.Tensor:
    from .guard_rule import WEIGHTS

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
    (:func:`.guard_rule.storable`) and what the guard did (int8, :func:`.guard_rule.guard_codes`).
    ``scale``: the trust scale s per layer (float64). Blocks in ``lay`` (contiguous): ``d = A −
    I``, ``d2 = D²``, ``d3 = D³``, ``z = K₀Y``, ``v = Δᵀ(Y + T)``, and ``w = s²UᵀU`` or its parts
    (``gg = s²G``, with Φ ``c = s²C`` and ``h = s²H``). ``alpha``, ``target``, ``lr``, ``beta``:
    floats or per-layer values; ``movable``: ``(L,)`` bool."""
    _, meta, _ = _kernels()
    # the Gram blocks are read where they are when contiguous (views of one slot: a copy otherwise)
    w, gg, c, h = (x.contiguous() if x is not None else None for x in (w, gg, c, h))
    if not all(x.is_contiguous() for x in (d, d2, d3, z, v, m_phi, m_theta, delta, feedback)):
        raise RuntimeError("the guard's blend kernels write the middle's own (contiguous) blocks")
    coef = torch.stack([lay.per_layer(x) for x in (alpha, target, lr, beta)], 1)
    if w is not None:
        mode, w_block = meta.GB_W_GIVEN, w
    else:
        mode, w_block = (meta.GB_W_CHG if c is not None else meta.GB_W_G), gg
    result = launches(
        lay,
        coef,
        mode,
        dict(d=d, d2=d2, d3=d3, z=z, v=v, w=w_block, c=c, h=h, m_phi=m_phi, m_theta=m_theta, delta=delta),
        feedback=feedback,
        movable=movable,
        scale=scale,
        stored=stored,
    )
    scale, dist, fits, codes = (result[:, k] for k in (meta.GB_R_SCALE, meta.GB_R_DIST, meta.GB_R_FITS, meta.GB_R_CODE))
    return scale, dist, fits != 0, codes.to(torch.int8)


def launches(
    lay: Layout,
    coef: torch.Tensor,
    w_mode: int,
    blocks: dict,
    *,
    feedback=None,
    movable,
    scale,
    stored,
    hyper=None,
    hyper_out=None,
    part=None,
    result=None,
    guard: bool = True,
    write_feedback: bool = False,
) -> torch.Tensor:
    """The three launches of the guard (sums, rule, blend) over the blocks of ``lay`` in
    ``blocks`` (``d, d2, d3, z, v, w, c, h, m_phi, m_theta, delta``: contiguous; ``c``, ``h``
    ``None`` unless ``w_mode`` needs them); ``coef``: ``(L, 4)`` float64 ``[α, target, η, β]``.
    Without ``feedback`` the blend writes M_Φ and M_θ of every layer (the fused middle's; Δ is
    then M_Φ, the official update's, and ``delta`` may be left out: the kernel does not read it);
    ``hyper``/``hyper_out``: the rule also writes the update's table ``[tsη, tsβ, α]``.
    ``part``/``result``: the partial sums' and the result's buffers (persistent), else new.
    ``guard=False``: t = 1 for every layer (the full step's distance predicted, nothing blended).
    ``write_feedback`` (without ``feedback``): ``F = M_θ − M_Φ`` in M_θ's place.
    Returns the ``(L, meta.GB_RESULT_FIELDS)`` float64 result table."""
    kernels, meta, tl = _kernels()
    count, device, d = lay.count, lay.device, blocks["d"]
    # per layer: the block's offset, p, its first work item and how many
    work, layers = tiles(lay)
    weights = _weights(lay)
    acc = {torch.float32: tl.float32, torch.float64: tl.float64}[d.dtype]  # the blocks' (compute) dtype
    items = work.shape[0]
    programs = triton_launch.persistent(items, device)
    if part is None:
        part = torch.empty((items, meta.GB_PART), dtype=torch.float64, device=device)
    w_block = blocks["w"]
    triton_launch.launch(
        kernels.guard_sums_kernel,
        (programs,),
        work,
        layers,
        coef,
        weights,
        d,
        blocks["d2"],
        blocks["d3"],
        blocks["z"],
        blocks["v"],
        w_block,
        blocks.get("c") if blocks.get("c") is not None else w_block,
        blocks.get("h") if blocks.get("h") is not None else w_block,
        blocks["m_phi"],
        part,
        items,
        ACC=acc,
        W_MODE=w_mode,
        BT=kernels.TILE,
    )
    if result is None:
        result = torch.empty((count, meta.GB_RESULT_FIELDS), dtype=torch.float64, device=device)
    triton_launch.launch(
        kernels.guard_choose_kernel,
        (triton_launch.persistent(count, device),),
        layers,
        coef,
        weights,
        movable,
        scale,
        part,
        result,
        hyper if hyper is not None else coef,
        hyper_out if hyper_out is not None else coef,
        count,
        _top(stored),
        ACC=acc if hyper is not None else tl.float64,
        HYPER=hyper is not None,
        GUARD=guard,
    )
    triton_launch.launch(
        kernels.guard_blend_kernel,
        (programs,),
        work,
        layers,
        coef,
        result,
        d,
        blocks["m_phi"],
        blocks["m_theta"],
        blocks["delta"] if feedback is not None else blocks["m_phi"],  # (not read without feedback: Δ = M_Φ)
        feedback if feedback is not None else blocks["m_theta"],
        items,
        ACC=acc,
        FULL=feedback is None,
        FEEDBACK=write_feedback,
        BT=kernels.TILE,
    )
    return result


def _top(stored: torch.dtype | None) -> float:
    """The largest value ``stored`` holds (inf where a finite θ₊ always fits: float32, float64)."""
    if stored is None or stored in (torch.float32, torch.float64):
        return float("inf")
    return float(torch.finfo(stored).max)
