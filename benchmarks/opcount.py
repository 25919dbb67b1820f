"""How many device operations a step issues: the non-view aten ops of one call, counted with a
``TorchDispatchMode`` (each is at least one kernel launch on a GPU, a few microseconds of host
time). Used by the benchmark report and by ``tests/test_op_count.py``."""

from __future__ import annotations

import collections
from collections.abc import Callable

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpCounter", "count_ops", "VIEWS"]

#: aten ops that only make views (no kernel): not counted
VIEWS = ("view", "as_strided", "transpose", "aten.t", "expand", "unsqueeze", "squeeze", "select", "slice")
VIEWS += ("permute", "detach", "alias", "reshape", "unbind", "split", "diagonal")


class OpCounter(TorchDispatchMode):
    """Counts the non-view aten ops run inside it, per op name (``ops``)."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if not any(v in name for v in VIEWS):
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


def count_ops(fn: Callable[[], object]) -> int:
    """The non-view aten ops one call of ``fn`` issues."""
    with OpCounter() as counter:
        fn()
    return counter.total
