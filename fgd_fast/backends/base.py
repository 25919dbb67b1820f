"""What every FGD backend implements (one signature for reference, torch, triton, cuda).

A backend is a function

    prepare(params, grads, bufs, fresh, *, lr, momentum, feedback, check_finite, precision,
            trust_radius, max_distance, variant, [reduce, shapes]) -> StepPlan

over the orthogonal parameters of one device:

* ``params[i]`` — the parameter (any shape, at least 2-D; its ``n × p`` matrix view is θ);
* ``grads[i]`` — its gradient g (same shape);
* ``bufs[i]`` — Φ storage (the parameter's shape, float32 for float16/bfloat16 parameters,
  else the parameter dtype), or ``None`` for the stateless ``momentum == 0`` form;
* ``fresh[i]`` — Φ is known to be zero (first step): a backend may skip reading it;
* ``lr``, ``momentum``, ``feedback`` — per-layer η, β, α (floats; a backend that sets
  ``prepare.device_lr = True`` may get η as one-element tensors, to read on the device:
  :func:`hyper_table`, or the torch backend's per-layer column, ``torch_groups.Group._hyper``);
* ``precision`` — ``"ieee"``, ``"tf32x3"`` or ``"tf32"`` for the fp32 products (``torch``,
  ``triton``); ``reference`` and ``cuda`` always compute in full precision and ignore it;
* ``trust_radius`` — ρ of the step guard (:mod:`.algebra`), ``None`` for no guard;
* ``max_distance`` — the guard's limit on the predicted distance after the step; without a
  guard, a request to predict it (``None``: no prediction);
* ``variant`` — ``"official"`` (the authors' code) or ``"paper"`` (Algorithm 1 as printed:
  the θ step takes the tangent part of Φ₊; :mod:`.algebra`).

Carried Grams (optional; a backend that supports them sets ``prepare.carries_grams = True``):
``gram_refresh`` — at most how many steps the backend may carry its Gram blocks from step to
step (:mod:`.carry`; 1: never).

Bounded predictions (optional; ``prepare.bounds_next = True``): ``exact_next=False`` lets
``dist_next`` be an upper bound of the distance after the step where that bound is within the
guard's target (the decisions are those of the exact distance, which the backend computes
wherever a bound leaves the target); the default ``True`` always gives the distance.

Row shards (optional; a backend that supports them sets ``prepare.row_shards = True``, the
others only ever see whole matrices):

* ``shapes[i]`` — the shape of the full parameter of which ``params[i]`` (and ``grads[i]``,
  ``bufs[i]``) holds some of θ's rows: θ's orientation and ``p`` come from ``shapes[i]``,
  the local row count from the tensor (possibly 0);
* ``reduce(tensors)`` — sums a list of tensors in place over the ranks holding the other
  rows; it may return a ``wait()`` callable (an asynchronous collective: the sums are in
  place once it returns), and may carry ``reduce.bucket_bytes``. The backend calls it at
  least once per ``prepare``, the same calls on every rank (even with an empty list):
  once, or, with ``bucket_bytes``, once per that many bytes of blocks as the Gram pass makes
  them (computing the next Grams while they travel); it sends the partial Gram blocks of the
  local rows (and, where checked without a prediction, the per-layer count of non-finite
  gradient entries as a floating tensor) and waits for every call before the O(p³) middle,
  which then runs on the full blocks; every rank gets the same ``dist`` and ``finite`` and
  updates its own rows.

``prepare`` must not write any parameter or buffer. It returns a :class:`StepPlan` with the
per-layer distance ``‖θᵀθ − I‖_F`` (and input finiteness when ``check_finite``), and with a
guard or prediction the predicted distance and finiteness after the step and the guard's
decision, as device tensors; ``plan.apply()`` then writes θ₊ into ``params`` and Φ₊ into
``bufs``.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch

from .algebra import Checks, join_checks, middle, velocity_blocks
from .guard_rule import TF32_UNIT
from .layout import Layout, _capturing
from .shared_state import cache_lock, cached_entry, matmul_precision

__all__ = [
    "PRECISIONS",
    "StepPlan",
    "Backend",
    "TableCache",
    "compute_dtype",
    "device_table",
    "hyper_table",
    "BackendUnavailable",
    "check_precision",
    "fp32_matmuls",
    "full_precision",
    "phase",
    "in_input_order",
    "plan_of",
    "layer_classes",
    "needs_cuda",
    "device_of",
    "Run",
    "runs_of",
    "middle_of_runs",
    "SLOT_A",
    "SLOT_E",
    "SLOT_B",
    "SLOT_C",
    "M_THETA",
    "M_PHI",
]

# The block order of both fused backends (Triton and CUDA; the kernels name the same slots):
# per layer the Gram blocks [A | E | B | C] (A = θᵀθ, E = θᵀg, B = θᵀΦ, C = ΦᵀΦ; B and C only
# where Φ is read), each p × p, and the update matrices [M_θ | M_Φ].
SLOT_A, SLOT_E, SLOT_B, SLOT_C = range(4)
M_THETA, M_PHI = range(2)

PRECISIONS = ("ieee", "tf32x3", "tf32")


@dataclass
class StepPlan:
    dist: torch.Tensor  # (L,) ‖θᵀθ − I‖_F per layer, in input order
    finite: torch.Tensor | None  # (L,) bool: gradient (and Φ) finite; None when not checked
    apply: Callable[[], None]  # performs every write of the step
    dist_next: torch.Tensor | None = None  # (L,) ‖θ₊ᵀθ₊ − I‖_F of the step, computed before writing
    finite_next: torch.Tensor | None = None  # (L,) bool: θ₊ and Φ₊ finite
    guarded: torch.Tensor | None = None  # (L,) int8: guards.KEPT / SCALED / RESET
    # (L, 5) float64 [dist, finite, dist_next, finite_next, guarded] in input order where one
    # table holds them all (read with one .tolist(): guards.raise_if_invalid), else None
    checks: torch.Tensor | None = None


class Backend(Protocol):
    def __call__(
        self,
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        bufs: list[torch.Tensor | None],
        fresh: list[bool],
        *,
        lr: list[float],
        momentum: list[float],
        feedback: list[float],
        check_finite: bool,
        precision: str = "ieee",
        trust_radius: float | None = None,
        max_distance: float | None = None,
        variant: str = "official",
        reduce: Callable[[list[torch.Tensor]], None] | None = None,
        shapes: list[torch.Size] | None = None,
    ) -> StepPlan: ...


class BackendUnavailable(RuntimeError):
    """A requested backend cannot run here (not installed, or tensors on a device it does not
    support); the message says why and what to use instead."""


def check_precision(precision: str) -> None:
    """Every backend's first check: ``precision`` is one of :data:`PRECISIONS`."""
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(f"unknown precision={precision!r}: choose one of {', '.join(map(repr, PRECISIONS))}")


