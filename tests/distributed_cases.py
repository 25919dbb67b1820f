"""What each rank runs in tests/test_distributed.py, and the single-process references.

A case is ``CASES[name](rank, world, out_dir, **kwargs) -> result`` run in a child process
with a gloo process group; the parent compares the results with one process that runs the
mean gradient on the whole model (``reference``).
"""

from __future__ import annotations

import os
import traceback
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

import fgd_fast

DTYPE = torch.float64
#: the Stiefel-constrained weights of `Mixed` (every placement and shape kind of the tests)
ORTHOGONAL = ("stem.weight", "conv.weight", "expand.weight", "fc1.weight", "odd.weight")
HYPER = dict(lr=0.05, momentum=0.9, feedback=0.4, weight_decay=1e-4)


class Mixed(nn.Module):
    """On 2 / 4 ranks with ``fgd_fast.shard_placement``:

    * ``stem`` Conv2d(3, 8, 3): θ 27 × 8, no input dim divisible → ``Shard(0)``, θ's columns
      (the exact all-gather fallback);
    * ``conv`` Conv2d(8, 12, 3): θ 72 × 12 → ``Shard(1)``, row shards;
    * ``expand`` 1 × 1 Conv2d(12, 26): θ = W2 26 × 12 → ``Shard(0)``, uneven row shards on 4;
    * ``fc1`` Linear(26, 16): θ 26 × 16 → ``Shard(1)`` on 2, ``Shard(0)`` fallback on 4;
    * ``odd`` Linear(2, 3): θ = W2 3 × 2 → ``Shard(0)``; one rank holds no row on 4;
    * ``fc2`` Linear(16, 10) and every bias: plain parameters (SGD).
    """

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.conv = nn.Conv2d(8, 12, 3, padding=1)
        self.expand = nn.Conv2d(12, 26, 1)
        self.fc1 = nn.Linear(26, 16)
        self.fc2 = nn.Linear(16, 10)
        self.odd = nn.Linear(2, 3, bias=False)

    def forward(self, x):
        x = torch.tanh(self.stem(x))
        x = torch.tanh(self.conv(x))
        x = torch.tanh(self.expand(x)).mean(dim=(2, 3))
        y = self.fc2(torch.tanh(self.fc1(x)))
        return y.square().mean() + self.odd(x[:, :2]).square().mean()


def build(seed: int = 0) -> Mixed:
    torch.manual_seed(seed)
    return Mixed().to(DTYPE)


def rule(name: str, p: torch.Tensor) -> bool:
    return name in ORTHOGONAL


def full_grad(name: str, shape, step: int, spike=None) -> torch.Tensor:
    """The (mean) gradient of parameter ``name`` at ``step``: the same on every process;
    ``spike = (name, step, factor)`` multiplies one of them (so the guard binds on that layer only)."""
    gen = torch.Generator().manual_seed(1000 * step + sum(map(ord, name)))
    g = 0.01 * torch.randn(shape, generator=gen, dtype=DTYPE)
    return g * spike[2] if spike is not None and (name, step) == tuple(spike[:2]) else g


def batch(rank: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7919 * step + rank)
    return torch.randn(4, 3, 5, 5, generator=gen, dtype=DTYPE)


# -- the single-process references ------------------------------------------------------------
def reference(steps: int, world: int, *, mode: str = "grads", backend: str = "torch", spike=None):
    """Full parameters and Φ after ``steps`` steps of one process on the mean gradient."""
    model = build()
    opt = fgd_fast.FGD(fgd_fast.stiefel_param_groups(model, rule), backend=backend, **HYPER)
    for step in range(steps):
        if mode == "grads":
            for name, p in model.named_parameters():
                p.grad = full_grad(name, p.shape, step, spike)
        else:  # the mean of the ranks' losses: what DDP / FSDP average
            opt.zero_grad()
            loss = sum(model(batch(r, step)) for r in range(world)) / world
            loss.backward()
        opt.step()
    bufs = {n: opt.state[p]["momentum_buffer"] for n, p in model.named_parameters() if p in opt.state}
    reference.guard_stats = opt.guard_stats()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, bufs, opt.orthogonality()


