"""Peak extra memory of one optimizer step (one concern: counting the bytes a step allocates).

* CUDA: ``torch.cuda.max_memory_allocated()`` after ``reset_peak_memory_stats()``, minus the
  memory allocated before the step (the caching allocator's own count).
* CPU: torch keeps no allocator statistics for CPU tensors, so :class:`LiveBytes` (a
  ``TorchDispatchMode``) watches every aten op of the step — autograd's backward included —
  and counts the storage of each tensor an op returns that is new (not one of the op's
  inputs' storages, not already counted). Each counted storage gets a ``weakref.finalize``
  that subtracts its bytes when torch frees it; the peak of that running total is the
  result. It sees what aten ops return (temporaries, new state), not scratch memory that a
  kernel allocates and frees inside itself (e.g. LAPACK workspaces), so it is a lower bound.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["LiveBytes", "peak_extra_bytes", "METHODS"]

METHODS = {
    "cuda": "torch.cuda.max_memory_allocated() minus the allocation before the step",
    "cpu": (
        "storages returned by aten ops during the step, tracked live (TorchDispatchMode + weakref "
        "finalizers); excludes kernel-internal scratch"
    ),
}


def _storages(tree) -> dict[int, torch.UntypedStorage]:
    out = {}
    for t in tree_leaves(tree):
        if isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type != "meta":
            s = t.untyped_storage()
            if s.nbytes():
                out[s.data_ptr()] = s
    return out


class LiveBytes(TorchDispatchMode):
    """Running total (``current``) and maximum (``peak``) of bytes allocated by aten ops."""

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._live: dict[int, int] = {}  # data_ptr -> bytes of the storages counted and alive

    def _free(self, ptr: int, nbytes: int) -> None:
        if self._live.get(ptr) == nbytes:
            del self._live[ptr]
            self.current -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        seen = _storages((args, kwargs))
        for ptr, s in _storages(out).items():
            if ptr in seen or ptr in self._live:
                continue  # an input (in place, view, out=) or a storage already counted
            nbytes = s.nbytes()
            self._live[ptr] = nbytes
            self.current += nbytes
            self.peak = max(self.peak, self.current)
            weakref.finalize(s, self._free, ptr, nbytes)
        return out


def peak_extra_bytes(step: Callable[[], None], device: torch.device) -> tuple[int, str]:
    """``(bytes, method)``: the peak memory ``step()`` allocates above what existed before it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step()
        torch.cuda.synchronize(device)
        return max(0, torch.cuda.max_memory_allocated(device) - before), METHODS["cuda"]
    with LiveBytes() as live:
        step()
    return live.peak, METHODS["cpu"]
