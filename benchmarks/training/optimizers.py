"""The optimizers ``benchmarks/training/train.py`` compares, with the authors' CIFAR-10 settings.

Defaults (WRN-28-10 on CIFAR-10, batch 128, 200 epochs, every learning rate × 0.2 at epochs
60, 120 and 160):

* ``sgd``: ``torch.optim.SGD``, lr 0.1, momentum 0.9, weight decay 5e-4 on every parameter
  (the wide-ResNet recipe both papers compare against).
* ``fgd``: :class:`fgd_fast.FGD` with ``backend="auto"``; ``fgd-<backend>`` names another
  backend. Bu & Chang's settings: Stiefel lr 0.2, feedback 0.4, momentum 0.9; the other
  parameters get SGD with lr 0.05, momentum 0.9, weight decay 5e-4 (for CIFAR-100 they use
  0.16 and 0.08).
* ``cayley-sgd`` / ``cayley-adam``: :class:`fgd_fast.baselines.CayleySGD` / ``CayleyADAM``
  (low-rank form). Li, Li & Todorovic's settings for the same network: Stiefel lr 0.1; the
  other parameters lr 0.8 (Cayley SGD) / 0.5 (Cayley ADAM), momentum 0.9, Nesterov for
  Cayley SGD, weight decay 5e-4.
* ``landing``: :class:`fgd_fast.baselines.LandingSGD` (Ablin & Peyré; the Stiefel version with
  the safe step of Ablin, Vary, Gao & Absil): momentum 0.9 on the relative gradient, safe
  distance 0.5 (the authors' default); its Stiefel lr and attraction λ from a small sweep on
  digits (``benchmarks/training/sweep.py --optimizer landing``), the other parameters as FGD's.

Each optimizer constrains the same weights (``stiefel_param_groups`` with the chosen rule);
``sgd`` leaves them free, and its distance from the manifold shows how far they drift.
Every setting can be overridden (``train.py --set fgd.lr=0.1``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import fgd_fast
from fgd_fast.backends import BackendUnavailable
from fgd_fast.baselines import CayleyADAM, CayleySGD, LandingSGD
from fgd_fast.functional import backend_for

__all__ = ["SETTINGS", "FAMILIES", "available_fgd_backends", "build_optimizer", "settings_for"]

SETTINGS: dict[str, dict[str, Any]] = {
    "sgd": dict(lr=0.1, momentum=0.9, weight_decay=5e-4),
    "fgd": dict(lr=0.2, feedback=0.4, momentum=0.9, euclidean_lr=0.05, weight_decay=5e-4, guard=True),
    "cayley-sgd": dict(lr=0.1, momentum=0.9, euclidean_lr=0.8, weight_decay=5e-4, nesterov=True),
    "cayley-adam": dict(lr=0.1, beta1=0.9, beta2=0.99, euclidean_lr=0.5, weight_decay=5e-4),
    "landing": dict(lr=0.2, attraction=2.0, momentum=0.9, safe_distance=0.5, euclidean_lr=0.05, weight_decay=5e-4),
}
FAMILIES = tuple(SETTINGS)


def family(name: str) -> str:
    """``fgd`` for ``fgd`` and ``fgd-<backend>``, else the name itself."""
    return "fgd" if name == "fgd" or name.startswith("fgd-") else name


def settings_for(name: str, overrides: dict[str, dict[str, float]]) -> dict[str, Any]:
    """The settings of optimizer ``name``: its family's defaults, then ``overrides[family]``,
    then ``overrides[name]`` (so ``fgd.lr`` applies to every ``fgd-<backend>``)."""
    fam = family(name)
    if fam not in SETTINGS:
        raise ValueError(f"unknown optimizer {name!r}: choose from {', '.join(FAMILIES)} or fgd-<backend>")
    out = dict(SETTINGS[fam])
    for key in (fam, name):
        for k, v in overrides.get(key, {}).items():
            if k not in out:
                raise ValueError(f"--set {key}.{k}: {fam} has no setting {k!r} (it has {', '.join(out)})")
            out[k] = _convert(f"{key}.{k}", out[k], v)
    return out


def _convert(name: str, default: Any, value: str) -> Any:
    """``value`` as the type of ``default`` (a bool from true/false/1/0/yes/no)."""
    if isinstance(default, bool):
        text = str(value).lower()
        if text not in ("1", "true", "yes", "0", "false", "no"):
            raise ValueError(f"--set {name}={value}: expected true or false")
        return text in ("1", "true", "yes")
    try:
        return type(default)(value)
    except (TypeError, ValueError):
        raise ValueError(f"--set {name}={value}: expected a {type(default).__name__}, like {default!r}") from None


def available_fgd_backends(device: torch.device) -> tuple[list[str], dict[str, str]]:
    """The explicit backends that run on ``device``, and why each other one does not."""
    ok, why = [], {}
    for name in fgd_fast.BACKENDS:
        if name == "auto":
            continue
        try:
            backend_for(name, device)
        except BackendUnavailable as exc:
            why[name] = str(exc)
        else:
            ok.append(name)
    return ok, why


def _groups(model: nn.Module, rule: str, stiefel: dict, euclidean: dict) -> list[dict]:
    groups = fgd_fast.stiefel_param_groups(model, rule=rule, orthogonalize=False)  # the start is orthonormal already
    groups[0].update(stiefel)
    groups[1].update(euclidean)
    return [g for g in groups if g["params"]]


def build_optimizer(name: str, model: nn.Module, rule: str, s: dict[str, Any]) -> torch.optim.Optimizer:
    """Optimizer ``name`` over ``model`` with settings ``s`` (see :func:`settings_for`)."""
    fam = family(name)
    if fam == "sgd":
        return torch.optim.SGD(model.parameters(), lr=s["lr"], momentum=s["momentum"], weight_decay=s["weight_decay"])
    euclid = dict(lr=s["euclidean_lr"], weight_decay=s["weight_decay"])
    if fam == "fgd":
        backend = name.split("-", 1)[1] if "-" in name else "auto"
        groups = _groups(model, rule, dict(lr=s["lr"]), euclid)
        return fgd_fast.FGD(
            groups, lr=s["lr"], momentum=s["momentum"], feedback=s["feedback"], backend=backend, guard=s["guard"]
        )
    if fam == "cayley-sgd":
        groups = _groups(model, rule, dict(lr=s["lr"]), dict(euclid, nesterov=s["nesterov"]))
        return CayleySGD(groups, lr=s["lr"], momentum=s["momentum"])
    if fam == "landing":
        groups = _groups(model, rule, dict(lr=s["lr"], weight_decay=0.0), euclid)
        return LandingSGD(
            groups, lr=s["lr"], momentum=s["momentum"], attraction=s["attraction"], safe_distance=s["safe_distance"]
        )
    groups = _groups(model, rule, dict(lr=s["lr"]), euclid)
    return CayleyADAM(groups, lr=s["lr"], betas=(s["beta1"], s["beta2"]))