# -- helpers on the ranks -----------------------------------------------------------------------
def _mesh(world):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def _sharded(world, placement=True, seed=0, hsdp=False):
    import functools

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = build(seed)
    if hsdp:  # 2 replicas × world/2 shards
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        fn = functools.partial(fgd_fast.shard_placement, world_size=world // 2)
    else:
        mesh, fn = _mesh(world), fgd_fast.shard_placement
    fully_shard(model, mesh=mesh, shard_placement_fn=fn if placement else None)
    return model


def _set_grads(model, step, *, poison=None, spike=None):
    """Each parameter's gradient: this rank's shard of ``full_grad`` (as FSDP2 would leave the mean)."""
    from torch.distributed.tensor import DTensor

    for name, p in model.named_parameters():
        g = full_grad(name, p.shape, step, spike)
        part = _shard_of(p, g)
        if poison == name:
            part = part.clone()
            if part.numel():
                part.view(-1)[0] = float("nan")
        p.grad = DTensor.from_local(
            part, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=g.stride()
        )


def _shard_of(p, full):
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    for d, (size, start) in enumerate(zip(shape, offset)):
        full = full.narrow(d, start, size)
    return full.contiguous()


def _full_state(model, opt):
    params = {n: p.full_tensor() for n, p in model.named_parameters()}
    bufs = {n: opt.state[p]["momentum_buffer"].full_tensor() for n, p in model.named_parameters() if p in opt.state}
    return params, bufs


def _local_state(model, opt):
    local = lambda t: (t.to_local() if hasattr(t, "to_local") else t).detach().clone()  # noqa: E731
    return (
        {n: local(p) for n, p in model.named_parameters()},
        {n: local(opt.state[p]["momentum_buffer"]) for n, p in model.named_parameters() if p in opt.state},
    )


class _CountAllReduce:
    """Counts ``dist.all_reduce`` calls (the step's packed Gram reduction) and the numbers they
    sum; with ``events``, appends ``("reduce", asynchronous)`` to it at each."""

    def __init__(self, events: list | None = None):
        self.events = events

    def __enter__(self):
        self.count, self.numbers, self.saved = 0, 0, dist.all_reduce

        def counting(*args, **kwargs):
            if kwargs.get("op", dist.ReduceOp.SUM) == dist.ReduceOp.SUM:  # (not the ranks' MAX agreement)
                self.count += 1
                self.numbers += args[0].numel()
                if self.events is not None:
                    self.events.append(("reduce", kwargs.get("async_op", False)))
            return self.saved(*args, **kwargs)

        dist.all_reduce = counting
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self.saved


#: the packed all-gather fgd_fast calls (fgd_fast.collectives.all_gather_flat): torch 2.13
#: deprecates all_gather_into_tensor for all_gather_single, which torch 2.11 lacks
_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"


class _CountGathers:
    """Counts the step's all-gathers: packed ones (``all_gather_single``, or
    ``all_gather_into_tensor`` where torch lacks it) and ``DTensor.full_tensor`` calls (one
    gather per tensor); and its ``all_to_all_single`` calls (the owner path) with the numbers
    they send from this rank."""

    def __enter__(self):
        from torch.distributed.tensor import DTensor

        self.packed = self.whole = self.to_all = self.sent = 0
        self.saved = getattr(dist, _GATHER), DTensor.full_tensor, dist.all_to_all_single

        def packed(*args, **kwargs):
            self.packed += 1
            return self.saved[0](*args, **kwargs)

        def whole(t, *args, **kwargs):
            self.whole += 1
            return self.saved[1](t, *args, **kwargs)

        def to_all(output, input, *args, **kwargs):
            self.to_all += 1
            self.sent += input.numel()
            return self.saved[2](output, input, *args, **kwargs)

        setattr(dist, _GATHER, packed)
        DTensor.full_tensor, dist.all_to_all_single = whole, to_all
        return self

    def __exit__(self, *exc):
        from torch.distributed.tensor import DTensor

        setattr(dist, _GATHER, self.saved[0])
        DTensor.full_tensor, dist.all_to_all_single = self.saved[1:]


# -- the cases ----------------------------------------------------------------------------------
def fsdp_steps(
    rank,
    world,
    out,
    *,
    steps=5,
    placement=True,
    backend="torch",
    hsdp=False,
    spike=None,
    dtype=None,
    bucket_bytes=None,
    sharding="auto",
):
    global DTYPE
    DTYPE = dtype or DTYPE  # (this rank's process only)
    events: list = []  # with bucket_bytes: the order of the last step's Gram groups and all-reduces
    if bucket_bytes is not None:
        import fgd_fast.collectives as fc
        from fgd_fast.backends import torch_groups

        fc.BUCKET_BYTES = bucket_bytes
        real = torch_groups.Group.grams

        def grams(self, scratch):
            events.append(("gram", None))
            return real(self, scratch)

        torch_groups.Group.grams = grams
    model = _sharded(world, placement, hsdp=hsdp)
    opt = fgd_fast.FGD(fgd_fast.stiefel_param_groups(model, rule), backend=backend, sharding=sharding, **HYPER)
    placements = {n: getattr(p.placements[-1], "dim", None) for n, p in model.named_parameters()}  # Shard(dim)
    start_orth = opt.orthogonality()
    reduces, summed, gathers, to_all, said = [], [], [], [], []
    for step in range(steps):
        _set_grads(model, step, spike=spike)
        events.clear()
        counter, gathered = _CountAllReduce(events), _CountGathers()
        with counter, gathered, warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            opt.step()
        reduces.append(counter.count)
        summed.append(counter.numbers)
        gathers.append((gathered.packed, gathered.whole))
        to_all.append((gathered.to_all, gathered.sent))
        said += [str(w.message) for w in seen if "all-gathers" in str(w.message)]
    params, bufs = _full_state(model, opt)
    return dict(
        params=params,
        bufs=bufs,
        placements=placements,
        start_orth=start_orth,
        orth=opt.orthogonality(),
        dist={n: fgd_fast.stiefel_distance(p) for n, p in model.named_parameters() if n in ORTHOGONAL},
        reduces=reduces,
        summed=summed,
        gathers=gathers,
        to_all=to_all,
        said=said,
        events=events,
        guard=opt.guard_stats(),
    )


def _set_tp_grads(model, step, spike=None):
    """Each parameter's gradient of a tensor-parallel model: its shard of ``full_grad`` where it is
    a DTensor, the whole gradient where it is not."""
    from torch.distributed.tensor import DTensor

    for name, p in model.named_parameters():
        g = full_grad(name, p.shape, step, spike)
        if isinstance(p, DTensor):
            g = DTensor.from_local(
                _shard_of(p, g), p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=g.stride()
            )
        p.grad = g


def _lying_layout_table():
    """While the owner path's layout table is made, torch's shard geometry placing a strided
    shard as plain ``Shard`` does (a torch that splits ``_StridedShard`` otherwise than its
    geometry says): the table's boxes tile θ but are not where the pieces are."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import _utils as geometry

    from fgd_fast import owners

    real_table, real_geometry = owners._exchanged_pieces, geometry.compute_local_shape_and_global_offset

    def plain(shape, mesh, placements, *args, **kwargs):
        placements = [Shard(pl.dim) if type(pl).__name__ == "_StridedShard" else pl for pl in placements]
        return real_geometry(shape, mesh, placements, *args, **kwargs)

    def lying(params, group):
        geometry.compute_local_shape_and_global_offset = plain
        try:
            return real_table(params, group)
        finally:
            geometry.compute_local_shape_and_global_offset = real_geometry

    owners._exchanged_pieces = lying


def tp_steps(rank, world, out, *, steps=5, fsdp=False, spike=None, sharding="auto", lying_table=False):
    """Tensor parallel on ``Mixed``: ``fc1`` ColwiseParallel (θ's columns split: the owner path),
    ``odd`` RowwiseParallel (θ = W2's 2 columns over the ranks: empty pieces on 4), ``fc2``
    RowwiseParallel (SGD); the other layers plain. With ``fsdp``, a 2 × world/2 (dp, tp) mesh
    and FSDP2 over dp on top (its default ``Shard(0)``): ``fc1`` becomes (_StridedShard(0),
    Shard(0)), ``odd`` (Shard(0), Shard(1)) — 2-D placements on the owner path over all ranks —
    and the convolutions row shards (``expand``) or owner layers within each dp group.
    ``lying_table``: :func:`_lying_layout_table`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = build()
    if fsdp:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        tp_mesh = mesh["tp"]
    else:
        tp_mesh = _mesh(world)
    parallelize_module(model, tp_mesh, {"fc1": ColwiseParallel(), "odd": RowwiseParallel(), "fc2": RowwiseParallel()})
    if fsdp:
        fully_shard(model, mesh=mesh["dp"])  # FSDP2's default Shard(0)
    opt = fgd_fast.FGD(fgd_fast.stiefel_param_groups(model, rule), sharding=sharding, **HYPER)
    if lying_table:
        _lying_layout_table()
    placements = {n: str(tuple(p.placements)) for n, p in model.named_parameters() if isinstance(p, DTensor)}
    to_all, gathers, said = [], [], []
    for step in range(steps):
        _set_tp_grads(model, step, spike)
        counted = _CountGathers()
        with counted, warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            opt.step()
        to_all.append((counted.to_all, counted.sent))
        gathers.append((counted.packed, counted.whole))
        said += [str(w.message) for w in seen if "all-gathers" in str(w.message)]
    full = lambda t: t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()  # noqa: E731
    return dict(
        params={n: full(p) for n, p in model.named_parameters()},
        bufs={n: full(opt.state[p]["momentum_buffer"]) for n, p in model.named_parameters() if p in opt.state},
        placements=placements,
        to_all=to_all,
        gathers=gathers,
        said=said,
        orth=opt.orthogonality(),
        guard=opt.guard_stats(),
    )


def tp_nan_at_the_first_step(rank, world, out):
    """An ownership review: FSDP over TP (``fc1``: (_StridedShard, Shard)) with a NaN in the last
    rank's shard of ``fc1`` at the first step. The owner path's check that each piece lies where
    its table says compared values (a NaN never equals itself), found "no", and the verdict was
    kept: after the repair ``fc1`` was all-gathered every step (with a warning naming the wrong
    cause). The check compares positions now: the refused step, the repair, then the owner path."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = build()
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    plan = {"fc1": ColwiseParallel(), "odd": RowwiseParallel(), "fc2": RowwiseParallel()}
    parallelize_module(model, mesh["tp"], plan)
    fully_shard(model, mesh=mesh["dp"])
    opt = fgd_fast.FGD(fgd_fast.stiefel_param_groups(model, rule), **HYPER)
    fc1 = model.fc1.weight
    kept = fc1.to_local().clone()
    if rank == world - 1:
        with torch.no_grad():
            fc1.to_local().view(-1)[0] = float("nan")
    messages, said, gathers = [], [], []
    for step in range(3):
        _set_tp_grads(model, step)
        counted = _CountGathers()
        with counted, warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            try:
                opt.step()
                messages.append(None)
            except ValueError as error:
                messages.append(str(error))
                with torch.no_grad():
                    fc1.to_local().copy_(kept)  # the repair (re-initialised, reloaded) and the errors' advice
                opt.reset_parameter(fc1)
        said += [str(w.message) for w in seen if "all-gathers" in str(w.message)]
        gathers.append(counted.whole)
    return dict(messages=messages, said=said, gathers=gathers, orth=opt.orthogonality()["fc1.weight"])


def fsdp_compiled(rank, world, out, *, steps=3, placement=True):
    """``torch.compile(opt.step)`` under FSDP2: the DTensor part of the step (agreement, row
    shards, owner path) runs eagerly between graphs; the step is still one process's."""
    model = _sharded(world, placement)
    opt = fgd_fast.FGD(fgd_fast.stiefel_param_groups(model, rule), **HYPER)
    step = torch.compile(opt.step, backend="aot_eager")
    for s in range(steps):
        _set_grads(model, s)
        step()
    params, bufs = _full_state(model, opt)
    return dict(params=params, bufs=bufs)


def fsdp_train(rank, world, out, *, steps=5):
    model = _sharded(world)
    opt = fgd_fast.FGD(fgd_fast.stiefel_param_groups(model, rule), **HYPER)
    for step in range(steps):
        opt.zero_grad()
        model(batch(rank, step)).backward()
        opt.step()
    params, bufs = _full_state(model, opt)
    return dict(params=params, bufs=bufs, orth=opt.orthogonality())


def fsdp_refusals(rank, world, out):
    """A NaN gradient / a shard off the manifold on the last rank only: every rank raises the
    same error and no rank writes anything."""

    model = _sharded(world)
    opt = fgd_fast.FGD(fgd_fast.stiefel_param_groups(model, rule), **HYPER)
    for step in range(2):
        _set_grads(model, step)
        opt.step()
    messages, unchanged = [], []
    for poison in ("conv.weight", "expand.weight", "stem.weight"):  # row shards (even, uneven), gathered
        _set_grads(model, 2, poison=poison if rank == world - 1 else None)
        _record_refusal(model, opt, FloatingPointError, messages, unchanged)
    _set_grads(model, 2)
    if rank == world - 1:
        with torch.no_grad():
            model.conv.weight.to_local().mul_(1.5)  # this rank's rows leave the manifold
    _record_refusal(model, opt, ValueError, messages, unchanged)
    return dict(messages=messages, unchanged=unchanged)


def _record_refusal(model, opt, error, messages, unchanged):
    """Step, which must raise ``error``; record its message and whether this rank's state is unchanged."""
    import pytest

    before = _local_state(model, opt)
    with pytest.raises(error) as info:
        opt.step()
    messages.append(str(info.value))
    unchanged.append(_same(before, _local_state(model, opt)))


def fsdp_step_beyond_the_limit(rank, world, out, *, sharding):
    """The guard off and a ×3000 gradient on ``conv`` (a row shard): the step would leave θ
    beyond ``max_distance``; ``check_manifold``'s check after the step (the distance θ₊ would
    have, from the path's own plan: row sums, owners' checks or the gathered step's) refuses it
    on every rank and nothing is written."""
    model = _sharded(world)
    opt = fgd_fast.FGD(fgd_fast.stiefel_param_groups(model, rule), guard=False, sharding=sharding, **HYPER)
    _set_grads(model, 0, spike=("conv.weight", 0, 3000.0))
    messages, unchanged = [], []
    _record_refusal(model, opt, ValueError, messages, unchanged)
    return dict(messages=messages, unchanged=unchanged)


def fsdp_partial(rank, world, out, *, steps=3):
    """Only ``conv`` sharded (FSDP2 on a submodule): the plain group mixes DTensor and plain
    biases, which crashed the Euclidean step (``_foreach_add`` got mixed tensor types)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    model = build()
    fully_shard(model.conv, mesh=_mesh(world), shard_placement_fn=fgd_fast.shard_placement)
    opt = fgd_fast.FGD(fgd_fast.stiefel_param_groups(model, rule), **HYPER)
    for step in range(steps):
        for name, p in model.named_parameters():
            g = full_grad(name, p.shape, step)
            if isinstance(p, DTensor):
                g = DTensor.from_local(
                    _shard_of(p, g), p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=g.stride()
                )
            p.grad = g
        opt.step()
    full = lambda t: t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()  # noqa: E731
    return dict(params={n: full(p) for n, p in model.named_parameters()})


def fsdp_plain_check_on_one_rank(rank, world, out):
    """FSDP2 on ``stem`` only (its default placement: the owner path, whose writes are a
    collective) and a NaN in an unsharded orthogonal layer's gradient on the last rank: every
    rank raises (that rank its FloatingPointError), none writes. The other ranks wrote their
    unsharded layers, then waited in the owner path's exchange until the process group timed out."""
    import pytest
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    model = build()
    fully_shard(model.stem, mesh=_mesh(world))
    opt = fgd_fast.FGD(fgd_fast.stiefel_param_groups(model, rule), **HYPER)
    for name, p in model.named_parameters():
        g = full_grad(name, p.shape, 0)
        if isinstance(p, DTensor):
            g = DTensor.from_local(
                _shard_of(p, g), p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=g.stride()
            )
        elif name == "conv.weight" and rank == world - 1:
            g = g.clone()
            g.view(-1)[0] = float("nan")
        p.grad = g
    before = _local_state(model, opt)
    with pytest.raises((FloatingPointError, ValueError)) as info:
        opt.step()
    return dict(
        raised=type(info.value).__name__, message=str(info.value), unchanged=_same(before, _local_state(model, opt))
    )


def fsdp_orthogonality_on_one_rank(rank, world, out):
    """``if rank == 0: opt.orthogonality()`` after a step: no collective (it used to abort);
    also after a step at lr = 0 (the end of a schedule), which moves nothing (the distances
    were dropped: rank 0 alone entered a collective)."""
    model = _sharded(world)
    opt = fgd_fast.FGD(fgd_fast.stiefel_param_groups(model, rule), **HYPER)
    _set_grads(model, 0)
    opt.step()
    one = opt.orthogonality() if rank == 0 else None  # the other ranks go on
    fresh = opt.orthogonality(fresh=True)  # a collective: every rank
    for group in opt.param_groups:
        group["lr"] = 0.0
    _set_grads(model, 1)
    opt.step()
    rested = opt.orthogonality() if rank == 0 else None
    return dict(one=one, fresh=fresh, rested=rested, after_rest=opt.orthogonality(fresh=True))


def fsdp_grad_on_one_rank(rank, world, out, *, steps=3):
    """An unsharded orthogonal layer beside a sharded one, with a gradient on rank 0 only (a
    layer the others did not use): the ranks' agreement on its checks is called by every rank
    (it was called by the ranks with such gradients only: mismatched collectives)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 32)).double()
    for layer in m:
        fgd_fast.orthogonalize_(layer.weight.data)
    fully_shard(m[1], mesh=_mesh(world))
    opt = fgd_fast.FGD([dict(params=[m[0].weight, m[1].weight], orthogonal=True)], lr=0.05, backend="torch")
    w = m[1].weight
    for _ in range(steps):
        local = torch.full((w.to_local().shape[0], 16), 0.01, dtype=torch.float64)
        w.grad = DTensor.from_local(local, w.device_mesh, w.placements, shape=w.shape, stride=w.stride())
        m[0].weight.grad = torch.full((16, 8), 0.01, dtype=torch.float64) if rank == 0 else None
        opt.step()
    return dict(distance=opt.orthogonality(fresh=True))


def fsdp_dtensor_grads_none_on_one_rank(rank, world, out):
    """A review: a rank whose orthogonal DTensors all had ``grad=None`` (the others' had
    gradients) skipped the step, and the others waited in the ranks' agreement for ever. Now
    it joins the agreement: every rank raises, naming the layer count, and nothing changes; a
    step where no rank has such gradients (a frozen sharded layer) is a no-op that raises on
    none (the other layers step)."""
    model = _sharded(world)
    opt = fgd_fast.FGD(fgd_fast.stiefel_param_groups(model, rule), **HYPER)
    _set_grads(model, 0)
    opt.step()
    messages, unchanged = [], []
    _set_grads(model, 1)
    if rank == world - 1:
        for name, p in model.named_parameters():
            if name in ORTHOGONAL:
                p.grad = None
    _record_refusal(model, opt, ValueError, messages, unchanged)
    # every rank without them: the orthogonal layers rest, the plain ones step
    for name, p in model.named_parameters():
        if name in ORTHOGONAL:
            p.grad = None
    before = _local_state(model, opt)
    opt.step()
    after = _local_state(model, opt)
    rested = all(torch.equal(before[0][n], after[0][n]) for n in ORTHOGONAL)
    moved = any(not torch.equal(before[0][n], after[0][n]) for n in before[0] if n not in ORTHOGONAL)
    return dict(messages=messages, unchanged=unchanged, rested=rested, moved=moved)


def fsdp_mismatched_gradients(rank, world, out, *, kind):
    """A diff review: ``case="swap"`` (2 ranks): rank 0 has a gradient for layer 1 only, rank 1
    for layer 0 only — the agreement compared the layer count alone and the ranks summed different
    layers' Grams; ``kind="submesh"`` (4 ranks): layer 0 on 2-rank sub-meshes, layer 1 on all 4,
    the last rank without layer 0's gradient — the ranks agreed on the meshes in different orders
    and, once they did not, the other sub-mesh's ranks waited on the whole mesh for the ranks that
    raised. Every rank must raise (returns the message) and nothing must change."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(0)
    whole = init_device_mesh("cpu", (world,))
    first = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))["shard"]
    meshes = (first, whole) if kind == "submesh" else (whole, whole)
    ps = [
        torch.nn.Parameter(distribute_tensor(fgd_fast.orthogonalize_(torch.randn(32, 8, dtype=DTYPE)), m, [Shard(0)]))
        for m in meshes
    ]
    opt = fgd_fast.FGD([dict(params=ps, orthogonal=True)], lr=0.05, momentum=0.9)
    for step in range(2):
        for i, p in enumerate(ps):
            g = 0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * step + i), dtype=DTYPE)
            p.grad = distribute_tensor(g, p.device_mesh, p.placements)
        if step == 0:
            opt.step()
    if kind == "swap":
        ps[rank].grad = None
    elif rank == world - 1:
        ps[0].grad = None
    before = [p.to_local().clone() for p in ps]
    try:
        opt.step()
        message = None
    except ValueError as error:
        message = str(error)
    return dict(message=message, unchanged=all(torch.equal(b, p.to_local()) for b, p in zip(before, ps)))


