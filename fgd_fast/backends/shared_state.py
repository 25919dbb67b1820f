"""The locks of what the backends share across a process (one concern: threads).

Two optimizers may step at once in two threads (a hyper-parameter search, two models). What
their steps share is guarded here:

* the caches of device tables and layouts (``base.TableCache``, ``layout`` indices and memos,
  ``carry``'s store): one re-entrant lock around every lookup and insertion (a dict changed
  while another thread iterated it raised, or a key vanished between a check and a read);
* torch's process-wide fp32 matmul precision, which a step switches for its products
  (:func:`matmul_switch`): one thread at a time switches it, re-entrantly (a step nests an IEEE
  region inside a TF32 one), so two steps no longer restore each other's temporary setting
  (which left TF32 on for the rest of the process); a thread that wants it waits for the other
  thread's region to end.

Under ``torch.compile`` nothing is locked (Dynamo traces no lock; a compiled step neither fills
caches at run time nor switches the precision).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

__all__ = ["cache_lock", "matmul_switch"]

_CACHES = threading.RLock()


def cache_lock() -> contextlib.AbstractContextManager:
    """The backends' caches' lock (a null context while Dynamo traces)."""
    return contextlib.nullcontext() if torch.compiler.is_compiling() else _CACHES


class _Switch:
    """Which thread may change the matmul precision now, and how deep its regions nest."""

    def __init__(self):
        self.ready = threading.Condition()
        self.owner: int | None = None
        self.depth = 0


_SWITCH = _Switch()


@contextlib.contextmanager
def matmul_switch() -> Iterator[None]:
    """Hold the right to change (and restore) torch's fp32 matmul precision inside: re-entrant in
    one thread; another thread's region waits until this one's outermost region ends."""
    me = threading.get_ident()
    with _SWITCH.ready:
        while _SWITCH.owner not in (None, me):
            _SWITCH.ready.wait()
        _SWITCH.owner = me
        _SWITCH.depth += 1
    try:
        yield
    finally:
        with _SWITCH.ready:
            _SWITCH.depth -= 1
            if _SWITCH.depth == 0:
                _SWITCH.owner = None
                _SWITCH.ready.notify_all()
