"""Gram blocks carried from one step to the next (the torch backend on a CPU).

A step's Gram pass reads θ and Φ to form ``A = θᵀθ``, ``B = θᵀΦ``, ``C = ΦᵀΦ``. But the step
itself knows θ₊ and Φ₊ as ``θK + sU`` and ``sU + θM_Φ``, so the next step's blocks follow from
this step's ``p × p`` blocks (:func:`.algebra.next_grams`: four ``p × p`` products instead of
``2.5`` passes of ``2np²``). The torch backend carries them where that is cheaper (``n ≥ 2p``
for B and C; A comes free with the guard's exact distance) for at most ``gram_refresh − 1``
steps, then takes them from the parameters again (``FGD(gram_refresh=)``; the default, 1, reads
them every step).

Carried blocks are exact to rounding: they differ from a fresh Gram by the rounding of storing
θ₊ and Φ₊ (float32 or float64 parameters only; a float16/bfloat16 θ is never carried), which
accumulates over the steps carried, so the guard's rounding margin is taken that many times.
The carried blocks are not part of the optimizer's state: a copy or a restored checkpoint reads
its Grams afresh, so it continues equal to the original to rounding, not bit for bit.

A carried entry is used only for the very tensors it was made from, unchanged since: the same
parameter and buffer objects (weak references), and their version counters as the step left
them, at the same addresses. Any in-place write through autograd's view of a tensor
(``p.copy_``, ``p.mul_``, ``load_state_dict``, ``orthogonalize_``, a new momentum buffer) bumps
the counter, and new memory (``p.data = other``, torch's ``vector_to_parameters``) moves the
address: the next step reads the parameters again. A write in place through ``p.data``
(``p.data.copy_``, ``orthogonalize_(p.data)``) changes neither: it is seen at the next refresh
(call :func:`forget` after such a write, or use ``gram_refresh=1``).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .shared_state import cache_lock

__all__ = ["GRAM_REFRESH", "Carried", "take", "keep", "forget"]

#: The default of ``FGD(gram_refresh=)``: Gram blocks read from the parameters every step (exact and
#: bit-reproducible: a copy or a checkpoint continues bit-identically, which carried blocks do only to rounding)
GRAM_REFRESH = 1


@dataclass
class Carried:
    blocks: tuple[torch.Tensor, ...]  # (A,) or (A, B, C), each (L, p, p)
    refs: tuple  # weak references to the parameters and buffers they were made from
    versions: tuple[tuple[int, int], ...]  # their version counters and addresses after the step that made them
    age: int  # steps since the blocks were last read from the parameters


_store: dict[tuple, Carried] = {}
_CAPACITY = 8  # entries kept (one per middle group of layers: a model has a few); the oldest go first


def _state(tensors: Sequence[torch.Tensor]) -> tuple[tuple[int, int], ...]:
    """Per tensor: its version counter and its memory's address (``p.data = other``, as torch's
    ``vector_to_parameters`` does, keeps the counter but moves the address)."""
    return tuple((t._version, t.data_ptr()) for t in tensors)


def _stamp(tensors: Sequence[torch.Tensor]) -> tuple[tuple, tuple[tuple[int, int], ...]]:
    return tuple(weakref.ref(t) for t in tensors), _state(tensors)


def take(key: tuple, tensors: Sequence[torch.Tensor], refresh: int) -> Carried | None:
    """The entry of ``key`` if its blocks were made from ``tensors`` as they are now and are
    younger than ``refresh`` steps, else None. The entry is removed either way (its blocks
    become the step's scratch; :func:`keep` stores the next one)."""
    with cache_lock():  # (dict.pop is atomic; the lock orders it with another thread's keep)
        entry = _store.pop(key, None)
    if entry is None or entry.age + 1 >= refresh:
        return None
    if len(entry.refs) != len(tensors) or any(r() is not t for r, t in zip(entry.refs, tensors)):
        return None
    if entry.versions != _state(tensors):
        return None
    return entry


def keep(key: tuple, blocks: tuple[torch.Tensor, ...], tensors: Sequence[torch.Tensor], age: int) -> None:
    """Store the next step's blocks of ``key``, stamped with ``tensors`` as they are now (call
    after the step's writes)."""
    refs, versions = _stamp(tensors)
    with cache_lock():  # (another thread's step may iterate or insert at once)
        for old in [k for k, e in _store.items() if any(r() is None for r in e.refs)]:
            del _store[old]  # entries of tensors since freed (a model dropped) hold memory for nothing
        _store[key] = Carried(blocks, refs, versions, age)
        while len(_store) > _CAPACITY:
            del _store[next(iter(_store))]


def forget() -> None:
    """Drop every carried block: the next step of every layer reads its parameters (after a
    write the version counters cannot see, e.g. through ``p.data``)."""
    with cache_lock():
        _store.clear()
