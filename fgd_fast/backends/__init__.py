"""Backend registry and resolution.

``reference`` and ``torch`` run anywhere. ``triton`` and ``cuda`` are imported lazily the
first time they are asked for, so the package imports with no Triton, no GPU and no compiler.
``resolve_backend`` is called once per (requested name, device type, precision) and cached by the
caller.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Callable

import torch

from .base import PRECISIONS, Backend, BackendUnavailable, StepPlan, check_precision, compute_dtype

__all__ = [
    "BACKENDS",
    "DEFAULT_PRECISION",
    "PRECISION_BACKENDS",
    "PRECISIONS",
    "Backend",
    "BackendUnavailable",
    "StepPlan",
    "checked_precision",
    "compute_dtype",
    "resolve_backend",
]

BACKENDS = ("auto", "reference", "torch", "triton", "cuda")
#: The default ``precision``: the fastest precision whose accuracy is fp32-level as measured on a
#: GPU (max ‖θᵀθ − I‖_F within 1.5× of the reference form's on every workload measured; the
#: numbers are in the README and ``benchmarks/results/gpu-h200-2026-11-26-first.md``). On a CPU,
#: ``"tf32x3"`` computes exactly what ``"ieee"`` does (a CPU has no TF32).
DEFAULT_PRECISION = "tf32x3"
PRECISION_BACKENDS = ("auto", "torch", "triton")  # honour precision= (the others compute in IEEE fp32)
#: The oldest Triton the kernels are tested with (3.6, the GPU machine's; CI runs 3.8): an older one
#: is refused with the reason rather than failing in its own way (3.0–3.3's interpreter cannot run
#: the kernels).
MIN_TRITON = (3, 6)


def checked_precision(precision: str | None, backend: str, advice: str = "") -> str:
    """``precision`` for ``backend``: ``None`` is the library's default where the backend
    honours it (:data:`DEFAULT_PRECISION`), ``"ieee"`` elsewhere; a precision other than
    ``"ieee"`` with a backend that always computes in full precision is a ``ValueError``
    (``advice`` is added to its message)."""
    if precision is None:
        return DEFAULT_PRECISION if backend in PRECISION_BACKENDS else "ieee"
    check_precision(precision)
    if precision != "ieee" and backend not in PRECISION_BACKENDS:
        raise ValueError(
            f"precision={precision!r} needs backend='torch', 'triton' or 'auto'; backend={backend!r} always "
            "computes in full precision: pass precision='ieee' (or none: the default follows the backend) or "
            "choose one of those backends" + advice
        )
    return precision


def _load_reference() -> Backend:
    from .reference import prepare_reference

    return prepare_reference


def _load_torch() -> Backend:
    from .torch_batched import prepare_torch

    return prepare_torch


def _triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _tf32_tensor_cores(device: torch.device) -> bool:
    """Whether ``device`` is an NVIDIA GPU with TF32 tensor cores (compute capability 8.0 on:
    Ampere, Hopper, Blackwell), where the Triton backend's tensor-core step was measured fastest.
    An older NVIDIA GPU runs its TF32 products as fp32 FMA (slower than cuBLAS); a ROCm build's
    GPU has no TF32 dot in Triton (but the MI300's)."""
    if getattr(torch.version, "hip", None):
        return False
    try:
        return torch.cuda.get_device_capability(device) >= (8, 0)
    except (AssertionError, RuntimeError):  # (a torch without CUDA: no GPU to ask)
        return False


def _release(version: str) -> tuple[int, ...]:
    """The leading release numbers of a version string: ``"3.6.0+git9a1b"`` → ``(3, 6, 0)``."""
    match = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(part) for part in match.group(0).split(".")) if match else ()


def _load_triton(device: torch.device) -> Backend:
    if device.type != "cuda" and not _triton_interpreted():
        how = "" if importlib.util.find_spec("triton") else "install Triton (pip install 'fgd_fast[triton]') and "
        raise BackendUnavailable(
            f"backend='triton' needs CUDA tensors, got {device.type} tensors ({how}set TRITON_INTERPRET=1 "
            "before importing fgd_fast to run the kernels on the CPU for testing, or use "
            "backend='torch')"
        )
    if device.type == "cuda" and getattr(torch.version, "hip", None):
        raise BackendUnavailable(
            f"backend='triton' runs on NVIDIA GPUs (its kernels are built and tested for them); this torch "
            f"{torch.__version__} is a ROCm (HIP) build: use backend='torch' (or 'auto', which picks it)"
        )
    try:
        import triton

        version = getattr(triton, "__version__", "")
        if _release(version) < MIN_TRITON:
            raise BackendUnavailable(
                f"backend='triton' needs Triton >= {'.'.join(map(str, MIN_TRITON))}, the oldest version its kernels "
                f"are tested with; found {version or 'one without a version'}: pip install "
                f"'triton>={'.'.join(map(str, MIN_TRITON))}' (matching your torch), or use backend='torch' (or "
                "'auto', which falls back quietly)"
            )
        from .triton import prepare_triton
    except BackendUnavailable:
        raise
    except Exception as exc:  # Triton missing or failing at import (driver, ...)
        raise BackendUnavailable(
            f"backend='triton' is unavailable: {type(exc).__name__}: {exc}; install a Triton that runs here "
            "(pip install triton), or use backend='torch' (or 'auto', which falls back quietly)"
        ) from exc
    return prepare_triton


def _load_cuda(device: torch.device) -> Backend:
    if device.type != "cuda":
        raise BackendUnavailable(f"backend='cuda' needs CUDA tensors, got {device.type} tensors; use backend='torch'")
    try:
        from .cuda import prepare_cuda
    except Exception as exc:  # extension missing or failing to build or load
        raise BackendUnavailable(
            f"backend='cuda' is unavailable: {type(exc).__name__}: {exc}; rebuild the extension "
            "(pip install --no-build-isolation -e . with a CUDA toolkit), or use backend='torch' or 'auto'"
        ) from exc
    return prepare_cuda


def resolve_backend(name: str, device: torch.device, precision: str = "ieee") -> tuple[str, Backend]:
    """``(resolved name, prepare function)`` for ``name`` on ``device``.

    ``"auto"`` picks the fastest backend that loads and never raises, as measured on a GPU
    (``benchmarks/results/gpu-h200-2026-11-26-first.md``): ``torch`` for ``"ieee"`` (cuBLAS
    beat Triton's CUDA-core kernels) and on CPUs, and ``triton`` for the TF32 precisions on
    NVIDIA GPUs with TF32 tensor cores (compute capability 8.0 on) when it loads (its
    tensor-core step beat the torch backend's), else ``torch``.
    An explicit name that cannot run raises :class:`BackendUnavailable` with the reason.
    """
    loaders: dict[str, Callable[[], Backend]] = {
        "reference": _load_reference,
        "torch": _load_torch,
        "triton": lambda: _load_triton(device),
        "cuda": lambda: _load_cuda(device),
    }
    if name != "auto":
        if name not in loaders:
            raise ValueError(f"unknown backend={name!r}: choose one of {', '.join(map(repr, BACKENDS))}")
        return name, loaders[name]()
    if device.type == "cuda" and precision in ("tf32", "tf32x3") and _tf32_tensor_cores(device):
        try:
            return "triton", loaders["triton"]()
        except BackendUnavailable:
            pass
    return "torch", _load_torch()
