"""Torch backend: the two-pass form of the step (docs/algorithm.md §3), batched with ``bmm``.

Layers are bucketed by ``(n, p, layout, dtype, device, η, β, α, reads Φ, writes Φ)``; each
bucket is stacked once into ``X = [θ | Φ | g]`` (``[θ | g]`` when Φ is zero or absent) and
runs without a Python loop over its layers:

1. Gram pass, one ``bmm``: ``θᵀX = [A | B | E]`` with ``A = θᵀθ, B = θᵀΦ, E = θᵀg``; plus
   ``C = ΦᵀΦ``.
2. O(p³) algebra on ``(L, p, p)`` tensors (:mod:`.algebra`): ``M_Φ`` and ``M_θ``.
3. Update pass, two ``baddbmm``: ``U = βΦ − ηg``, ``Φ₊ = U + θM_Φ``, ``θ₊ = θ + U + θM_θ``,
   into new tensors during ``prepare``; ``apply`` only copies them into place, so a step that
   fails (including for lack of memory) fails before any write.

A first step (Φ = 0) is the same formula with ``B = C = 0``; ``momentum == 0`` is that
formula without storing Φ.

Layout: when ``θ = W2ᵀ`` (the usual case, ``c_o <= m``) the memory holds the rows
``R = θᵀ`` contiguously, so ``X`` is stored as ``(L, k·p, n)`` rows and every product is
taken in that layout (``(θM)ᵀ = MᵀR``): stacking and writing back are plain contiguous copies.
"""
from __future__ import annotations

from collections import defaultdict

import torch

from .._matrix import as_w2, stiefel_shape
from .algebra import middle
from .base import PRECISIONS, compute_dtype, fp32_matmuls, plan_of
from .tf32 import split_tf32

__all__ = ["prepare_torch"]


class _Bucket:
    """Grams and M matrices of a set of equal-shape layers; ``apply`` writes them."""

    def __init__(self, idx, params, grads, bufs, key, check_finite, precision):
        n, p, rows, dtype, device, lr, beta, alpha, reads_phi, writes_phi = key
        cdt = compute_dtype(dtype)
        self.layers, self.lr, self.beta, self.rows = idx, lr, beta, rows
        self.reads_phi, self.writes_phi, self.p = reads_phi, writes_phi, p
        self.params = [params[i] for i in idx]
        self.bufs = [bufs[i] for i in idx] if writes_phi else []
        k = 3 if reads_phi else 2
        blocks = [self.params] + ([self.bufs] if reads_phi else []) + [[grads[i] for i in idx]]
        # X in the parameters' own layout; `x` is always the (L, n, k·p) column view of it
        store = torch.empty((len(idx), k * p, n) if rows else (len(idx), n, k * p), dtype=cdt, device=device)
        x = store.transpose(1, 2) if rows else store
        for j, tensors in enumerate(blocks):
            part = store[:, j * p:(j + 1) * p, :] if rows else store[:, :, j * p:(j + 1) * p]
            torch._foreach_copy_(list(part.unbind(0)), [as_w2(t) for t in tensors])
        self.x = x
        theta = x[:, :, :p]
        gram = torch.bmm(theta.transpose(1, 2), x)  # θᵀ[θ | Φ | g] = [A | B | E]
        a = gram[:, :, :p]
        if precision == "tf32x3" and cdt == torch.float32:
            # lean 3×TF32, only A is split: hi = tf32(θ), lo = tf32(θ − hi) are TF32 numbers, so
            # a TF32 product sees them exactly; A ≈ H + L + Lᵀ with H = hiᵀhi, L = hiᵀlo
            hi, lo = split_tf32(theta)
            both = torch.bmm(hi.transpose(1, 2), torch.cat([hi, lo], dim=2))  # hiᵀ[hi | lo] = [H | L]
            low = both[:, :, p:]
            a = both[:, :, :p] + (low + low.transpose(1, 2))  # A ≈ H + (L + Lᵀ)
        e = gram[:, :, (k - 1) * p:]
        b = c = None
        if reads_phi:
            phi = x[:, :, p:2 * p]
            b = gram[:, :, p:2 * p]
            c = torch.bmm(phi.transpose(1, 2), phi)  # C = ΦᵀΦ
        mid = middle(a, b, c, e, lr=lr, beta=beta, alpha=alpha)  # M_θ, M_Φ, ‖A − I‖_F
        self.m_theta, self.m_phi, self.dist = mid.m_theta, mid.m_phi, mid.dist
        g = x[:, :, (k - 1) * p:]
        # max |g| is NaN/Inf exactly when g has a NaN/Inf (amax propagates NaN)
        self.finite = torch.isfinite(torch.linalg.vector_norm(g, float("inf"), dim=(1, 2))) if check_finite else None

    def _times_plus(self, u: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        """``θ M + u`` in the stored layout (rows: ``MᵀR + uᵀ``), returned as stored."""
        theta = self.x[:, :, :self.p]
        if self.rows:
            return torch.baddbmm(u.transpose(1, 2), m.transpose(1, 2), theta.transpose(1, 2))
        return torch.baddbmm(u, theta, m)

    def update(self) -> None:
        """Pass 2 into new tensors (nothing is written yet: a failure here changes nothing)."""
        p, x = self.p, self.x
        u = x[:, :, -p:] * (-self.lr)  # U = βΦ − ηg
        if self.reads_phi:
            u.add_(x[:, :, p:2 * p], alpha=self.beta)
        self.phi_new = self._times_plus(u, self.m_phi)  # Φ₊ = U + θ M_Φ
        self.theta_new = self._times_plus(u.add_(x[:, :, :p]), self.m_theta)  # θ₊ = (θ + U) + θ M_θ
        self.x = None  # the stacked inputs are no longer needed

    def apply(self) -> None:
        # copy into the tensors themselves (a reshape of a channels_last weight is a copy)
        torch._foreach_copy_(self.params, [t.reshape(q.shape) for t, q in zip(self.theta_new.unbind(0), self.params)])
        if self.writes_phi:
            torch._foreach_copy_(self.bufs, [t.reshape(q.shape) for t, q in zip(self.phi_new.unbind(0), self.bufs)])


def prepare_torch(params, grads, bufs, fresh, *, lr, momentum, feedback, check_finite, precision="ieee"):
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, param in enumerate(params):
        n, p, rows = stiefel_shape(param.shape)
        reads_phi = bufs[i] is not None and not fresh[i]
        key = (n, p, rows, param.dtype, param.device, lr[i], momentum[i], feedback[i], reads_phi, bufs[i] is not None)
        groups[key].append(i)
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision={precision!r}: choose one of {', '.join(map(repr, PRECISIONS))}")
    with fp32_matmuls(precision):  # IEEE fp32 or TF32 products, whatever the global setting
        buckets = [_Bucket(idx, params, grads, bufs, key, check_finite, precision) for key, idx in groups.items()]
        for b in buckets:  # compute θ₊, Φ₊ here: apply() then only copies, so it cannot fail half-way
            b.update()
    return plan_of(buckets, params[0].device if params else torch.device("cpu"), check_finite)
