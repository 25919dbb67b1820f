"""Independent NumPy oracles (float64 by default) used by the tests.

Written from the math (docs/algorithm.md §1–§3) without reading the package: the matrix
convention, the authors' term-by-term FGD sequence, Algorithm 1 of the paper as printed, and
SGD.
"""

from __future__ import annotations

import numpy as np


def to_theta(w: np.ndarray) -> np.ndarray:
    """n×p view with n >= p of w.reshape(c_o, -1)."""
    w2 = w.reshape(w.shape[0], -1)
    return w2.T.copy() if w2.shape[0] <= w2.shape[1] else w2.copy()


def from_theta(theta: np.ndarray, shape) -> np.ndarray:
    c_o = shape[0]
    m = int(np.prod(shape[1:]))
    w2 = theta.T if c_o <= m else theta
    return w2.reshape(shape)


def sym(m: np.ndarray) -> np.ndarray:
    return (m + m.T) / 2


def fgd_step(w, grad, phi, *, lr, momentum, feedback, dtype=np.float64):
    """One step of the authors' sequence on a parameter ``w`` (any shape).

    ``phi`` is Φ in θ (n×p) form or None (first step / momentum 0). Returns (w_new, phi_new)
    with phi_new in θ form (None when momentum == 0).
    """
    th = to_theta(np.asarray(w, dtype=dtype))
    g = to_theta(np.asarray(grad, dtype=dtype))
    lr, beta, alpha = dtype(lr), dtype(momentum), dtype(feedback)
    eye = np.eye(th.shape[1], dtype=dtype)
    ata = th.T @ th
    ninv = 2 * eye - ata
    if phi is None or momentum == 0:
        v = -lr * (g - th @ (ninv @ sym(th.T @ g)))
    else:
        phi = np.asarray(phi, dtype=dtype)
        tp = th.T @ phi
        con = -th @ (ninv @ (phi.T @ phi))
        rd = (beta - 1) * phi - lr * g
        rd = rd - th @ (ninv @ sym(th.T @ rd))
        ext = th @ (ninv @ ninv @ tp @ sym(tp))
        fb = -alpha * (th @ (ninv @ (tp.T @ ninv + tp)))
        v = phi + con + rd + ext + fb
    th_new = th + v - alpha * (th @ (ata - eye))
    return from_theta(th_new, np.shape(w)), (v if momentum != 0 else None)


def fgd_paper_step(w, grad, phi, *, lr, momentum, feedback, dtype=np.float64):
    """One step of Algorithm 1 of the paper as printed (Bu & Chang, AAAI 2022), in its own
    variables, with its practical approximation (θᵀθ)⁻¹ ≈ 2I − θᵀθ, read as "φ first, then θ
    with the new φ":

        φ ← φ + η[X_φ(θ, φ) − (α'/4) θ(θᵀθ)⁻¹(φᵀθ(θᵀθ)⁻¹ + θᵀφ)]
        θ ← θ + η[X_θ(θ, φ) − (α'/4) θ(I − (θᵀθ)⁻¹)],   X_θ(θ, φ) = φ − θ(θᵀθ)⁻¹ sym(θᵀφ)

    X_φ = θ(θᵀθ)⁻¹((θᵀθ)⁻¹θᵀφ sym(θᵀφ) − φᵀφ) + (D − θ(θᵀθ)⁻¹ sym(θᵀD))/η, D = −γφ − ∇L.
    The library's units: Φ = ηφ (step units), β = 1 − γ, α = ηα'/4. A first step (``phi``
    None, or momentum 0) starts from the paper's φ₀ = θ(θᵀθ)⁻¹ sym(θᵀ∇L) − ∇L. ``phi`` and the
    returned velocity are Φ in θ (n×p) form.
    """
    th = to_theta(np.asarray(w, dtype=dtype))
    g = to_theta(np.asarray(grad, dtype=dtype))
    eta, gamma = dtype(lr), dtype(1 - momentum)
    alpha_p = dtype(4 * feedback / lr)
    eye = np.eye(th.shape[1], dtype=dtype)
    inv = 2 * eye - th.T @ th  # (θᵀθ)⁻¹ ≈ 2I − θᵀθ
    if phi is None or momentum == 0:
        ph = th @ inv @ sym(th.T @ g) - g  # φ₀
    else:
        ph = np.asarray(phi, dtype=dtype) / eta
        d = -gamma * ph - g
        x_phi = th @ inv @ (inv @ th.T @ ph @ sym(th.T @ ph) - ph.T @ ph) + (d - th @ inv @ sym(th.T @ d)) / eta
        ph = ph + eta * (x_phi - alpha_p / 4 * (th @ inv @ (ph.T @ th @ inv + th.T @ ph)))
    x_theta = ph - th @ inv @ sym(th.T @ ph)
    th_new = th + eta * (x_theta - alpha_p / 4 * (th @ (eye - inv)))
    return from_theta(th_new, np.shape(w)), (eta * ph if momentum != 0 else None)


