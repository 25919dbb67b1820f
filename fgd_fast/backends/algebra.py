"""The O(p³) middle of the two-pass step (docs/algorithm.md §3), shared by every batched backend.

Given the Gram blocks of a batch of layers with the same p — ``A = θᵀθ``, ``B = θᵀΦ``,
``C = ΦᵀΦ``, ``E = θᵀg``, each ``(L, p, p)`` — it returns ``M_Φ`` and ``M_θ`` of the update
pass (``Φ₊ = U + θ M_Φ``, ``θ₊ = θ + U + θ M_θ``, ``U = βΦ − ηg``) and the per-layer checks.
Without Φ (first step, ``momentum == 0``) pass ``b = c = None``.

``lr``, ``beta``, ``alpha`` are floats or ``(L, 1, 1)`` tensors (per-layer values).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["Middle", "middle", "sym"]

Scalar = float | torch.Tensor


class Middle(NamedTuple):
    m_theta: torch.Tensor  # (L, p, p) M_θ = M_Φ + F
    m_phi: torch.Tensor  # (L, p, p) M_Φ
    feedback: torch.Tensor  # (L, p, p) F = −α(A − I), so that θ₊ = θ + Φ₊ + θF
    dist: torch.Tensor  # (L,) ‖A − I‖_F
    finite: torch.Tensor  # (L,) bool: E = θᵀg finite (a NaN/Inf in g makes E non-finite)


def sym(m: torch.Tensor) -> torch.Tensor:
    """``sym(M) = (M + Mᵀ)/2`` of a matrix or a batch of matrices."""
    return 0.5 * (m + m.transpose(-1, -2))


def middle(a, b, c, e, *, lr: Scalar, beta: Scalar, alpha: Scalar) -> Middle:
    p = a.shape[-1]
    eye = torch.eye(p, dtype=a.dtype, device=a.device)
    a_minus_i = a - eye  # A − I
    n_inv = eye - a_minus_i  # N = 2I − A
    inner = lr * sym(e)  # η sym(E)
    if b is not None:
        s = sym(b)  # S = sym(B)
        inner = inner - c - (beta - 1.0) * s + n_inv @ b @ s  # −C − (β−1)S + η sym(E) + NBS
        inner = inner - alpha * (b.transpose(-1, -2) @ n_inv + b)  # − α(BᵀN + B)
    m_phi = n_inv @ inner  # M_Φ = N[…]
    feedback = -alpha * a_minus_i  # F = −α(A − I)
    m_theta = m_phi + feedback  # M_θ = M_Φ − α(A − I)
    dist = torch.linalg.matrix_norm(a_minus_i)  # ‖θᵀθ − I‖_F
    finite = torch.isfinite(e).flatten(-2).all(-1)
    return Middle(m_theta, m_phi, feedback, dist, finite)
