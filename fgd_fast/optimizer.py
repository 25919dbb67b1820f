"""``FGD``: the ``torch.optim.Optimizer`` front end (collects state, validates, dispatches)."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ._stiefel_optimizer import StiefelOptimizer
from .backends import BACKENDS, DEFAULT_PRECISION, PRECISION_BACKENDS, PRECISIONS
from .checks import MAX_DISTANCE
from .functional import backend_for, fgd
from .validation import (
    check_bool,
    check_choice,
    check_nesterov,
    check_nonnegative,
    check_real,
    check_unit_interval,
)

__all__ = ["FGD"]


class FGD(StiefelOptimizer):
    r"""Feedback Gradient Descent (Bu & Chang, AAAI 2022) with SGD for the other parameters.

    Parameters in a group with ``orthogonal=True`` are kept on the Stiefel manifold: with θ the
    ``n × p`` matrix view of a parameter (orthonormal along the smaller side of
    ``W.reshape(c_o, -1)``), ``g`` its gradient and Φ its velocity (``momentum_buffer``, in
    step units), one step is, with ``A = θᵀθ``, ``N = 2I − A``, ``B = θᵀΦ``, ``C = ΦᵀΦ``,
    ``E = θᵀg``, ``S = sym(B)``:

    .. math::

        M_Φ &= N\,[\,−C − (β − 1)S + η\,\mathrm{sym}(E) + N B S − α(BᵀN + B)\,] \\
        Φ &← βΦ − ηg + θ M_Φ \\
        θ &← θ + Φ − α\,θ(A − I)

    The first step uses Φ = 0; ``momentum=0`` is the stateless form
    ``θ ← θ − η(g − θN\,sym(θᵀg)) − αθ(A − I)``. Weight decay, dampening and Nesterov do not
    apply to orthogonal parameters. All other parameters get exactly ``torch.optim.SGD``.
    What each term does, the two-pass form the fast backends compute, the cost model and the
    precision notes: ``docs/algorithm.md``.

    Args:
        params: parameters or parameter groups; ``fgd_fast.stiefel_param_groups(model)``
            builds them. A group may override ``lr``, ``momentum``, ``feedback``,
            ``weight_decay``, ``dampening`` and ``nesterov``, and sets ``orthogonal: bool``
            (default ``False``); the other arguments are optimizer-wide.
        lr: learning rate η (>= 0).
        momentum: β in [0, 1) (the paper's γ = 1 − β).
        feedback: α in [0, 1), pull back towards θᵀθ = I; 0.5 cancels first-order drift
            (the paper's α relates as α = η·α_paper/4).
        weight_decay, dampening, nesterov: as in ``torch.optim.SGD`` (Euclidean groups only).
        backend: ``"auto"`` (fastest available, never fails), ``"reference"``, ``"torch"``,
            ``"triton"`` or ``"cuda"`` (raise with the reason if they cannot run). On an H200
            the ``"torch"`` backend was measured fastest in full fp32 precision, so ``"auto"``
            is ``"torch"`` unless ``precision="tf32"`` asks for Triton's tensor-core path.
        check_finite: raise ``FloatingPointError`` (changing nothing) when an orthogonal
            parameter's gradient has NaN/Inf.
        check_manifold: raise ``ValueError`` (changing nothing) when an orthogonal parameter
            is more than ``max_distance`` from the manifold, ‖θᵀθ − I‖_F (call
            ``fgd_fast.orthogonalize_`` first). Both checks share one host synchronisation
            per step; turn both off to capture ``step()`` in a CUDA graph (warm up with two
            steps first; a replay reuses the captured step's hyper-parameters, so a new lr
            means a new capture).
        max_distance: the limit of ``check_manifold``, in (0, 1); default 0.5.
        precision: fp32 products of the ``"torch"`` and ``"triton"`` backends: ``"ieee"``
            (IEEE fp32; the default, ``None``, is ``fgd_fast.backends.DEFAULT_PRECISION``, the
            fastest precision measured fp32-level on a GPU: ``"ieee"`` today), ``"tf32x3"``
            (TF32 tensor cores with θᵀθ split into hi + lo parts: near-fp32 accuracy where it
            matters) or ``"tf32"`` (opt-in; ~1e-3 relative error in θᵀθ, so θ settles ~1e-3 off
            the manifold). A CPU has no TF32 and
            computes every precision in fp32. ``"auto"`` picks Triton on CUDA tensors for
            ``"tf32"`` and the torch backend otherwise. ``"reference"`` and ``"cuda"`` always
            compute in full precision (whatever torch's global TF32 setting), so an explicit one
            with a precision other than ``"ieee"`` is refused.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float,
        *,
        momentum: float = 0.9,
        feedback: float = 0.4,
        weight_decay: float = 0.0,
        dampening: float = 0.0,
        nesterov: bool = False,
        backend: str = "auto",
        check_finite: bool = True,
        check_manifold: bool = True,
        max_distance: float = MAX_DISTANCE,
        precision: str | None = None,
    ) -> None:
        self.backend = check_choice("backend", backend, BACKENDS)
        if precision is None:  # the library's default where the backend honours precision=
            precision = DEFAULT_PRECISION if backend in PRECISION_BACKENDS else "ieee"
        self.precision = check_choice("precision", precision, PRECISIONS)
        if precision != "ieee" and backend not in PRECISION_BACKENDS:
            raise ValueError(
                f"precision={precision!r} needs backend='torch', 'triton' or 'auto'; backend={backend!r} always "
                "computes in full precision: drop precision= or choose one of those backends"
            )
        self.check_finite = check_bool("check_finite", check_finite)
        self.check_manifold = check_bool("check_manifold", check_manifold)
        self.max_distance = check_real("max_distance", max_distance)
        if not 0.0 < self.max_distance < 1.0:
            raise ValueError(
                f"invalid max_distance={max_distance}: it must lie in (0, 1), inside the radius of the "
                "Neumann series 2I − θᵀθ ≈ (θᵀθ)⁻¹"
            )
        defaults = dict(
            lr=lr,
            momentum=momentum,
            feedback=feedback,
            weight_decay=weight_decay,
            dampening=dampening,
            nesterov=nesterov,
            orthogonal=False,
        )
        _check_group(defaults)
        super().__init__(params, defaults)

    # -- the step ---------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Perform one optimisation step; nothing changes if it raises."""
        loss = self._run_closure(closure)
        orth = dict(params=[], grads=[], bufs=[], lr=[], momentum=[], feedback=[], labels=[])
        eucl = []
        for group, p, text in self._params_with_grads():
            if group["orthogonal"]:
                orth["params"].append(p)
                orth["grads"].append(p.grad)
                orth["bufs"].append(self.state.get(p, {}).get("momentum_buffer") if group["momentum"] > 0 else None)
                orth["lr"].append(group["lr"])
                orth["momentum"].append(group["momentum"])
                orth["feedback"].append(group["feedback"])
                orth["labels"].append(text)
        for group in self.param_groups:
            if not group["orthogonal"]:
                ps = [p for p in group["params"] if p.grad is not None]
                eucl.append((group, ps))

        if orth["params"]:
            fgd(
                orth["params"],
                orth["grads"],
                orth["bufs"],
                lr=orth["lr"],
                momentum=orth["momentum"],
                feedback=orth["feedback"],
                backend=self.backend,
                check_finite=self.check_finite,
                check_manifold=self.check_manifold,
                max_distance=self.max_distance,
                precision=self.precision,
                labels=orth["labels"],
            )
            for p, buf in zip(orth["params"], orth["bufs"]):
                if buf is not None:
                    self.state[p]["momentum_buffer"] = buf
        for group, ps in eucl:
            self._sgd(ps, group, momentum=group["momentum"], dampening=group["dampening"], nesterov=group["nesterov"])
        return loss

    def _validate_group(self, group: dict[str, Any]) -> None:
        _check_group(group)

    # -- introspection ----------------------------------------------------------------------
    def resolved_backend(self, device: torch.device | str = "cpu") -> str:
        """The backend that ``step()`` runs on tensors of ``device``."""
        return backend_for(self.backend, device, self.precision)


def _check_group(group: dict[str, Any]) -> None:
    """Check a (merged) group's hyper-parameters; raises with the fix, changes nothing."""
    check_nonnegative("lr", group["lr"])
    check_unit_interval("momentum", group["momentum"], "the paper's γ = 1 − momentum must be positive")
    check_unit_interval("feedback", group["feedback"], "0.3–0.5 is typical; 0.5 cancels first-order drift")
    check_nonnegative("weight_decay", group["weight_decay"])
    check_real("dampening", group["dampening"])
    check_nesterov(group["nesterov"], group["momentum"], group["dampening"])
    check_bool("orthogonal", group["orthogonal"])
