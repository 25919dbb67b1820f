"""Independent NumPy oracles for Cayley SGD / ADAM (float64 unless asked otherwise).

Written from the equations of docs/algorithm.md §7 and of the paper, one layer at a time and
with the dense n×n skew matrix; nothing here reads the package. ADAM follows the library's
reading of the paper's Algorithm 2 (v starts at 0; Y₀ = X − tW̃X, not the printed X − t·rW̃X:
``tests/test_baselines.py`` checks that choice against the exact Cayley transform).
The ``public_*`` functions transcribe what the public code computes (its rows convention
``X = W2ᵀ``, renormalised rows, s = 5, the 1-norm, the un-projected start, SGD momentum lost).
"""

from __future__ import annotations

import numpy as np

from oracle import from_theta, to_theta


def skew(x: np.ndarray, m: np.ndarray) -> np.ndarray:
    """W = Ŵ − Ŵᵀ with Ŵ = M Xᵀ − ½ X (Xᵀ M Xᵀ)  (n×n)."""
    w_hat = m @ x.T - 0.5 * x @ (x.T @ m @ x.T)
    return w_hat - w_hat.T


def matrix_norm(w: np.ndarray, norm: str) -> float:
    if norm == "fro":
        return np.sqrt(np.sum(w * w))
    return np.max(np.sum(np.abs(w), axis=0))  # the matrix 1-norm: largest column sum


def cayley_loop(x, w, t, y0, s):
    """Y ← X + (t/2) W (X + Y), s times, from y0."""
    y = y0
    for _ in range(s):
        y = x + (t / 2) * (w @ (x + y))
    return y


def unit_columns(x, eps):
    return x / (np.sqrt(np.sum(x * x, axis=0, keepdims=True)) + eps)


def qr_sign(x):
    q, r = np.linalg.qr(x)
    d = np.sign(np.diag(r))
    return q * np.where(d == 0, 1, d)


def sgd_step(
    w, grad, mom, *, lr, momentum, q=0.5, s=2, eps=1e-8, norm="fro", renormalize=False, qr=False, dtype=np.float64
):
    """One Cayley SGD step on parameter ``w``; ``mom`` is M in θ form or None.

    Returns (w_new, M_new in θ form, t) — M_new is None when momentum == 0.
    """
    f = dtype
    x = to_theta(np.asarray(w, dtype=f))
    g = to_theta(np.asarray(grad, dtype=f))
    if renormalize:
        x = unit_columns(x, f(eps))
    if qr:
        x = qr_sign(x)
    m = -g if mom is None else f(momentum) * mom - g
    wm = skew(x, m)
    m = wm @ x
    t = min(f(lr), f(2 * q) / (f(matrix_norm(wm, norm)) + f(eps)))
    y = cayley_loop(x, wm, t, x + t * m, s)
    return from_theta(y, np.shape(w)), (m if momentum > 0 else None), t


def adam_step(
    w, grad, m, v, k, *, lr, betas, q=0.5, s=2, eps=1e-8, norm="fro", renormalize=False, qr=False, dtype=np.float64
):
    """Step ``k`` (1-based) of Cayley ADAM; ``m`` in θ form (None: zero), ``v`` a scalar.

    Returns (w_new, m_new, v_new, t).
    """
    f = dtype
    b1, b2 = f(betas[0]), f(betas[1])
    x = to_theta(np.asarray(w, dtype=f))
    g = to_theta(np.asarray(grad, dtype=f))
    if renormalize:
        x = unit_columns(x, f(eps))
    if qr:
        x = qr_sign(x)
    m = (1 - b1) * g if m is None else b1 * m + (1 - b1) * g
    v = (1 - b2) * np.sum(g * g) if v is None else b2 * v + (1 - b2) * np.sum(g * g)
    m_hat = m / (1 - b1**k)
    v_hat = v / (1 - b2**k)
    wn = skew(x, m_hat) / np.sqrt(v_hat + f(eps))
    t = min(f(lr), f(2 * q) / (f(matrix_norm(wn, norm)) + f(eps)))
    y = cayley_loop(x, -wn, t, x - t * (wn @ x), s)
    m_new = (1 - b1**k) * np.sqrt(v_hat + f(eps)) * (wn @ x)
    return from_theta(y, np.shape(w)), m_new, v, t


def _public_rows(w, eps, qr):
    """The public code's X: rows of W2 = w.reshape(c_o, -1) divided by (norm + eps), QR'd if asked."""
    w2 = np.asarray(w).reshape(np.shape(w)[0], -1)
    assert w2.shape[0] <= w2.shape[1], "the public code only constrains c_o <= m"
    rows = w2 / (np.linalg.norm(w2, axis=1, keepdims=True) + eps)
    if qr:
        rows = qr_sign(rows.T).T
    return rows.T  # X, n×p


def public_sgd_step(w, grad, *, lr, qr=False, eps=1e-8):
    """The public SGDG step: V = 0·buffer − Gᵀ (the stored momentum is never updated)."""
    x = _public_rows(w, eps, qr)
    v = -np.asarray(grad).reshape(np.shape(grad)[0], -1).T
    wm = skew(x, v)
    t = min(lr, 1.0 / (matrix_norm(wm, "one") + eps))
    y = cayley_loop(x, wm, t, x + t * v, 5)
    return y.T.reshape(np.shape(w))


def public_adam_step(w, grad, m, v, k, *, lr, betas, qr=False, eps=1e-8):
    """The public AdamG step (m, v kept); returns (w_new, m_new, v_new)."""
    b1, b2 = betas
    x = _public_rows(w, eps, qr)
    g = np.asarray(grad).reshape(np.shape(grad)[0], -1).T
    m = (1 - b1) * g + (0 if m is None else b1 * m)
    v = (1 - b2) * np.sum(g * g) + (0 if v is None else b2 * v)
    m_hat, v_hat = m / (1 - b1**k), v / (1 - b2**k)
    wn = skew(x, m_hat) / np.sqrt(v_hat + eps)
    t = min(lr, 1.0 / (matrix_norm(wn, "one") + eps))
    y = cayley_loop(x, -wn, t, x - t * m, 5)
    m_new = (wn @ x) * np.sqrt(v_hat + eps) * (1 - b1**k)
    return y.T.reshape(np.shape(w)), m_new, v
