"""How many device operations a step issues: the non-view aten ops of one call, counted with a
``TorchDispatchMode``. Most are kernels (at least one launch each on a GPU, a few microseconds
of host time); the count also holds the allocations (``empty``) and host reads of device values
(``_local_scalar_dense``), which cost host time without a kernel, so for the torch backend's
step it bounds the launches from above (Triton's launches are counted apart; the CUDA
extension's kernels are no aten ops). Ops of other namespaces (the profiler's
``record_function`` marks, ``_c10d_functional`` collectives) are not counted. Used by the
benchmark report and by ``tests/test_op_count.py``."""

from __future__ import annotations

import collections
import contextlib
import sys
from collections.abc import Callable, Iterator
from unittest import mock

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpCounter", "counted", "count_ops", "count_wrn_style_step", "VIEWS", "is_view", "PRODUCTS", "product"]

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
    """Counts the non-view aten ops run inside it, per op name (``ops``; other namespaces, such as
    the profiler's marks, are not device operations and not counted)."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name.startswith("aten.") and not is_view(name):
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


def count_wrn_style_step(backend: str) -> tuple[collections.Counter, int]:
    """(non-view aten ops by name, Triton launches) of one steady-state step (the third: the first
    two make Φ and the tables) of ``FGD(backend=backend)`` with default options on a 21-layer
    WRN-style set in three p-classes (7 each of 16-, 32- and 64-channel 3 × 3 convolutions for the
    torch backend; 8, 12 and 16 for Triton, whose count does not depend on the sizes and whose CPU
    interpreter is slow). Triton is counted as a GPU runs it: the guard blends every layer, no
    device value is read on the host; its launches are counted, not the interpreter's own tensor
    work. The set of ``tests/test_op_count.py`` and ``benchmarks/studies/op_counts.py``."""
    import torch
    from torch.utils._python_dispatch import _disable_current_modes

    import fgd_fast
    from fgd_fast.backends import guard_rule

    launches = [0]
    with contextlib.ExitStack() as patches:
        if backend == "triton":
            from fgd_fast.backends import triton_launch

            real = triton_launch.launch

            def launch(*args, **kwargs):
                launches[0] += 1
                with _disable_current_modes():
                    return real(*args, **kwargs)

            patches.enter_context(mock.patch.object(guard_rule, "HOST_READ_DEVICES", ()))
            patches.enter_context(mock.patch.object(triton_launch, "launch", launch))
        gen = torch.Generator().manual_seed(0)
        c = (16, 32, 64) if backend == "torch" else (8, 12, 16)
        shapes = [(c[0], c[0], 3, 3)] * 7 + [(c[1], c[1], 3, 3)] * 7 + [(c[2], c[2], 3, 3)] * 7
        params = [torch.nn.Parameter(fgd_fast.orthogonalize_(torch.randn(s, generator=gen))) for s in shapes]
        opt = fgd_fast.FGD([dict(params=params, orthogonal=True)], lr=0.01, backend=backend)
        for step in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen) * 0.01
            if step == 2:
                launches[0] = 0
                with counted() as count:  # (the CPU step outside its inference mode: see counted)
                    opt.step()
            else:
                opt.step()
    return count.ops, launches[0]
