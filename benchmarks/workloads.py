"""The benchmark workloads: the Stiefel-constrained layers of real models, at three scales.

Each workload is a model from :mod:`models` plus the selection rule that picks its
orthogonal weights (:func:`fgd_fast.select_stiefel`):

==============  ================  =======================================================
name            rule              full size (``scale="full"``)
==============  ================  =======================================================
``wrn-28-10``   ``"official"``    21 matrices: 7 × 1440×160, 7 × 2880×320, 7 × 5760×640
``resnet-50``   ``"paper"``       the 3×3 bottleneck convs and the 7×7 stem (17 matrices)
``vgg-16``      ``"paper"``       12 of the 13 convs (the first has 27 < 64 inputs; narrower
                                  variants keep it: 27 ≥ their c_o)
``transformer`` ``"all"``         12 blocks × (4 × 768×768 + 2 × 3072×768) = 72 matrices
==============  ================  =======================================================

Scales (same structure, narrower via the models' width multipliers):

* ``"full"`` — the sizes above; the default on a GPU.
* ``"cpu"`` — the default without a GPU: widths chosen so the whole main job (timing,
  200-step stability, memory, for every contender) takes a few minutes on 2 cores.
* ``"tiny"`` — a few channels per layer; the smoke test runs every case once with it.

The scale comes from the ``FGD_BENCH_SCALE`` environment variable (or the suite's
``--bench-scale`` option); :func:`default_scale` picks ``"full"`` on a GPU, else ``"cpu"``.
Model weights come from a fixed seed and the constrained ones are orthonormalised once per
device (:func:`fgd_fast.orthogonalize_`), so every contender starts from the same point and
is built with ``orthogonalize=False``.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

import fgd_fast
from benchmarks.machine import bench_device
from benchmarks.models import resnet50, transformer, vgg16, wide_resnet
from fgd_fast._matrix import stiefel_shape

__all__ = ["SCALES", "Workload", "default_scale", "workloads", "layer_shapes", "weight_shapes"]

SCALES = ("full", "cpu", "tiny")
SEED = 0

# per scale: WRN widen factor, ResNet-50 / VGG-16 width multipliers, transformer (blocks, d_model)
_SIZES = {
    "full": dict(wrn=10.0, resnet=1.0, vgg=1.0, blocks=12, d_model=768),
    "cpu": dict(wrn=1.5, resnet=0.2, vgg=0.2, blocks=2, d_model=128),
    "tiny": dict(wrn=0.25, resnet=0.03125, vgg=0.03125, blocks=1, d_model=16),
}


@dataclass(frozen=True)
class Workload:
    """A model (built from a seed) and the rule that selects its Stiefel-constrained weights."""

    name: str
    rule: str
    description: str
    build: Callable[[], nn.Module]

    def model(self, device: torch.device | str = "cpu") -> nn.Module:
        """A fresh copy of the seeded model on ``device``, constrained weights orthonormal."""
        return copy.deepcopy(template_model(self, torch.device(device)))


_BUILT: dict[tuple[str, str], nn.Module] = {}  # (name, description) -> seeded model on the CPU
_TEMPLATES: dict[tuple[str, str, str], nn.Module] = {}  # ... and device -> orthonormalised copy


def _built(w: Workload) -> nn.Module:
    """The model of ``w`` as its constructor made it from the seed (on the CPU, built once)."""
    key = (w.name, w.description)
    if key not in _BUILT:
        torch.manual_seed(SEED)
        _BUILT[key] = w.build()
    return _BUILT[key]


def template_model(w: Workload, device: torch.device) -> nn.Module:
    """The model of ``w`` on ``device`` with its constrained weights orthonormalised there."""
    key = (w.name, w.description, str(device))
    if key not in _TEMPLATES:
        model = copy.deepcopy(_built(w)).to(device)
        for _, p in fgd_fast.select_stiefel(model, w.rule):
            fgd_fast.orthogonalize_(p.data)
        _TEMPLATES[key] = model
    return _TEMPLATES[key]


def default_scale() -> str:
    """``FGD_BENCH_SCALE`` if set, else ``"full"`` on a GPU and ``"cpu"`` on a CPU (the
    benchmark's device: ``FGD_BENCH_DEVICE=cpu`` on a GPU machine takes the CPU sizes)."""
    scale = os.environ.get("FGD_BENCH_SCALE") or ("full" if bench_device().type == "cuda" else "cpu")
    if scale not in SCALES:
        raise ValueError(f"FGD_BENCH_SCALE={scale!r}: choose one of {', '.join(SCALES)}")
    return scale


def workloads(scale: str) -> list[Workload]:
    """The four workloads at ``scale`` (``"full"``, ``"cpu"`` or ``"tiny"``)."""
    if scale not in _SIZES:
        raise ValueError(f"unknown scale {scale!r}: choose one of {', '.join(SCALES)}")
    s = _SIZES[scale]
    d, blocks = s["d_model"], s["blocks"]
    return [
        Workload("wrn-28-10", "official", f"WRN-28-{s['wrn']:g}", lambda: wide_resnet(28, s["wrn"])),
        Workload("resnet-50", "paper", f"ResNet-50 ×{s['resnet']:g}", lambda: resnet50(s["resnet"])),
        Workload("vgg-16", "paper", f"VGG-16 ×{s['vgg']:g}", lambda: vgg16(s["vgg"])),
        Workload(
            "transformer",
            "all",
            f"{blocks} block{'s' * (blocks > 1)} × d={d}",
            lambda: transformer(blocks, d, heads=max(1, d // 64)),
        ),
    ]


def weight_shapes(workload: Workload) -> list[torch.Size]:
    """Shapes of the constrained weights of ``workload`` (the gradients' shapes)."""
    return [p.shape for _, p in fgd_fast.select_stiefel(_built(workload), workload.rule)]


def layer_shapes(workload: Workload) -> list[tuple[int, int]]:
    """``(n, p)`` of every constrained matrix of ``workload`` (θ is ``n × p``, ``n >= p``)."""
    return [tuple(stiefel_shape(s)[:2]) for s in weight_shapes(workload)]
