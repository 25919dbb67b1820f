"""The owner path: each sharded layer stepped whole by one rank, its *owner*.

A layer whose θ is not split into whole rows (a tensor-parallel column shard, FSDP2's default
``Shard(0)`` of a wide convolution, a 2-D FSDP × TP placement), or whose Gram blocks would
cost more to sum than the matrix does to move (square θ on many ranks), is stepped like this:

1. **to the owners** — every rank sends its pieces of θ, g and Φ of each layer to that
   layer's owner (one ``all_to_all_single`` per dtype for all layers; a piece that several
   ranks hold, on a replicating mesh dimension, travels once);
2. **the step** — each owner runs the backend on the whole matrices of its layers (the owners
   share the O(np² + p³) work: layers are dealt largest first to the least loaded rank);
3. **the checks** — the per-layer distance, finiteness and guard decision of every layer
   reach every rank in one small all-reduce, so every rank raises the same error before any
   rank writes;
4. **back** — ``apply()`` sends every rank its pieces of θ₊ and Φ₊ (one ``all_to_all_single``
   per dtype) and writes them into its shards.

Per rank and step that moves about ``5np/R`` numbers per layer on average (R ranks, layers
spread evenly: :func:`owner_bytes`; an owner receives its layers whole: :func:`busiest_bytes`),
against ``3np`` for gathering every layer whole on every rank and ``2(3.5p² + 1.5p + 1)`` for
summing the Gram blocks of row shards. On an HSDP mesh it runs within each shard group
(:func:`owner_group`). Where each rank's piece lies comes from
torch's own ``compute_local_shape_and_global_offset``, exchanged once per set of layers and
checked: the pieces must tile the tensor (and, for placements other than plain ``Shard`` /
``Replicate``, lie where the table says, checked once by positions: the element indices split
as the parameter is), or the layer is gathered instead. An owner's failure on its whole
matrices (out of memory) rides in the checks' all-reduce, so no rank waits for it.

Every collective is a standard one (``all_gather_single``, ``all_to_all_single``,
``all_reduce``) on tensors of the parameters' device, valid on NCCL as on gloo.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from ._matrix import stiefel_shape
from .backends.base import StepPlan, TableCache
from .collectives import all_gather_flat

__all__ = ["Pieces", "owner_group", "pieces_of", "owner_bytes", "busiest_bytes", "deal_cost", "prepare_owned"]


@dataclass(frozen=True)
class Pieces:
    """Where the pieces of a set of DTensor layers lie in ``group`` (``size`` ranks, this one
    ``me``): ``boxes[l][s]`` is ``(shape, offset)`` of group rank ``s``'s piece of layer ``l``,
    ``senders[l]`` the group ranks whose piece travels (one per distinct piece), ``owners[l]``
    the group rank that steps layer ``l``, ``ok[l]`` whether the pieces tile it."""

    group: object
    size: int
    me: int
    boxes: tuple
    senders: tuple
    owners: tuple
    ok: tuple


_pieces_cache = TableCache(capacity=16)  # (group, the layers' shapes and placements) → Pieces


def owner_group(t):
    """The process group over which DTensor ``t``'s pieces are spread: its mesh's group on a
    1-D mesh; on a larger mesh that shards along one mesh dimension and replicates along the
    others (HSDP), that dimension's group (each replica group then steps the layer alike, and
    the traffic stays within it, as the row all-reduce's does); the default group for any other
    mesh over every rank; ``None`` (the layer is then gathered) otherwise."""
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard

    mesh = t.device_mesh
    if mesh.ndim == 1:
        return mesh.get_group(0)
    sharded = [d for d, pl in enumerate(t.placements) if type(pl) is Shard]
    if len(sharded) == 1 and all(type(pl) in (Shard, Replicate) for pl in t.placements):
        return mesh.get_group(sharded[0])
    if sorted(mesh.mesh.flatten().tolist()) == list(range(dist.get_world_size())):
        return dist.group.WORLD
    return None


def owner_bytes(param, buf, ranks: int) -> float:
    """Bytes one rank moves per step for this layer on the owner path, averaged over the ranks
    (layers dealt evenly): θ, g, Φ to the owner and θ₊, Φ₊ back, ``(R − 1)/R²`` of each whole
    matrix per rank in each direction."""
    n, p, _ = stiefel_shape(param.shape)
    item = param.element_size()
    phi_item = buf.element_size() if buf is not None else 0
    return (ranks - 1) / ranks**2 * n * p * (3 * item + 2 * phi_item) if ranks > 1 else 0.0


def _box(t: torch.Tensor, shape, offset) -> torch.Tensor:
    for d, (size, start) in enumerate(zip(shape, offset)):
        t = t.narrow(d, start, size)
    return t


def _volume(shape) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def _tiles(shape, boxes) -> bool:
    """Whether the distinct ``boxes`` lie inside ``shape``, do not overlap and cover it."""
    inside = all(all(o >= 0 and o + s <= n for s, o, n in zip(b[0], b[1], shape)) for b in boxes)
    apart = all(
        any(a[1][d] + a[0][d] <= b[1][d] or b[1][d] + b[0][d] <= a[1][d] for d in range(len(shape)))
        for i, a in enumerate(boxes)
        for b in boxes[i + 1 :]
        if _volume(a[0]) and _volume(b[0])
    )
    return inside and apart and sum(_volume(b[0]) for b in boxes) == _volume(shape)


def _deal(costs: list[int], size: int) -> tuple[int, ...]:
    """Owners: the largest layer first, each to the least loaded rank (ties: the lower rank)."""
    import heapq

    load = [(0, r) for r in range(size)]  # a heap of (load, rank): the least loaded, then the lowest rank
    owners = [0] * len(costs)
    for layer in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        total, rank = heapq.heappop(load)
        owners[layer] = rank
        heapq.heappush(load, (total + costs[layer], rank))
    return tuple(owners)


def deal_cost(param) -> int:
    """How :func:`pieces_of` weighs a layer when dealing owners: its Gram pass and middle."""
    n, p, _ = stiefel_shape(param.shape)
    return n * p * p + p**3


def busiest_bytes(layers: list, ranks: int) -> float:
    """The bytes the busiest rank sends or receives per step on the owner path for ``layers``
    (``(param, buf)`` pairs; shapes only), owners dealt as :func:`pieces_of` deals them: an
    owner receives ``(R−1)/R`` of θ, g, Φ whole and sends ``(R−1)/R`` of θ₊, Φ₊ for each of its
    layers; every rank sends its ``1/R`` of the others' and receives ``1/R`` of their results."""
    if ranks < 2 or not layers:
        return 0.0
    out, back = [], []
    for param, buf in layers:
        n, p, _ = stiefel_shape(param.shape)
        item, phi = param.element_size(), (buf.element_size() if buf is not None else 0)
        out.append(n * p * (2 * item + phi))
        back.append(n * p * (item + phi))
    owners = _deal([deal_cost(param) for param, _ in layers], ranks)
    own_out, own_back = [0.0] * ranks, [0.0] * ranks
    for o, x, y in zip(owners, out, back):
        own_out[o] += x
        own_back[o] += y
    total_out, total_back, share = sum(out), sum(back), (ranks - 1) / ranks
    return max(
        max(oo * share + (total_back - ob) / ranks, ob * share + (total_out - oo) / ranks)
        for oo, ob in zip(own_out, own_back)
    )


