"""The locks of what the backends share across a process (one concern: threads).

Two optimizers may step at once in two threads (a hyper-parameter search, two models). What
their steps share is guarded here:

* the caches of device tables and layouts (``base.TableCache``, ``layout`` indices and memos,
  ``carry``'s store): one re-entrant lock around every lookup and insertion (a dict changed
  while another thread iterated it raised, or a key vanished between a check and a read), never
  around building an entry: a build may wait for other ranks (the owner sharding's all-gather),
  and ranks run as threads would wait for the lock in turn (two threads may then both build
  one entry; the first inserted is kept);
* torch's process-wide fp32 matmul precision, which a step sets for its products
  (:func:`matmul_precision`): the regions open in every thread are counted, the setting is the
  most precise any of them wants (IEEE while one wants it, else TF32), and the last region to
  close restores the user's setting as the first one found it. (Each step used to save the
  setting, set its own and restore what it had saved, so two threads' steps restored each
  other's temporary values and TF32 stayed on for the rest of the process.) No region waits
  for another: ranks run as threads of one process meet in collectives inside their regions.
  A region never gets less precision than it asks for; one that overlaps an IEEE region may get
  more. fp32 matmuls of other threads that run meanwhile see the setting too (it is the
  process's), and a change of it made while a region is open (in another thread) is undone when
  the last one closes.

Under ``torch.compile`` nothing is locked (Dynamo traces no lock; a compiled step neither fills
caches at run time nor switches the precision).
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["cache_lock", "cached_entry", "matmul_precision"]

_CACHES = threading.RLock()


def cache_lock() -> contextlib.AbstractContextManager:
    """The backends' caches' lock (a null context while Dynamo traces)."""
    return contextlib.nullcontext() if torch.compiler.is_compiling() else _CACHES


def cached_entry(store: OrderedDict, pinned: set, key, make: Callable[[], Any], capacity: int, capturing: bool):
    """``(store[key], whether it was built now)``: a hit becomes the most recent entry; a miss is
    built by ``make()`` outside the lock (kept across steps: never an inference tensor) and
    inserted (another thread's, if it came first), the least recently used unpinned entries
    going beyond ``capacity``. ``capturing``: a CUDA graph is being captured, whose replays read
    the entry's memory: it is pinned, never evicted."""
    with cache_lock():
        found = key in store
        if found:
            store.move_to_end(key)
            value = store[key]
    if not found:
        with torch.inference_mode(False):
            made = make()
    with cache_lock():
        if not found:
            value = store.setdefault(key, made)
            unpinned = [k for k in store if k not in pinned]  # oldest first
            for k in unpinned[: max(0, len(unpinned) - capacity)]:
                del store[k]
        if capturing:
            pinned.add(key)
    return value, not found


class _Regions:
    """The open precision regions of every thread and the setting the first one found."""

    def __init__(self):
        self.lock = threading.Lock()
        self.open = {"ieee": 0, "tf32": 0}
        self.found: tuple | None = None  # (legacy setting or None, [(per-backend switch, value)])
        self.changed = False


_REGIONS = _Regions()


def _read() -> tuple:
    """The settings as they are: the legacy one (None where the caller set the per-backend switches
    unlike it: torch raises reading it) and torch >= 2.9's per-backend switches."""
    switches = [s for s in (torch.backends.cuda.matmul, torch.backends.mkldnn.matmul) if hasattr(s, "fp32_precision")]
    try:
        legacy = torch.get_float32_matmul_precision()
    except RuntimeError:
        legacy = None
    return legacy, [(s, s.fp32_precision) for s in switches]


def _apply(found: tuple, ieee: bool) -> bool:
    """Set IEEE (``ieee``) or TF32-allowed fp32 products through the API the caller used (mixing
    them makes torch raise at a matmul), writing only what differs; whether anything was written."""
    legacy, switches = found
    if legacy is not None:
        wanted = "highest" if ieee else "high"
        try:
            now = torch.get_float32_matmul_precision()
        except RuntimeError:  # (the per-backend switches set unlike it since: the legacy setter resets them)
            now = None
        if now == wanted:
            return False
        torch.set_float32_matmul_precision(wanted)
        return True
    # (cuBLAS at the step's precision, oneDNN on a CPU in IEEE fp32 at every precision)
    targets = {torch.backends.cuda.matmul: "ieee" if ieee else "tf32", torch.backends.mkldnn.matmul: "ieee"}
    stale = [(s, v) for s, v in targets.items() if s.fp32_precision != v]
    for switch, value in stale:
        switch.fp32_precision = value
    return bool(stale)


def _restore(found: tuple) -> None:
    """The settings as :func:`_read` found them (the legacy setter also writes the per-backend
    switches, to "none": those are put back after it)."""
    legacy, switches = found
    if legacy is not None:
        torch.set_float32_matmul_precision(legacy)
    for switch, value in switches:
        switch.fp32_precision = value


@contextlib.contextmanager
def matmul_precision(precision: str) -> Iterator[None]:
    """fp32 products at ``precision`` inside (``"ieee"``, or TF32 allowed for ``"tf32"`` and
    ``"tf32x3"``), counted with every thread's open regions as the module docstring says."""
    want = "ieee" if precision == "ieee" else "tf32"
    with _REGIONS.lock:
        if not any(_REGIONS.open.values()):
            _REGIONS.found, _REGIONS.changed = _read(), False
        # (counted once set: a setting that could not be written opens no region)
        _REGIONS.changed |= _apply(_REGIONS.found, want == "ieee" or _REGIONS.open["ieee"] > 0)
        _REGIONS.open[want] += 1
    try:
        yield
    finally:
        with _REGIONS.lock:
            _REGIONS.open[want] -= 1
            if any(_REGIONS.open.values()):
                _REGIONS.changed |= _apply(_REGIONS.found, _REGIONS.open["ieee"] > 0)
            elif _REGIONS.changed:  # (the last region: the user's setting back, as found)
                _restore(_REGIONS.found)
