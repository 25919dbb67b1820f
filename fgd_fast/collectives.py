"""The collectives of a sharded FGD step, packed: sums over the ranks (the partial Gram blocks
of row shards, float64 values folded into a float32 call) and whole tensors gathered from
FSDP2's shards, in as few calls as :data:`BUCKET_BYTES` allows. Used by
:mod:`fgd_fast.distributed`; nothing here imports ``torch.distributed`` until called."""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

__all__ = [
    "BUCKET_BYTES",
    "packed",
    "is_dtensor",
    "full_values",
    "fold_float64",
    "unfold_float64",
    "summing_over",
    "all_gather_flat",
]

#: the packed all-reduces of a step (and the fallback's packed all-gathers, counted in whole
#: tensors) are split into calls of at most this many bytes
BUCKET_BYTES = 64 << 20


def all_gather_flat(output: torch.Tensor, tensor: torch.Tensor, group=None) -> None:
    """Every rank's ``tensor`` of ``group``, concatenated into ``output`` (a collective):
    ``all_gather_single`` where torch has it (2.13 deprecates ``all_gather_into_tensor`` with a
    warning per call), else ``all_gather_into_tensor`` (torch 2.11)."""
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, tensor, group=group)


def packed(items: list, size: Callable[[object], int], cap: int) -> list[list]:
    """``items`` in order, cut into consecutive runs of at most ``cap`` total ``size`` (at
    least one item each): the calls of a packed collective."""
    runs: list[list] = []
    total = 0
    for item in items:
        if runs and runs[-1] and total + size(item) <= cap:
            runs[-1].append(item)
            total += size(item)
        else:
            runs.append([item])
            total = size(item)
    return runs


def _unpack(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy consecutive pieces of ``flat`` back into ``tensors`` (in their shapes)."""
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (free when none was ever made)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def _one_dim_shard(t) -> int | None:
    """The dimension a DTensor on a 1-D mesh is sharded along (``Shard(d)``), else ``None``."""
    if not is_dtensor(t) or t.device_mesh.ndim != 1 or len(t.placements) != 1:
        return None
    return getattr(t.placements[0], "dim", None) if t.placements[0].is_shard() else None


def _shard_extent(size: int, world: int, rank: int) -> tuple[int, int]:
    """``(start, length)`` of rank ``rank``'s part of a dimension of ``size`` split over
    ``world`` ranks as DTensor's ``Shard`` splits it (``torch.chunk``: ceil-sized parts, the
    last ones possibly short or empty)."""
    part = -(-size // world)
    start = min(size, rank * part)
    return start, max(0, min(size, start + part) - start)


def _part(t, world: int, rank: int) -> tuple[int, int, int]:
    """``(d, length, numel)`` of rank ``rank``'s shard of DTensor ``t`` (``Shard(d)``, 1-D mesh)."""
    d = _one_dim_shard(t)
    _, length = _shard_extent(t.shape[d], world, rank)
    return d, length, t.numel() // max(1, t.shape[d]) * length


