"""Triton's CPU interpreter, made to show races between the programs of a launch.

On a GPU the programs of one launch run concurrently, in no fixed order; the interpreter runs
them one after another, program 0 first, which hides a race between programs: one reading what
another writes, two writing one element, two sharing a scratch slab (each program finishes
before the next begins, so a shared slab never gets overwritten under a program's feet). Two
tools here, both for Triton 3.6 and 3.8:

* :func:`programs_in_order` runs every launch's programs in reverse order or in a seeded
  shuffle: a race-free kernel gives the same bits whatever the order, so a test compares a step
  run in several orders bit for bit;
* :func:`watch_programs` records which memory each program of a launch loads and stores
  (through the interpreter's masked load and store, byte by byte) and lists, per launch,
  the memory one program stores and another program loads or stores: a race on a GPU however
  the programs are ordered or interleaved, shared slabs included; and the memory a program
  loads after storing it with no ``tl.debug_barrier()`` between (on a GPU the threads that
  load a tile need not be those that stored it: a race between the threads of one program).

Both wrap the interpreter's builder: it calls ``set_grid_dim(nx, ny, nz)`` once per launch,
then ``set_grid_idx(x, y, z)`` before each program, ``create_masked_load`` /
``create_masked_store`` for every ``tl.load`` / ``tl.store`` and ``create_barrier`` for
``tl.debug_barrier()``. A program's load of what it stored is flagged even where the same
threads would do both (a conservative check); a store over what the program loaded before its
last barrier (write after read) is not checked: an in-place update loads and stores each
element in one thread.
"""

from __future__ import annotations

import contextlib
import itertools
import random
from collections import Counter
from typing import NamedTuple

import numpy as np


@contextlib.contextmanager
def _wrapped(on_dim=None, on_idx=None, on_access=None, on_end=None, on_barrier=None):
    """Patch the interpreter for the ``with`` block; the callbacks see the launch's kernel name."""
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    executor = interpreter.GridExecutor
    real_call = executor.__call__
    names = ("set_grid_dim", "set_grid_idx", "create_masked_load", "create_masked_store", "create_barrier")
    real = {k: getattr(builder, k) for k in names}
    launch = {"name": None}

    def call(self, *args, **kwargs):
        launch["name"] = getattr(self.fn, "__name__", "?")
        out = real_call(self, *args, **kwargs)
        if on_end:
            on_end(launch["name"])
        return out

    def set_grid_dim(nx, ny, nz):
        real["set_grid_dim"](nx, ny, nz)
        if on_dim:
            on_dim(launch["name"], (nx, ny, nz))

    def set_grid_idx(x, y, z):
        real["set_grid_idx"](*(on_idx((x, y, z)) if on_idx else (x, y, z)))

    def load(ptrs, mask, *args):
        if on_access:
            on_access("load", ptrs, mask)
        return real["create_masked_load"](ptrs, mask, *args)

    def store(ptrs, value, mask, *args):
        if on_access:
            on_access("store", ptrs, mask)
        return real["create_masked_store"](ptrs, value, mask, *args)

    def barrier():
        if on_barrier:
            on_barrier()
        return real["create_barrier"]()

    executor.__call__ = call
    builder.set_grid_dim, builder.set_grid_idx = set_grid_dim, set_grid_idx
    builder.create_masked_load, builder.create_masked_store = load, store
    builder.create_barrier = barrier
    try:
        yield builder
    finally:
        executor.__call__ = real_call
        for k in real:  # the class's methods again
            delattr(builder, k)


@contextlib.contextmanager
def programs_in_order(order: str, seed: int = 0):
    """Run every interpreted Triton launch's programs in ``order`` ("reverse" or "shuffle",
    seeded) for the ``with`` block; yields a Counter of kernel name → launches of two or more
    programs (the launches whose order changed), so a test can show it permuted something."""
    if order not in ("reverse", "shuffle"):
        raise ValueError(f"order={order!r}: pass 'reverse' or 'shuffle'")
    rng = random.Random(seed)
    permuted: Counter = Counter()
    mapping: dict = {}

    def on_dim(name, grid):
        loop = list(itertools.product(*map(range, grid)))
        run = loop[::-1] if order == "reverse" else rng.sample(loop, len(loop))
        mapping.clear()
        mapping.update(zip(loop, run))
        if len(loop) > 1:
            permuted[name] += 1

    with _wrapped(on_dim=on_dim, on_idx=lambda idx: mapping[idx]):
        yield permuted