@torch.no_grad()
def pieces_of(params: list, group) -> Pieces:
    """The :class:`Pieces` of DTensor layers ``params`` (sharing ``group``), exchanged in one
    ``all_gather_single`` the first time this set of layers is seen (a collective: every
    rank calls it for the same layers) and kept."""
    key = (group, tuple((tuple(p.shape), p.device_mesh, tuple(p.placements)) for p in params))
    return _pieces_cache.get_or(key, lambda: _exchanged_pieces(params, group))


def _exchanged_pieces(params: list, group) -> Pieces:
    """:func:`pieces_of` for a set of layers not seen before (the collectives)."""
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    size, me = dist.get_world_size(group), dist.get_rank(group)
    device = params[0].to_local().device
    ndim = max(p.dim() for p in params)
    mine = torch.zeros(len(params), 2, ndim, dtype=torch.int64)
    for i, p in enumerate(params):
        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        mine[i, 0, : p.dim()] = torch.tensor(list(shape), dtype=torch.int64)
        mine[i, 1, : p.dim()] = torch.tensor(list(offset), dtype=torch.int64)
    every = torch.empty(size * mine.numel(), dtype=torch.int64, device=device)
    all_gather_flat(every, mine.reshape(-1).to(device), group)
    table = every.view(size, len(params), 2, ndim).tolist()
    boxes, senders, ok = [], [], []
    for i, p in enumerate(params):
        pieces = tuple((tuple(table[s][i][0][: p.dim()]), tuple(table[s][i][1][: p.dim()])) for s in range(size))
        first: dict = {}
        for s, piece in enumerate(pieces):
            first.setdefault(piece, s)
        boxes.append(pieces)
        senders.append(frozenset(first.values()))
        ok.append(_tiles(tuple(p.shape), list(first)))
    # a placement torch splits in other ways (e.g. FSDP over TP's _StridedShard): check once that
    # each piece is where the table says, by positions (not values: a NaN never equals itself, and
    # equal rows, e.g. zeros, would pass a wrong table): the global index of every element, split
    # as the parameter is, must be the box the table gives this rank
    odd = [i for i, p in enumerate(params) if ok[i] and any(type(pl) not in (Shard, Replicate) for pl in p.placements)]
    if odd:
        placed = _placed_as_the_table_says([params[i] for i in odd], [boxes[i][me] for i in odd], device, group)
        for i, fits in zip(odd, placed):
            ok[i] = fits
    owned = [i for i in range(len(params)) if ok[i]]
    owners = [-1] * len(params)
    for i, o in zip(owned, _deal([deal_cost(params[i]) for i in owned], size)):
        owners[i] = o
    return Pieces(group, size, me, tuple(boxes), tuple(senders), tuple(owners), tuple(ok))


