r"""The Cayley retraction of Li, Li & Todorovic (ICLR 2020), batched over equal-shape layers.

Notation (docs/algorithm.md §7): ``X`` is ``n × p`` with orthonormal columns, ``M``
(``n × p``) the momentum, and every tensor here carries a leading batch dimension ``L``.
The skew matrix of the update is

.. math::

    Ŵ = M Xᵀ − ½ X (Xᵀ M Xᵀ),\qquad W = Ŵ − Ŵᵀ = P Xᵀ − X Pᵀ,\qquad P = M − ½ X (XᵀM).

The optimizer moves along ``W_d = c·W`` (``c = 1`` for Cayley SGD, ``c = −1/r`` for Cayley
ADAM), with step ``t = min(lr, 2q / (‖W_d‖ + ε))``, starting from ``Y₀ = X + t W_d X`` and
running ``s`` fixed-point iterations of the Cayley transform

.. math::

    Y ← X + \tfrac{t}{2} W_d (X + Y).

The map ``Y ↦ X + (t/2) W_d (X + Y)`` is a contraction with factor ``(t/2)‖W_d‖₂ ≤ q`` because
both norms offered (Frobenius, and the matrix 1-norm for a skew matrix) bound the spectral norm.

Two forms compute the same iterates:

* :func:`dense_cayley` forms ``W`` (``n × n``) like the public code: O(n²p) time, O(n²) memory.
* :func:`lowrank_coefficients` never leaves ``p``-sized algebra. ``W`` maps every vector into
  ``span[X, M]`` (since ``P`` is in it), so with the basis ``B = [X | M]`` (``n × 2p``)

  .. math::

      W B = B K,\qquad K = \begin{bmatrix} −½EA − Eᵀ + ½EᵀA & −½E² − C + ½EᵀE \\ A & E \end{bmatrix}

  (``A = XᵀX``, ``E = XᵀM``, ``C = MᵀM``: one Gram ``BᵀB``). Every iterate is
  ``Y = X + B d`` with a ``2p × p`` coefficient ``d``: ``d₀ = t c K e₁``,
  ``d ← t c K e₁ + (t/2) c K d`` (``e₁ = [I; 0]``, ``X = B e₁``), and ``W X = B K e₁``. The
  optimizer then needs one product ``B [d | K e₁] = [Y − X | W X]``: O(n p²) in all,
  independent of ``s``. Keeping the increment ``d`` rather than ``Y``'s coefficient
  ``e₁ + d`` avoids rounding the small ``d`` against 1 in float32.
"""

from __future__ import annotations

import torch

__all__ = ["NORMS", "skew_fro_norm", "lowrank_coefficients", "dense_cayley"]

#: Norms of W for the step-size rule: ``"fro"`` (both forms), ``"one"`` (max column abs sum,
#: the public code's; needs the dense form).
NORMS = ("fro", "one")