def landing_step(w, grad, buf, *, lr, momentum, attraction, eps, dampening=0.0, nesterov=False, weight_decay=0.0):
    """One step of Landing on St(n, p) (Ablin & Peyré 2022; Ablin, Vary, Gao & Absil 2023),
    float64, written from the papers with the ``n × n`` relative gradient formed explicitly:

        ψ = skew(G Xᵀ) X,  skew(M) = (M − Mᵀ)/2;  M ← μM + (1 − τ)ψ (M = ψ first);
        Λ = M (or ψ + μM, Nesterov) + λ X (XᵀX − I);  X ← X − η Λ

    η = min(lr, η*, 1/(2λ)) with η* the positive root of β η² − α η − (ε − d) = 0, d = ‖XᵀX − I‖_F,
    a = ‖M‖_F, α = 2(λd − ad − 2λd), β = a² + λ²d³ + 2λad² + a²d (``eps`` None: η = lr); beyond
    ε the step is X ← X − min(lr, 1/(2λ)) λ X(XᵀX − I). ``buf`` is M in θ form or None.
    """
    x = to_theta(np.asarray(w, dtype=np.float64))
    g = to_theta(np.asarray(grad, dtype=np.float64)) + weight_decay * x
    n, p = x.shape
    rel = g @ x.T  # the n × n relative gradient G Xᵀ
    psi = 0.5 * (rel - rel.T) @ x
    new_buf = None
    direction = psi
    if momentum != 0:
        new_buf = psi.copy() if buf is None else momentum * buf + (1 - dampening) * psi
        direction = psi + momentum * new_buf if nesterov else new_buf
    dist = x.T @ x - np.eye(p)
    normal = attraction * x @ dist
    if eps is None:
        return from_theta(x - lr * (direction + normal), np.shape(w)), new_buf
    d, a, lam = np.linalg.norm(dist), np.linalg.norm(direction), attraction
    if d >= eps:
        return from_theta(x - min(lr, 1 / (2 * lam)) * normal, np.shape(w)), new_buf
    alpha = 2 * (lam * d - a * d - 2 * lam * d)
    beta = a**2 + lam**2 * d**3 + 2 * lam * a * d**2 + a**2 * d
    eta = min(lr, 1 / (2 * lam))  # (past ηλ = ½ the pull overshoots: D → (1 − 2ηλ)D to first order)
    if beta != 0:
        eta = min(eta, max(np.roots([beta, -alpha, -(eps - d)]).real))
    return from_theta(x - eta * (direction + normal), np.shape(w)), new_buf


def sgd_step(w, grad, buf, *, lr, momentum, dampening, weight_decay, nesterov):
    d = grad + weight_decay * w
    if momentum != 0:
        buf = d.copy() if buf is None else momentum * buf + (1 - dampening) * d
        d = d + momentum * buf if nesterov else buf
    return w - lr * d, buf


def stiefel_dist(w) -> float:
    th = to_theta(np.asarray(w, dtype=np.float64))
    return float(np.linalg.norm(th.T @ th - np.eye(th.shape[1])))


def random_stiefel(rng: np.random.Generator, shape) -> np.ndarray:
    w = rng.standard_normal(shape)
    q, r = np.linalg.qr(to_theta(w))
    q = q * np.where(np.diag(r) < 0, -1.0, 1.0)
    return from_theta(q, shape)