def fsdp_other_layouts(rank, world, out, *, steps=3):
    """Two row-sharded layers (``Shard(0)`` of a 32 × 8 θ = W2) whose gradient (layer 0) or,
    from the second step, momentum buffer (layer 1) is replicated instead: neither fits the row
    all-reduce or the owner path, so both are gathered and stepped whole, with a warning. Returns
    the largest difference from one process stepping plain tensors, and the warnings."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.manual_seed(0)
    mesh = _mesh(world)
    start = [fgd_fast.orthogonalize_(torch.randn(32, 8, dtype=DTYPE)) for _ in range(2)]
    ps = [torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)])) for w in start]
    plain = [torch.nn.Parameter(w.clone()) for w in start]
    opt = fgd_fast.FGD([dict(params=ps, orthogonal=True)], lr=0.05, momentum=0.9)
    one = fgd_fast.FGD([dict(params=plain, orthogonal=True)], lr=0.05, momentum=0.9)
    said = []
    for step in range(steps):
        for i, (p, q) in enumerate(zip(ps, plain)):
            g = 0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * step + i), dtype=DTYPE)
            p.grad = distribute_tensor(g, mesh, [Replicate()] if i == 0 else p.placements)
            q.grad = g
        if step == 1:  # (the buffer as a loaded state might hold it: another placement, the same values)
            state = opt.state[ps[1]]
            state["momentum_buffer"] = state["momentum_buffer"].redistribute(mesh, [Replicate()])
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            opt.step()
        said += [str(w.message) for w in seen if "all-gathers" in str(w.message)]
        one.step()
    diff = max(float((p.full_tensor() - q).abs().max()) for p, q in zip(ps, plain))
    buf = max(
        float((opt.state[p]["momentum_buffer"].full_tensor() - one.state[q]["momentum_buffer"]).abs().max())
        for p, q in zip(ps, plain)
    )
    return dict(diff=diff, buf=buf, said=said)


def fsdp_local_check_on_a_submesh(rank, world, out):
    """A review (4 ranks): an unsharded orthogonal layer beside sharded layers on a 2-rank
    sub-mesh and on the whole mesh, the last rank's unsharded gradient NaN. The ranks agreed on
    the local checks mesh by mesh and raised at the first disagreement: the last rank's sub-mesh
    raised, the other sub-mesh's ranks waited on the whole mesh for them (a hang). Now every rank
    raises before writing (the last rank its own error)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(0)
    whole = init_device_mesh("cpu", (world,))
    first = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))["shard"]
    ps = [
        torch.nn.Parameter(distribute_tensor(fgd_fast.orthogonalize_(torch.randn(32, 8, dtype=DTYPE)), m, [Shard(0)]))
        for m in (first, whole)
    ]
    plain = torch.nn.Parameter(fgd_fast.orthogonalize_(torch.randn(16, 8, dtype=DTYPE)))
    opt = fgd_fast.FGD([dict(params=[*ps, plain], orthogonal=True)], lr=0.05, momentum=0.9)
    for p in ps:
        g = 0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1), dtype=DTYPE)
        p.grad = distribute_tensor(g, p.device_mesh, p.placements)
    plain.grad = torch.full_like(plain, float("nan") if rank == world - 1 else 0.01)
    before = [p.to_local().clone() for p in ps] + [plain.detach().clone()]
    try:
        opt.step()
        message = None
    except (ValueError, FloatingPointError) as error:
        message = f"{type(error).__name__}: {error}"
    after = [p.to_local() for p in ps] + [plain.detach()]
    return dict(message=message, unchanged=all(torch.equal(b, a) for b, a in zip(before, after)))