def _scale3(scale: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    """``c`` as an ``(L, 1, 1)`` (or ``(1, 1, 1)``) tensor of ``like``'s dtype and device."""
    if isinstance(scale, torch.Tensor):
        return scale.to(like.dtype).reshape(-1, 1, 1)
    return torch.full((1, 1, 1), float(scale), dtype=like.dtype, device=like.device)


def _step_size(norm_w: torch.Tensor, *, lr: float, q: float, eps: float) -> torch.Tensor:
    """``t = min(lr, 2q / (‖W_d‖ + ε))`` per layer, shape ``(L, 1, 1)``."""
    return torch.clamp(2.0 * q / (norm_w + eps), max=lr).reshape(-1, 1, 1)


def skew_fro_norm(a: torch.Tensor, e: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    r"""``‖W‖_F`` of ``W = P Xᵀ − X Pᵀ`` from the Grams ``A = XᵀX``, ``E = XᵀM``, ``C = MᵀM``.

    ``‖W‖_F² = ‖PXᵀ‖² + ‖XPᵀ‖² − 2⟨PXᵀ, XPᵀ⟩ = 2 (tr(PᵀP·A) − tr((XᵀP)²))`` with
    ``PᵀP = C − EᵀE + ¼ EᵀAE`` and ``XᵀP = E − ½AE``. Exact for any ``X`` (orthonormal or
    not); the difference is clamped at 0 against rounding before the square root.
    """
    at = e.transpose(1, 2)  # Eᵀ
    ae = torch.bmm(a, e)  # A E
    ptp = c - torch.bmm(at, e) + 0.25 * torch.bmm(at, ae)  # PᵀP = C − EᵀE + ¼EᵀAE
    xtp = e - 0.5 * ae  # XᵀP = E − ½AE
    # tr(PᵀP·A) = Σ (PᵀP ∘ A) (both symmetric);  tr(F²) = Σ (F ∘ Fᵀ)
    sq = 2.0 * ((ptp * a).sum((1, 2)) - (xtp * xtp.transpose(1, 2)).sum((1, 2)))
    return sq.clamp_min(0.0).sqrt()


def lowrank_coefficients(
    gram: torch.Tensor,
    scale: torch.Tensor | float,
    *,
    lr: float,
    q: float,
    s: int,
    eps: float,
    init: float | None = None,
) -> torch.Tensor:
    r"""The ``2p × 2p`` matrix ``Q = [d_s | K e₁]`` with ``[X | M] Q = [Y_s − X | W X]``.

    ``gram`` is ``BᵀB`` for ``B = [X | M]`` (``(L, 2p, 2p)``); ``scale`` is ``c`` (a number or
    an ``(L,)`` tensor), so the iteration moves along ``W_d = c·W`` with ``‖W_d‖ = |c|·‖W‖_F``.
    ``init=None`` starts from ``Y₀ = X + t W_d X``; a number σ starts from ``Y₀ = X + tσM``
    (the public code's un-projected start).
    """
    p = gram.shape[-1] // 2
    a, e, c_mm = gram[:, :p, :p], gram[:, :p, p:], gram[:, p:, p:]  # A, E, C
    scale = _scale3(scale, gram)
    at = e.transpose(1, 2)
    k = torch.empty_like(gram)
    # top row: coefficients on X of W·X and W·M
    k[:, :p, :p] = torch.bmm(at, a).mul_(0.5).sub_(at).sub_(torch.bmm(e, a), alpha=0.5)  # ½EᵀA − Eᵀ − ½EA
    k[:, :p, p:] = torch.bmm(at, e).mul_(0.5).sub_(c_mm).sub_(torch.bmm(e, e), alpha=0.5)  # ½EᵀE − C − ½E²
    # bottom row: coefficients on M
    k[:, p:, :p] = a  # A
    k[:, p:, p:] = e  # E
    norm = skew_fro_norm(a, e, c_mm) * scale.abs().reshape(-1)  # ‖W_d‖_F = |c|·‖W‖_F
    t = _step_size(norm, lr=lr, q=q, eps=eps)  # t = min(lr, 2q/(‖W_d‖_F + ε))
    k_dir = k * scale  # K_d = c·K, so W_d B = B K_d
    wx = k[:, :, :p]  # W X = B (K e₁)
    # iterate on the increment D = Y − X = B d (small, so float32 keeps its digits):
    # Y ← X + (t/2) W_d (X + Y)  ⇔  d ← t K_d e₁ + (t/2) K_d d
    step = t * k_dir[:, :, :p]  # t K_d e₁ (t W_d X)
    if init is None:
        d = step  # Y₀ = X + t W_d X
    else:
        d = torch.zeros_like(step)
        d[:, p:, :] = (init * t) * torch.eye(p, dtype=gram.dtype, device=gram.device)  # Y₀ = X + tσM
    k_half = (0.5 * t) * k_dir  # (t/2) K_d
    for _ in range(s):
        d = torch.baddbmm(step, k_half, d)  # d ← t K_d e₁ + (t/2) K_d d
    return torch.cat((d, wx), dim=2)


def dense_cayley(
    x: torch.Tensor,
    m: torch.Tensor,
    scale: torch.Tensor | float,
    *,
    lr: float,
    q: float,
    s: int,
    eps: float,
    norm: str,
    init: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Y_s, W X)`` with the ``n × n`` skew ``W`` formed explicitly (the public code's cost).

    ``x``, ``m``: ``(L, n, p)``; ``scale``, ``init`` as in :func:`lowrank_coefficients`;
    ``norm`` is ``"fro"`` or ``"one"`` (largest column sum of ``|W_d|``).
    """
    scale = _scale3(scale, x)
    xt = x.transpose(1, 2)
    xtm_xt = torch.bmm(torch.bmm(xt, m), xt)  # Xᵀ M Xᵀ  (p × n)
    w_hat = torch.baddbmm(torch.bmm(m, xt), x, xtm_xt, alpha=-0.5)  # Ŵ = M Xᵀ − ½ X (XᵀMXᵀ)
    w = w_hat - w_hat.transpose(1, 2)  # W = Ŵ − Ŵᵀ
    del w_hat
    norm_w = torch.linalg.matrix_norm(w, ord="fro" if norm == "fro" else 1)
    t = _step_size(norm_w * scale.abs().reshape(-1), lr=lr, q=q, eps=eps)  # t = min(lr, 2q/(|c|‖W‖ + ε))
    wx = torch.bmm(w, x)  # W X (the new momentum)
    if init is None:
        y = x + (t * scale) * wx  # Y₀ = X + t W_d X
    else:
        y = x + (init * t) * m  # Y₀ = X + tσM
    w.mul_((0.5 * t) * scale)  # (t/2) W_d, in place: one n × n buffer
    for _ in range(s):
        y = torch.baddbmm(x, w, x + y)  # Y ← X + (t/2) W_d (X + Y)
    return y, wx
