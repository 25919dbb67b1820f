r"""Cayley SGD and Cayley ADAM (Li, Li & Todorovic, ICLR 2020), the baselines FGD is compared to.

Both keep every parameter of a group with ``orthogonal=True`` on the Stiefel manifold through
the iterative Cayley transform of :mod:`.retraction`, in the matrix convention of FGD
(:mod:`fgd_fast._matrix`: ``X`` is the ``n × p`` view of ``W.reshape(c_o, -1)``, orthonormal
along its smaller side; for the usual ``c_o <= m`` this is ``X = W2ᵀ``, the public code's).
Equal-shape layers of a group are stacked and updated with batched matrix products.

Differences from the public code (``SGDG`` / ``AdamG``), and what ``public_code_compat=True``
restores:

============================  ==============================  ==============================
                              public code                     this module (compat)
============================  ==============================  ==============================
SGD momentum                  never stored (rebinding bug):   kept, ``M ← W X``
                              runs with β = 0                 (compat: β = 0 for X)
fixed-point iterations ``s``  5, hard-coded                   parameter, default 2 (5)
norm in ``t``                 1-norm of dense ``W``           Frobenius, from p×p Grams
                                                              (``form="dense"``: either; 1)
start ``Y₀``                  ``X + t M`` (M un-projected)    ``X + t W X`` (compat: public)
rows renormalised             every step                      ``renormalize`` (compat: yes)
QR re-orthonormalisation      random, probability 1/101       every ``qr_period`` steps,
                                                              deterministic (0; compat 101)
tall weights (``c_o > m``)    plain SGD                       constrained, ``X = W2``
Euclidean weight decay,       read from the last orthogonal   the group's own
dampening, Nesterov           group (SGDG): none in its script
============================  ==============================  ==============================

Where this module reads the paper's Algorithm 2 (Cayley ADAM) otherwise than as printed: the
second moment starts at ``v = 0``, as in the public ``AdamG`` (the paper initialises ``v₁ = 1``;
the bias correction ``v / (1 − β₂ᵏ)`` both use is the one for a start at 0); and the iteration
starts from ``Y₀ = X − tW̃X``, the first-order point of the curve it computes, where the paper
writes ``Y₀ = X − αM`` right after assigning ``M = r W̃X``: r = (1 − β₁ᵏ)√(v̂ + ε) times that
step, which leaves the s = 2 iterations off the Cayley transform by an amount growing with
|r − 1| (``tests/test_baselines.py`` measures both starts against the exact transform).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from .._matrix import as_w2
from ..validation import check_dampening, check_nesterov, check_unit_interval
from ._base import Bucket, CayleyBase, store_state

__all__ = ["CayleySGD", "CayleyADAM"]


class CayleySGD(CayleyBase):
    r"""Cayley SGD with momentum on the Stiefel manifold; ``torch.optim.SGD`` for the rest.

    For a parameter of a group with ``orthogonal=True`` (``X`` its ``n × p`` view, ``G`` its
    gradient, ``M`` its ``momentum_buffer``), one step is

    .. math::

        M &← βM − G,\qquad P = M − ½X(XᵀM),\qquad W = P Xᵀ − X Pᵀ \;(= Ŵ − Ŵᵀ,\;
            Ŵ = M Xᵀ − ½X(XᵀMXᵀ)) \\
        M &← W X,\qquad t = \min(η,\; 2q / (‖W‖ + ε)) \\
        Y &= X + tM;\quad Y ← X + \tfrac{t}{2} W (X + Y)\ \ (s\ \text{times});\quad X ← Y

    ``form="lowrank"`` never forms the ``n × n`` matrix ``W``: the iterates stay in
    ``span[X, M]`` and cost O(n p²) per step in all (see :mod:`fgd_fast.baselines.retraction`).
    Its ``‖W‖`` is the Frobenius norm, ``‖W‖_F² = 2(tr(PᵀP·XᵀX) − tr((XᵀP)²))``, computed
    from the p×p Grams ``XᵀX, XᵀM, MᵀM``: exact (not a bound), cheap, and like the public
    code's 1-norm an upper bound of the spectral norm, so ``(t/2)‖W‖₂ ≤ q`` still makes the
    fixed-point iteration contract. ``form="dense"`` forms ``W`` like the public code
    (O(n²) memory, O(n²p) time) and accepts ``norm="fro"`` (same iterates as ``"lowrank"`` up
    to rounding) or ``norm="one"`` (the public code's largest column sum of ``|W|``).

    Weight decay, dampening and Nesterov apply to the Euclidean groups only, which get exactly
    ``torch.optim.SGD`` (``fgd_fast.sgd``).

    Args:
        params: parameters or parameter groups (e.g. ``fgd_fast.stiefel_param_groups(model)``);
            a group may override ``lr, momentum, q, s, eps, weight_decay, dampening, nesterov,
            renormalize`` and sets ``orthogonal: bool`` (default ``False``).
        lr: the step bound η >= 0 (the paper's ``l``).
        momentum: β in [0, 1).
        q: in (0, 1); ``t ≤ 2q/‖W‖`` bounds the iteration's contraction factor by q.
        s: fixed-point iterations (int >= 1); default 2, 5 with ``public_code_compat``.
        eps: ε > 0 in the step bound (and in the renormalisation).
        weight_decay, dampening, nesterov: as in ``torch.optim.SGD`` (Euclidean groups only).
        form: ``"lowrank"`` (default) or ``"dense"`` (default with ``public_code_compat``).
        norm: ``"fro"`` (default) or ``"one"`` (``form="dense"`` only; compat default).
        renormalize: divide each of the p columns of ``X`` by ``‖x_j‖ + ε`` before the step
            (for ``c_o <= m`` the rows of ``W.reshape(c_o, -1)``, as the public code does);
            default ``False``, ``True`` with ``public_code_compat``.
        public_code_compat: reproduce the public code (see the module docstring): β = 0 for
            orthogonal parameters (momentum is still used by Euclidean ones), the start
            ``Y₀ = X − tG``, and the defaults above.
        qr_period: replace ``X`` by ``Q·sign(diag R)`` of its QR factorisation (after the
            renormalisation) on every ``qr_period``-th step of a parameter; 0 (default) never,
            101 with ``public_code_compat`` — a deterministic stand-in for the public code's
            random QR with probability 1/101.
        check_finite: raise ``FloatingPointError`` (changing nothing) when an orthogonal
            parameter's gradient has NaN/Inf.
        maximize: maximise the objective (the gradient negated for every parameter).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float,
        *,
        momentum: float = 0.9,
        q: float = 0.5,
        s: int | None = None,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        dampening: float = 0.0,
        nesterov: bool = False,
        form: str | None = None,
        norm: str | None = None,
        renormalize: bool | None = None,
        public_code_compat: bool = False,
        qr_period: int | None = None,
        check_finite: bool = True,
        maximize: bool = False,
    ) -> None:
        hyper = dict(
            lr=lr, momentum=momentum, q=q, eps=eps, weight_decay=weight_decay, dampening=dampening, nesterov=nesterov
        )
        super().__init__(
            params,
            hyper,
            s=s,
            form=form,
            norm=norm,
            renormalize=renormalize,
            public_code_compat=public_code_compat,
            qr_period=qr_period,
            check_finite=check_finite,
            maximize=maximize,
        )

    _STATE_DICT_KEYS = (*CayleyBase._STATE_DICT_KEYS, "momentum")

    def _validate_group(self, group: dict[str, Any], at_step: bool = False) -> None:
        self._validate_common(group)
        check_unit_interval("momentum", group["momentum"], "0.9 is typical")
        check_dampening(group["dampening"])
        check_nesterov(group["nesterov"], group["momentum"], group["dampening"], at_step)

    def _beta(self, group: dict[str, Any]) -> float:
        """β of the orthogonal update: the public code's is effectively 0."""
        return 0.0 if self.public_code_compat else group["momentum"]

    def _bucket_key(self, group, state):
        return (state.get("momentum_buffer") is not None and self._beta(group) > 0,)

    def _moments(self, b: Bucket):
        b.m.neg_()  # −G
        beta = self._beta(b.group)
        if beta > 0 and b.states[0].get("momentum_buffer") is not None:
            torch._foreach_add_(b.m_blocks, [as_w2(st["momentum_buffer"]) for st in b.states], alpha=beta)  # M = βM − G
        return 1.0, (1.0 if self.public_code_compat else None)  # W_d = W; compat start Y₀ = X + tM

    def _commit(self, b: Bucket, wx):
        keep = self._beta(b.group) > 0
        for p, w in zip(b.params, wx):
            st = self.state[p]
            if keep:
                store_state(st, "momentum_buffer", w, p.shape)  # M ← W X
            st["step"] = st.get("step", 0) + 1

    def _euclidean(self, group, params):
        self._group_sgd(group, params)


class CayleyADAM(CayleyBase):
    r"""Cayley ADAM on the Stiefel manifold; SGD with momentum β₁ for the rest.

    For a parameter of a group with ``orthogonal=True`` at its k-th step (``X`` its ``n × p``
    view, ``G`` its gradient; state ``exp_avg`` = m, ``exp_avg_sq`` = the scalar v):

    .. math::

        m &← β₁m + (1 − β₁)G,\qquad v ← β₂v + (1 − β₂)‖G‖_F^2,\qquad
            r = (1 − β₁^k)\sqrt{v/(1 − β₂^k) + ε} \\
        W &= P Xᵀ − X Pᵀ,\ P = m − ½X(Xᵀm);\qquad \tilde W = W / r
            \;(= W(\hat m)/\sqrt{\hat v + ε}) \\
        t &= \min(η,\; 2q / (‖\tilde W‖ + ε)),\qquad m ← W X \;(= r\,\tilde W X) \\
        Y &= X − t\tilde W X;\quad Y ← X − \tfrac{t}{2}\tilde W (X + Y)\ \ (s\ \text{times});
            \quad X ← Y

    ``form``/``norm`` as in :class:`CayleySGD`. Parameters without ``orthogonal=True`` get
    ``torch.optim.SGD`` with ``momentum = β₁`` and the group's ``weight_decay``, as in the public
    ``AdamG``, without dampening or Nesterov (``AdamG`` reads both from its groups, and its
    training script turns Nesterov on; this class has neither option).

    Args:
        params: parameters or parameter groups; a group may override ``lr, betas, q, s, eps,
            weight_decay, renormalize`` and sets ``orthogonal``.
        lr: the step bound η >= 0.
        betas: (β₁, β₂), each in [0, 1).
        eps: ε > 0 under the square root, in the step bound and in the renormalisation.
        q, s, form, norm, renormalize, qr_period, check_finite, maximize: as in :class:`CayleySGD`.
        weight_decay: L2 penalty of the Euclidean groups only.
        public_code_compat: reproduce the public ``AdamG`` (which, unlike its SGD, does keep
            m): the start ``Y₀ = X − t m`` (m un-projected, un-normalised), s = 5, the dense
            1-norm, renormalised rows and the QR every 101 steps.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float,
        *,
        betas: tuple[float, float] = (0.9, 0.99),
        eps: float = 1e-8,
        q: float = 0.5,
        s: int | None = None,
        weight_decay: float = 0.0,
        form: str | None = None,
        norm: str | None = None,
        renormalize: bool | None = None,
        public_code_compat: bool = False,
        qr_period: int | None = None,
        check_finite: bool = True,
        maximize: bool = False,
    ) -> None:
        hyper = dict(lr=lr, betas=betas, q=q, eps=eps, weight_decay=weight_decay)
        super().__init__(
            params,
            hyper,
            s=s,
            form=form,
            norm=norm,
            renormalize=renormalize,
            public_code_compat=public_code_compat,
            qr_period=qr_period,
            check_finite=check_finite,
            maximize=maximize,
        )

    _STATE_DICT_KEYS = (*CayleyBase._STATE_DICT_KEYS, "betas")

    def _validate_group(self, group: dict[str, Any], at_step: bool = False) -> None:
        self._validate_common(group)
        betas = group["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"invalid betas={betas!r}: pass a pair (beta1, beta2), e.g. betas=(0.9, 0.99)")
        check_unit_interval("betas[0]", betas[0], "e.g. 0.9")
        check_unit_interval("betas[1]", betas[1], "e.g. 0.99")

    def _check_orthogonal_state(self, p: torch.Tensor, group: dict[str, Any], label: str) -> None:
        super()._check_orthogonal_state(p, group, label)
        state = self.state.get(p, {})
        missing = [k for k in ("exp_avg", "exp_avg_sq") if state.get(k) is None]
        v = state.get("exp_avg_sq")
        if (state.get("step", 0) > 0 and missing) or (
            v is not None and not (isinstance(v, torch.Tensor) and v.shape == () and v.device == p.device)
        ):
            raise ValueError(
                f"{label}: its Cayley ADAM moments do not fit it (step {state.get('step')}, exp_avg_sq "
                f"{v if not isinstance(v, torch.Tensor) else (tuple(v.shape), v.device)}); the step was not applied "
                "and nothing changed. Clear them (opt.state[param].clear()) to restart its moments"
            )

    def _check_saved_state(self, p, group, state, text) -> None:
        super()._check_saved_state(p, group, state, text)
        missing = [k for k in ("exp_avg", "exp_avg_sq") if state.get(k) is None]
        if state.get("step", 0) > 0 and missing:
            raise ValueError(
                f"cannot load this state_dict: parameter {text} has taken {state['step']} steps but has no "
                f"{' or '.join(missing)}; nothing was loaded (drop that parameter's entry from "
                "state_dict['state'] to restart its moments)"
            )

    def _bucket_key(self, group, state):
        return (state.get("step", 0),)  # bias corrections need equal step counts

    def _moments(self, b: Bucket):
        beta1, beta2 = b.group["betas"]
        k = b.step[0] + 1
        fresh = k == 1
        v = torch.linalg.vector_norm(b.m, dim=(1, 2)).square_().mul_(1.0 - beta2)  # (1 − β₂)‖G‖²
        if not fresh:
            v.add_(torch.stack([st["exp_avg_sq"] for st in b.states]), alpha=beta2)  # v = β₂v + (1 − β₂)‖G‖²
        b.m.mul_(1.0 - beta1)  # (1 − β₁)G
        if not fresh:
            m_old = [as_w2(st["exp_avg"]) for st in b.states]
            torch._foreach_add_(b.m_blocks, m_old, alpha=beta1)  # m = β₁m + (1 − β₁)G
        b.v_new = v
        r = (v / (1.0 - beta2**k)).add_(b.group["eps"]).sqrt_().mul_(1.0 - beta1**k)  # r = (1 − β₁^k)√(v̂ + ε)
        return r.reciprocal_().neg_(), (-1.0 if self.public_code_compat else None)  # W_d = −W/r; compat Y₀ = X − tm

    def _commit(self, b: Bucket, wx):
        for p, w, v in zip(b.params, wx, b.v_new.unbind(0)):
            st = self.state[p]
            store_state(st, "exp_avg", w, p.shape)  # m ← W X
            store_state(st, "exp_avg_sq", v, torch.Size([]))
            st["step"] = st.get("step", 0) + 1

    def _euclidean(self, group, params):
        self._sgd(params, group, momentum=group["betas"][0])  # the public code: SGD with momentum β₁