def fsdp_sharded_check_on_part_of_the_ranks(rank, world, out, *, kind):
    """An ownership review (4 ranks): a sharded layer's check is shared within its own group, so
    one that failed on part of the ranks stayed there. ``submesh-rows`` / ``submesh-cols``: a
    row-sharded layer on a 2-rank sub-mesh (the last rank's gradient NaN) beside a layer on the
    whole mesh, row-sharded (the other sub-mesh stepped it: half a step) or column-sharded (the
    owner path: the other sub-mesh wrote the first layer, then waited in the all-to-all).
    ``hsdp-nan`` / ``hsdp-off``: HSDP (2 replicas × 2 shards), the last rank's gradient of
    ``name`` NaN or its shard of θ off the manifold: the other replica wrote. Now every rank
    raises before writing."""
    if kind.startswith("submesh"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard, distribute_tensor

        torch.manual_seed(0)
        whole = init_device_mesh("cpu", (world,))
        sub = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))["shard"]
        placements = [[Shard(0)], [Shard(1) if kind == "submesh-cols" else Shard(0)]]  # (θ = W, 32 × 8)
        ps = [
            torch.nn.Parameter(distribute_tensor(fgd_fast.orthogonalize_(torch.randn(32, 8, dtype=DTYPE)), m, pl))
            for m, pl in zip((sub, whole), placements)
        ]
        opt = fgd_fast.FGD([dict(params=ps, orthogonal=True)], lr=0.05, momentum=0.9)
        for step in range(2):
            for k, p in enumerate(ps):
                g = 0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * step + k), dtype=DTYPE)
                part = _shard_of(p, g)  # (this rank's shard, as FSDP2 leaves it: distribute_tensor would
                if step == 1 and k == 0 and rank == world - 1:  # scatter the first rank's values)
                    part[0, 0] = float("nan")
                p.grad = DTensor.from_local(part, p.device_mesh, p.placements, shape=p.shape, stride=g.stride())
            if step == 0:
                opt.step()
        before = ([p.to_local().clone() for p in ps], [opt.state[p]["momentum_buffer"].to_local().clone() for p in ps])
        model = None
    else:
        model = _sharded(world, hsdp=True)
        opt = fgd_fast.FGD(fgd_fast.stiefel_param_groups(model, rule), **HYPER)
        _set_grads(model, 0)
        opt.step()
        name = "stem.weight"
        _set_grads(model, 1, poison=name if rank == world - 1 and kind == "hsdp-nan" else None)
        if kind == "hsdp-off" and rank == world - 1:
            with torch.no_grad():
                dict(model.named_parameters())[name].to_local().mul_(1.5)
        before = _local_state(model, opt)
    try:
        opt.step()
        message = None
    except (ValueError, FloatingPointError) as error:
        message = f"{type(error).__name__}: {error}"
    if model is None:
        after = ([p.to_local() for p in ps], [opt.state[p]["momentum_buffer"].to_local() for p in ps])
        unchanged = all(torch.equal(b, a) for x, y in zip(before, after) for b, a in zip(x, y))
    else:
        unchanged = _same(before, _local_state(model, opt))
    return dict(message=message, unchanged=unchanged)


