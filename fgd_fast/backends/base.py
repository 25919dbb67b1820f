"""What every FGD backend implements (one signature for reference, torch, triton, cuda).

A backend is a function

    prepare(params, grads, bufs, fresh, *, lr, momentum, feedback, check_finite) -> StepPlan

over the orthogonal parameters of one device:

* ``params[i]`` — the parameter (any shape, at least 2-D; its ``n × p`` matrix view is θ);
* ``grads[i]`` — its gradient g (same shape);
* ``bufs[i]`` — Φ storage (the parameter's shape, float32 for float16/bfloat16 parameters,
  else the parameter dtype), or ``None`` for the stateless ``momentum == 0`` form;
* ``fresh[i]`` — Φ is known to be zero (first step): a backend may skip reading it;
* ``lr``, ``momentum``, ``feedback`` — per-layer η, β, α.

``prepare`` must not write any parameter or buffer. It returns a :class:`StepPlan` with the
per-layer distance ``‖θᵀθ − I‖_F`` (and gradient finiteness when ``check_finite``) as device
tensors; ``plan.apply()`` then writes θ₊ into ``params`` and Φ₊ into ``bufs``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

__all__ = ["StepPlan", "Backend", "compute_dtype"]


@dataclass
class StepPlan:
    dist: torch.Tensor  # (L,) ‖θᵀθ − I‖_F per layer, in input order
    finite: torch.Tensor | None  # (L,) bool: gradient finite; None when not checked
    apply: Callable[[], None]  # performs every write of the step


class Backend(Protocol):
    def __call__(
        self,
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        bufs: list[torch.Tensor | None],
        fresh: list[bool],
        *,
        lr: list[float],
        momentum: list[float],
        feedback: list[float],
        check_finite: bool,
    ) -> StepPlan: ...


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float16/bfloat16 parameters compute (and keep Φ) in float32; others in their dtype."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
