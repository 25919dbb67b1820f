"""Contender optimizers from other libraries, set up for benchmarks (one concern: adapters).

Each builder selects the weights to constrain with a rule of :func:`fgd_fast.select_stiefel`,
projects them onto the manifold (``orthogonalize_``, as ``stiefel_param_groups`` does, so every
contender starts from the same point), re-parametrises each one in place so that the other
library sees the ``n × p`` matrix ``θ`` of FGD's convention (:mod:`fgd_fast._matrix`), and
returns the optimizer over the whole model:

* :func:`geoopt_stiefel_sgd` — ``geoopt.optim.RiemannianSGD`` with ``θ`` a
  ``geoopt.ManifoldParameter`` on ``EuclideanStiefel`` (projection ``G − θ sym(θᵀG)``, QR
  retraction) or, with ``canonical=True``, on ``CanonicalStiefel`` (``G − θGᵀθ``, Cayley
  retraction by an ``n × n`` solve).
* :func:`torch_orthogonal_sgd` — ``torch.nn.utils.parametrizations.orthogonal`` on ``θ`` and
  plain ``torch.optim.SGD``.

The module's weight becomes ``W = StiefelView(shape)(θ)`` (a reshape/transpose) computed on
access; the trainable tensor is ``module.parametrizations.<name>.original``. Weight decay
applies to the unconstrained parameters only, as in FGD. geoopt is imported when
:func:`geoopt_stiefel_sgd` is called, so this module imports without it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from .._matrix import as_stiefel, from_stiefel, stiefel_shape
from ..manifold import orthogonalize_
from ..selection import Rule, select_stiefel
from ..validation import (
    check_bool,
    check_choice,
    check_dampening,
    check_nesterov,
    check_nonnegative,
    check_unit_interval,
)

__all__ = ["StiefelView", "geoopt_stiefel_sgd", "torch_orthogonal_sgd"]

#: ``torch.nn.utils.parametrizations.orthogonal``'s maps
ORTHOGONAL_MAPS = ("matrix_exp", "cayley", "householder")


class StiefelView(nn.Module):
    """Parametrization ``θ (n × p) ↦ W`` of ``shape``: the inverse of ``as_stiefel``."""

    def __init__(self, shape: torch.Size | tuple[int, ...]) -> None:
        super().__init__()
        stiefel_shape(shape)  # at least 2 dims
        self.shape = tuple(shape)

    def forward(self, theta: torch.Tensor) -> torch.Tensor:
        return from_stiefel(theta, self.shape)


def _require_geoopt():
    try:
        import geoopt
    except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
        raise ImportError(
            "geoopt_stiefel_sgd needs geoopt, which is not installed: pip install geoopt "
            "(fgd_fast itself does not depend on it)"
        ) from exc
    return geoopt


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (model.get_submodule(path) if path else model), attr


def _reparametrize(
    model: nn.Module,
    rule: Rule,
    orthogonalize: bool,
    attach: Callable[[nn.Module, str, torch.Tensor, torch.Size], None],
    exclude: Iterable[str] = (),
) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, nn.Parameter]]]:
    """Constrain the weights ``rule`` selects (less ``exclude``); returns (constrained θ, other parameters)."""
    chosen = [(n, p) for n, p in select_stiefel(model, rule, exclude=exclude) if p.requires_grad]
    chosen_ids = {id(p) for _, p in chosen}
    rest = [(n, p) for n, p in model.named_parameters() if p.requires_grad and id(p) not in chosen_ids]
    owners: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(n)
    for name, p in chosen:  # every weight checked before any is parametrized (a failure changes nothing)
        tied = owners.get(id(p), [])
        if len(tied) > 1:  # (a parametrization replaces the weight on one owner: the others keep a stale copy)
            raise ValueError(
                f"{name} is one tensor shared by {', '.join(tied)} (tied weights): a parametrization would "
                "replace it on one of them only and untie them. Constrain it with fgd_fast.FGD "
                "(stiefel_param_groups keeps tied weights tied), or leave it out of the rule"
            )
        module, attr = _owner(model, name)
        if parametrize.is_parametrized(module, attr) or isinstance(module, parametrize.ParametrizationList):
            raise ValueError(f"{name} is already parametrized; build the contender on a fresh model")
    orth = []
    for name, p in chosen:
        module, attr = _owner(model, name)
        if orthogonalize:
            with torch.no_grad():
                orthogonalize_(p.data)
        theta = as_stiefel(p.detach()).clone(memory_format=torch.contiguous_format)  # θ, n × p
        shape = p.shape
        delattr(module, attr)
        attach(module, attr, theta, shape)
        orth.append((name, module.parametrizations[attr].original))
    return orth, rest


def _groups(orth, rest, weight_decay: float) -> list[dict[str, Any]]:
    groups = [
        dict(params=[p for _, p in orth], names=[n for n, _ in orth], weight_decay=0.0),
        dict(params=[p for _, p in rest], names=[n for n, _ in rest], weight_decay=weight_decay),
    ]
    return [g for g in groups if g["params"]]


def _sgd_options(lr, momentum, weight_decay, nesterov, dampening) -> dict[str, Any]:
    """The validated SGD keyword arguments both adapters pass on (weight decay goes per group)."""
    check_nonnegative("lr", lr)
    check_unit_interval("momentum", momentum, "e.g. 0.9")
    check_dampening(dampening)
    check_nonnegative("weight_decay", weight_decay)
    check_nesterov(nesterov, momentum, dampening)
    return dict(lr=lr, momentum=momentum, dampening=dampening, nesterov=nesterov)


def geoopt_stiefel_sgd(
    model: nn.Module,
    rule: Rule = "paper",
    *,
    lr: float,
    momentum: float = 0.9,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    canonical: bool = False,
    stabilize: int | None = None,
    orthogonalize: bool = True,
    exclude: Iterable[str] = (),
) -> torch.optim.Optimizer:
    """``geoopt.optim.RiemannianSGD`` with the weights ``rule`` selects on a Stiefel manifold.

    ``canonical=False``: ``geoopt.EuclideanStiefel`` (Euclidean metric, QR retraction);
    ``canonical=True``: ``geoopt.CanonicalStiefel`` (canonical metric, Cayley retraction).
    ``stabilize`` is geoopt's (project every ``stabilize`` steps; ``None``: never). Modifies
    ``model`` in place (see the module docstring) and raises ``ImportError`` without geoopt.
    ``rule`` and ``exclude``: which weights are constrained, as :func:`fgd_fast.select_stiefel` takes them;
    ``orthogonalize``: project them onto the manifold first (``False`` when resuming); ``lr``,
    ``momentum``, ``dampening``, ``nesterov``: ``torch.optim.SGD``'s, for every parameter;
    ``weight_decay``: for the unconstrained parameters only (the constrained group gets 0).
    """
    sgd = _sgd_options(lr, momentum, weight_decay, nesterov, dampening)
    check_bool("canonical", canonical)
    check_bool("orthogonalize", orthogonalize)
    geoopt = _require_geoopt()
    manifold = geoopt.CanonicalStiefel() if canonical else geoopt.EuclideanStiefel()

    def attach(module, attr, theta, shape):
        module.register_parameter(attr, geoopt.ManifoldParameter(theta, manifold=manifold))
        parametrize.register_parametrization(module, attr, StiefelView(shape), unsafe=True)

    orth, rest = _reparametrize(model, rule, orthogonalize, attach, exclude)
    return geoopt.optim.RiemannianSGD(_groups(orth, rest, weight_decay), **sgd, stabilize=stabilize)


def torch_orthogonal_sgd(
    model: nn.Module,
    rule: Rule = "paper",
    *,
    lr: float,
    momentum: float = 0.9,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    orthogonal_map: str | None = None,
    orthogonalize: bool = True,
    exclude: Iterable[str] = (),
) -> torch.optim.SGD:
    """``torch.optim.SGD`` with ``torch.nn.utils.parametrizations.orthogonal`` on ``θ`` of the
    weights ``rule`` selects (``orthogonal_map`` is torch's: ``None`` picks ``"matrix_exp"``
    for square ``θ``, else ``"householder"``). Modifies ``model`` in place.
    ``rule`` and ``exclude``: which weights are constrained, as :func:`fgd_fast.select_stiefel` takes them;
    ``orthogonalize``: project them onto the manifold first (``False`` when resuming); ``lr``,
    ``momentum``, ``dampening``, ``nesterov``: ``torch.optim.SGD``'s, for every parameter;
    ``weight_decay``: for the unconstrained parameters only (the constrained group gets 0).
    """
    sgd = _sgd_options(lr, momentum, weight_decay, nesterov, dampening)
    check_bool("orthogonalize", orthogonalize)
    if orthogonal_map is not None:  # (torch checks it inside, after the first weight was replaced)
        check_choice("orthogonal_map", orthogonal_map, ORTHOGONAL_MAPS)

    def attach(module, attr, theta, shape):
        module.register_parameter(attr, nn.Parameter(theta))
        torch.nn.utils.parametrizations.orthogonal(module, attr, orthogonal_map=orthogonal_map)  # θ = Q(original)
        parametrize.register_parametrization(module, attr, StiefelView(shape), unsafe=True)  # W = view(θ)

    orth, rest = _reparametrize(model, rule, orthogonalize, attach, exclude)
    return torch.optim.SGD(_groups(orth, rest, weight_decay), **sgd)
