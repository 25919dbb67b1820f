"""Reference backend: one parameter at a time, term by term, as the authors' code does it
(the sequence of docs/algorithm.md §3, everything evaluated at the pre-step θ).

Every faster backend is tested against it, so it favours legibility over speed.
"""
from __future__ import annotations

import torch

from .._matrix import as_stiefel, from_stiefel
from .algebra import sym
from .base import StepPlan, compute_dtype, full_precision

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


def prepare_reference(params, grads, bufs, fresh, *, lr, momentum, feedback, check_finite, precision="ieee"):
    """Compute every θ₊, Φ₊ now (nothing is written); ``apply`` only copies them into place."""
    dists, finite, results = [], [], []
    with full_precision():  # IEEE fp32 products whatever the global TF32 setting
        for i, param in enumerate(params):
            cdt = compute_dtype(param.dtype)
            theta = as_stiefel(param).to(cdt, copy=True)
            eye = torch.eye(theta.shape[1], dtype=cdt, device=theta.device)
            a_minus_i = theta.t() @ theta - eye  # A − I
            dists.append(torch.linalg.matrix_norm(a_minus_i))
            if check_finite:
                finite.append(torch.isfinite(grads[i]).all())
            g = as_stiefel(grads[i]).to(cdt)
            buf = bufs[i]
            phi = None if buf is None or fresh[i] else as_stiefel(buf).to(cdt)
            phi_new = _velocity(theta, phi, g, lr=lr[i], momentum=momentum[i], feedback=feedback[i])
            fb_theta = -feedback[i] * theta @ a_minus_i  # fb_θ = −α θ (A − I)
            theta_new = theta + phi_new + fb_theta
            results.append((from_stiefel(theta_new, param.shape), from_stiefel(phi_new, param.shape)))

    def apply() -> None:
        for param, buf, (theta_new, phi_new) in zip(params, bufs, results):
            param.copy_(theta_new)
            if buf is not None:
                buf.copy_(phi_new)

    dev = params[0].device if params else torch.device("cpu")
    return StepPlan(
        dist=torch.stack(dists) if dists else torch.zeros(0, device=dev),
        finite=torch.stack(finite) if check_finite and finite else None,
        apply=apply,
    )
