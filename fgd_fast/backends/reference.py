"""Reference backend: one parameter at a time, term by term, as the authors' code does it.

This is the oracle every faster backend is tested against, so it favours legibility over
speed. With ``sym(M) = (M + Mᵀ)/2``, ``A = θᵀθ``, ``N = 2I − A`` (truncated Neumann series
of ``A⁻¹``), ``B = θᵀΦ`` and everything evaluated at the pre-step θ, one step is

    con   = −θ N (ΦᵀΦ)                                  # centripetal term
    rd    = (β − 1)Φ − η g;  rd ← rd − θ N sym(θᵀ rd)  # damped gradient, projected
    ext   = θ N N B sym(B)                              # extension of the vector field
    fb_Φ  = −α θ N (Bᵀ N + B)                           # feedback on the tangency of Φ
    Φ    ← Φ + con + rd + ext + fb_Φ
    fb_θ  = −α θ (A − I)                                # feedback on θᵀθ = I
    θ    ← θ + Φ + fb_θ

On the first step (no Φ yet) and for ``momentum == 0`` the velocity is the projected
gradient ``Φ = −η (g − θ N sym(θᵀ g))``.
"""
from __future__ import annotations

import torch

from .._matrix import as_stiefel, from_stiefel
from .base import StepPlan, compute_dtype, full_precision

__all__ = ["prepare_reference"]


def _sym(m: torch.Tensor) -> torch.Tensor:
    return 0.5 * (m + m.t())


def _velocity(theta, phi, g, *, lr, momentum, feedback):
    """Φ₊ of the authors' sequence (``phi`` is None on a first / stateless step)."""
    p = theta.shape[1]
    eye = torch.eye(p, dtype=theta.dtype, device=theta.device)
    a = theta.t() @ theta
    n_inv = 2.0 * eye - a  # N ≈ (θᵀθ)⁻¹
    if phi is None:
        return -lr * (g - theta @ n_inv @ _sym(theta.t() @ g))
    b = theta.t() @ phi
    con = -theta @ n_inv @ (phi.t() @ phi)
    rd = (momentum - 1.0) * phi - lr * g
    rd = rd - theta @ n_inv @ _sym(theta.t() @ rd)
    ext = theta @ n_inv @ n_inv @ b @ _sym(b)
    fb_phi = -feedback * theta @ n_inv @ (b.t() @ n_inv + b)
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