def fsdp_backend_on_some_ranks(rank, world, out, *, plain):
    """An ownership review: an explicit backend that loads on some ranks only (here Triton's CPU
    interpreter, turned off on the last rank; on a cluster, ``"cuda"`` where the extension built on
    some nodes) raised on those ranks before the ranks' first collective, and the others waited
    in it for them (the process group's timeout). ``plain``: an unsharded layer beside the sharded
    one (its backend is resolved first). Now the failing rank raises its own error, the others
    that a rank could not prepare its step; nothing is written anywhere."""
    import fgd_fast.functional as functional

    torch.manual_seed(0)
    mesh = _mesh(world)
    from torch.distributed.tensor import Shard, distribute_tensor

    ps = [torch.nn.Parameter(distribute_tensor(fgd_fast.orthogonalize_(torch.randn(32, 8)), mesh, [Shard(0)]))]
    if plain:
        ps.append(torch.nn.Parameter(fgd_fast.orthogonalize_(torch.randn(16, 4))))
    opt = fgd_fast.FGD([dict(params=ps, orthogonal=True)], lr=0.05, backend="triton")
    for p in ps:
        g = 0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1))
        p.grad = distribute_tensor(g, mesh, [Shard(0)]) if p is ps[0] else g
    if rank == world - 1:
        os.environ.pop("TRITON_INTERPRET", None)
        functional._resolved.clear()
    before = [p.detach().clone() if not hasattr(p, "to_local") else p.to_local().clone() for p in ps]
    try:
        opt.step()
        message = None
    except Exception as error:
        message = f"{type(error).__name__}: {error}"
    after = [p.detach() if not hasattr(p, "to_local") else p.to_local() for p in ps]
    return dict(message=message, unchanged=all(torch.equal(b, a) for b, a in zip(before, after)), state=len(opt.state))


def fsdp_buffer_unfit_on_one_rank(rank, world, out, *, what="buffer"):
    """A diff review: a momentum buffer that does not fit its parameter on one rank only (cast by
    hand there), an orthogonal one's (``what="buffer"``: refused in ``fgd()``) or a plain bias's
    (``"plain"``: refused by ``FGD.step`` itself), was refused on that rank before the ranks'
    first collective, and the other ranks waited in it. The rank joins the agreement with its
    error: every rank raises, none writes. A review: a hyper-parameter refused on one rank only
    (``what="lr"``: the orthogonal group's lr negative, ``"plain_weight_decay"``: the plain
    group's weight decay negative), checked before the step's collection, left the others waiting
    in the agreement too (a deadlock in a loop that logs the error and goes on)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(0)
    mesh = _mesh(world)
    theta = fgd_fast.orthogonalize_(torch.randn(32, 8, dtype=DTYPE))
    w = torch.nn.Parameter(distribute_tensor(theta, mesh, [Shard(0)]))
    bias = torch.nn.Parameter(torch.zeros(8, dtype=DTYPE))
    groups = [dict(params=[w], orthogonal=True), dict(params=[bias])]
    opt = fgd_fast.FGD(groups, lr=0.05, momentum=0.9, backend="torch")
    for step in range(2):
        g = 0.01 * torch.randn(w.shape, generator=torch.Generator().manual_seed(step), dtype=DTYPE)
        w.grad = distribute_tensor(g, mesh, w.placements)
        bias.grad = torch.full_like(bias, 0.01)
        if step == 0:
            opt.step()
    if rank == world - 1 and what == "lr":
        opt.param_groups[0]["lr"] = -0.1
    elif rank == world - 1 and what == "plain_weight_decay":
        opt.param_groups[1]["weight_decay"] = -1.0
    elif rank == world - 1 and what.startswith("phi_"):  # (a NaN/Inf in this rank's rows of Φ only)
        opt.state[w]["momentum_buffer"].to_local().view(-1)[0] = float(what[4:])
    elif rank == world - 1:
        unfit = w if what == "buffer" else bias
        opt.state[unfit]["momentum_buffer"] = opt.state[unfit]["momentum_buffer"].float()
    before = w.to_local().clone()
    try:
        opt.step()
        message = None
    except (ValueError, FloatingPointError) as error:
        message = str(error)
    return dict(message=message, unchanged=torch.equal(before, w.to_local()))


def fsdp_owner_fails(rank, world, out, *, hsdp=False):
    """An ownership review: the owner path puts a layer's whole θ, g and Φ on one rank; a failure
    there (out of memory, faked here in the backend's prepare, which only the owner calls) raised
    on the owner alone, and the others waited in the next collective (the process group's
    timeout). The checks' all-reduce now carries the failure: the owner raises its own error, the
    others that the owner could not step; nothing is written."""
    from torch.distributed.tensor import Shard, distribute_tensor

    import fgd_fast.functional as functional

    torch.manual_seed(0)
    if hsdp:  # (2 replicas × 2 shards: the owner path runs within each shard group; replica 0's owner fails)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate

        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        placements = ([Replicate(), Shard(1)], [Replicate(), Shard(0)])
    else:
        mesh = _mesh(world)
        placements = ([Shard(1)], [Shard(0)])  # (the owner path: two layers, one per rank; the first fails)
    ps = [
        torch.nn.Parameter(distribute_tensor(fgd_fast.orthogonalize_(torch.randn(32, 8, dtype=DTYPE)), mesh, pl))
        for pl in placements
    ]
    opt = fgd_fast.FGD([dict(params=ps, orthogonal=True)], lr=0.05, backend="torch")
    for k, p in enumerate(ps):
        g = 0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(k), dtype=DTYPE)
        p.grad = distribute_tensor(g, mesh, p.placements)
    opt.step()
    name, prepare = functional._cached_backend("torch", "cpu", opt.precision)

    first = ps[0].full_tensor()  # (a collective: before the step)

    def failing(params, *args, **kwargs):  # (on the first layer's owner only: its θ whole; one replica's)
        if (not hsdp or rank < world // 2) and any(torch.equal(t, first) for t in params):
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory (faked)")
        return prepare(params, *args, **kwargs)

    functional._resolved[("torch", "cpu", None, opt.precision)] = (name, failing)
    before = ([p.to_local().clone() for p in ps], [opt.state[p]["momentum_buffer"].to_local().clone() for p in ps])
    try:
        opt.step()
        message = None
    except Exception as error:
        message = f"{type(error).__name__}: {error}"
    after = ([p.to_local() for p in ps], [opt.state[p]["momentum_buffer"].to_local() for p in ps])
    unchanged = all(torch.equal(b, a) for x, y in zip(before, after) for b, a in zip(x, y))
    return dict(message=message, unchanged=unchanged)


def owner_step_without_received(rank, world, out):
    """A memory review: the owner kept the first exchange's received pieces (its layers' θ, g and Φ
    once more) alive through its whole-matrix step, and the step back packed each column-sharded
    box twice (a contiguous copy, then the send buffer). The owner steps without the received
    buffers now (checked when its backend's prepare runs) and the results match one process."""
    import gc
    import time
    import weakref

    from torch.distributed.tensor import Shard, distribute_tensor

    import fgd_fast.functional as functional
    import fgd_fast.owners as owners

    torch.manual_seed(0)
    mesh = _mesh(world)
    whole = [fgd_fast.orthogonalize_(torch.randn(32, 8, dtype=DTYPE)) for _ in range(2)]
    ps = [torch.nn.Parameter(distribute_tensor(w, mesh, [Shard(1)])) for w in whole]  # (columns: owner path)
    ref = [torch.nn.Parameter(w.clone()) for w in whole]
    opt = fgd_fast.FGD([dict(params=ps, orthogonal=True)], lr=0.05, backend="torch")
    one = fgd_fast.FGD([dict(params=ref, orthogonal=True)], lr=0.05, backend="torch")
    name, prepare = functional._cached_backend("torch", "cpu", opt.precision)
    exchange, alive = owners._exchange, []

    def recording(*args, **kwargs):
        received = exchange(*args, **kwargs)
        alive[:] = [weakref.ref(t) for t in received.values()]  # (the last exchange's: before prepare, the first)
        return received

    def checking(params, *args, **kwargs):
        for _ in range(40):  # (gloo's worker may let go of a finished exchange's tensors a moment later)
            gc.collect()
            alive_now = sum(r() is not None for r in alive)
            if not alive_now:
                break
            time.sleep(0.025)
        alive.clear()
        assert alive_now == 0, f"{alive_now} received buffer(s) alive during the owner's step"
        return prepare(params, *args, **kwargs)

    owners._exchange = recording
    functional._resolved[("torch", "cpu", None, opt.precision)] = (name, checking)
    try:
        for k in range(3):
            for j, (p, r) in enumerate(zip(ps, ref)):
                g = 0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * k + j), dtype=DTYPE)
                p.grad, r.grad = distribute_tensor(g, mesh, p.placements), g.clone()
            opt.step()
            one.step()
    finally:
        owners._exchange = exchange
    return dict(error=max(float((p.full_tensor() - r.detach()).abs().max()) for p, r in zip(ps, ref)))


