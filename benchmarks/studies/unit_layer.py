"""The layer both feedback studies run: a 16 × 72 float64 weight (a 3 × 3 convolution with 8
input channels), orthonormalised, with FGD at lr 0.01, momentum 0.9 and no checks."""

from __future__ import annotations

import torch

import fgd_fast


def unit_layer(
    alpha: float, backend: str, *, variant: str = "official", generator: torch.Generator | None = None
) -> tuple[torch.nn.Parameter, fgd_fast.FGD]:
    """``(w, opt)``; the weight is drawn from ``generator`` (torch's global RNG when None)."""
    w = torch.nn.Parameter(fgd_fast.orthogonalize_(torch.randn(16, 8, 3, 3, dtype=torch.float64, generator=generator)))
    opt = fgd_fast.FGD(
        [dict(params=[w], orthogonal=True)],
        lr=0.01,
        momentum=0.9,
        feedback=alpha,
        backend=backend,
        variant=variant,
        check_finite=False,
        check_manifold=False,
    )
    return w, opt