def _placed_as_the_table_says(params: list, mine: list, device, group) -> list[bool]:
    """Per DTensor of ``params``: whether on every rank of ``group`` its local piece is the box
    ``mine`` (``(shape, offset)``, this rank's) of the whole tensor, compared by the positions
    of the elements (a collective: one all-reduce)."""
    import torch.distributed as dist

    agree = torch.ones(len(params), dtype=torch.float64, device=device)
    for k, (p, (shape, offset)) in enumerate(zip(params, mine)):
        where = _positions(p, device)
        agree[k] = float(torch.equal(_box(where.full, shape, offset), where.local))
    dist.all_reduce(agree, op=dist.ReduceOp.MIN, group=group)
    return [bool(a > 0) for a in agree.tolist()]


class _Positions(NamedTuple):
    full: torch.Tensor  # every element's index in the whole tensor
    local: torch.Tensor  # the indices of this rank's shard, split as the parameter is


def _positions(p, device) -> _Positions:
    """Where this rank's shard of DTensor ``p`` lies in the whole tensor: the whole tensor's
    element indices, replicated, then redistributed to ``p``'s placements (no communication:
    every rank takes its own part)."""
    from torch.distributed.tensor import DTensor, Replicate

    index = torch.int32 if p.numel() < 2**31 else torch.int64  # (half the memory of int64, a one-off)
    full = torch.arange(p.numel(), dtype=index, device=device).view(p.shape)
    everywhere = DTensor.from_local(full, p.device_mesh, [Replicate()] * p.device_mesh.ndim, run_check=False)
    return _Positions(full, everywhere.redistribute(p.device_mesh, p.placements).to_local())


