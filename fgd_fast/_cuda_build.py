"""Find or build the CUDA extension of ``backend="cuda"`` (one concern: loading it).

:func:`load` returns the compiled module: ``fgd_fast._C`` when ``setup.py`` built it, else a
just-in-time build of ``csrc/`` with ``torch.utils.cpp_extension.load`` (an editable install
builds on first use; ninja caches the objects in :func:`build_directory`). Any failure is
raised as ``ImportError`` whose message says why (CPU build of torch, no toolkit, compiler
error), which the backend registry turns into ``BackendUnavailable``. Nothing here runs at
``import fgd_fast``, and a failure is remembered, so a broken toolkit is tried only once per
process.

Environment: ``FGD_FAST_JIT=0`` disables the just-in-time build; ``FGD_FAST_BUILD_DIR``
overrides the build directory; ``FGD_FAST_BUILD_VERBOSE=1`` shows the compiler's output.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path
from types import ModuleType

import torch

__all__ = ["CSRC", "SOURCES", "build_directory", "extra_include_dirs", "hash_define", "load", "source_hash"]

#: the kernel sources: ``fgd_fast/csrc`` in an installed wheel, ``csrc/`` beside the package
#: in a source checkout or editable install
_HERE = Path(__file__).resolve().parent
CSRC = _HERE / "csrc" if (_HERE / "csrc").is_dir() else _HERE.parent / "csrc"
SOURCES = ("fgd_binding.cpp", "fgd_gram.cu", "fgd_update.cu")
HEADERS = ("fgd_cuda.h", "fgd_device.cuh")
NVCC_FLAGS = ["-O3", "-std=c++17"]  # no --use_fast_math: A's rounding sets the distance floor

_result: ModuleType | str | None = None  # the module, or the reason it cannot be loaded


def source_hash(csrc: Path = CSRC) -> int | None:
    """A 60-bit hash of the kernel sources and headers in ``csrc`` (None where one is missing):
    built into the extension (:func:`hash_define`, ``constants()["SOURCE_HASH"]``), so that a
    prebuilt ``fgd_fast._C`` older than edited sources (an editable install) is not used."""
    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        path = csrc / name
        if not path.is_file():
            return None
        digest.update(name.encode() + b"\0" + path.read_bytes())
    return int(digest.hexdigest()[:15], 16)


def hash_define(csrc: Path = CSRC) -> list[str]:
    """The compiler flag carrying :func:`source_hash` (a number: no quoting through ninja's shell)."""
    value = source_hash(csrc)
    return [] if value is None else [f"-DFGD_SOURCE_HASH={value}LL"]


def build_directory() -> Path:
    """Where the just-in-time build keeps its objects: one folder per torch/CUDA/Python."""
    if os.environ.get("FGD_FAST_BUILD_DIR"):
        return Path(os.environ["FGD_FAST_BUILD_DIR"])
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    tag = f"torch{torch.__version__.split('+')[0]}-cu{torch.version.cuda}-py{sys.version_info[0]}{sys.version_info[1]}"
    return cache / "fgd_fast" / tag


def extra_include_dirs(cuda_home: str | None) -> list[str]:
    """``csrc/`` plus, when the toolkit lacks the CUDA library headers ATen includes
    (e.g. ``cublas_v2.h`` in a compiler-only install), the ``nvidia/cu*/include`` folder
    that the CUDA build of torch ships beside itself."""
    dirs = [str(CSRC)]
    if cuda_home and (Path(cuda_home) / "include" / "cublas_v2.h").exists():
        return dirs
    site = Path(torch.__file__).resolve().parent.parent
    major = (torch.version.cuda or "").split(".")[0]
    for cand in (site / "nvidia" / f"cu{major}" / "include", site / "nvidia" / "cublas" / "include"):
        if (cand / "cublas_v2.h").exists():
            dirs.append(str(cand))
            break
    return dirs


def _last_lines(text: str, count: int = 25) -> str:
    lines = [ln for ln in str(text).splitlines() if ln.strip()]
    return "\n".join(lines[-count:])


def _try_load() -> ModuleType | str:
    if getattr(torch.version, "hip", None):  # (a ROCm build: torch.version.cuda is None, devices say "cuda")
        return (
            f"torch {torch.__version__} is a ROCm (HIP) build; the fgd_fast CUDA extension is for NVIDIA GPUs "
            "(use backend='triton' or 'torch')"
        )
    if torch.version.cuda is None:
        return (
            f"torch {torch.__version__} is a CPU-only build; the fgd_fast CUDA extension needs a CUDA build "
            "of torch (use backend='torch' or 'triton')"
        )
    try:
        from fgd_fast import _C  # built by setup.py

        here = source_hash()
        if here is None or _C.constants().get("SOURCE_HASH") == here:
            return _C
        prebuilt = (
            f"fgd_fast._C was built from other sources than {CSRC} (edited since it was built: rebuild it with "
            "`pip install -e . --no-build-isolation`)"
        )
    except (ImportError, OSError) as exc:
        prebuilt = f"fgd_fast._C is not built or does not load ({exc})"
    if os.environ.get("FGD_FAST_JIT", "1") == "0":
        return f"{prebuilt}, and FGD_FAST_JIT=0 disables the just-in-time build"
    missing = [s for s in SOURCES if not (CSRC / s).exists()]
    if missing:
        return f"{prebuilt}, and the sources for a just-in-time build are missing ({CSRC}: {', '.join(missing)})"
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        return f"{prebuilt}, and no CUDA toolkit was found for a just-in-time build (set CUDA_HOME)"
    out = build_directory()
    try:
        out.mkdir(parents=True, exist_ok=True)
        return cpp_extension.load(
            name="fgd_fast_cuda",
            sources=[str(CSRC / s) for s in SOURCES],
            extra_include_paths=extra_include_dirs(cpp_extension.CUDA_HOME),
            extra_cflags=["-O3", *hash_define()],
            extra_cuda_cflags=NVCC_FLAGS + hash_define(),
            build_directory=str(out),
            verbose=os.environ.get("FGD_FAST_BUILD_VERBOSE", "0") not in ("", "0"),
        )
    except Exception as exc:  # compiler or linker error, ninja missing, …
        return f"{prebuilt}, and the just-in-time build in {out} failed:\n{_last_lines(exc)}"


def load() -> ModuleType:
    """The CUDA extension module; ``ImportError`` with the reason if it cannot be had."""
    global _result
    if _result is None:
        _result = _try_load()
    if isinstance(_result, str):
        raise ImportError(_result)
    return _result
