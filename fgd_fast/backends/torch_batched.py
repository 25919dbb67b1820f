"""Torch backend: the two-pass form of the step with torch's BLAS products, in place.

Layers are bucketed by ``(n, p, layout, dtype, device, η, β, α, reads Φ, writes Φ)``. This module
plans a step (the buckets, their scratch, the order of the passes); a bucket's passes are in
:mod:`.torch_bucket`, the middle groups in :mod:`.torch_groups`, the row shards' sums over the
ranks in :mod:`.gram_sums`.

``prepare`` (writes nothing) runs, per bucket, in chunks of layers (the middle chunks of
buckets that share p and the block layout are grouped, so one middle serves them all):

1. Gram pass: ``A = θᵀθ, B = θᵀΦ, C = ΦᵀΦ, E = θᵀg`` (``bmm`` into ``(c, p, p)`` blocks; B and
   C only when Φ is read). ``precision="tf32x3"`` computes A in IEEE fp32 and the others in
   TF32 (cuBLAS's tensor cores truncate their adds: a TF32 split of A would be exact in its
   inputs and still biased; see ``Bucket._ieee_gram``).
2. O(p³) middle (:mod:`.algebra`; the math: docs/algorithm.md §3), one call per group:
   ``M_Φ``, ``F = −α(A − I)`` and ``M_θ = M_Φ + F``; kept until ``apply``, with the distance
   ``‖A − I‖_F``; with the step
   guard also its per-layer scale ``s`` (inputs from ``‖g‖²`` per layer in
   float64, taken in the Gram pass, reduced with the Grams under row shards) and its
   prediction of the step's outcome. The prediction's velocity Gram ``UᵀU`` (``U = βΦ − ηg``)
   comes from the Gram pass, or, where a host read is free and ``exact_next=False`` (what
   :func:`fgd_fast.functional.fgd` passes for parameters that are not DTensors), from a pass of
   its own only if the middle's bound of it leaves the target (:func:`.guard_rule.velocity_bound`).

and allocates every buffer that ``apply`` will need. ``apply`` then allocates nothing and
writes in place, layer by layer (or chunk by chunk):

3. ``Φ ← (sβ)Φ − (sη)g`` (``sU``), ``Φ ← Φ + θ M_Φ`` (``Φ₊ = sU + θM_Φ``), ``O ← Φ₊ + θF``,
   ``θ ← θ + O`` (``θ₊ = θ + sU + θM_θ = θ + Φ₊ + θF``); without Φ (``momentum == 0``)
   ``O ← −(sη)g + θM_θ``, ``θ ← θ + O``. The coefficients carry the guard's scale (s = 1
   exactly where it does not bind, and without a guard).

So a step that fails in ``prepare`` — a check, or lack of memory — has written nothing, and
the step's extra memory is the p × p matrices plus a bounded scratch, not copies of θ, Φ and g.
On a CPU (eager, without row shards) both run in ``torch.inference_mode`` (:func:`_scratch_mode`):
the temporaries skip autograd's tracking, θ and Φ stay normal tensors.

Operands. On a CPU a layer of at least ``_CPU_STACK_BELOW`` (2¹⁴) elements is read where it is
(``W.view(c_o, −1)``; no copies), and smaller equal-shape layers are staged into stacks (one
``torch.stack`` each way) so that they share one ``bmm`` call; a layer whose tensors cannot be
viewed that way (e.g. ``channels_last``) is staged through the scratch. On a GPU, equal-shape
layers are staged into stacks of at most ``_STACK_FRACTION`` of the constrained bytes, so that
small layers share one ``bmm`` launch. Layout: when ``θ = W2ᵀ`` (``c_o ≤ m``, the usual case)
the memory holds the rows ``R = θᵀ``, and every product is taken in that layout
(``(θM)ᵀ = MᵀR``).

Memory (extra bytes of a step, ``s`` the item size): ``2·Σp²·s`` for ``M_Φ, F`` of every layer,
plus the scratch (one output slot of the largest layer on a CPU; three stack slots of at most
``_STACK_FRACTION`` of the constrained bytes ``P`` each on a GPU), plus the transient blocks of
one middle chunk (at most ``P``; on a CPU the chunks may hold ``2²³`` elements and the stacks
``2²⁰`` whatever P, so that a small model's middle runs in one chunk per bucket). The benchmark
report records the measured peak per workload.

Row shards (``reduce=``, see :mod:`.base`): each ``params[i]`` holds some rows of a larger θ
(``shapes[i]`` is the full parameter's shape). ``prepare`` then runs the Gram pass of every
bucket first (partial blocks of the local rows, held: ``4·Σp²`` numbers, ``5·Σp²`` with the
guard's UᵀU), ``reduce`` sums them — in buckets of ``reduce.bucket_bytes`` sent while the next
Grams are computed, one call for a small model — A, C and UᵀU as upper triangles: ``3p² +
p`` numbers per layer, ``3.5p² + 1.5p + 1`` with the guard's UᵀU and ‖g‖² — and, without a
prediction, the per-layer non-finite-gradient counts over the ranks, and then runs
the middle on the summed blocks (where the guard scales a layer whose float32 UᵀU overflowed
for finite inputs, a CPU's middle asks for (sU)ᵀ(sU): each rank's rows' part, summed by one more
``reduce``, made on every rank alike); ``apply`` updates the local rows as above (the update of a
row of θ needs only that row of θ, Φ and g). Middle chunks then follow the full parameters'
sizes, so that every rank packs the same list.
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict

import torch

from .._matrix import stiefel_shape
from .base import StepPlan, check_precision, device_of, fp32_matmuls, layer_classes, phase, plan_of
from .gram_sums import OverlappedSums
from .guard_rule import host_reads_free
from .torch_bucket import Bucket
from .torch_groups import middle_groups

__all__ = ["prepare_torch"]

_STACK_FRACTION = 1 / 6  # a stack slot holds at most this share of the constrained bytes
# on a CPU (memory is plentiful, each call costs host time) a middle chunk may hold this many
# elements and a stack slot this many, even for a model whose bytes would allow less (32 + 4 MB in fp32)
_CPU_MIDDLE_FLOOR, _CPU_STACK_FLOOR = 1 << 23, 1 << 20
# on a CPU only layers of fewer elements are stacked (per-call overhead against the copies): 2¹⁴
# measured 2–8% faster per step than 2¹⁶ on every CPU workload, 2¹⁷ 4–28% slower than 2¹⁶
# (benchmarks/studies/torch_knobs.py)
_CPU_STACK_BELOW = 1 << 14
# on a CPU (eager, without row shards) the step runs in torch.inference_mode: its temporaries and
# their views skip autograd's version and view tracking, measured 3–6% faster per step on three CPU
# workloads, no gain on VGG-16 ×0.2 (benchmarks/studies/torch_knobs.py); see _scratch_mode
_CPU_INFERENCE_MODE = 1


def _scratch_mode(device: torch.device, reduce) -> contextlib.AbstractContextManager:
    """``torch.inference_mode()`` for a step on a CPU (eager, without row shards; a null context
    elsewhere). Inside it the step's temporaries (scratch, Gram blocks, the middle's matrices)
    are inference tensors, which skip autograd's version and view tracking; the parameters and
    momentum buffers it writes in place stay normal tensors (their version counters bumped, so a
    graph that saved θ still refuses to backpropagate through the step). What outlives the step is
    built outside it (layout indices and tables: ``torch.inference_mode(False)`` where they are
    made), but for the plan's per-layer checks (read only) and the Gram blocks carried to the next
    step (:mod:`.carry`, made and read only on this path)."""
    if _CPU_INFERENCE_MODE and device.type == "cpu" and reduce is None and not torch.compiler.is_compiling():
        return torch.inference_mode()
    return contextlib.nullcontext()


class _Step:
    """The buckets of one device, the scratch they share, and the precision of their products."""

    def __init__(self, buckets, scratch, precision, groups=(), mode=contextlib.nullcontext):
        self.units, self.scratch, self.precision, self.groups = buckets, scratch, precision, groups
        self.mode = mode  # makes the context apply runs in (see _scratch_mode)

    def apply(self) -> None:
        # (contexts, not decorators: torch.compile traces them)
        with torch.no_grad(), fp32_matmuls(self.precision), self.mode(), phase("update"):
            for b in self.units:
                b.apply(self.scratch[b.cdt])
        for g in self.groups:  # stamped with the versions the writes left
            g.keep()


@torch.no_grad()  # products into preallocated outputs, in-place writes of leaf parameters
def prepare_torch(
    params,
    grads,
    bufs,
    fresh,
    *,
    lr,
    momentum,
    feedback,
    check_finite,
    precision="ieee",
    reduce=None,
    shapes=None,
    trust_radius=None,
    max_distance=None,
    variant="official",
    gram_refresh=1,
    exact_next=True,
):
    check_precision(precision)
    device = device_of(params)

    def key(i: int) -> tuple:
        param = params[i]
        # a row shard has the full parameter's orientation and p, and its own (local) row count
        _, p, rows = stiefel_shape(param.shape if shapes is None else shapes[i])
        n = param.numel() // max(p, 1)
        reads_phi = bufs[i] is not None and not fresh[i]
        bucket = (
            n,
            p,
            rows,
            param.dtype,
            param.device,
            ("tensor", id(lr[i])) if isinstance(lr[i], torch.Tensor) else lr[i],  # (a tensor: by identity)
            momentum[i],
            feedback[i],
            reads_phi,
            bufs[i] is not None,
        )
        if shapes is not None:  # the full shape keeps the buckets (so the reduced list) alike on every rank
            bucket += (tuple(shapes[i]), tuple(param.shape))
        return bucket

    mode = lambda: _scratch_mode(device, reduce)  # noqa: E731
    options = dict(check_finite=check_finite, reduce=reduce, gram_refresh=gram_refresh, exact_next=exact_next)
    options.update(trust_radius=trust_radius, max_distance=max_distance, variant=variant)
    with mode():
        return _prepared(params, grads, bufs, lr, key, device, precision, shapes, mode, **options)


def _prepared(params, grads, bufs, lr, key, device, precision, shapes, mode, **options) -> StepPlan:
    """:func:`prepare_torch` after its arguments are checked: the buckets, then :func:`_planned`."""
    groups = layer_classes(len(params), key)
    buckets = [Bucket(idx, params, grads, bufs, key, precision, lr[idx[0]]) for key, idx in groups.items()]
    total = sum(b.numel * len(b.layers) for b in buckets)  # constrained elements P
    floor = _CPU_STACK_FLOOR if device.type == "cpu" else 0
    for b in buckets:
        stacks = len(b.layers) > 1 and (device.type == "cuda" or b.numel < _CPU_STACK_BELOW)
        b.stack_numel = max(int(total * _STACK_FRACTION), floor) if stacks else 0
    # middle chunks from the full sizes with row shards: the same chunks (so reduced list) on every rank
    middle_numel = total if shapes is None else sum(math.prod(shape) for shape in shapes)
    middle_numel = max(middle_numel, _CPU_MIDDLE_FLOOR if device.type == "cpu" else 0)
    return _planned(buckets, device, middle_numel, precision, mode, **options)


def _planned(
    buckets,
    device,
    middle_numel,
    precision,
    mode,
    *,
    check_finite,
    reduce,
    gram_refresh,
    exact_next,
    trust_radius,
    max_distance,
    variant,
):
    """:func:`prepare_torch`'s step over its ``buckets``: scratch, Gram pass, middle, checks."""
    scratch = _scratch(buckets, middle_numel, device)
    for b in buckets:
        b.start(middle_numel, trust_radius, max_distance, variant)
    # Grams carried between steps (:mod:`.carry`): where host reads are free (a CPU), with a prediction, whole matrices
    carrying = gram_refresh > 1 and reduce is None and host_reads_free(device)
    # the guard's velocity Grams only where a bound leaves the target: where a host read decides it
    lazy = not exact_next and reduce is None and host_reads_free(device)
    groups = middle_groups(buckets, middle_numel, gram_refresh if carrying else 1, lazy=lazy, reduce=reduce)
    with fp32_matmuls(precision):  # IEEE fp32 or TF32 products, whatever the global setting
        if reduce is None:
            for g in groups:  # the Grams of one group alive at once
                with phase("gram"):
                    blocks = g.grams(scratch)
                with phase("middle"):
                    g.middle(blocks, scratch)
            # with a prediction the middle's finiteness (‖g‖², tr C) is the check: no pass over g
            with phase("middle"):
                for b in buckets:
                    b.finish(check_finite, b.finite_flags() if check_finite and not b.predict else None)
        else:  # every group's partial Grams, summed over the ranks as they are made, then every middle
            sums = OverlappedSums(reduce)
            held = []
            with phase("gram"):  # (the sums over the ranks included)
                for g in groups:
                    held.append(g.grams(scratch))
                    sums.add(held[-1], g.symmetric_slots())  # (sent once a bucket is full; the next Grams meanwhile)
                # non-finite counts, only without a prediction: with one, the summed ‖g‖², tr C and E say it
                counted = check_finite and not any(b.predict for b in buckets)
                bad = [(~b.finite_flags()).to(b.cdt) for b in buckets] if counted else []
                sums.finish(bad)
            with phase("middle"):
                for g, blocks in zip(groups, held):
                    g.middle(blocks, scratch)
                for i, b in enumerate(buckets):
                    b.finish(check_finite, bad[i] == 0 if counted else None)
    step = _Step(buckets, scratch, precision, [g for g in groups if g.carry], mode)
    plan = plan_of(buckets, device, check_finite)
    plan.apply = step.apply
    return plan


def _scratch(buckets, total: int, device) -> dict[torch.dtype, list[torch.Tensor]]:
    """Per compute dtype, the stack slots θ, Φ and the output O (also g's stack in the Gram
    pass), sized for the largest chunk; θ and Φ slots only where a chunk is staged."""
    sizes: dict[torch.dtype, list[int]] = defaultdict(lambda: [0, 0, 0])
    for b in buckets:
        size = sizes[b.cdt]
        for gemm_chunks in b.chunks(total):
            for ch in gemm_chunks:
                numel = (ch.e - ch.s) * b.numel
                size[2] = max(size[2], numel)
                if ch.staged:
                    size[0] = max(size[0], numel)
                    size[1] = max(size[1], numel if b.writes_phi else 0)
    return {dt: [torch.empty(k, dtype=dt, device=device) for k in size] for dt, size in sizes.items()}


prepare_torch.row_shards = True  # accepts reduce= and shapes= (row shards of larger matrices)
prepare_torch.carries_grams = True  # accepts gram_refresh= (Gram blocks carried between steps on a CPU)
prepare_torch.bounds_next = True  # accepts exact_next=False (dist_next may be a bound within the target)
prepare_torch.device_lr = True  # takes lr as tensors (read on the device: never on the host where that costs)
