"""How many device operations a step issues: the non-view aten ops of one call, counted with a
``TorchDispatchMode`` (each is at least one kernel launch on a GPU, a few microseconds of host
time). Used by the benchmark report and by ``tests/test_op_count.py``."""

from __future__ import annotations

import collections
import contextlib
import sys
from collections.abc import Callable, Iterator

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpCounter", "counted", "count_ops", "VIEWS", "is_view", "PRODUCTS", "product"]

#: aten ops that only make views (no kernel): not counted (matched by the whole name: ``index_select``
#: or ``slice_scatter`` are kernels)
VIEWS = ("view", "_unsafe_view", "as_strided", "transpose", "t", "expand", "unsqueeze", "squeeze", "select")
VIEWS += ("slice", "narrow", "permute", "detach", "alias", "reshape", "_reshape_alias", "unbind", "split")
VIEWS += ("split_with_sizes", "diagonal", "unfold", "view_as", "expand_as", "_nested_view_from_buffer")


def is_view(name: str) -> bool:
    """Whether the aten op ``name`` (e.g. ``"aten.view"``, ``"aten.unbind.int"``) only makes views."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[0] == "aten" and parts[1] in VIEWS


#: the matrix products among aten ops (operands: the first two tensors, after the input added to for the others)
PRODUCTS = ("bmm", "mm", "baddbmm", "baddbmm_", "addmm", "addmm_")


def product(name: str, args) -> tuple | None:
    """``(x, y, flops)`` of the aten op ``name`` (its packet name, e.g. ``"bmm"``) called with
    ``args`` if it is a matrix product ``x @ y`` (2 flops per multiply-add), else None."""
    if name not in PRODUCTS:
        return None
    x, y = (args[0], args[1]) if name in ("bmm", "mm") else (args[1], args[2])
    batch = x.shape[0] if x.dim() == 3 else 1
    return x, y, 2 * batch * x.shape[-2] * x.shape[-1] * y.shape[-1]


class OpCounter(TorchDispatchMode):
    """Counts the non-view aten ops run inside it, per op name (``ops``)."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if not is_view(name):
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


@contextlib.contextmanager
def counted() -> Iterator[OpCounter]:
    """An :class:`OpCounter` over the block, with the torch backend's CPU step kept outside
    ``torch.inference_mode``, which it enters otherwise: inside it the dispatcher shows composite
    ops such as ``to`` or ``stack`` undecomposed, so the same kernels would count differently."""
    torch_batched = sys.modules.get("fgd_fast.backends.torch_batched")
    kept = getattr(torch_batched, "_CPU_INFERENCE_MODE", None)
    if kept is not None:
        torch_batched._CPU_INFERENCE_MODE = 0
    try:
        with OpCounter() as counter:
            yield counter
    finally:
        if kept is not None:
            torch_batched._CPU_INFERENCE_MODE = kept


def count_ops(fn: Callable[[], object]) -> int:
    """The non-view aten ops one call of ``fn`` issues (counted as :func:`counted` does)."""
    with counted() as counter:
        fn()
    return counter.total