class Race(NamedTuple):
    """Memory one program of a launch stores and another loads (``"store/load"``) or stores
    (``"store/store"``), or one program loads after storing it, no barrier between."""

    kernel: str
    kind: str
    units: int  # bytes in conflict
    programs: tuple  # two of the programs involved


class Watch(NamedTuple):
    races: list  # Race per launch and kind
    launches: Counter  # kernel name -> launches of two or more programs


@contextlib.contextmanager
def watch_programs():
    """Record every interpreted launch's loads and stores per program for the ``with`` block;
    yields a :class:`Watch` whose ``races`` fill in as launches end."""
    watch = Watch([], Counter())
    acc = {"grid": (1, 1, 1), "pid": 0, "loads": [], "stores": [], "dirty": set(), "own": Counter()}

    def on_dim(name, grid):
        acc.update(grid=grid, pid=0, loads=[], stores=[], dirty=set(), own=Counter())
        if int(np.prod(grid)) > 1:
            watch.launches[name] += 1

    def on_idx(idx):
        _, ny, nz = acc["grid"]
        acc["pid"] = (idx[0] * ny + idx[1]) * nz + idx[2]
        acc["dirty"] = set()  # (what this program stored since its last barrier)
        return idx

    def on_barrier():
        acc["dirty"] = set()

    def on_access(kind, ptrs, mask):
        addr = np.asarray(ptrs.data, dtype=np.uint64).ravel()[np.asarray(mask.data, dtype=bool).ravel()]
        if addr.size == 0:
            return
        width = max(1, ptrs.get_element_ty().primitive_bitwidth // 8)  # bytes per element (a bool: one)
        units = addr[:, None] + np.arange(width, dtype=np.uint64)[None, :]
        units = np.unique(units.ravel())
        acc["loads" if kind == "load" else "stores"].append((units, np.full(units.size, acc["pid"], np.int64)))
        if kind == "store":
            acc["dirty"].update(units.tolist())
        elif acc["dirty"]:
            again = acc["dirty"].intersection(units.tolist())
            if again:
                acc["own"][acc["pid"]] += len(again)

    def on_end(name):
        if acc["own"]:
            pid = acc["own"].most_common(1)[0][0]
            watch.races.append(Race(name, "own store/load, no barrier", sum(acc["own"].values()), (pid, pid)))
        if not acc["stores"] or int(np.prod(acc["grid"])) < 2:
            return
        stored = _pairs(acc["stores"])  # unique (unit, program) of the stores, sorted by unit
        loaded = _pairs(acc["loads"]) if acc["loads"] else (np.empty(0, np.uint64), np.empty(0, np.int64))
        # store/store: a unit stored by two programs
        u, p = stored
        same = u[1:] == u[:-1]
        if same.any():
            k = int(np.flatnonzero(same)[0])
            watch.races.append(Race(name, "store/store", int(np.unique(u[1:][same]).size), (int(p[k]), int(p[k + 1]))))
        # store/load: a unit one program stores and another loads
        lu, lp = loaded
        first = np.searchsorted(u, lu, side="left")
        last = np.searchsorted(u, lu, side="right")
        hit = last > first
        # a load conflicts unless its unit is stored by its own program alone
        own = hit & (last - first == 1) & (p[np.minimum(first, p.size - 1)] == lp)
        bad = hit & ~own
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            writer = int(p[first[k]]) if p[first[k]] != lp[k] else int(p[first[k] + 1])
            watch.races.append(Race(name, "store/load", int(np.unique(lu[bad]).size), (writer, int(lp[k]))))

    with _wrapped(on_dim=on_dim, on_idx=on_idx, on_access=on_access, on_end=on_end, on_barrier=on_barrier):
        yield watch


def _pairs(chunks):
    """The unique (unit, program) pairs of ``chunks``, sorted by unit then program."""
    units = np.concatenate([c[0] for c in chunks])
    progs = np.concatenate([c[1] for c in chunks])
    pairs = np.unique(np.stack([units.astype(np.int64), progs]), axis=1)
    return pairs[0].astype(np.uint64), pairs[1]
