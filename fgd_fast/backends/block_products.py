"""The middle's ``p × p`` products, in one place (so a check can run them at another precision).

Every ``p × p`` product goes through :func:`mm`, :func:`mm_add` or
:func:`i_plus_d` (one place, so a check can run them at another precision), and every product
with ``N = 2I − A = I − D`` or ``A = I + D`` is written as ``X ∓ D·X`` (:func:`i_plus_d`): the
identity's part is exact and only the small correction ``D·X`` (``‖D‖`` ~1e-6…1e-2) is a
product. So a middle run on TF32 tensor cores (``precision="tf32"``/``"tf32x3"``) keeps fp32
accuracy where it matters: TF32's ~2⁻¹¹ relative error touches ``D·X`` and the second-order
terms, not ``X``; in ``(I − D)·X`` it would round ``I − D`` itself (``1 − 1e-6`` is 1 in
TF32) and lose D altogether (``benchmarks/studies/tf32_middle.py`` measures both on the
workloads with TF32 emulated: :func:`.tf32.emulated_tf32_middle`).

The ``block_*`` forms take a :class:`.layout.Layout` (blocks of several p in one flat buffer, or
one ``(L, p, p)`` batch) and run each product per group of equal p, or as one launch over every
layer where the backend set ``Layout.products`` (:mod:`.mid_products`).
"""

from __future__ import annotations

import torch

from .layout import Layout

__all__ = [
    "Scalar",
    "mm",
    "mm_add",
    "i_plus_d",
    "sym",
    "axpy",
    "axpy_",
    "plus_t",
    "block_mm",
    "block_mm_add",
    "block_i_plus_d",
]

Scalar = float | torch.Tensor


def mm(x: torch.Tensor, y: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ y``: a ``p × p`` product of the middle (into ``out`` if given)."""
    return torch.matmul(x, y, out=out) if out is not None else torch.matmul(x, y)


def mm_add(
    z: torch.Tensor, x: torch.Tensor, y: torch.Tensor, out: torch.Tensor | None = None, alpha: float = 1.0
) -> torch.Tensor:
    """``z + α·x @ y`` (a new tensor, or ``out``): a ``p × p`` product of the middle added to ``z``."""
    if z.dim() == x.dim() == y.dim() == 3:
        if out is not None:
            return torch.baddbmm(z, x, y, alpha=alpha, out=out)
        return torch.baddbmm(z, x, y, alpha=alpha)
    product = torch.matmul(x, y)
    return torch.add(z, product, alpha=alpha, out=out) if out is not None else torch.add(z, product, alpha=alpha)


def i_plus_d(d: torch.Tensor, x: torch.Tensor, alpha: Scalar, extra: torch.Tensor | None = None) -> torch.Tensor:
    """``(I + αD)·X (+ extra)``, as ``X + α·D·X``: the identity's part exact, only the small
    correction ``D·X`` a product (``N = I − D``: α = −1; ``A = I + D``: α = 1)."""
    z = x if extra is None else x + extra
    if isinstance(alpha, (int, float)) and z.dim() == d.dim() == x.dim() == 3:
        return torch.baddbmm(z, d, x, alpha=alpha)
    return z + alpha * mm(d, x)


def sym(m: torch.Tensor) -> torch.Tensor:
    """``sym(M) = (M + Mᵀ)/2`` of a matrix or a batch of matrices."""
    return 0.5 * (m + m.transpose(-1, -2))


def axpy(x: torch.Tensor, y: torch.Tensor, a) -> torch.Tensor:
    """``x + a·y`` (a new tensor) in one op where ``a`` is a number."""
    return torch.add(x, y, alpha=a) if isinstance(a, (int, float)) else x + a * y


def axpy_(x: torch.Tensor, y: torch.Tensor, a) -> torch.Tensor:
    """``x ← x + a·y`` in place (``x`` a temporary of the middle; each block it does not allocate
    is one cold buffer fewer: the middle's ops are memory-bound on a CPU)."""
    return x.add_(y, alpha=a) if isinstance(a, (int, float)) else x.add_(a * y)


def plus_t(lay: Layout, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x + yᵀ`` per layer (a new tensor); with several p the gathered ``yᵀ`` is new already and
    takes ``x`` in place."""
    return x + lay.t(y) if lay.single else lay.t(y).add_(x)


# -- the middle's products over a layout (per group; see :mod:`.layout`) ----------------------
def block_mm(lay: Layout, x, y, tx: bool = False) -> torch.Tensor:
    """``XY`` (``XᵀY`` with ``tx``) per layer."""
    if lay.products is not None:  # the backend's (one launch for every p)
        return lay.products(lay, x, y, tx=tx)
    if lay.single:
        return mm(x.transpose(-1, -2) if tx else x, y)
    out = lay.empty(x.dtype)
    for xk, yk, ok in zip(lay.pieces(x), lay.pieces(y), lay.pieces(out)):
        mm(xk.transpose(-1, -2) if tx else xk, yk, out=ok)
    return out


def block_mm_add(lay: Layout, z, x, y, tx: bool = False, alpha: float = 1.0) -> torch.Tensor:
    """``Z + αXY`` (``Z + αXᵀY`` with ``tx``) per layer."""
    if lay.products is not None:
        return lay.products(lay, x, y, z=z, alpha=alpha, tx=tx)
    if lay.single:
        return mm_add(z, x.transpose(-1, -2) if tx else x, y, alpha=alpha)
    out = lay.empty(x.dtype)
    for zk, xk, yk, ok in zip(lay.pieces(z), lay.pieces(x), lay.pieces(y), lay.pieces(out)):
        mm_add(zk, xk.transpose(-1, -2) if tx else xk, yk, out=ok, alpha=alpha)
    return out


def block_i_plus_d(lay: Layout, d, x, alpha: Scalar, extra=None) -> torch.Tensor:
    """``(I + αD)·X (+ extra)`` per layer as ``X + α·D·X`` (:func:`i_plus_d`); ``alpha`` a
    number or ``L`` per-layer values."""
    if lay.products is not None:
        return lay.products(lay, d, x, z=x if extra is None else x + extra, alpha=alpha)
    if lay.single:
        return i_plus_d(d, x, lay.col(alpha), extra)
    z = x if extra is None else x + extra
    if not isinstance(alpha, (int, float)):  # per-layer α
        return z + lay.col(alpha) * block_mm(lay, d, x)
    return block_mm_add(lay, z, d, x, alpha=alpha)