def rows_float64_beside_float32(rank, world, out, *, steps=6, sharding="rows", float32_first=False):
    """An ownership review: row shards of a float64 layer beside a float32 one: the float64 Gram
    blocks rode folded in the float32 all-reduce (hi + lo pairs, ~1e-7 of the sum), so the float64
    layer stepped at float32 accuracy (4.9e-9 from one process). Returns the float64 layer and
    its state after ``steps`` steps, and one process's. ``sharding="gather"`` with
    ``float32_first``: the layers gathered, the float32 one listed first."""
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = _mesh(world)
    torch.manual_seed(0)
    w64 = fgd_fast.orthogonalize_(torch.randn(64, 16, dtype=torch.float64))
    w32 = fgd_fast.orthogonalize_(torch.randn(64, 16))
    ws = [torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)])) for w in (w64, w32)]
    hyper = dict(lr=0.05, momentum=0.9, feedback=0.4, backend="torch")
    opt = fgd_fast.FGD([dict(params=ws[::-1] if float32_first else ws, orthogonal=True)], sharding=sharding, **hyper)
    ref = torch.nn.Parameter(w64.clone())
    ropt = fgd_fast.FGD([dict(params=[ref], orthogonal=True)], **hyper)
    for s in range(steps):
        g = 0.01 * torch.randn(64, 16, generator=torch.Generator().manual_seed(s), dtype=torch.float64)
        ws[0].grad = distribute_tensor(g, mesh, [Shard(0)])
        ws[1].grad = distribute_tensor(g.float(), mesh, [Shard(0)])
        ref.grad = g.clone()
        opt.step()
        ropt.step()
    return dict(
        theta=ws[0].full_tensor(),
        phi=opt.state[ws[0]]["momentum_buffer"].full_tensor(),
        ref_theta=ref.detach().clone(),
        ref_phi=ropt.state[ref]["momentum_buffer"].clone(),
    )