def full_values(tensors: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """:func:`full_value` of each tensor, with one all-gather per (process group, dtype, device)
    and :data:`BUCKET_BYTES` of whole tensors for the DTensors sharded along one dimension of
    a 1-D mesh (FSDP2's placements): every rank's shards packed into one message, padded to the
    longest; other DTensors take ``full_tensor()`` each, plain tensors and ``None`` pass
    through."""
    import torch.distributed as dist

    out: list[torch.Tensor | None] = list(tensors)
    kinds: dict[tuple, list[int]] = {}
    for k, t in enumerate(tensors):
        if t is None or not is_dtensor(t):
            continue
        d = _one_dim_shard(t)
        group = t.device_mesh.get_group(0) if d is not None else None
        if d is None or _part(t, t.device_mesh.size(), t.device_mesh.get_local_rank())[1] != t.to_local().shape[d]:
            out[k] = t.full_tensor()  # (another placement, or shards not split as torch.chunk splits)
            continue
        kinds.setdefault((group, t.dtype, t.device), []).append(k)
    whole_bytes = lambda k: tensors[k].numel() * tensors[k].element_size()  # noqa: E731
    buckets = [  # at most BUCKET_BYTES of whole tensors per all-gather (at least one tensor)
        (key, run) for key, members in kinds.items() for run in packed(members, whole_bytes, BUCKET_BYTES)
    ]
    for (group, dtype, device), members in buckets:
        world, me = dist.get_world_size(group), dist.get_rank(group)
        sizes = [sum(_part(tensors[k], world, r)[2] for k in members) for r in range(world)]
        longest = max(sizes)
        message = torch.zeros(longest, dtype=dtype, device=device)
        if sizes[me]:
            torch.cat([tensors[k].to_local().reshape(-1) for k in members], out=message[: sizes[me]])
        gathered = torch.empty(world * longest, dtype=dtype, device=device)
        all_gather_flat(gathered, message, group)
        at = [r * longest for r in range(world)]  # each rank's read position in the gathered messages
        for k in members:
            t, parts = tensors[k], []
            for r in range(world):
                d, length, numel = _part(t, world, r)
                shape = list(t.shape)
                shape[d] = length
                parts.append(gathered[at[r] : at[r] + numel].view(shape))
                at[r] += numel
            out[k] = torch.cat(parts, dim=_one_dim_shard(t))
    return out


#: float64 sums that ride in a float32 all-reduce are scaled by this power of two (exact), so
#: that values up to ~6e57 fit float32's range (‖g‖² of a gradient up to ‖g‖ ≈ 8e28)
_FOLD_SCALE = 2.0**-64


def fold_float64(values: torch.Tensor) -> torch.Tensor:
    """float64 ``values`` as float32 pairs ``[hi, lo]`` (scaled by :data:`_FOLD_SCALE`), so that
    they can be summed over ranks in a float32 all-reduce: ``Σ hi + Σ lo`` keeps ~1e-7 of the
    sum (float32 adds). A value beyond float32's range after scaling becomes ``inf`` (an
    overflowing ‖g‖²: the guard resets, as for a float64 overflow), NaN stays NaN."""
    x = values.reshape(-1) * _FOLD_SCALE
    hi = x.to(torch.float32)
    lo = torch.where(torch.isfinite(hi), x - hi.to(torch.float64), 0.0).to(torch.float32)  # (no inf − inf)
    return torch.cat((hi, lo))


def unfold_float64(pairs: torch.Tensor) -> torch.Tensor:
    """The float64 values of :func:`fold_float64`'s (summed) pairs."""
    hi, lo = pairs.to(torch.float64).chunk(2)
    return (hi + lo) / _FOLD_SCALE


def summing_over(group) -> Callable[[list[torch.Tensor]], Callable[[], None]]:
    """``reduce(tensors)``: sum the tensors in place over ``group``'s ranks, packed into as
    few all-reduce calls as :data:`BUCKET_BYTES` allows (one for most models; float64 per-layer
    scalars next to float32 tensors, the guard's ‖g‖² of a float32 model, travel folded into the
    float32 call: :func:`fold_float64`; a float64 layer's blocks, and the scalars beside them, are
    summed in float64). The all-reduces are asynchronous: ``reduce`` returns ``wait()``,
    after which the sums are in the tensors (the backend computes more Grams meanwhile).
    ``reduce.bucket_bytes`` tells the backend how much to send per call."""
    import torch.distributed as dist

    def reduce(tensors: list[torch.Tensor]) -> Callable[[], None]:
        by_kind: dict[tuple, list[torch.Tensor]] = {}
        for t in tensors:
            by_kind.setdefault((t.dtype, t.device), []).append(t)
        folded = []  # (float64 tensors, their pairs) riding in a float32 call
        for (dtype, device), same in list(by_kind.items()):
            # only per-layer scalars (1-D: a float32 model's ‖g‖²), never a float64 layer's Gram
            # blocks (2-D and more), which need float64 sums; with those present the scalars go
            # in their float64 call too (no call added; the float64 layers' ‖g‖² stay exact)
            scalars = all(t.dim() == 1 for t in same)
            if dtype == torch.float64 and (torch.float32, device) in by_kind and scalars:
                pairs = fold_float64(torch.cat([t.reshape(-1) for t in same]))
                by_kind[(torch.float32, device)].append(pairs)
                folded.append((same, pairs))
                del by_kind[(dtype, device)]
        issued = []  # (work, flat, tensors)
        for same in by_kind.values():
            for chunk in packed(same, lambda t: t.nbytes, BUCKET_BYTES):
                flat = torch.cat([t.reshape(-1) for t in chunk])
                # Σ over ranks, bitwise the same result on every rank; asynchronous
                issued.append((dist.all_reduce(flat, group=group, async_op=True), flat, chunk))

        def wait() -> None:
            for work, flat, chunk in issued:
                work.wait()
                _unpack(flat, chunk)
            for same, pairs in folded:
                _unpack(unfold_float64(pairs), same)

        return wait

    reduce.bucket_bytes = BUCKET_BYTES
    return reduce
