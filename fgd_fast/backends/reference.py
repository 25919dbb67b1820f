"""Reference backend: one parameter at a time, term by term, as the authors' code does it
(the sequence of docs/algorithm.md §3, everything evaluated at the pre-step θ).

Every faster backend is tested against it, so it favours legibility over speed.

The guard (``trust_radius``) follows the batched backends' rule (:mod:`.algebra`) on the
candidate itself: the scale ``s = min(1, ρ/(‖Φ‖ + η‖g‖))`` comes first and the sequence runs
on ``sΦ, sg``; then with the pull-back ``θ_pb = θ − αθ(A − I)`` and ``V = θ₊ − θ_pb`` the
distance of ``θ_pb + tV`` is ``D₀ + tX₁ + t²X₂`` from the n × p matrices (``D₀ = θ_pbᵀθ_pb − I``,
``X₁ = 2 sym(θ_pbᵀV)``, ``X₂ = VᵀV``), and :func:`.guard_rule.choose_weight` picks t.

``variant="paper"`` (Algorithm 1 as printed) moves θ by the tangent part of Φ₊ only:
``θ₊ = θ + Φ₊ − θN sym(θᵀΦ₊) − αθ(A − I)``.
"""

from __future__ import annotations

import torch

from .._matrix import as_stiefel, from_stiefel
from .base import StepPlan, compute_dtype, full_precision
from .block_products import sym
from .guard_rule import choose_weight, guard_codes, guard_target, storable, store_unit, trust_scale

__all__ = ["prepare_reference"]


def _velocity(theta, phi, g, *, lr, momentum, feedback):
    """Φ₊ of the authors' sequence (``phi`` is None on a first / stateless step)."""
    p = theta.shape[1]
    eye = torch.eye(p, dtype=theta.dtype, device=theta.device)
    a = theta.t() @ theta
    n_inv = 2.0 * eye - a  # N = 2I − A ≈ (θᵀθ)⁻¹
    if phi is None:  # first / stateless step: the projected gradient
        return -lr * (g - theta @ n_inv @ sym(theta.t() @ g))  # Φ = −η(g − θN sym(θᵀg))
    b = theta.t() @ phi  # B = θᵀΦ
    con = -theta @ n_inv @ (phi.t() @ phi)  # centripetal: −θN(ΦᵀΦ)
    rd = (momentum - 1.0) * phi - lr * g  # damped gradient (β − 1)Φ − ηg ...
    rd = rd - theta @ n_inv @ sym(theta.t() @ rd)  # ... projected: rd − θN sym(θᵀrd)
    ext = theta @ n_inv @ n_inv @ b @ sym(b)  # extension: θNNB sym(B)
    fb_phi = -feedback * theta @ n_inv @ (b.t() @ n_inv + b)  # feedback on Φ's tangency: −αθN(BᵀN + B)
    return phi + con + rd + ext + fb_phi


