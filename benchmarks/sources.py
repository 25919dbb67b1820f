"""A digest of the source tree (one concern: identifying what was measured without git).

The GPU machine receives a copy of the working tree without ``.git``; the SHA-256 over the
package, kernel, extension, benchmark and test sources (paths and contents, in sorted order)
is the same there as in the checkout it came from, so a result can be matched to a commit:
``python -m benchmarks.gpu.gpu_check --digest`` prints it for the current checkout.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

__all__ = ["source_digest", "SOURCE_DIRS"]

SOURCE_DIRS = ("fgd_fast", "kernels", "csrc", "benchmarks", "tests")
SUFFIXES = {".py", ".cu", ".cuh", ".cpp", ".h", ".sh"}
TOP_FILES = ("setup.py", "pytest.ini")


def _files(root: Path) -> list[Path]:
    found = [root / f for f in TOP_FILES if (root / f).is_file()]
    for d in SOURCE_DIRS:
        for path in (root / d).rglob("*"):
            parts = set(path.relative_to(root).parts)
            if path.is_file() and path.suffix in SUFFIXES and "__pycache__" not in parts and "results" not in parts:
                found.append(path)
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def source_digest(root: Path) -> str:
    """The first 16 hex digits of the SHA-256 of the source files under ``root``."""
    h = hashlib.sha256()
    for path in _files(root):
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()[:16]