def _exchange(group, size: int, device, dtypes: list, send: dict, recv_sizes: dict) -> dict:
    """One ``all_to_all_single`` per dtype (every rank calls the same ones, empty or not):
    ``send[dtype][d]`` (tensors for group rank ``d``, any strides: each is copied once, into the
    send buffer) out, ``recv_sizes[dtype][s]`` numbers in from group rank ``s``; returns the
    received flat buffer per dtype."""
    import torch.distributed as dist

    works, received = [], {}
    for dtype in dtypes:
        parts = send.get(dtype, [[] for _ in range(size)])
        in_splits = [sum(t.numel() for t in parts[d]) for d in range(size)]
        out = torch.empty(sum(in_splits), dtype=dtype, device=device)
        at = 0
        for t in (t for dest in parts for t in dest):  # (a box of a whole matrix: no copy of its own first)
            out[at : at + t.numel()].view(t.shape).copy_(t)
            at += t.numel()
        into = torch.empty(sum(recv_sizes[dtype]), dtype=dtype, device=device)
        works.append(dist.all_to_all_single(into, out, recv_sizes[dtype], in_splits, group=group, async_op=True))
        received[dtype] = into
    for work in works:
        work.wait()
    return received


def _share_checks(checks: torch.Tensor, group) -> None:
    """Every layer's check values on every rank: each column is non-zero on its owner only."""
    import torch.distributed as dist

    dist.all_reduce(checks, group=group)


def _raise_if_an_owner_failed(failed: torch.Tensor, params: list, lay: Pieces) -> None:
    """On the ranks whose owned layers prepared: raise if another owner's did not (it raises its
    own error), before anything is written on any rank (one host read of the shared flags)."""
    where = [i for i, f in enumerate(failed.tolist()) if f]
    if where:
        ranks = sorted({lay.owners[i] for i in where})
        shapes = ", ".join(f"{tuple(params[i].shape)} {tuple(params[i].placements)}" for i in where)
        raise RuntimeError(
            f"FGD could not step {len(where)} parameter(s) on the owner path ({shapes}) on their owner rank(s) "
            f"{ranks} of the group (which raised the reason, e.g. out of memory: an owner holds whole matrices); "
            "the step was not applied on any rank and nothing changed. Fix the cause there, or shard θ's rows "
            "(fgd_fast.shard_placement) where the layers allow it"
        )


