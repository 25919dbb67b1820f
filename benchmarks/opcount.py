"""How many device operations a step issues: the non-view aten ops of one call, counted with a
``TorchDispatchMode`` (each is at least one kernel launch on a GPU, a few microseconds of host
time). Used by the benchmark report and by ``tests/test_op_count.py``."""

from __future__ import annotations

import collections
import contextlib
import sys
from collections.abc import Callable, Iterator

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpCounter", "counted", "count_ops", "VIEWS", "is_view"]

#: aten ops that only make views (no kernel): not counted (matched by the whole name: ``index_select``
#: or ``slice_scatter`` are kernels)
VIEWS = ("view", "_unsafe_view", "as_strided", "transpose", "t", "expand", "unsqueeze", "squeeze", "select")
VIEWS += ("slice", "narrow", "permute", "detach", "alias", "reshape", "_reshape_alias", "unbind", "split")
VIEWS += ("split_with_sizes", "diagonal", "unfold", "view_as", "expand_as", "_nested_view_from_buffer")


def is_view(name: str) -> bool:
    """Whether the aten op ``name`` (e.g. ``"aten.view"``, ``"aten.unbind.int"``) only makes views."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[0] == "aten" and parts[1] in VIEWS


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