def dcp_load_with_a_nan_in_one_shard(rank, world, out):
    """A checkpoint review: a DCP optimizer state with a NaN in rank 0's shard of one Φ only.
    The load's finiteness check read each rank's own shard: rank 0 refused, rank 1 loaded (its
    next step would wait in collectives rank 0 never calls). The ranks agree on the verdict now:
    every rank raises, none loads; the clean checkpoint then loads on every rank."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    model = _sharded(world)
    opt = fgd_fast.FGD(fgd_fast.stiefel_param_groups(model, rule), **HYPER)
    for step in range(2):
        _set_grads(model, step)
        opt.step()
    sd = get_optimizer_state_dict(model, opt)
    phi = sd["state"]["conv.weight"]["momentum_buffer"]
    kept = phi.to_local().clone()
    if rank == 0:
        phi.to_local().view(-1)[0] = float("nan")
    fresh = fgd_fast.FGD(fgd_fast.stiefel_param_groups(model, rule, orthogonalize=False), **HYPER)
    try:
        set_optimizer_state_dict(model, fresh, sd)
        message = None
    except ValueError as error:
        message = str(error)
    refused_whole = len(fresh.state) == 0
    phi.to_local().copy_(kept)
    set_optimizer_state_dict(model, fresh, sd)
    return dict(message=message, refused_whole=refused_whole, loaded_after=len(fresh.state) == len(opt.state))


def fsdp_load_refused_on_one_rank(rank, world, out, *, what="nokey"):
    """A failure-injection review: a plain ``load_state_dict`` whose saved group lacks a key
    (``what="nokey"``) or holds an invalid lr (``"lr"``) on one rank only was refused there alone
    (those checks ran before the ranks' agreement) and the others waited in their next collective.
    Every check now joins the agreement: every rank raises, none loads."""
    import copy

    model = _sharded(world)
    opt = fgd_fast.FGD(fgd_fast.stiefel_param_groups(model, rule), **HYPER)
    for step in range(2):
        _set_grads(model, step)
        opt.step()
    sd = copy.deepcopy(opt.state_dict())
    if rank == world - 1:
        if what == "nokey":
            del sd["param_groups"][0]["feedback"]
        else:
            sd["param_groups"][0]["lr"] = -1.0
    fresh = fgd_fast.FGD(fgd_fast.stiefel_param_groups(model, rule, orthogonalize=False), **HYPER)
    try:
        fresh.load_state_dict(sd)
        message = None
    except ValueError as error:
        message = str(error)
    return dict(message=message, refused_whole=len(fresh.state) == 0)


def fsdp_disagreements(rank, world, out):
    """One rank with another lr, feedback, momentum, check flag, backend, sharding or guard
    setting: every rank raises the same error naming it, nothing is written, and nothing hangs
    (a rank with another guard setting would take other steps: the weights would drift apart;
    a rank at lr = 0 skipped the step and left the others waiting in the agreement)."""

    messages, unchanged = [], []
    for option, mine, theirs in (
        ("lr", 0.05, 0.1),
        ("lr", 0.0, 0.1),
        ("feedback", 0.3, 0.4),
        ("momentum", 0.5, 0.9),
        ("check_finite", False, True),
        ("backend", "reference", "torch"),
        ("sharding", "gather", "rows"),
        ("check_manifold", False, True),
        ("max_distance", 0.3, 0.5),
        ("guard", False, True),
        ("trust_radius", 2.0, 4.0),
        ("variant", "paper", "official"),
        ("maximize", True, False),
    ):
        model = _sharded(world)
        kwargs = dict(HYPER, **{option: mine if rank == world - 1 else theirs})
        opt = fgd_fast.FGD(fgd_fast.stiefel_param_groups(model, rule), **kwargs)
        _set_grads(model, 0)
        _record_refusal(model, opt, ValueError, messages, unchanged)
    # backend="auto" resolved to another backend on one rank (Triton loads on some ranks only)
    import fgd_fast.functional as functional
    from fgd_fast.backends.reference import prepare_reference

    resolved = dict(functional._resolved)
    if rank == world - 1:
        functional._resolved[("auto", "cpu", None, "tf32x3")] = ("reference", prepare_reference)
    model = _sharded(world)
    opt = fgd_fast.FGD(fgd_fast.stiefel_param_groups(model, rule), **dict(HYPER, backend="auto"))
    assert opt.precision == "tf32x3"  # (the key above)
    _set_grads(model, 0)
    _record_refusal(model, opt, ValueError, messages, unchanged)
    functional._resolved.clear()
    functional._resolved.update(resolved)
    # per-layer lrs that differ while the former weighted sum Σ(k+1)·lr_k agreed (a + 14b = 2 on every rank)
    model = _sharded(world)
    orth, plain = sorted(fgd_fast.stiefel_param_groups(model, rule), key=lambda g: not g.get("orthogonal"))
    a, b = (0.25, 0.125) if rank == world - 1 else (1.125, 0.0625)
    first, rest = orth["params"][:1], orth["params"][1:]
    groups = [dict(params=first, orthogonal=True, lr=a), dict(params=rest, orthogonal=True, lr=b), plain]
    opt = fgd_fast.FGD(groups, **HYPER)
    _set_grads(model, 0)
    _record_refusal(model, opt, ValueError, messages, unchanged)
    return dict(messages=messages, unchanged=unchanged)


def fsdp_submesh(rank, world, out, *, steps=2):
    """FSDP2 on a mesh over ranks 0 and 1 and, beside it, a model of its own on the last rank
    (another stage: other layers, another lr): each mesh's ranks agree among themselves. The
    agreement all-reduced over the whole world: ranks 0 and 1 waited for the last (a hang) or,
    with FSDP2 there too, every rank raised that the ranks disagree."""
    import functools

    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    first = rank < world - 1
    # (every rank makes both meshes, in one order: making a mesh creates process groups, a collective)
    meshes = [DeviceMesh("cpu", list(range(world - 1))), DeviceMesh("cpu", [world - 1])]
    mesh = meshes[0] if first else meshes[1]
    model = build(seed=0 if first else 1)
    placement = functools.partial(fgd_fast.shard_placement, world_size=mesh.size())
    fully_shard(model, mesh=mesh, shard_placement_fn=placement)
    opt = fgd_fast.FGD(fgd_fast.stiefel_param_groups(model, rule), **dict(HYPER, lr=0.05 if first else 0.1))
    for step in range(steps):
        _set_grads(model, step)
        opt.step()
    return dict(params=_full_state(model, opt)[0], first=first)


def _same(a, b):
    same = all(torch.equal(x, b[i][k]) for i, part in enumerate(a) for k, x in part.items())
    return same and a[1].keys() == b[1].keys()


def fsdp_checkpoint(rank, world, out, *, before=3, after=3, model_first=False):
    """Save with torch.distributed.checkpoint after ``before`` steps, load into a fresh model and
    optimizer (optimizer state first, or the model's first), continue: bit-identical to the run
    that never stopped."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    path = os.path.join(out, "ckpt")
    model = _sharded(world)
    opt = fgd_fast.FGD(fgd_fast.stiefel_param_groups(model, rule), **HYPER)
    for step in range(before):
        _set_grads(model, step)
        opt.step()
    for p in [p for g in opt.param_groups if g["orthogonal"] for p in g["params"]]:
        opt.state[p]["guard_count"] += torch.tensor([3, 1])  # (counts the checkpoint must carry)
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
    for step in range(before, before + after):
        _set_grads(model, step)
        opt.step()
    straight = _local_state(model, opt)

    model2 = _sharded(world, seed=1)  # other initial weights: the checkpoint must restore them
    opt2 = fgd_fast.FGD(fgd_fast.stiefel_param_groups(model2, rule), **HYPER)
    state = {"model": get_model_state_dict(model2), "optim": get_optimizer_state_dict(model2, opt2)}
    dcp.load(state, checkpoint_id=path)
    # torch initialises an empty optimizer's state with an lr = 0 step: FGD takes none (it only
    # creates the state), so the restored weights stay as loaded in either order
    if model_first:
        set_model_state_dict(model2, state["model"])
        set_optimizer_state_dict(model2, opt2, state["optim"])
    else:
        set_optimizer_state_dict(model2, opt2, state["optim"])
        set_model_state_dict(model2, state["model"])
    for step in range(before, before + after):
        _set_grads(model2, step)
        opt2.step()
    resumed = _local_state(model2, opt2)
    return dict(
        identical=_same(straight, resumed),
        names=sorted(resumed[1]),
        counts=(opt.guard_stats(), opt2.guard_stats()),  # (DCP loads only the keys the fresh state has)
    )


def fsdp_save(rank, world, out, *, path, before=3, after=3):
    """Save after ``before`` steps (to ``path``, shared with another run), then run ``after``
    more: the whole parameters and Φ at the end, for a run on another rank count to match."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model = _sharded(world)
    opt = fgd_fast.FGD(fgd_fast.stiefel_param_groups(model, rule), **HYPER)
    for step in range(before + after):
        if step == before:
            state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
            dcp.save(state, checkpoint_id=path)
        _set_grads(model, step)
        opt.step()
    params, bufs = _full_state(model, opt)
    return dict(params=params, bufs=bufs)


def fsdp_resume(rank, world, out, *, path, before=3, after=3):
    """Load the checkpoint ``fsdp_save`` wrote (on any rank count: DCP reshards) into a fresh
    model and optimizer and run the last ``after`` steps: the whole parameters and Φ."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model = _sharded(world, seed=1)  # other weights: the checkpoint must restore them
    opt = fgd_fast.FGD(fgd_fast.stiefel_param_groups(model, rule), **HYPER)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    for step in range(before, before + after):
        _set_grads(model, step)
        opt.step()
    params, bufs = _full_state(model, opt)
    return dict(params=params, bufs=bufs)


def ddp_train(rank, world, out, *, steps=5):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = build(seed=rank)  # DDP broadcasts rank 0's weights at construction
    ddp = DDP(model)
    opt = fgd_fast.FGD(fgd_fast.stiefel_param_groups(model, rule), **HYPER)
    for step in range(steps):
        opt.zero_grad()
        ddp(batch(rank, step)).backward()
        opt.step()
    return dict(params={n: p.detach().clone() for n, p in model.named_parameters()}, orth=opt.orthogonality())


def zero_steps(rank, world, out, *, steps=5):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = build()
    opt = ZeroRedundancyOptimizer(fgd_fast.stiefel_param_groups(model, rule), optimizer_class=fgd_fast.FGD, **HYPER)
    for step in range(steps):
        for name, p in model.named_parameters():
            p.grad = full_grad(name, p.shape, step)  # what DDP leaves on every rank
        opt.step()
    owned = [n for n, p in model.named_parameters() if any(p is q for g in opt.optim.param_groups for q in g["params"])]
    orth = opt.optim.orthogonality()
    opt.consolidate_state_dict(to=0)
    state = opt.state_dict() if rank == 0 else None
    return dict(
        params={n: p.detach().clone() for n, p in model.named_parameters()}, orth=orth, owned=owned, state=state
    )


def _weights_steps(weights, placements, mesh, *, steps=3, seed=0, **options):
    """``weights`` distributed on ``mesh`` with ``placements`` (one per weight) and stepped
    ``steps`` times in one orthogonal group, beside one process stepping the same whole weights
    on the same gradients; both results (whole)."""
    from torch.distributed.tensor import distribute_tensor

    hyper = dict(HYPER, **options)
    dts = [torch.nn.Parameter(distribute_tensor(w.clone(), mesh, pl)) for w, pl in zip(weights, placements)]
    opt = fgd_fast.FGD([dict(params=dts, orthogonal=True)], **hyper)
    refs = [torch.nn.Parameter(w.clone()) for w in weights]
    hyper.pop("sharding", None)
    ropt = fgd_fast.FGD([dict(params=refs, orthogonal=True)], **hyper)
    for step in range(steps):
        for k, (d, r) in enumerate(zip(dts, refs)):
            gen = torch.Generator().manual_seed(1000 * seed + 10 * step + k)
            g = 0.01 * torch.randn(r.shape, generator=gen, dtype=r.dtype)
            d.grad, r.grad = distribute_tensor(g, mesh, d.placements), g
        opt.step()
        ropt.step()
    return dict(
        got=[d.full_tensor() for d in dts] + [opt.state[d]["momentum_buffer"].full_tensor() for d in dts],
        want=[r.detach().clone() for r in refs] + [ropt.state[r]["momentum_buffer"].clone() for r in refs],
    )


def owner_layouts(rank, world, out):
    """The owner path's layout table on a 1-D mesh: a Linear listed before a convolution (the
    table sized by the largest number of dimensions, not the first layer's), then a second
    optimizer over layers of the same shapes placed otherwise (Shard(0) for Shard(1)): its own
    table (the cache is keyed by placements too). Both steps are one process's."""
    from torch.distributed.tensor import Shard

    mesh = _mesh(world)
    torch.manual_seed(0)
    weights = [fgd_fast.orthogonalize_(torch.randn(shape, dtype=torch.float64)) for shape in ((26, 16), (12, 8, 3, 3))]
    return [_weights_steps(weights, [[Shard(dim)]] * 2, mesh, sharding="owner", seed=dim) for dim in (1, 0)]


def submesh_2d(rank, world, out):
    """A 2-D (1 × 2) mesh over ranks 0 and 1, and a 1 × 1 mesh over the last rank stepping a layer
    of its own (the second below) at another lr. On the first: a layer sharded along both mesh dimensions (no group
    of its own: gathered within the mesh, never over the default group, which would wait for the
    last rank) and a layer replicated along the first and sharded along the second (the owner
    path within the second's group): both one process's steps. Then ranks 0 and 1 disagree on
    lr: both raise (the agreement reduced over each of the mesh's dimensions), nothing written."""
    import pytest
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    first = rank < world - 1
    meshes = [DeviceMesh("cpu", [list(range(world - 1))]), DeviceMesh("cpu", [[world - 1]])]
    mesh = meshes[0] if first else meshes[1]
    torch.manual_seed(0)
    weights = [fgd_fast.orthogonalize_(torch.randn(shape, dtype=torch.float64)) for shape in ((26, 16), (12, 8, 3, 3))]
    placements = [[Shard(0), Shard(1)], [Replicate(), Shard(1)]]
    if not first:  # (the HSDP-like layer only, at another lr)
        return _weights_steps(weights[1:], placements[1:], mesh, lr=0.1)
    result = _weights_steps(weights, placements, mesh)
    w = torch.nn.Parameter(distribute_tensor(weights[0].clone(), mesh, placements[0]))
    opt = fgd_fast.FGD([dict(params=[w], orthogonal=True)], **dict(HYPER, lr=0.05 + 0.01 * rank))
    w.grad = distribute_tensor(torch.full(w.shape, 0.01, dtype=w.dtype), mesh, placements[0])
    before = w.to_local().clone()
    with pytest.raises(ValueError) as info:
        opt.step()
    return dict(result, message=str(info.value), unchanged=torch.equal(before, w.to_local()))


def sums_by_dtype(rank, world, out):
    """``summing_over(None)`` of three mixes (float64 scalars alone; beside float32 tensors;
    beside float64 blocks and float32 scalars): ``(sum, expected sum, rtol)`` per tensor."""
    from fgd_fast.collectives import summing_over

    def tensors(r):
        gen = torch.Generator().manual_seed(r)
        f64 = lambda *shape: torch.rand(shape, generator=gen, dtype=torch.float64) * 1e10  # noqa: E731
        f32 = lambda *shape: torch.rand(shape, generator=gen) * 1e3  # noqa: E731
        return [[f64(3), f64(1)], [f64(2), f32(4, 4), f32(5)], [f64(3, 3), f64(2), f32(3)]]

    mine, every = tensors(rank), [tensors(r) for r in range(world)]
    out = []
    for k, mix in enumerate(mine):
        summing_over(None)(mix)()
        for j, t in enumerate(mix):
            want = sum(ts[k][j] for ts in every)
            folded = k == 1 and t.dtype == torch.float64
            out.append((t, want, 1e-6 if folded or t.dtype == torch.float32 else 1e-15))
    return out


def owner_replicated_pieces(rank, world, out, *, steps=3):
    """A 2 × 2 mesh over all ranks, θ split along the second mesh dimension by a strided shard
    (``_StridedShard``, split factor 1: the rows as ``Shard(0)`` would split them) and replicated
    along the first: no mesh dimension of its own (not a plain ``Shard``), so the owner path
    over the default group, where two ranks hold each piece. Each distinct piece is sent to the
    owner once (by its first holder), θ₊ and Φ₊ come back to every holder; the steps are one
    process's. Returns the numbers each step sent from this rank, and the states."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (2, world // 2))
    placements = (Replicate(), _StridedShard(0, split_factor=1))
    torch.manual_seed(0)
    weight = fgd_fast.orthogonalize_(torch.randn(26, 16, dtype=torch.float64))

    def local(full):
        shape, offset = compute_local_shape_and_global_offset(full.shape, mesh, placements)
        return full[offset[0] : offset[0] + shape[0]].contiguous()

    w = torch.nn.Parameter(
        DTensor.from_local(local(weight), mesh, placements, run_check=False, shape=weight.shape, stride=weight.stride())
    )
    ref = torch.nn.Parameter(weight.clone())
    opt = fgd_fast.FGD([dict(params=[w], orthogonal=True)], **HYPER)
    ropt = fgd_fast.FGD([dict(params=[ref], orthogonal=True)], **HYPER)
    sent = []
    for step in range(steps):
        g = full_grad("w", weight.shape, step)
        w.grad = DTensor.from_local(local(g), mesh, placements, run_check=False, shape=g.shape, stride=g.stride())
        ref.grad = g
        counted = _CountGathers()
        with counted:
            opt.step()
        ropt.step()
        sent.append((counted.to_all, counted.sent, counted.packed, counted.whole))
    return dict(
        sent=sent,
        theta=w.full_tensor(),
        phi=opt.state[w]["momentum_buffer"].full_tensor(),
        ref_theta=ref.detach().clone(),
        ref_phi=ropt.state[ref]["momentum_buffer"].clone(),
    )


CASES = {
    f.__name__: f
    for f in (
        fsdp_steps,
        tp_steps,
        fsdp_compiled,
        fsdp_train,
        fsdp_refusals,
        fsdp_step_beyond_the_limit,
        fsdp_disagreements,
        fsdp_orthogonality_on_one_rank,
        fsdp_plain_check_on_one_rank,
        fsdp_grad_on_one_rank,
        fsdp_dtensor_grads_none_on_one_rank,
        fsdp_mismatched_gradients,
        fsdp_partial,
        fsdp_checkpoint,
        fsdp_save,
        fsdp_resume,
        ddp_train,
        zero_steps,
        fsdp_submesh,
        fsdp_other_layouts,
        owner_layouts,
        submesh_2d,
        sums_by_dtype,
        owner_replicated_pieces,
        fsdp_local_check_on_a_submesh,
        fsdp_sharded_check_on_part_of_the_ranks,
        fsdp_backend_on_some_ranks,
        fsdp_owner_fails,
        owner_step_without_received,
        fsdp_buffer_unfit_on_one_rank,
        fsdp_load_refused_on_one_rank,
        rows_float64_beside_float32,
        tp_nan_at_the_first_step,
        dcp_load_with_a_nan_in_one_shard,
    )
}


def entry(rank: int, world: int, init: str, out: str, case: str, kwargs: dict, mutant: str | None = None) -> None:
    """A child process: join the gloo group, run ``case``, save its result (or traceback);
    ``mutant``: a mutant of the collectives to plant first (tests/mutants.py)."""
    if mutant:
        import mutants

        mutants.plant_here(mutant)
    torch.set_num_threads(1)  # 2 cores shared by the ranks (and fork-safety after OpenMP)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        result = {"ok": CASES[case](rank, world, out, **kwargs)}
    except BaseException:  # reported by the parent with the rank
        result = {"error": traceback.format_exc()}
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    if "error" not in result:
        dist.barrier()
    dist.destroy_process_group()