class TableCache(OrderedDict):
    """A small LRU dict for the device tables of the fused backends (metadata, work lists),
    keyed on what they are built from, so steady-state steps copy nothing to the device.

    A table used while a CUDA graph is being captured is pinned: the graph reads its memory
    at every replay, so it is never evicted (an evicted table's memory could be reused).
    At most ``capacity`` unpinned entries are kept. ``TableCache.builds`` counts the tables built
    by every cache of the process (a steady-state step should build none: the training
    comparison records it per step).
    """

    builds = 0  # (every cache's builds, process-wide)

    def __init__(self, capacity: int = 64):
        super().__init__()
        self.capacity = capacity
        self.pinned: set = set()

    def get_or(self, key, make):
        # (``make`` runs outside the caches' lock: it may wait for other ranks, e.g. an all-gather,
        # whose threads need the lock)
        value, built = cached_entry(self, self.pinned, key, make, self.capacity, _capturing())
        if built:
            with cache_lock():
                TableCache.builds += 1
        return value


# The pinned host tables whose copies a CUDA graph captured: every replay copies from them again,
# so they live as long as the process (one per table built during a capture, which the warm-up
# steps make rare); freed, the caching host allocator could hand their memory to other data.
_replayed_hosts: list[torch.Tensor] = []


def device_table(rows, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host-built table on ``device`` without synchronising the host: on CUDA it goes
    through pinned memory with a non-blocking copy (the caching host allocator keeps the pinned
    block alive until the copy is done; a copy captured in a CUDA graph keeps it for good)."""
    table = torch.tensor(rows, dtype=dtype)
    if device.type != "cuda":
        return table.to(device)
    host = table.pin_memory()
    if _capturing():
        _replayed_hosts.append(host)  # (each replay re-reads this memory)
    return host.to(device, non_blocking=True)


class _HyperTable:
    """A set of layers' ``(L, 3)`` table ``[η, β, α]`` on the device, rewritten in place when the
    values change (through a pinned host mirror on CUDA, waiting for its previous copy first).
    A change during a CUDA-graph capture copies from a mirror of its own, never rewritten: each
    replay copies it again, so a replay reuses the captured step's values, and no event of the
    capture is waited on by a later eager step (CUDA refuses to)."""

    def __init__(self, count: int, dtype: torch.dtype, device: torch.device):
        self.table = torch.empty((count, 3), dtype=dtype, device=device)
        self.host = torch.empty((count, 3), dtype=dtype, pin_memory=device.type == "cuda")
        self.values: tuple | None = None
        self.copied = None  # a CUDA event after the last (eager) copy from the host mirror
        self.captured: list[torch.Tensor] = []  # the mirrors captured copies read at each replay

    def set(self, values: tuple) -> torch.Tensor:
        capturing = _capturing()
        # (after a capture, an eager step copies whatever it finds: a replay may have written the
        # captured values over the table since the last eager copy)
        if values != self.values or (self.captured and not capturing):
            host = self.host
            if capturing:
                host = torch.empty_like(self.host, pin_memory=True)
                self.captured.append(host)
            elif self.copied is not None:
                self.copied.synchronize()  # (the mirror is rewritten only after its last copy)
            host.copy_(torch.tensor(values, dtype=host.dtype))
            self.table.copy_(host, non_blocking=True)
            if self.table.device.type == "cuda" and not capturing:
                self.copied = torch.cuda.Event()
                self.copied.record(torch.cuda.current_stream(self.table.device))
            self.values = values
        return self.table


_hyper_tables = TableCache(capacity=16)


def hyper_table(values: tuple, dtype: torch.dtype, device: torch.device, owners: tuple) -> torch.Tensor:
    """The ``(L, 3)`` table ``[η, β, α]`` (``values``, one row per layer) of the layers whose
    parameters are at addresses ``owners``: one table per set of layers, kept from step to step
    and rewritten in place when a scheduler changes a value, so no table is built per step and a
    captured step reads the same memory (a new value reaches it where the step runs again
    eagerly).

    An η given as a tensor (``FGD(lr=torch.tensor(…))``, changed in place by a scheduler) is
    read on the device at every step instead: the η column is gathered from the tensors by
    device ops (captured with the step, so a replay reads the tensors' values then)."""
    tensors = any(isinstance(row[0], torch.Tensor) for row in values)
    fixed = tuple((0.0, *row[1:]) if isinstance(row[0], torch.Tensor) else row for row in values)
    entry = _hyper_tables.get_or(
        ("hyper", device, dtype, owners, len(values)), lambda: _HyperTable(len(values), dtype, device)
    )
    table = entry.set(fixed)
    if not tensors:
        return table
    # η per layer on the device: the tensors as they are now, the floats as fills (no host copy: capturable)
    etas = [
        row[0].reshape(()).to(device=device, dtype=dtype)
        if isinstance(row[0], torch.Tensor)
        else torch.full((), row[0], dtype=dtype, device=device)
        for row in values
    ]
    return torch.cat([torch.stack(etas).unsqueeze(1), table[:, 1:]], 1)


@contextmanager
def fp32_matmuls(precision: str = "ieee"):
    """fp32 matmuls at ``precision`` inside, whatever the global setting (restored after):
    ``"ieee"`` in IEEE fp32, ``"tf32"``/``"tf32x3"`` with TF32 tensor cores allowed (a CPU
    computes them in fp32). The Gram A = θᵀθ sets the distance the feedback term can reach.

    Under ``torch.compile`` the setting cannot be switched inside a graph, so it is left as
    it is (keep ``torch.set_float32_matmul_precision("highest")``, the default, for compiled
    steps)."""
    if torch.compiler.is_compiling():
        yield
        return
    with matmul_precision(precision):  # (the process's setting: regions of every thread counted)
        yield


def full_precision():
    """fp32 matmuls in IEEE precision inside (``fp32_matmuls("ieee")``)."""
    return fp32_matmuls("ieee")


#: the step's parts as profiler ranges (``fgd::gram``, ``fgd::middle``, ``fgd::update``)
PHASES = ("gram", "middle", "update")


def phase(name: str) -> contextlib.AbstractContextManager:
    """A profiler range ``fgd::<name>`` around one part of the step (:data:`PHASES`) while a
    profiler records (``torch.profiler.profile``), so that a profile splits the step's time —
    host and device — into its Gram pass, middle and update even where every product is a cuBLAS
    kernel; a null context otherwise: a range is an operator of its own, which an unprofiled step
    (and a CUDA graph, and the op count) should not pay for."""
    if name not in PHASES:
        raise ValueError(f"phase {name!r}: expected one of {PHASES}")
    if not torch.compiler.is_compiling() and torch.autograd._profiler_enabled():
        return torch.profiler.record_function(f"fgd::{name}")
    return contextlib.nullcontext()


_permutations = TableCache()


def _inverse_permutation(order: tuple[int, ...], device: torch.device) -> torch.Tensor:
    def make() -> torch.Tensor:
        inverse = [0] * len(order)
        for position, i in enumerate(order):
            inverse[i] = position
        return device_table(inverse, torch.long, device)

    return _permutations.get_or((order, device), make)


def in_input_order(parts: list[torch.Tensor], order: list[int], device: torch.device) -> torch.Tensor:
    """Concatenate per-batch values whose layers are ``order`` back into input order (the
    parts themselves where there is one and the order is the input's: no op).

    The device index is cached on ``order``, so steady-state steps copy nothing to the device.
    """
    if not parts:
        return torch.zeros(0, device=device)
    joined = _adjacent(parts)
    if joined is None:
        joined = parts[0] if len(parts) == 1 else torch.cat(parts)
    if all(k == i for k, i in enumerate(order)):
        return joined  # already in input order: no gather
    return joined[_inverse_permutation(tuple(order), device)]


def _adjacent(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """The parts as one view where they are consecutive 1-D slices of one tensor (a middle's
    per-layer values handed out per bucket), else None (and under ``torch.compile``, which
    traces no storage addresses)."""
    if len(parts) < 2 or torch.compiler.is_compiling():
        return None
    base = parts[0]._base
    if base is None or base.dim() != 1 or not base.is_contiguous():
        return None
    size, start = base.element_size(), parts[0].data_ptr() - base.data_ptr()
    end = start
    for part in parts:
        if part._base is not base or part.dim() != 1 or part.stride(0) != 1 or part.data_ptr() - base.data_ptr() != end:
            return None
        end += part.numel() * size
    return base[start // size : end // size]


def device_of(params: Sequence[torch.Tensor]) -> torch.device:
    """The device of a backend call's tensors (the CPU for an empty call)."""
    return params[0].device if params else torch.device("cpu")


def needs_cuda(backend: str, params: Sequence[torch.Tensor], *, allow: bool = False) -> None:
    """A fused backend's device check: :class:`BackendUnavailable` when some tensor is not on
    CUDA (``allow``: the caller can run them anyway, e.g. under Triton's interpreter)."""
    bad = sorted({str(p.device) for p in params if p.device.type != "cuda"})
    if bad and not allow:
        raise BackendUnavailable(
            f"backend={backend!r} needs CUDA tensors, got tensors on {', '.join(bad)}; use backend='torch'"
            + (" (or TRITON_INTERPRET=1 before importing fgd_fast, for CPU testing)" if backend == "triton" else "")
        )
    devices = sorted({str(p.device) for p in params})
    if len(devices) > 1:  # (one launch reads every layer through one device's pointers)
        raise ValueError(
            f"backend={backend!r} steps one device's tensors per call, got {', '.join(devices)}; call it per "
            "device (fgd_fast.fgd and FGD group the layers so)"
        )


def layer_classes(count: int, key: Callable[[int], Hashable]) -> dict[Hashable, list[int]]:
    """Every backend's prologue: the layers ``0 … count − 1`` grouped by ``key(i)`` (in
    first-seen order), one launch class or bucket per key."""
    classes: dict[Hashable, list[int]] = {}
    for i in range(count):
        classes.setdefault(key(i), []).append(i)
    return classes


def plan_of(
    units: list, device: torch.device, check_finite: bool, written: tuple[list, list] | None = None
) -> StepPlan:
    """The :class:`StepPlan` of a backend's units (launch classes, buckets): each has
    ``layers`` (its positions in the input lists), per-layer ``dist`` and ``finite`` device
    tensors, optional ``dist_next``, ``finite_next``, ``guarded`` (absent or ``None``: not
    computed) and an ``apply()`` that performs its writes. ``written``: ``(params, bufs)``, which
    the units' kernels write through raw pointers (Triton, the CUDA extension; ``None`` buffers
    skipped), so torch does not see their version counters move: ``apply`` bumps them, so autograd
    refuses a graph that saved the old θ (as it does after any in-place write) and caches keyed on
    versions see the step."""
    order = [i for u in units for i in u.layers]
    written = [*written[0], *(b for b in written[1] if b is not None)] if written else []
    dist = in_input_order([u.dist.to(torch.float64) for u in units], order, device)
    finite = in_input_order([u.finite for u in units], order, device) if check_finite else None
    extra = {}
    for name in ("dist_next", "finite_next", "guarded"):
        parts = [getattr(u, name, None) for u in units]
        extra[name] = in_input_order(parts, order, device) if units and all(t is not None for t in parts) else None

    def apply() -> None:
        for u in units:
            u.apply()
        if written and not torch.compiler.is_compiling():  # (compiled: the kernels' mutations are traced)
            torch.autograd.graph.increment_version(written)

    # one unit with its checks in one table (the Triton fused middle's), its layers in input order
    table = getattr(units[0], "check_table", None) if len(units) == 1 else None
    checks = table if table is not None and all(k == i for k, i in enumerate(order)) else None
    return StepPlan(dist=dist, finite=finite, apply=apply, checks=checks, **extra)


@dataclass
class Run:
    """Consecutive layers ``first:end`` of a launch class with the same ``p`` (and the same use
    of Φ): one batch of the O(p³) middle. Their Gram blocks start at element ``gram_at`` (``slots``
    blocks of p² per layer) and their update matrices at ``m_at`` (two blocks per layer)."""

    p: int
    first: int
    end: int
    gram_at: int
    m_at: int
    reads_phi: bool
    slots: int


def runs_of(shapes: list[tuple[int, bool]], slots: list[int]) -> list[Run]:
    """The runs of layers with equal ``(p, reads Φ)``, for layers in launch order given as
    ``(p, reads Φ)`` with ``slots[k]`` Gram blocks each (offsets are prefix sums)."""
    runs: list[Run] = []
    gram_at = m_at = 0
    for k, (p, reads) in enumerate(shapes):
        if runs and (runs[-1].p, runs[-1].reads_phi, runs[-1].slots) == (p, reads, slots[k]):
            runs[-1].end = k + 1
        else:
            runs.append(Run(p, k, k + 1, gram_at, m_at, reads, slots[k]))
        gram_at += slots[k] * p * p
        m_at += 2 * p * p
    return runs


def middle_of_runs(
    gram,
    mats,
    hyper,
    runs,
    *,
    feedback_with_phi=False,
    g_sq=None,
    grads=None,
    phis=None,
    unit=0.0,
    stored=None,
    trust_radius=None,
    max_distance=None,
    variant="official",
    precision="ieee",
    blend_kernels=None,
    gather=None,
    products=None,
    kept=None,
) -> Checks:
    """The O(p³) middle (:func:`.algebra.middle`) of every run: one call per chain of
    consecutive runs that read Φ alike, their p's in one :class:`.layout.Layout`.

    ``gram``: the Gram blocks in the fused backends' order (``run.slots`` per layer, ``[A|E|B|C|…]``);
    ``hyper``: ``(layers, 3)`` rows of η, β, α; writes ``[M_θ | M_Φ]`` of every layer into
    ``mats`` (``feedback_with_phi``: where Φ is read, the θ slot holds ``F = M_θ − M_Φ`` for
    kernels that form ``θ₊ = θ + Φ₊ + θF``). ``g_sq`` (``(layers,)`` float64 ‖g‖², launch order),
    ``grads`` and ``phis`` (the layers' g and Φ in launch order: the guard's ``G = gᵀg`` and
    ``H = Φᵀg`` as torch products, where ``gather`` does not give them), ``unit`` (:func:`.guard_rule.store_unit`),
    ``stored`` (the parameters' dtype), ``trust_radius``, ``max_distance``: the step guard
    (:func:`.algebra.middle`); ``variant`` the update's (:mod:`.algebra`). Products at
    ``precision`` whatever the global TF32 setting (``"tf32"``/``"tf32x3"``: TF32 tensor cores,
    which the middle's ``X − D·X`` forms keep at fp32 accuracy; the CUDA backend: IEEE).
    ``blend_kernels``: the guard's blend by kernels (:func:`.algebra.middle`). ``gather(lay,
    chain) -> [A, E, B, C, G, H]``: the chain's blocks in ``lay``, formed by the backend (one
    launch: :func:`.gram_gather.gather`) instead of views of ``gram`` copied into the layout.
    ``kept``: a list; where given, each chain's ``(θ matrix, M_Φ)`` (the middle's blocks in its
    layout: per layer at the sum of the p² before it) is appended to it and ``mats`` is not
    written (the Triton update kernels read them where they are). ``products``: how the
    middle's products run (:attr:`.layout.Layout.products`; the Triton backend's
    :func:`.mid_products.engine`: one launch each for every p).
    Returns the per-layer checks (:class:`.algebra.Checks`) in launch order; an update kernel
    takes the guard's scale through :func:`.algebra.scaled_hyper`.
    """
    mids = []
    with fp32_matmuls(precision):
        for chain in _chains(runs):  # one middle per chain of runs (several p in one layout)
            first, end = chain[0].first, chain[-1].end
            lay = Layout([(r.end - r.first, r.p) for r in chain], gram.device)
            lay.products = products
            if gather is not None:  # the Gram kernels' blocks gathered into the layout by the backend
                a, e, b, c, gg, h_blk = gather(lay, chain)
            else:
                a, e, b, c, gg, h_blk = _chain_blocks(lay, chain, gram, g_sq, grads, phis)
            h = hyper[first:end]
            mid = middle(
                a,
                b,
                c,
                e,
                lr=h[:, 0],
                beta=h[:, 1],
                alpha=h[:, 2],
                g_sq=g_sq[first:end] if g_sq is not None else None,
                h=h_blk,
                gg=gg,
                unit=unit,
                stored=stored,
                radius=trust_radius,
                limit=max_distance,
                variant=variant,
                layout=lay,
                blend_kernels=blend_kernels,
                # (the update's θM_θ: TF32 operands at "tf32" on a GPU; "tf32x3" splits them, "ieee" keeps them)
                operand_unit=TF32_UNIT if precision == "tf32" and gram.device.type == "cuda" else 0.0,
            )
            m_theta = mid.feedback if (feedback_with_phi and chain[0].reads_phi) else mid.m_theta
            if kept is not None:  # the update reads the middle's own buffers (layout order)
                kept.append((m_theta, mid.m_phi))
            else:
                for r in chain:
                    cnt, p = r.end - r.first, r.p
                    out = mats[r.m_at : r.m_at + cnt * 2 * p * p].view(cnt, 2, p, p)
                    m_t, m_p = (lay.layers(m, r.first - first, r.end - first) for m in (m_theta, mid.m_phi))
                    out[:, M_THETA].copy_(m_t)  # M_θ = M_Φ − α(A − I) (or F)
                    out[:, M_PHI].copy_(m_p)  # M_Φ = N[−C − (β−1)S + …]
            mids.append(mid.checks())  # keep only the per-layer checks
    return join_checks(mids)


def _chain_blocks(lay, chain, gram, g_sq, grads, phis) -> list:
    """``[A, E, B, C, G, H]`` of a chain in ``lay`` from views of ``gram`` (``None`` where absent;
    G and H, where the guard predicts, by torch products of ``grads`` and ``phis``)."""
    parts = []  # per run: [A, E, B, C, G, H] ((cnt, p, p) views or None)
    for r in chain:
        cnt, p = r.end - r.first, r.p
        blocks = gram[r.gram_at : r.gram_at + cnt * r.slots * p * p].view(cnt, r.slots, p, p)
        a, e = blocks[:, SLOT_A], blocks[:, SLOT_E]
        b, c = (blocks[:, SLOT_B], blocks[:, SLOT_C]) if r.reads_phi else (None, None)
        gg = h_blk = None
        if g_sq is not None:  # the guard's G = gᵀg, H = Φᵀg
            gg, h_blk = velocity_blocks(grads[r.first : r.end], phis[r.first : r.end] if r.reads_phi else None, a.dtype)
        parts.append([a, e, b, c, gg, h_blk])
    return [_in_layout(lay, [pt[k] for pt in parts]) for k in range(6)]


def _chains(runs: list[Run]) -> list[list[Run]]:
    """Consecutive runs that read Φ alike (one middle each: its blocks are B and C, or none)."""
    chains: list[list[Run]] = []
    for r in runs:
        if chains and chains[-1][-1].reads_phi == r.reads_phi and chains[-1][-1].end == r.first:
            chains[-1].append(r)
        else:
            chains.append([r])
    return chains


def _in_layout(lay: Layout, pieces: list[torch.Tensor | None]) -> torch.Tensor | None:
    """The runs' ``(cnt, p, p)`` blocks as one block of ``lay`` (a copy per run where there are
    several: the fused backends interleave a layer's blocks), or None."""
    if pieces[0] is None:
        return None
    if lay.single:
        return pieces[0]
    out = lay.empty(pieces[0].dtype)
    for view, piece in zip(lay.pieces(out), pieces):
        view.copy_(piece)
    return out


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float16/bfloat16 parameters compute (and keep Φ) in float32; others in their dtype."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
