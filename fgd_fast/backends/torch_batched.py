"""Torch backend: the two-pass form of ALGORITHM.md, batched with ``bmm``.

Layers are bucketed by ``(n, p, dtype, device, η, β, α, reads Φ, writes Φ)``; each bucket is
stacked once into ``X = [θ | Φ | g]`` of shape ``(L, n, 3p)`` (``[θ | g]`` when Φ is zero or
absent) and runs without a Python loop over its layers:

1. Gram pass, one ``bmm``: ``θᵀX = [A | B | E]`` with ``A = θᵀθ, B = θᵀΦ, E = θᵀg``; plus
   ``C = ΦᵀΦ``.
2. O(p³) algebra on ``(L, p, p)`` tensors, with ``N = 2I − A`` and ``S = sym(B)``:
   ``M_Φ = N[−C − (β − 1)S + η sym(E) + N B S − α(BᵀN + B)]`` and ``M_θ = M_Φ − α(A − I)``.
3. Update pass, two ``baddbmm``: ``U = βΦ − ηg``, ``Φ₊ = U + θM_Φ``, ``θ₊ = θ + U + θM_θ``.

A first step (Φ = 0) is the same formula with ``B = C = 0``; ``momentum == 0`` is that
formula without storing Φ.
"""
from __future__ import annotations

from collections import defaultdict

import torch

from .._matrix import as_stiefel, from_stiefel, stiefel_shape
from .base import StepPlan, compute_dtype

__all__ = ["prepare_torch"]


def _sym(m: torch.Tensor) -> torch.Tensor:
    return 0.5 * (m + m.transpose(-1, -2))


def _bucket_key(i, params, bufs, fresh, lr, momentum, feedback):
    n, p, _ = stiefel_shape(params[i].shape)
    reads_phi = bufs[i] is not None and not fresh[i]
    return (n, p, params[i].dtype, params[i].device, lr[i], momentum[i], feedback[i], reads_phi, bufs[i] is not None)


class _Bucket:
    """Grams and M matrices of a set of equal-shape layers; ``apply`` writes them."""

    def __init__(self, idx, params, grads, bufs, key, check_finite):
        n, p, dtype, device, lr, beta, alpha, reads_phi, writes_phi = key
        cdt = compute_dtype(dtype)
        self.idx, self.lr, self.beta, self.reads_phi, self.writes_phi = idx, lr, beta, reads_phi, writes_phi
        self.params = [params[i] for i in idx]
        self.bufs = [bufs[i] for i in idx] if writes_phi else []
        k = 3 if reads_phi else 2
        x = torch.empty((len(idx), n, k * p), dtype=cdt, device=device)  # X = [θ | (Φ |) g]
        blocks = [self.params] + ([self.bufs] if reads_phi else []) + [[grads[i] for i in idx]]
        for j, tensors in enumerate(blocks):
            torch._foreach_copy_(list(x[:, :, j * p:(j + 1) * p].unbind(0)), [as_stiefel(t) for t in tensors])
        self.x, self.p = x, p
        theta = x[:, :, :p]
        g = x[:, :, (k - 1) * p:]
        gram = torch.bmm(theta.transpose(1, 2), x)  # θᵀ[θ | Φ | g] = [A | B | E]
        a, e = gram[:, :, :p], gram[:, :, (k - 1) * p:]
        eye = torch.eye(p, dtype=cdt, device=device)
        a_minus_i = a - eye  # A − I
        self.dist = torch.linalg.matrix_norm(a_minus_i)  # ‖θᵀθ − I‖_F
        self.finite = torch.isfinite(g).flatten(1).all(dim=1) if check_finite else None
        n_inv = eye - a_minus_i  # N = 2I − A
        inner = lr * _sym(e)  # η sym(E)
        if reads_phi:
            phi = x[:, :, p:2 * p]
            b = gram[:, :, p:2 * p]
            c = torch.bmm(phi.transpose(1, 2), phi)  # C = ΦᵀΦ
            s = _sym(b)  # S = sym(B)
            inner = inner - c - (beta - 1.0) * s + n_inv @ b @ s  # −C − (β−1)S + η sym(E) + NBS
            inner = inner - alpha * (b.transpose(1, 2) @ n_inv + b)  # − α(BᵀN + B)
        self.m_phi = n_inv @ inner  # M_Φ = N[…]
        self.m_theta = self.m_phi - alpha * a_minus_i  # M_θ = M_Φ − α(A − I)

    def apply(self) -> None:
        p, x = self.p, self.x
        theta = x[:, :, :p]
        g = x[:, :, -p:]
        u = g * (-self.lr)  # U = βΦ − ηg
        if self.reads_phi:
            u.add_(x[:, :, p:2 * p], alpha=self.beta)
        phi_new = torch.baddbmm(u, theta, self.m_phi)  # Φ₊ = U + θ M_Φ
        theta_new = torch.baddbmm(theta + u, theta, self.m_theta)  # θ₊ = θ + U + θ M_θ
        torch._foreach_copy_(self.params, [from_stiefel(t, q.shape) for t, q in zip(theta_new.unbind(0), self.params)])
        if self.writes_phi:
            torch._foreach_copy_(self.bufs, [from_stiefel(t, q.shape) for t, q in zip(phi_new.unbind(0), self.bufs)])


def prepare_torch(params, grads, bufs, fresh, *, lr, momentum, feedback, check_finite):
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i in range(len(params)):
        groups[_bucket_key(i, params, bufs, fresh, lr, momentum, feedback)].append(i)
    buckets = [_Bucket(idx, params, grads, bufs, key, check_finite) for key, idx in groups.items()]
    order = [i for b in buckets for i in b.idx]
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order))
    dev = params[0].device if params else torch.device("cpu")
    inverse = inverse.to(dev)
    dist = torch.cat([b.dist.to(torch.float64) for b in buckets])[inverse] if buckets else torch.zeros(0, device=dev)
    finite = torch.cat([b.finite for b in buckets])[inverse] if check_finite and buckets else None

    def apply() -> None:
        for b in buckets:
            b.apply()

    return StepPlan(dist=dist, finite=finite, apply=apply)
