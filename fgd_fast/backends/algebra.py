"""The O(p³) middle of the two-pass step (docs/algorithm.md §3), shared by every batched
backend, and the step guard.

Given the Gram blocks of a batch of layers with the same p — ``A = θᵀθ``, ``B = θᵀΦ``,
``C = ΦᵀΦ``, ``E = θᵀg``, each ``(L, p, p)`` — it returns ``M_Φ`` and ``M_θ`` of the update
pass (``Φ₊ = sU + θ M_Φ``, ``θ₊ = θ + sU + θ M_θ``, ``U = βΦ − ηg``, with the guard's scale
``s``: 1 where it does not bind, and then this is exactly the authors' update) and the
per-layer checks. Without Φ (first step, ``momentum == 0``) pass ``b = c = None``.

**Variants** (``variant=``). ``"official"`` is the authors' code: ``θ₊ = θ + Φ₊ − αθ(A − I)``.
``"paper"`` is Algorithm 1 as printed, read as "Φ first, then θ with the new Φ": the θ step
takes only the tangent part of the velocity, ``θ₊ = θ + Φ₊ − θN sym(θᵀΦ₊) − αθ(A − I)``. With
``θᵀΦ₊ = θᵀ(sU) + A M_Φ = T + A M_Φ`` that is one more ``p × p`` term in ``M_θ``:
``M_θ = M_Φ + F``, ``F = −α(A − I) − N sym(T + A M_Φ)``; the update pass is unchanged.

``lr``, ``beta``, ``alpha`` are floats or ``(L, 1, 1)`` tensors (per-layer values).

The guard's rule — trust scale, target, exact distance, blend weight — is :mod:`.guard_rule`'s;
the products are :mod:`.block_products`' (where every product with ``N`` or ``A`` is ``X ∓ D·X``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._matrix import as_stiefel
from .block_products import Scalar, axpy, axpy_, block_i_plus_d, block_mm, block_mm_add, plus_t
from .guard_rule import (
    all_finite,
    choose_weight,
    finite_of,
    full_steps_fit,
    guard_codes,
    guard_target,
    host_reads_free,
    inputs_finite,
    pull_back_distances,
    step_bound,
    step_distance,
    storable,
    trust_scale,
    velocity_bound,
    velocity_gram,
    with_write_rounding,
)
from .layout import Layout

VARIANTS = ("official", "paper")

__all__ = [
    "VARIANTS",
    "Middle",
    "middle",
    "next_grams",
    "Checks",
    "join_checks",
    "velocity_blocks",
    "grad_norm",
    "grad_sq",
    "scaled_hyper",
]


class Middle(NamedTuple):
    m_theta: torch.Tensor  # (L, p, p) M_θ = M_Φ + F
    m_phi: torch.Tensor  # (L, p, p) M_Φ
    feedback: torch.Tensor  # (L, p, p) F = M_θ − M_Φ, so that θ₊ = θ + Φ₊ + θF (official: −α(A − I))
    dist: torch.Tensor  # (L,) ‖A − I‖_F
    finite: torch.Tensor  # (L,) bool: inputs finite (‖g‖² and tr C; without them E = θᵀg)
    scale: torch.Tensor | None = None  # (L,) s of the update pass U → sU (None: 1, no guard)
    dist_next: torch.Tensor | None = None  # (L,) bound of ‖θ₊ᵀθ₊ − I‖_F (None: not predicted)
    finite_next: torch.Tensor | None = None  # (L,) bool: θ₊, Φ₊ finite
    guarded: torch.Tensor | None = None  # (L,) int8: guards.KEPT / SCALED / RESET
    carried: tuple | None = None  # (A₊, B₊, C₊) or (A₊,) of the full step (see next_grams), where asked for

    def checks(self) -> tuple:
        """The per-layer fields ``dist … guarded``, in :class:`Checks`' order, as a plain tuple
        (what outlives the middle: a compiled step may hold it across its graph break, where
        torch 2.11's Dynamo cannot rebuild a NamedTuple made in the traced code)."""
        return tuple(self[3:9])


#: (:func:`.guard_rule.step_bound`), its two products only where that leaves the target; measured 2–14%
#: faster per step on the CPU workloads (``benchmarks/studies/torch_knobs.py``)
_NORM_BOUND_FIRST = True


#: The blend weights the guard tries, largest first (2^(−k/2), k = 0…14), and 0.
def next_grams(d_full, a_minus_i, m, m_phi, t, w, eye, layout: Layout) -> tuple[torch.Tensor, ...]:
    """``(A₊, B₊, C₊)``, the Gram blocks of the next step, from this step's ``p × p`` blocks
    (four products instead of three passes over θ and Φ): with ``θ₊ = θK + sU``, ``K = I + M``
    (``M = M_θ``), ``Φ₊ = sU + θM_Φ``, ``T = θᵀ(sU)``, ``W = s²UᵀU`` and ``Y = T + AM_Φ``:

    * ``A₊ = I + d_full`` (``d_full = θ₊ᵀθ₊ − I``, :func:`.guard_rule.step_distance`);
    * ``C₊ = Φ₊ᵀΦ₊ = W + M_ΦᵀT + TᵀM_Φ + M_ΦᵀAM_Φ = W + sym(M_Φᵀ(Y + T))``;
    * ``B₊ = θ₊ᵀΦ₊ = KᵀT + KᵀAM_Φ + W + TᵀM_Φ = Y + W + MᵀY + TᵀM_Φ``.

    Exact to rounding: the Grams a pass over the stored θ₊, Φ₊ would give, but for the rounding
    of storing them (what the guard's margin allows per step carried)."""
    lay = layout
    y = block_i_plus_d(lay, a_minus_i, m_phi, 1.0, t)  # Y = T + AM_Φ = T + M_Φ + DM_Φ
    c_next = lay.sym(block_mm(lay, m_phi, y + t, tx=True)).add_(w)  # C₊ = W + sym(M_Φᵀ(Y + T))
    b_next = block_mm_add(lay, block_mm_add(lay, y + w, m, y, tx=True), t, m_phi, tx=True)  # B₊ = Y + W + MᵀY + TᵀM_Φ
    return d_full + eye, b_next, c_next


def _ahead(carry: int, d_full, a_minus_i, m, m_phi, t, w, eye, lay: Layout) -> tuple[torch.Tensor, ...] | None:
    """What ``middle(carry=)`` asked for: None (0), ``(A₊,)`` (1) or ``(A₊, B₊, C₊)`` (3)."""
    if not carry:
        return None
    return next_grams(d_full, a_minus_i, m, m_phi, t, w, eye, lay) if carry == 3 else (d_full + eye,)


def _unless_overflowed(uu, gg, finite, scale, uu_later, lay: Layout):
    """The scaled velocity block (``s²UᵀU``, or ``s²G`` without Φ), or where it is not finite for a
    layer whose inputs are (rare: a finite U too large for its float32 Gram, ‖U‖ > ~1.8e19),
    ``(sU)ᵀ(sU)`` formed again from sU, as the reference forms it (a host read: a CPU)."""
    formed = uu if uu is not None else gg
    if formed is None or not bool((finite & ~all_finite(formed, lay)).any()):
        return uu, gg
    return uu_later(scale), None


def middle(
    a,
    b,
    c,
    e,
    *,
    lr: Scalar,
    beta: Scalar,
    alpha: Scalar,
    g_sq: torch.Tensor | None = None,
    h: torch.Tensor | None = None,
    gg: torch.Tensor | None = None,
    uu: torch.Tensor | None = None,
    radius: float | None = None,
    limit: float | None = None,
    unit: float = 0.0,
    stored: torch.dtype | None = None,
    variant: str = "official",
    carry: int = 0,
    layout: Layout | None = None,
    blend_kernels=None,
    uu_later=None,
    phi_sq_later=None,
    operand_unit: float = 0.0,
) -> Middle:
    """The update's ``p × p`` matrices and checks; see the module docstring.

    ``g_sq``: ``(L, p)`` or ``(L,)`` sums of g² (float64), ``h = Φᵀg`` (with Φ) and ``gg = gᵀg``,
    or ``uu = UᵀU`` itself: needed for the guard or a prediction. ``radius``: the safety radius ρ, ``None`` for no guard
    (then s = t = 1). ``limit``: ``max_distance``; with ``radius`` it sets the guard's target
    (less the rounding margin of ``unit``, :func:`.guard_rule.store_unit`), without it only ``dist_next``
    is reported (with the guard off, where the write's rounding could take θ₊ past it, that
    bound: :func:`.guard_rule.with_write_rounding`, ``operand_unit`` the unit roundoff of the update
    product's operands, :data:`.guard_rule.TF32_UNIT` for TF32 ones); ``stored``: the parameters'
    dtype, whose range θ₊ must fit. Neither given: the
    plain update, no prediction. ``variant``: ``"official"`` or ``"paper"``. The blocks are
    scratch of this step: some are scaled in place. ``carry``: 1 or 3 to get the next step's
    ``(A₊,)`` or ``(A₊, B₊, C₊)`` in ``carried`` (:func:`next_grams`) where the full step is
    the one written for every layer (with a prediction; else ``carried`` is None).
    ``layout``: the blocks' :class:`.layout.Layout` (several p in one flat buffer; default: one
    ``(L, p, p)`` batch); ``lr``, ``beta``, ``alpha``: floats or ``L`` per-layer values.
    ``blend_kernels``: where the guard blends, do it by this function's launches
    (:func:`.guard_blend.blend`, the Triton backend's) instead of torch ops: the same rule.
    ``uu_later``: a callable that forms the velocity block when called: ``UᵀU``, or ``G = gᵀg``
    without Φ, unscaled; given the trust scales s, ``(sU)ᵀ(sU)`` with Φ or without. Where the
    blocks are scaled and a host read is free, it replaces a ``uu``/``gg`` that overflowed float32
    for a finite input (‖U‖ > ~1.8e19: the reference's sU does not). Given instead of ``uu``/``gg``
    (both None), where a host read is free and nothing is carried, the full step's distance is
    then first bounded without it (:func:`.guard_rule.velocity_bound`), from norms alone
    (:func:`.guard_rule.step_bound`) and, where that leaves the target, with the exact rest
    (:func:`.guard_rule.step_distance`); the block is formed only if some layer's bound still
    leaves the target: the same decisions, and ``dist_next`` is the bound where it stayed within (an exact
    value otherwise). ``phi_sq_later``: a callable giving ``‖Φ‖²`` per layer in float64 from Φ
    itself, called (where a host read is free) only if ``tr C`` is not finite: a finite Φ whose
    float32 Gram overflows is then a huge input, which the guard resets, not a non-finite one.
    """
    lay = layout or Layout.of(a)
    lazy = uu_later is not None and uu is None and gg is None  # the velocity block not formed yet
    p = lay.groups[0][1] if lay.single else lay.p_per_layer()  # the guard's margin and range depend on p
    eye = lay.eye(a.dtype)
    a_minus_i = a - eye  # D = A − I  (N = 2I − A = I − D: NX = X − DX)
    dist = lay.norm(a_minus_i)  # ‖θᵀθ − I‖_F
    lr_, beta_, alpha_ = (lay.col(v) for v in (lr, beta, alpha))  # per-layer values broadcast to the blocks
    predict = radius is not None or limit is not None
    host = host_reads_free(a.device)  # (a CPU: skip what a host read shows is not needed)
    scale = scaled = None  # scaled: s (a column) where the blocks were scaled
    if not predict:
        finite = all_finite(e, lay)  # E = θᵀg finite (without a prediction: the plain check)
    else:
        g_norm = g_sq.reshape(g_sq.shape[0], -1).sum(-1).sqrt()  # ‖g‖_F (float64)
        phi_sq = lay.trace(c).to(torch.float64) if b is not None else torch.zeros_like(g_norm)
        if carry and b is not None:  # a carried C₊ is a difference: its trace may round below 0 where Φ₊ ≈ 0
            phi_sq = phi_sq.clamp_min_(0.0)  # (whose square root, NaN, made the guard reset the step)
        g_finite = finite_of(g_norm)
        finite = g_finite & finite_of(phi_sq) if host else None  # (with every ‖g‖ finite, E's check is not needed)
        if host and not bool(finite.all()):  # (rare) a non-finite input, or an overflowing ΦᵀΦ
            if phi_sq_later is not None and b is not None and not bool(finite_of(phi_sq).all()):
                phi_sq = phi_sq_later()  # ‖Φ‖² from Φ itself: a finite Φ is then a huge input, not a non-finite one
            finite = g_finite & finite_of(phi_sq) if bool(g_finite.all()) else None
        if finite is None:
            finite = inputs_finite(g_norm, phi_sq, e, lay)
        phi_norm = phi_sq.sqrt()  # ‖Φ‖_F
        if radius is not None:
            scale, _ = trust_scale(phi_norm, g_norm, lr, radius, torch.finfo(a.dtype).tiny)
        if scale is not None and not (host and float(scale.min()) == 1.0):  # s = 1 everywhere: nothing to scale
            # (in place: the callers' blocks are scratch of this step)
            s = lay.col(scale.to(a.dtype))  # exactly 1.0 where the radius does not bind
            scaled = s  # (s applied twice, never s² formed: below ~1e-19 it is subnormal, below ~4e-23 zero
            # in float32, and the velocity term would drop out of the guard's distance)
            e = e.mul_(s)  # E → sE (exact when s = 1)
            gg, uu = (m.mul_(s).mul_(s) if m is not None else None for m in (gg, uu))  # G → s²G, UᵀU → s²UᵀU
            if b is not None:
                b, c = b.mul_(s), c.mul_(s).mul_(s)  # B → sB, C → s²C
                h = h.mul_(s).mul_(s) if h is not None else None  # H → s²H
            if not lazy and uu_later is not None and host:
                uu, gg = _unless_overflowed(uu, gg, finite, scale, uu_later, lay)
    if b is None:
        inner = (e + lay.t(e)).mul_(0.5 * lr_)  # η sym(E)
    else:
        half_e = e * (0.5 * lr_)  # (η/2)E
        sb = lay.sym(b)  # S = sym(B)
        nb = block_i_plus_d(lay, a_minus_i, b, -1.0)  # NB = B − DB (and BᵀN = (NB)ᵀ: N is symmetric)
        # η sym(E) − αBᵀN = (η/2)E + Rᵀ, R = (η/2)E − α·NB: one transposed read for both (on a CPU a
        # transposed operand is read element by element)
        inner = plus_t(lay, half_e, axpy(half_e, nb, -alpha_))
        inner = axpy_(axpy_(inner.sub_(c), sb, -(beta_ - 1.0)), b, -alpha_)  # − C − (β−1)S − αB
        inner = block_mm_add(lay, inner, nb, sb)  # + NB·S
        del nb, half_e
    m_phi = block_i_plus_d(lay, a_minus_i, inner, -1.0)  # M_Φ = N[…] = […] − D[…]
    pull_back = -alpha_ * a_minus_i  # F₀ = −α(A − I)
    feedback = pull_back  # F = −α(A − I)
    t = None
    if variant == "paper" or predict:
        t = e * (-lr_)  # T = θᵀ(sU) = β sB − η sE
        if b is not None:
            t = axpy_(t, b, beta_)
    if variant == "paper":  # the θ step's velocity projected on the tangent space
        z = lay.sym(block_i_plus_d(lay, a_minus_i, m_phi, 1.0, t))  # sym(T + A M_Φ), A M_Φ = M_Φ + D M_Φ
        feedback = pull_back - block_i_plus_d(lay, a_minus_i, z, -1.0)  # F = −α(A − I) − N sym(T + A M_Φ)
    m_theta = m_phi + feedback  # M_θ = M_Φ + F
    if not predict:
        return Middle(m_theta, m_phi, feedback, dist, finite)

    # (per layer with several p: kept with the layout, keyed on the rule itself)
    target = guard_target(limit, p, unit) if lay.single else lay.memo((guard_target, limit, unit), p)
    d_full = None
    if lazy and host and not carry:  # bound s²UᵀU first; form it only where that leaves the target
        velocity = velocity_bound(phi_norm, g_norm, beta, lr, scale)
        bound = step_bound(dist, m_theta, t, lay) + velocity if _NORM_BOUND_FIRST else None  # no product
        if bound is None or not full_steps_fit(bound, finite, target):  # the two products without s²UᵀU
            d_full = step_distance(a_minus_i, m_theta, t, None, lay)  # θ₊ᵀθ₊ − I − s²UᵀU
            bound = lay.norm(d_full).to(torch.float64) + velocity
        if full_steps_fit(bound, finite, target):  # the exact distances fit too: the same decisions
            fits = storable(bound, p, stored)
            if radius is None:  # (‖U‖ ≤ β‖Φ‖ + η‖g‖: the velocity bound's root)
                bound = _write_rounding(bound, m_theta, velocity.sqrt(), p, lay, limit, operand_unit)
                return Middle(m_theta, m_phi, feedback, dist, finite, None, bound, fits & all_finite(m_phi, lay))
            return Middle(m_theta, m_phi, feedback, dist, finite, scale, bound, fits, guard_codes(scale))
        formed = uu_later()  # the Gram pass's velocity block after all: UᵀU, or G = gᵀg without Φ
        formed = formed.mul_(scaled).mul_(scaled) if scaled is not None else formed  # → s²UᵀU or s²G, as the blocks
        uu, gg = (formed, gg) if b is not None else (None, formed)
        if scaled is not None:
            uu, gg = _unless_overflowed(uu, gg, finite, scale, uu_later, lay)
    # s²UᵀU (the blocks are scaled); the blend kernels form it from its parts where no host check needs it first
    w = uu if uu is not None or (blend_kernels is not None and not host) else velocity_gram(c, h, gg, beta_, lr_, lay)
    d_full = d_full.add_(w) if d_full is not None else None  # (bounded above: now exact)
    if radius is None:  # only the prediction
        w = w if w is not None else velocity_gram(c, h, gg, beta_, lr_, lay)
        d_full = step_distance(a_minus_i, m_theta, t, w, lay) if d_full is None else d_full
        dist_next = lay.norm(d_full).to(torch.float64)
        finite_next = storable(dist_next, p, stored) & all_finite(m_phi, lay)
        ahead = _ahead(carry, d_full, a_minus_i, m_theta, m_phi, t, w, eye, lay)
        u_norm = lay.trace(w).to(torch.float64).clamp_min(0.0).sqrt()  # ‖U‖_F = √tr(UᵀU)
        dist_next = _write_rounding(dist_next, m_theta, u_norm, p, lay, limit, operand_unit)
        return Middle(m_theta, m_phi, feedback, dist, finite, None, dist_next, finite_next, None, ahead)

    if host:
        d_full = step_distance(a_minus_i, m_theta, t, w, lay) if d_full is None else d_full  # θ₊ᵀθ₊ − I, full step
        dist_full = lay.norm(d_full).to(torch.float64)
        # (a non-finite M_Φ makes the full step's distance non-finite: it does not fit, and the blend checks M_Φ)
        if full_steps_fit(dist_full, finite, target):  # t = 1 for every layer
            fits = storable(dist_full, p, stored)
            ahead = _ahead(carry, d_full, a_minus_i, m_theta, m_phi, t, w, eye, lay)
            return Middle(m_theta, m_phi, feedback, dist, finite, scale, dist_full, fits, guard_codes(scale), ahead)

    # the guard: D(t) = D₀ + tX₁ + t²X₂ for θ₊ = θK₀ + t(θΔ + sU)
    delta = m_theta - pull_back  # Δ = K − K₀ = M_θ − F₀
    if blend_kernels is not None:  # the products here, the rest in three launches (guard_blend.py)
        d2 = block_mm(lay, a_minus_i, a_minus_i)  # D²
        y = block_i_plus_d(lay, a_minus_i, delta, 1.0, t)  # Y = AΔ + T
        scale, dist_next, fits, codes = blend_kernels(
            lay,
            d=a_minus_i,
            d2=d2,
            d3=block_mm(lay, d2, a_minus_i),  # D³
            z=block_i_plus_d(lay, a_minus_i, y, -alpha),  # Z = K₀Y (X₁ = Z + Zᵀ)
            v=block_mm(lay, delta, y.add_(t), tx=True),  # V = Δᵀ(Y + T) (X₂ = sym(V) + s²UᵀU)
            w=w,
            gg=gg,
            c=c if b is not None else None,
            h=h,
            m_phi=m_phi,
            m_theta=m_theta,
            delta=delta,
            feedback=feedback,
            movable=finite,
            scale=scale,
            stored=stored,
            alpha=alpha,
            target=target,
            lr=lr,
            beta=beta,
        )
        return Middle(m_theta, m_phi, feedback, dist, finite, scale, dist_next, fits, codes)  # scale: ts
    blended = _blend(lay, a_minus_i, delta, t, w, alpha, alpha_, m_phi, m_theta, feedback, pull_back, finite, target)
    m_theta, m_phi, feedback, weight, dist_next = blended
    scale = scale * weight  # U → tsU
    return Middle(
        m_theta, m_phi, feedback, dist, finite, scale, dist_next, storable(dist_next, p, stored), guard_codes(scale)
    )


def _write_rounding(dist_next, m_theta, u_norm, p, lay: Layout, limit, operand_unit: float) -> torch.Tensor:
    """:func:`.guard_rule.with_write_rounding` of the blocks' dtype (the unguarded prediction)."""
    unit = torch.finfo(m_theta.dtype).eps / 2
    m_norm = lay.norm(m_theta).to(torch.float64)
    return with_write_rounding(dist_next, m_norm, u_norm, p, unit, limit, operand_unit)


def _blend(lay: Layout, a_minus_i, delta, t, w, alpha, alpha_, m_phi, m_theta, feedback, pull_back, finite, target):
    """The guard's blend by torch ops: per layer the weight t of ``θ₊ = θK₀ + t(θΔ + sU)`` that
    :func:`.guard_rule.choose_weight` picks from ``D(t) = D₀ + tX₁ + t²X₂``, applied to the blocks:
    ``(M_θ, M_Φ, F, t, ‖D(t)‖)`` (t = 0: a reset, Φ₊ = 0 and θ₊ = θK₀). ``alpha`` as :func:`middle`
    takes it, ``alpha_`` broadcast to the blocks."""
    movable = finite & all_finite(m_phi, lay)
    d0, d_newton = pull_back_distances(a_minus_i, alpha_, lay)
    y = block_i_plus_d(lay, a_minus_i, delta, 1.0, t)  # Y = AΔ + T = Δ + DΔ + T = θᵀ(θΔ + sU)
    x1 = 2.0 * lay.sym(block_i_plus_d(lay, a_minus_i, y, -alpha))
    # X₁ = 2 sym(K₀Y), K₀ = I − αD;  X₂ = ΔᵀAΔ + ΔᵀT + TᵀΔ + s²UᵀU = sym(Δᵀ(Y + T)) + s²UᵀU
    # (ΔᵀAΔ symmetric, ΔᵀT + TᵀΔ = 2 sym(ΔᵀT))
    x2 = lay.sym(block_mm(lay, delta, y.add_(t), tx=True)).add_(w)
    movable = movable & all_finite(x2, lay)
    blend = choose_weight(d0, x1, x2, d_newton, target=target, movable=movable, layout=lay)
    del x1, x2, d0, d_newton
    weight = lay.col(blend.weight.to(a_minus_i.dtype))
    alpha_m = alpha_.to(a_minus_i.dtype) if isinstance(alpha_, torch.Tensor) else torch.full_like(weight, alpha_)
    base = a_minus_i * -torch.where(lay.col(blend.newton), 0.5, alpha_m)  # F₀ = −α'D (α' = ½: Newton–Schulz)
    whole, moving = weight == 1.0, weight > 0
    m_phi = torch.where(whole, m_phi, torch.where(moving, m_phi * weight, 0.0))  # tM_Φ (a reset: Φ₊ = 0)
    m_theta = torch.where(whole, m_theta, torch.where(moving, base + delta * weight, base))  # F₀ + tΔ
    feedback = torch.where(whole, feedback, torch.where(moving, base + (feedback - pull_back) * weight, base))
    return m_theta, m_phi, feedback, blend.weight, blend.dist


class Checks(NamedTuple):
    """The per-layer fields of several :class:`Middle` batches, concatenated (``None`` where
    the batches did not compute them)."""

    dist: torch.Tensor
    finite: torch.Tensor
    scale: torch.Tensor | None
    dist_next: torch.Tensor | None
    finite_next: torch.Tensor | None
    guarded: torch.Tensor | None


def join_checks(parts: list[tuple]) -> Checks:
    """The per-layer checks of several middle batches (each :meth:`Middle.checks`), concatenated."""

    def cat(k: int) -> torch.Tensor | None:
        fields = [part[k] for part in parts]
        if not fields or any(t is None for t in fields):
            return None
        return fields[0] if len(fields) == 1 else torch.cat(fields)

    return Checks(cat(0).to(torch.float64), *(cat(k) for k in range(1, 6)))


def velocity_blocks(
    grads: list[torch.Tensor], phis: list[torch.Tensor] | None, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(G, H)``: ``gᵀg`` and ``Φᵀg`` (``None`` without Φ) of layers with one p, stacked
    ``(L, p, p)`` in ``dtype``, for backends whose Gram kernels do not form them (a batched
    product per block where the layers share a shape, else one per layer)."""
    gs = [as_stiefel(g).to(dtype) for g in grads]
    fs = [as_stiefel(f).to(dtype) for f in phis] if phis is not None else None
    if all(x.shape == gs[0].shape for x in gs):  # one shape: two batched products
        g3 = torch.stack(gs)
        return g3.mT @ g3, (torch.stack(fs).mT @ g3 if fs is not None else None)  # G = gᵀg, H = Φᵀg
    gg = torch.stack([x.mT @ x for x in gs])
    return gg, (torch.stack([f.mT @ x for f, x in zip(fs, gs)]) if fs is not None else None)


def grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """``(L,)`` float64 ``‖g‖_F`` per layer (one multi-tensor op; float64 accumulation, so a
    finite float32 gradient cannot overflow it), for backends whose Gram pass does not take
    it."""
    return torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float64))


def grad_sq(grads: list[torch.Tensor]) -> torch.Tensor:
    """``(L,)`` float64 ``‖g‖²`` per layer (:func:`grad_norm` squared)."""
    return grad_norm(grads).square()


def scaled_hyper(hyper: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """The ``(L, 3)`` table ``[η, β, α]`` of an update kernel with the guard's scale folded in:
    ``[sη, sβ, α]``, so that the kernel's ``U = βΦ − ηg`` becomes ``sU`` (the table itself
    when there is no guard). A reset (s = 0) gives exact zeros, even for an η that is not finite
    (an lr tensor on the device, which no host read checks: 0·NaN would write NaN)."""
    if scale is None:
        return hyper
    factor = torch.ones_like(hyper)
    factor[:, :2] = scale.to(hyper.dtype).unsqueeze(1)
    return torch.where(factor == 0, 0.0, hyper * factor)  # s·η, s·β, α (exact where s = 1; 0 where s = 0)
