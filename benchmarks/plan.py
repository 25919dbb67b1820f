"""What runs at each scale, and for how long (one concern: the run plan and its budgets).

:data:`BUDGETS` bounds the work of one case (one contender on one workload):

* ``warmup`` steps first (the first creates the optimizer state; the last is timed as a
  *probe* of the step time);
* then the stability run continues the same gradient stream to ``stability_steps`` steps,
  unless :func:`stability_skip` names a reason, or ``stability_steps × probe`` exceeds
  ``stability_s`` (a safety valve for an overloaded machine; the case then records why);
* then ``settle`` untimed steps on the fixed gradient of the timing, for every case alike (so
  each timing follows at least ``warmup + settle`` steps, with or without a stability run);
* then pytest-benchmark times ``rounds = clamp(case_s / probe, min_rounds, max_rounds)``
  steps on that gradient, or ``slow_rounds`` when the probe is slower than ``slow_step_s``.

:func:`planned_skip` gives the reason a case is not run at all. Both lists of exclusions
are fixed per scale; only the safety valve above depends on the machine's load (a case it
trips says so in the report).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from benchmarks.contenders import Contender, unavailable
from fgd_fast.backends import DEFAULT_PRECISION, checked_precision
from fgd_fast.functional import backend_for

__all__ = ["Budget", "BUDGETS", "planned_skip", "rounds_for", "stability_skip"]


@dataclass(frozen=True)
class Budget:
    warmup: int
    case_s: float
    min_rounds: int
    max_rounds: int
    slow_step_s: float
    stability_steps: int
    stability_s: float
    settle: int = 3
    slow_rounds: int = 3


BUDGETS = {
    "full": Budget(
        warmup=2, case_s=0.5, min_rounds=7, max_rounds=50, slow_step_s=2.0, stability_steps=200, stability_s=10.0
    ),
    "cpu": Budget(
        warmup=2, case_s=0.5, min_rounds=7, max_rounds=30, slow_step_s=1.5, stability_steps=200, stability_s=60.0
    ),
    "tiny": Budget(
        warmup=1,
        case_s=0.0,
        min_rounds=1,
        max_rounds=1,
        slow_step_s=float("inf"),
        stability_steps=3,
        stability_s=float("inf"),
        settle=0,
        slow_rounds=1,
    ),
}

#: (scale, contender, workloads it still runs on, why it is left out of the others)
_EXCLUSIONS = (
    (
        "cpu",
        "torch-orthogonal",
        ("transformer",),
        "on a CPU, torch.linalg.householder_product's backward (the orthogonal parametrization "
        "of a tall matrix) loops over the p reflectors, too slow for the CPU main job on these "
        "convolution shapes; timed on the transformer set only (all workloads on a GPU or with --full)",
    ),
)

#: (scale, contender, why its stability run is left out) — to keep the CPU main job short
_STABILITY_EXCLUSIONS = (
    (
        "cpu",
        "fgd-reference",
        "the same update as fgd-torch (both are tested against one float64 oracle); run on a GPU / --full",
    ),
    (
        "cpu",
        "cayley-sgd-dense",
        "the same iterates as cayley-sgd-lowrank, at O(n²p) per product; run on a GPU / --full",
    ),
    (
        "cpu",
        "geoopt-canonical",
        "an n × n solve per layer and step makes 200 steps too slow for the CPU main job; run on a GPU / --full",
    ),
    ("cpu", "torch-orthogonal", "the slowest step on a CPU by far (see the table); run on a GPU / --full"),
)


def planned_skip(
    scale: str, workload: str, c: Contender, device: torch.device, *, allow_interpreter: bool = False
) -> str | None:
    """Why contender ``c`` is not run on ``workload`` at ``scale`` (``None``: it runs)."""
    reason = unavailable(c, device, allow_interpreter=allow_interpreter)
    if reason:
        return reason
    for s, name, kept, why in _EXCLUSIONS:
        if s == scale and name == c.name and workload not in kept:
            return why
    return None


def stability_skip(scale: str, c: Contender, device: torch.device) -> dict | None:
    """``{"skipped": why}`` if the stability run of ``c`` is left out at ``scale``, else None.

    An FGD backend that ``"auto"`` resolves to on ``device`` runs the same code as
    ``fgd-auto``: its distances are the same numbers, so they are not measured twice
    (``"same_as": "fgd-auto"``).
    """
    auto = backend_for("auto", device, DEFAULT_PRECISION)
    same_backend = (
        c.family == "fgd"
        and c.backend != "auto"
        and backend_for(c.backend, device, checked_precision(c.precision, c.backend)) == auto
    )
    if same_backend and checked_precision(c.precision, c.backend) == DEFAULT_PRECISION:  # (fgd-auto's precision)
        return {
            "skipped": f"fgd-auto runs this backend ({c.backend}) here: the same code, the same distances",
            "same_as": "fgd-auto",
        }
    for s, name, why in _STABILITY_EXCLUSIONS:
        if s == scale and name == c.name:
            return {"skipped": why}
    return None


def rounds_for(budget: Budget, probe_s: float) -> int:
    """Timed rounds for a step that took ``probe_s`` seconds (never fewer than ``slow_rounds``:
    a median of one round hides the spread)."""
    if probe_s > budget.slow_step_s:
        return budget.slow_rounds
    want = int(budget.case_s / max(probe_s, 1e-9))
    return max(budget.min_rounds, min(budget.max_rounds, want))
