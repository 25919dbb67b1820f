"""Launching the Triton backend's kernels (one concern: how many programs, and counting launches).

Shared by the backend's passes (``triton.py``) and the middle's launchers (``gram_gather.py``,
``mid_products.py``, ``guard_blend.py``, ``fused_middle.py``). Importing it imports no Triton:
the kernels are handed in by the callers.
"""

from __future__ import annotations

from collections import Counter

import torch

__all__ = ["launch", "launch_counts", "force_programs", "programs_wanted", "persistent"]

#: kernel name -> number of launches since import (tests assert the launch count per step)
launch_counts: Counter = Counter()
#: tests may force the number of programs of the persistent grids (None: from the GPU)
force_programs: int | None = None


def launch(kernel, grid, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``, counted in :data:`launch_counts`."""
    launch_counts[kernel.fn.__name__] += 1
    kernel[grid](*args, **kwargs)


def programs_wanted(device: torch.device) -> int:
    """Programs that fill ``device``: 4 per SM on a GPU; 1 under the interpreter (which runs
    programs one after another)."""
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def persistent(items: int, device: torch.device) -> int:
    """Programs of a persistent grid over ``items`` work items (~2 per SM on a GPU; 3 under the
    interpreter, so that programs share the work there too)."""
    wanted = force_programs or (programs_wanted(device) // 2 if device.type == "cuda" else 3)
    return max(1, min(items, wanted))
