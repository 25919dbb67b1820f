"""The O(p³) middle of the two-pass step (docs/algorithm.md §3), shared by every batched
backend, and the step guard.

Given the Gram blocks of a batch of layers with the same p — ``A = θᵀθ``, ``B = θᵀΦ``,
``C = ΦᵀΦ``, ``E = θᵀg``, each ``(L, p, p)`` — it returns ``M_Φ`` and ``M_θ`` of the update
pass (``Φ₊ = sU + θ M_Φ``, ``θ₊ = θ + sU + θ M_θ``, ``U = βΦ − ηg``, with the guard's scale
``s``: 1 where it does not bind, and then this is exactly the authors' update) and the
per-layer checks. Without Φ (first step, ``momentum == 0``) pass ``b = c = None``.

**The guard** (``guard=``), from per-layer scalars only:

* Trust region. With ``r = ‖Φ‖_F + η‖g‖_F`` (``‖Φ‖² = tr C``; ``‖g‖²`` comes from the
  backend as per-column sums of g², computed robustly in float64), the inputs Φ, g are
  scaled jointly by ``s = min(1, ρ/r)``: ``B → sB, C → s²C, E → sE`` here and ``U → sU`` in
  the update pass. ``r`` bounds ‖Φ‖, η‖g‖ and ‖U‖ at once (``‖U‖ ≤ β‖Φ‖ + η‖g‖ ≤ r``), so
  every input of the step is bounded by ρ after scaling, which ``‖βΦ − ηg‖`` alone would not
  do when βΦ and ηg nearly cancel; in training Φ ≈ −ηg/(1 − β), where ``r ≈ ‖U‖``.
* Prediction, before anything is written. ``θ₊ = θK + sU`` with ``K = I + M_θ``, so
  ``θ₊ᵀθ₊ − I = P + s²UᵀU`` with the ``p × p`` matrix
  ``P = KᵀAK + KᵀT + TᵀK − I``, ``T = θᵀ(sU) = β(sB) − η(sE)``; since ``UᵀU`` is positive
  semi-definite, ``‖UᵀU‖_F ≤ tr UᵀU = ‖U‖² ≤ r²``, and ``dist_next = ‖P‖_F + s²r²`` bounds
  ``‖θ₊ᵀθ₊ − I‖_F``. ``finite_next``: M_Φ, M_θ and that bound are finite.
* Fallback. When the scaled step is still predicted beyond ``limit`` or non-finite, the step
  becomes the pure pull-back ``θ₊ = θ(I − α(A − I))``, ``Φ₊ = 0`` (``s = 0``), whose distance
  is bounded with ``D = A − I`` by ``‖(1 − 2α)D + (α² − 2α)D²‖_F + α²‖D‖_F‖D²‖_F``
  (the expansion of ``(I + D)(I − αD)² − I``).

**Variants** (``variant=``). ``"official"`` is the authors' code: ``θ₊ = θ + Φ₊ − αθ(A − I)``.
``"paper"`` is Algorithm 1 as printed, read as "Φ first, then θ with the new Φ": the θ step
takes only the tangent part of the velocity, ``θ₊ = θ + Φ₊ − θN sym(θᵀΦ₊) − αθ(A − I)``. With
``θᵀΦ₊ = θᵀ(sU) + A M_Φ = T + A M_Φ`` that is one more ``p × p`` term in ``M_θ``:
``M_θ = M_Φ + F``, ``F = −α(A − I) − N sym(T + A M_Φ)``; the update pass is unchanged.

``lr``, ``beta``, ``alpha`` are floats or ``(L, 1, 1)`` tensors (per-layer values).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

VARIANTS = ("official", "paper")

__all__ = [
    "VARIANTS",
    "Middle",
    "middle",
    "sym",
    "trust_scale",
    "fallback_distance",
    "join_checks",
    "grad_sq",
    "scaled_hyper",
]

Scalar = float | torch.Tensor


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


def sym(m: torch.Tensor) -> torch.Tensor:
    """``sym(M) = (M + Mᵀ)/2`` of a matrix or a batch of matrices."""
    return 0.5 * (m + m.transpose(-1, -2))


def finite_of(x: torch.Tensor) -> torch.Tensor:
    """``isfinite(x)`` in two ops (``x − x == 0``: NaN for Inf and NaN; torch's isfinite is a
    composite of four or five, and the middle runs on the host's launch budget)."""
    return (x - x) == 0


def all_finite(m: torch.Tensor) -> torch.Tensor:
    """Per matrix of a ``(L, p, p)`` batch: every entry finite (``Σ 0·m == 0``: an Inf or NaN
    makes the sum NaN; a finite m cannot overflow it), in three ops."""
    return (m * 0).sum((-2, -1)) == 0


def _per_layer(x: Scalar) -> Scalar:
    """A ``(L, 1, 1)`` hyper-parameter as ``(L,)`` float64; a float stays a float."""
    return x.reshape(-1).to(torch.float64) if isinstance(x, torch.Tensor) else float(x)


def trust_scale(
    phi_norm: torch.Tensor,
    g_norm: torch.Tensor,
    lr: Scalar,
    radius: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, r)``: ``r = ‖Φ‖ + η‖g‖`` and ``s = min(1, ρ/r)`` per layer (float64), with ``s = 0``
    where ``r`` is not finite (an overflowing or non-finite input: the step is reset)."""
    r = phi_norm + _per_layer(lr) * g_norm  # r = ‖Φ‖_F + η‖g‖_F
    s = torch.clamp(radius / r, max=1.0)  # r = 0 gives inf → 1
    return torch.where(finite_of(r), s, 0.0), r


def fallback_distance(a_minus_i: torch.Tensor, alpha: Scalar) -> torch.Tensor:
    """Bound of ‖θ₊ᵀθ₊ − I‖_F for θ₊ = θ(I − αD), D = A − I (the guard's reset step)."""
    al = _per_layer(alpha)
    d2 = a_minus_i @ a_minus_i
    cubic = al * al * (torch.linalg.matrix_norm(a_minus_i) * torch.linalg.matrix_norm(d2)).to(torch.float64)
    lin = d2.mul_(alpha * alpha - 2.0 * alpha).add_(a_minus_i * (1.0 - 2.0 * alpha))  # (α² − 2α)D² + (1 − 2α)D
    return torch.linalg.matrix_norm(lin).to(torch.float64) + cubic  # + α²‖D‖‖D²‖ ≥ ‖α²D³‖


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
    radius: float | None = None,
    limit: float | None = None,
    variant: str = "official",
) -> Middle:
    """The update's ``p × p`` matrices and checks; see the module docstring.

    ``g_sq``: ``(L, p)`` or ``(L,)`` sums of g² (float64; needed for the guard or a
    prediction). ``radius``: the trust radius ρ, ``None`` for no guard (then s = 1).
    ``limit``: the guard's bound on the predicted distance (``max_distance``); with
    ``radius`` it triggers the fallback, without it only ``dist_next`` is reported. Neither
    given: the plain update, no prediction. ``variant``: ``"official"`` or ``"paper"`` (see the
    module docstring).
    """
    p = a.shape[-1]
    eye = torch.eye(p, dtype=a.dtype, device=a.device)
    a_minus_i = a - eye  # A − I
    n_inv = eye - a_minus_i  # N = 2I − A
    dist = torch.linalg.matrix_norm(a_minus_i)  # ‖θᵀθ − I‖_F
    predict = radius is not None or limit is not None
    scale = r = None
    if not predict:
        finite = all_finite(e)  # E = θᵀg finite (without a prediction: the plain check)
    else:
        g_norm = g_sq.reshape(g_sq.shape[0], -1).sum(-1).sqrt()  # ‖g‖_F (float64)
        phi_sq = c.diagonal(dim1=-2, dim2=-1).sum(-1).to(torch.float64) if b is not None else torch.zeros_like(g_norm)
        # inputs finite: ‖g‖² (float64: no overflow for a finite float32 g) and tr C, not E,
        # which overflows for a huge but finite g (then the prediction says "non-finite output")
        finite = finite_of(g_norm) & finite_of(phi_sq)
        if radius is not None:
            scale, r = trust_scale(phi_sq.sqrt(), g_norm, lr, radius)
        else:
            r = phi_sq.sqrt() + _per_layer(lr) * g_norm
        if scale is not None:  # (in place: the callers' blocks are scratch of this step)
            s = scale.to(a.dtype).view(-1, 1, 1)  # exactly 1.0 where the trust region does not bind
            e = e.mul_(s)  # E → sE (exact when s = 1)
            if b is not None:
                b, c = b.mul_(s), c.mul_(s * s)  # B → sB, C → s²C
    inner = lr * sym(e)  # η sym(E)
    if b is not None:
        sb = sym(b)  # S = sym(B)
        inner = inner - c - (beta - 1.0) * sb + n_inv @ b @ sb  # −C − (β−1)S + η sym(E) + NBS
        inner = inner - alpha * (b.transpose(-1, -2) @ n_inv + b)  # − α(BᵀN + B)
    m_phi = n_inv @ inner  # M_Φ = N[…]
    pull_back = -alpha * a_minus_i  # −α(A − I)
    feedback = pull_back  # F = −α(A − I)
    t = None
    if variant == "paper" or predict:
        t = e * (-lr)  # T = θᵀ(sU) = β sB − η sE
        if b is not None:
            t = t.add_(b * beta)
    if variant == "paper":  # the θ step's velocity projected on the tangent space
        feedback = pull_back - n_inv @ sym(t + a @ m_phi)  # F = −α(A − I) − N sym(T + A M_Φ)
    m_theta = m_phi + feedback  # M_θ = M_Φ + F
    if not predict:
        return Middle(m_theta, m_phi, feedback, dist, finite)

    # (written with few live p × p temporaries: the torch backend bounds a step's extra memory)
    k = m_theta.clone()
    k.diagonal(dim1=-2, dim2=-1).add_(1.0)  # K = I + M_θ
    kt_t = k.transpose(-1, -2) @ t
    del t
    pm = k.transpose(-1, -2) @ (a @ k)  # KᵀAK
    del k
    pm.add_(kt_t).add_(kt_t.transpose(-1, -2))  # + KᵀT + TᵀK
    del kt_t
    pm.diagonal(dim1=-2, dim2=-1).sub_(1.0)  # P = KᵀAK + KᵀT + TᵀK − I
    s64 = scale if scale is not None else torch.ones_like(r)
    dist_next = torch.linalg.matrix_norm(pm).to(torch.float64) + (s64 * r) ** 2  # ‖P‖ + s²r² ≥ ‖θ₊ᵀθ₊ − I‖
    del pm
    finite_next = finite_of(dist_next) & all_finite(m_phi)
    if radius is None:
        return Middle(m_theta, m_phi, feedback, dist, finite, None, dist_next, finite_next)

    ok = finite_next & (dist_next <= limit) if limit is not None else finite_next
    keep = ok.view(-1, 1, 1)
    m_phi = m_phi.masked_fill_(~keep, 0.0)  # reset: Φ₊ = 0·U + θ·0
    m_theta = torch.where(keep, m_theta, pull_back)  # θ₊ = θ − αθ(A − I)
    feedback = torch.where(keep, feedback, pull_back) if variant == "paper" else feedback
    scale = torch.where(ok, scale, 0.0)
    reset_dist = fallback_distance(a_minus_i, alpha)
    dist_next = torch.where(ok, dist_next, reset_dist)
    finite_next = torch.where(ok, finite_next, finite_of(reset_dist))
    guarded = torch.where(ok, (scale < 1.0).to(torch.int8), 2)  # guards.KEPT / SCALED, or RESET
    return Middle(m_theta, m_phi, feedback, dist, finite, scale, dist_next, finite_next, guarded)


class Checks(NamedTuple):
    """The per-layer fields of several :class:`Middle` batches, concatenated (``None`` where
    the batches did not compute them)."""

    dist: torch.Tensor
    finite: torch.Tensor
    scale: torch.Tensor | None
    dist_next: torch.Tensor | None
    finite_next: torch.Tensor | None
    guarded: torch.Tensor | None


def join_checks(mids: list[Middle]) -> Checks:
    def cat(name: str) -> torch.Tensor | None:
        parts = [getattr(m, name) for m in mids]
        return torch.cat(parts) if parts and all(t is not None for t in parts) else None

    return Checks(
        cat("dist").to(torch.float64), cat("finite"), cat("scale"), cat("dist_next"), cat("finite_next"), cat("guarded")
    )


def grad_sq(grads: list[torch.Tensor]) -> torch.Tensor:
    """``(L,)`` float64 ``‖g‖²`` per layer (one multi-tensor op; float64 accumulation, so a
    finite float32 gradient cannot overflow it), for backends whose Gram pass does not take
    it."""
    return torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float64)).square()


def scaled_hyper(hyper: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """The ``(L, 3)`` table ``[η, β, α]`` of an update kernel with the guard's scale folded in:
    ``[sη, sβ, α]``, so that the kernel's ``U = βΦ − ηg`` becomes ``sU`` (the table itself
    when there is no guard)."""
    if scale is None:
        return hyper
    factor = torch.ones_like(hyper)
    factor[:, :2] = scale.to(hyper.dtype).unsqueeze(1)
    return hyper * factor  # s·η, s·β, α (exact where s = 1)