def _norm64(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """‖t‖_F accumulated in float64 (a finite float32 tensor cannot overflow it); 0 for None."""
    if t is None:
        return torch.zeros((), dtype=torch.float64, device=like.device)
    return torch.linalg.vector_norm(t, dtype=torch.float64)


def prepare_reference(
    params,
    grads,
    bufs,
    fresh,
    *,
    lr,
    momentum,
    feedback,
    check_finite,
    precision="ieee",
    trust_radius=None,
    max_distance=None,
    variant="official",
):
    """Compute every θ₊, Φ₊ now (nothing is written); ``apply`` only copies them into place."""
    dists, finite, results, dist_next, finite_next, guarded = [], [], [], [], [], []
    predict = trust_radius is not None or max_distance is not None
    with full_precision():  # IEEE fp32 products whatever the global TF32 setting
        for i, param in enumerate(params):
            cdt = compute_dtype(param.dtype)
            theta = as_stiefel(param).to(cdt, copy=True)
            eye = torch.eye(theta.shape[1], dtype=cdt, device=theta.device)
            a_minus_i = theta.t() @ theta - eye  # A − I
            dists.append(torch.linalg.matrix_norm(a_minus_i))
            g = as_stiefel(grads[i]).to(cdt)
            buf = bufs[i]
            phi = None if buf is None or fresh[i] else as_stiefel(buf).to(cdt)
            if check_finite:
                ok = torch.isfinite(grads[i]).all()
                finite.append(ok if phi is None else ok & torch.isfinite(phi).all())
            scale = None
            if trust_radius is not None:  # the guard's safety radius: run the sequence on sΦ, sg
                scale, _ = trust_scale(_norm64(phi, g), _norm64(g, g), lr[i], trust_radius, torch.finfo(cdt).tiny)
                s = scale.to(cdt)
                g = g * s
                phi = phi * s if phi is not None else None
            phi_new = _velocity(theta, phi, g, lr=lr[i], momentum=momentum[i], feedback=feedback[i])
            fb_theta = -feedback[i] * theta @ a_minus_i  # fb_θ = −α θ (A − I)
            theta_new = theta + phi_new + fb_theta
            if variant == "paper":  # the θ step takes Φ₊'s tangent part: − θN sym(θᵀΦ₊)
                n_inv = eye - a_minus_i  # N = 2I − A
                theta_new = theta_new - theta @ n_inv @ sym(theta.t() @ phi_new)
            if predict and scale is None:  # the distance after the step, exactly, from the candidate θ₊
                d_new = torch.linalg.matrix_norm(theta_new.t() @ theta_new - eye).to(torch.float64)
                dist_next.append(d_new)
                finite_next.append(storable(d_new, theta.shape[1], param.dtype) & torch.isfinite(phi_new).all())
            elif predict:  # the guard: θ_pb + tV, t chosen by the one rule of every backend
                theta_pb = theta + fb_theta  # θ − αθ(A − I)
                v = theta_new - theta_pb
                d0 = theta_pb.t() @ theta_pb - eye
                x1 = 2.0 * sym(theta_pb.t() @ v)
                x2 = v.t() @ v
                theta_ns = theta - 0.5 * theta @ a_minus_i  # Newton–Schulz: θ(3I − A)/2
                ok_in = torch.isfinite(g).all() & (torch.isfinite(phi).all() if phi is not None else True)
                movable = ok_in & torch.isfinite(phi_new).all() & torch.isfinite(x2).all()
                blend = choose_weight(
                    d0[None],
                    x1[None],
                    x2[None],
                    (theta_ns.t() @ theta_ns - eye)[None],
                    target=guard_target(max_distance, theta.shape[1], store_unit(param.dtype)),
                    movable=movable.reshape(1),
                )
                t = blend.weight[0].to(cdt)
                at_rest = torch.where(blend.newton[0], theta_ns, theta_pb)
                theta_new = torch.where(t == 1, theta_new, torch.where(t > 0, theta_pb + t * v, at_rest))
                phi_new = torch.where(t == 1, phi_new, torch.where(t > 0, t * phi_new, torch.zeros_like(phi_new)))
                total = scale * blend.weight[0]  # U → tsU
                guarded.append(guard_codes(total))  # guards.KEPT / SCALED / RESET
                dist_next.append(blend.dist[0])
                finite_next.append(storable(blend.dist[0], theta.shape[1], param.dtype))
            results.append((from_stiefel(theta_new, param.shape), from_stiefel(phi_new, param.shape)))

    def apply() -> None:
        for param, buf, (theta_new, phi_new) in zip(params, bufs, results):
            param.copy_(theta_new)
            if buf is not None:
                buf.copy_(phi_new)

    dev = params[0].device if params else torch.device("cpu")
    stack = lambda ts: torch.stack(ts) if ts else None  # noqa: E731
    return StepPlan(
        dist=torch.stack(dists) if dists else torch.zeros(0, device=dev),
        finite=torch.stack(finite) if check_finite and finite else None,
        apply=apply,
        dist_next=stack(dist_next),
        finite_next=stack(finite_next),
        guarded=stack(guarded),
    )
