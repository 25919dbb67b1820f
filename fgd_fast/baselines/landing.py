"""``LandingSGD``: the landing algorithm on the Stiefel manifold, FGD's closest modern peer.

Landing (Ablin & Peyré, AISTATS 2022; on St(n, p) with a safe step size: Ablin, Vary, Gao &
Absil, 2023) is, like FGD, retraction-free and O(np²) per step. With θ the ``n × p`` matrix of
a parameter (θᵀθ = I on the manifold), G its gradient, A = θᵀθ and D = A − I, one step is

.. math::

    ψ &= \\mathrm{skew}(Gθᵀ)\\,θ = ½(G A − θ\\,Gᵀθ)        &&\\text{(relative gradient, never } n × n\\text{)} \\\\
    M &← μ M + (1 − τ) ψ  \\quad (M = ψ \\text{ on the first step})  &&\\text{(momentum on ψ)} \\\\
    Λ &= M + λ\\, θ D                                      &&\\text{(landing field)} \\\\
    θ &← θ − η\\,Λ,  \\qquad η = \\min(\\mathrm{lr},\\ η^*(d, a),\\ 1/(2λ))

with ``d = ‖D‖_F``, ``a = ‖M‖_F`` and the safe step of the authors' Stiefel code, the largest
η that keeps the next distance below ``safe_distance`` ε:

.. math::

    η^* = \\frac{α + \\sqrt{α² + 4β(ε − d)}}{2β},\\quad α = −2d(λ + a),\\quad
    β = a² + λ²d³ + 2λa d² + a² d.

ψ is tangent-like (θᵀψ is skew), so it moves θ along the manifold, and λθD pulls θ back;
without momentum the safe step keeps every iterate within ε. The cap 1/(2λ) is part of that:
to first order the pull maps D to (1 − 2ηλ)D, and past ηλ = ½ it overshoots — with a small
gradient and a large lr the authors' η* alone (their code has no cap) took θ from 0.003 to 0.55
beyond ε = 0.5 in one step (a test has that case). With momentum the direction M
mixes relative gradients of earlier θ and is no longer exactly tangent-like, so ε is a target
rather than a bound (as in the authors' code; measured: up to 1.39 for ε = 0.5 at μ = 0.9,
lr = 10 and gradients of norm ~3√(np)). Two
choices differ from the authors' code, both documented: the momentum buffer starts at ψ (as
``torch.optim.SGD`` starts at the first direction; their code starts it at μG + ψ), and where
θ is already beyond ε (where their formula's root turns negative) the step is the pure
attraction ``θ ← θ − η λ θD`` with ``η = min(lr, 1/(2λ))``, which maps D to O(D²).
Weight decay, as in the authors' code, is added to G of orthogonal parameters too, where it
changes nothing but rounding (G = wd·θ gives ψ = ½wd(θA − θA) = 0). Groups
without ``orthogonal=True`` get ``torch.optim.SGD``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from .._matrix import as_stiefel, from_stiefel
from .._stiefel_optimizer import StiefelOptimizer, option, state_outside_inference_mode, step_outside_autocast
from ..backends import compute_dtype
from ..guards import raise_if_invalid
from ..validation import (
    check_bool,
    check_dampening,
    check_keys,
    check_nesterov,
    check_nonnegative,
    check_positive,
    check_unit_interval,
)

__all__ = ["LandingSGD", "safe_step_size"]

_GROUP_KEYS = ("lr", "momentum", "dampening", "weight_decay", "nesterov", "attraction", "orthogonal")


def safe_step_size(d: torch.Tensor, a: torch.Tensor, attraction: float, eps: float) -> torch.Tensor:
    """min(η*, 1/(2λ)) of the module docstring (float64 tensors ``d``, ``a``); ``nan`` where
    ``d ≥ ε`` (outside the safe region)."""
    lam = attraction
    alpha = -2.0 * d * (lam + a)  # α = 2(λd − ad − 2λd)
    beta = a * a + lam * lam * d**3 + 2.0 * lam * a * d * d + a * a * d  # β = a² + λ²d³ + 2λad² + a²d
    disc = alpha * alpha + 4.0 * beta * (eps - d)
    root = (alpha + torch.sqrt(disc)) / (2.0 * beta)  # η* = (α + √(α² + 4β(ε − d)))/(2β)
    root = torch.where(beta > 0, root, torch.full_like(root, float("inf")))  # (a = d = 0: no step leaves)
    root = torch.clamp(root, max=0.5 / lam)  # min(η*, 1/(2λ)): past it the pull overshoots
    return torch.where(d < eps, root, torch.full_like(root, float("nan")))


def _finite(grad: torch.Tensor, buf: torch.Tensor | None) -> torch.Tensor:
    """A 0-d flag: the gradient (or new θ) and the momentum buffer (if any) are finite."""
    ok = torch.isfinite(grad).all()
    return ok if buf is None else ok & torch.isfinite(buf).all()


class LandingSGD(StiefelOptimizer):
    r"""Landing SGD with momentum and the safe step size (see the module docstring).

    Args:
        params: parameters or groups; ``orthogonal=True`` marks Stiefel-constrained ones
            (``fgd_fast.stiefel_param_groups(model)`` builds them). A group may override
            ``lr``, ``momentum``, ``dampening``, ``weight_decay``, ``nesterov``, ``attraction``.
        lr: the step size η (>= 0); the safe step may take a smaller one per layer (at most
            1/(2λ)).
        momentum, dampening, nesterov: μ, τ and Nesterov as in ``torch.optim.SGD``, applied
            to the relative gradient ψ of orthogonal parameters.
        weight_decay: added to the gradient (orthogonal parameters too, as the authors do;
            there its relative gradient is zero, so it changes θ only by rounding).
        attraction: λ > 0, the weight of the pull towards the manifold (the authors'
            ``lambda_regul``; default 1).
        safe_distance: ε in (0, 1), the distance ‖θᵀθ − I‖_F the safe step keeps θ inside (the
            authors' ``safe_step``; default 0.5), or ``None`` for the plain step η = lr.
        check_finite: raise ``FloatingPointError`` (changing nothing) on a non-finite
            gradient or momentum buffer of an orthogonal parameter (one host synchronisation).
        maximize: maximise the objective (the gradient negated for every parameter).
    """

    _orthogonal_buffers = ("momentum_buffer",)

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float,
        *,
        momentum: float = 0.9,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        attraction: float = 1.0,
        safe_distance: float | None = 0.5,
        check_finite: bool = True,
        maximize: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            attraction=attraction,
            orthogonal=False,
            safe_distance=safe_distance,
            check_finite=check_finite,
            maximize=maximize,
        )
        self._validate_options(defaults)
        _check_group(defaults)
        super().__init__(params, defaults)

    _OPTIONS = dict(safe_distance=0.5, check_finite=True, maximize=False)
    _STATE_DICT_KEYS = ("orthogonal", "attraction")
    safe_distance = option("safe_distance", "ε of the safe step, or None (optimizer-wide).")
    check_finite = option("check_finite", "Raise on a non-finite gradient or buffer (optimizer-wide).")
    maximize = option("maximize", "Maximise the objective: the gradient negated (optimizer-wide).")

    def _validate_options(self, options: dict[str, Any]) -> None:
        eps = options["safe_distance"]
        if eps is not None:
            check_positive("safe_distance", eps, "0.5 is the authors' default; None turns the safe step off")
            if not eps < 1.0:
                raise ValueError(
                    f"invalid safe_distance={eps}: it must lie in (0, 1) (the authors' default is 0.5), or be None "
                    "to turn the safe step off"
                )
        check_bool("check_finite", options["check_finite"])
        check_bool("maximize", options["maximize"])

    def _validate_group(self, group: dict[str, Any], at_step: bool = False) -> None:
        _check_group(group, at_step)

    @torch.no_grad()
    @state_outside_inference_mode
    @step_outside_autocast
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Perform one optimisation step; nothing changes if it raises."""
        loss = self._run_closure(closure)
        planned, finite, finite_next, labels, euclidean = [], [], [], [], {}
        for group, p, text in self._params_with_grads():
            if not group["orthogonal"]:
                euclidean.setdefault(id(group), (group, []))[1].append(p)
                continue
            if p.numel() == 0:
                continue
            new_theta, new_buf = self._landing(group, p)
            planned.append((p, new_theta, new_buf))
            labels.append(text)
            if self.check_finite:  # (the inputs, and what the step would write: a finite g can overflow)
                finite.append(_finite(p.grad, self.state.get(p, {}).get("momentum_buffer")))
                finite_next.append(_finite(new_theta, new_buf))
        if planned and self.check_finite:  # the one host synchronisation; raises before any write
            dev = planned[0][0].device
            raise_if_invalid(
                [torch.zeros(len(planned), device=dev)],
                [torch.stack([f.to(dev) for f in finite])],
                [list(range(len(planned)))],
                labels,
                check_finite=True,
                check_manifold=False,
                finite_next=[torch.stack([f.to(dev) for f in finite_next])],
                fgd=False,
                params=[p for p, _, _ in planned],
            )
        for group, ps in euclidean.values():  # (first: its temporaries allocated before an orthogonal write)
            self._group_sgd(group, ps)
        for p, new_theta, new_buf in planned:
            p.copy_(new_theta)
            if new_buf is not None:
                state = self.state[p]
                if state.get("momentum_buffer") is not None:  # (None, as loaded or set by hand: a fresh buffer)
                    state["momentum_buffer"].copy_(new_buf)
                else:
                    state["momentum_buffer"] = new_buf
        return loss

    def _landing(self, group: dict[str, Any], p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """θ₊ and the new buffer of ``p`` in its own shape (nothing written)."""
        cdt = compute_dtype(p.dtype)
        lr, mu, lam = float(group["lr"]), float(group["momentum"]), float(group["attraction"])
        theta = as_stiefel(p).to(cdt)
        g = as_stiefel(p.grad).to(cdt)
        if self.maximize:
            g = -g  # ascend
        if group["weight_decay"] != 0.0:
            g = g + float(group["weight_decay"]) * theta  # G + wd·θ
        eye = torch.eye(theta.shape[1], dtype=cdt, device=theta.device)
        a = theta.T @ theta  # A = θᵀθ
        d = a - eye  # D = A − I
        psi = 0.5 * (g @ a - theta @ (g.T @ theta))  # ψ = ½(G A − θ Gᵀθ) = skew(Gθᵀ)θ
        new_buf = None
        direction = psi
        if mu != 0.0:
            old = self.state.get(p, {}).get("momentum_buffer")
            if old is None:
                buf = psi.clone()  # M = ψ on the first step
            else:
                buf = as_stiefel(old).to(cdt) * mu + psi * (1.0 - float(group["dampening"]))  # M ← μM + (1 − τ)ψ
            direction = psi + mu * buf if group["nesterov"] else buf
            new_buf = from_stiefel(buf, p.shape).to(cdt).contiguous()
        normal = lam * (theta @ d)  # λθD
        eps = self.safe_distance
        if eps is None:
            new_theta = theta - lr * (direction + normal)  # θ₊ = θ − η(M + λθD)
        else:
            dist = torch.linalg.matrix_norm(d.double())  # (float64: ‖M + …‖ of a huge finite g overflows float32)
            size = torch.linalg.matrix_norm(direction.double())
            star = safe_step_size(dist, size, lam, eps)
            inside = dist < eps
            eta = torch.clamp(torch.nan_to_num(star, nan=0.0), max=lr).to(cdt)  # min(lr, η*, 1/(2λ))
            pull = torch.as_tensor(min(lr, 0.5 / lam), dtype=cdt, device=theta.device)  # outside: min(lr, 1/(2λ))
            eta = torch.where(inside, eta, pull)
            step = torch.where(inside, (direction + normal) * eta, normal * eta)  # outside: attraction only
            new_theta = theta - step
        return from_stiefel(new_theta, p.shape).to(p.dtype), new_buf


def _check_group(group: dict[str, Any], at_step: bool = False) -> None:
    """Check a (merged) group's hyper-parameters; raises with the fix, changes nothing
    (``at_step``: see :func:`fgd_fast.validation.check_nesterov`)."""
    check_keys(group, _GROUP_KEYS)
    check_nonnegative("lr", group["lr"])
    check_unit_interval("momentum", group["momentum"], "0.9 is typical")
    check_dampening(group["dampening"])
    check_nonnegative("weight_decay", group["weight_decay"])
    check_nesterov(group["nesterov"], group["momentum"], group["dampening"], at_step)
    check_positive("attraction", group["attraction"], "λ of the landing field; 1 is the authors' default")
    check_bool("orthogonal", group["orthogonal"])