def prepare_owned(
    prepare,
    lay: Pieces,
    params: list,
    grads: list,
    bufs: list,
    fresh: list[bool],
    *,
    lr: list[float],
    momentum: list[float],
    feedback: list[float],
    check_finite: bool,
    precision: str,
    trust_radius: float | None,
    max_distance: float | None,
    variant: str,
) -> StepPlan:
    """The :class:`StepPlan` of DTensor layers ``params`` (all ``lay.ok``) on the owner path.

    ``prepare`` is the backend for the parameters' device type, run by each owner on the whole
    matrices of its layers. Writes nothing; the plan's ``apply()`` (a collective) sends the
    results back and writes every rank's shards."""

    size, me, count = lay.size, lay.me, len(params)
    device = params[0].to_local().device if count else torch.device("cpu")
    mine = [i for i in range(count) if lay.owners[i] == me]

    def travelling(i: int) -> list:  # what goes to the owner: θ, g and Φ (not a first step's zeros)
        return [params[i], grads[i]] + ([bufs[i]] if bufs[i] is not None and not fresh[i] else [])

    def returning(i: int) -> list:  # what comes back: θ₊ and Φ₊
        return [params[i]] + ([bufs[i]] if bufs[i] is not None else [])

    def dtypes_of(pick) -> list:
        return sorted({t.dtype for i in range(count) for t in pick(i)}, key=str)

    # 1. to the owners: each piece once, in layer order per destination
    send: dict = {}
    for i in range(count):
        if me in lay.senders[i]:
            for t in travelling(i):
                send.setdefault(t.dtype, [[] for _ in range(size)])[lay.owners[i]].append(t.to_local())
    sizes = {dt: [0] * size for dt in dtypes_of(travelling)}
    for s in range(size):
        for i in mine:
            if s in lay.senders[i]:
                for t in travelling(i):
                    sizes[t.dtype][s] += _volume(lay.boxes[i][s][0])
    received = _exchange(lay.group, size, device, dtypes_of(travelling), send, sizes)

    # 2. the whole matrices of this rank's layers, and their step. The owner holds whole matrices
    # (the memory of the largest layers): a failure here is held until the checks' all-reduce,
    # which tells every rank, instead of leaving them waiting in a later collective.
    failed: Exception | None = None
    plan = None
    try:
        whole = {i: [torch.empty(t.shape, dtype=t.dtype, device=device) for t in travelling(i)] for i in mine}
        at = dict.fromkeys(received, 0)
        for s in range(size):
            for i in mine:
                if s in lay.senders[i]:
                    shape, offset = lay.boxes[i][s]
                    for t, full in zip(travelling(i), whole[i]):
                        n = _volume(shape)
                        _box(full, shape, offset).copy_(received[t.dtype][at[t.dtype] : at[t.dtype] + n].view(shape))
                        at[t.dtype] += n
        received.clear()  # (the pieces are in the whole matrices now: the owner's step runs without them)
        theta = {i: whole[i][0] for i in mine}
        phi = {
            i: (whole[i][2] if not fresh[i] else torch.zeros(bufs[i].shape, dtype=bufs[i].dtype, device=device))
            if bufs[i] is not None
            else None
            for i in mine
        }
        if mine:
            plan = prepare(
                [theta[i] for i in mine],
                [whole[i][1] for i in mine],
                [phi[i] for i in mine],
                [fresh[i] for i in mine],
                lr=[lr[i] for i in mine],
                momentum=[momentum[i] for i in mine],
                feedback=[feedback[i] for i in mine],
                check_finite=check_finite,
                precision=precision,
                trust_radius=trust_radius,
                max_distance=max_distance,
                variant=variant,
            )
    except Exception as error:
        failed = error

    # 3. every layer's checks on every rank: one all-reduce of [dist, finite, dist₊, finite₊, guarded]
    # (and a last row: 1 where the owner failed)
    rows = ("dist", "finite", "dist_next", "finite_next", "guarded")
    present = (True, check_finite, max_distance is not None, max_distance is not None, trust_radius is not None)
    checks = torch.zeros(len(rows) + 1, count, dtype=torch.float64, device=device)
    if mine:
        cols = torch.tensor(mine, device=device)
        if failed is not None:
            checks[len(rows), cols] = 1.0
        for r, name in enumerate(rows):
            value = getattr(plan, name) if plan is not None else None
            if present[r] and value is not None:
                checks[r, cols] = value.to(torch.float64)
    _share_checks(checks, lay.group)
    if failed is not None:
        raise failed
    _raise_if_an_owner_failed(checks[len(rows)], params, lay)
    codes = checks[4].round().to(torch.int8)

    def apply() -> None:
        # 4. back: every rank's pieces of θ₊ and Φ₊ from the owners, written into its shards
        if plan is not None:
            plan.apply()
        out: dict = {}
        for i in mine:
            results = [theta[i]] + ([phi[i]] if bufs[i] is not None else [])
            for t, full in zip(returning(i), results):
                parts = out.setdefault(t.dtype, [[] for _ in range(size)])
                for s in range(size):
                    shape, offset = lay.boxes[i][s]
                    parts[s].append(_box(full, shape, offset))
        back = {dt: [0] * size for dt in dtypes_of(returning)}
        for i in range(count):
            for t in returning(i):
                back[t.dtype][lay.owners[i]] += _volume(lay.boxes[i][me][0])
        landed = _exchange(lay.group, size, device, dtypes_of(returning), out, back)
        at = dict.fromkeys(landed, 0)
        for o in range(size):
            for i in range(count):
                if lay.owners[i] == o:
                    for t in returning(i):
                        local = t.to_local()
                        n = local.numel()
                        local.copy_(landed[t.dtype][at[t.dtype] : at[t.dtype] + n].view(local.shape))
                        at[t.dtype] += n

    return StepPlan(
        dist=checks[0],
        finite=checks[1] > 0.5 if present[1] else None,
        apply=apply,
        dist_next=checks[2] if present[2] else None,
        finite_next=checks[3] > 0.5 if present[3] else None,
        guarded=codes if present[4] else None,
    )
