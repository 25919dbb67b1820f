"""FGD on parameters sharded across processes (FSDP2 ``DTensor`` parameters).

Every FGD correction is θ times a ``p × p`` matrix built from the Gram blocks ``A = θᵀθ``,
``B = θᵀΦ``, ``C = ΦᵀΦ``, ``E = θᵀg``, and each block is a sum over the rows of θ:
``A = Σ_r θ_rᵀθ_r``. So when every rank holds some whole rows of θ (a *row shard*), the ranks
compute partial blocks of their rows, **one** all-reduce of all layers' packed blocks (E and B
whole, A, C and the guard's UᵀU as upper triangles, and ‖g‖²: ``3.5p² + 1.5p + 1`` numbers per
layer, whatever the number of ranks) gives
every rank the full blocks, every rank runs the same O(p³) middle, and each updates its own
rows (the update of a row needs only that row of θ, Φ and g). No rank ever holds a full
matrix, and the step is the one a single process would take on the full matrices.

* :func:`shard_placement` — pass it to ``fully_shard(..., shard_placement_fn=...)`` so that
  FSDP2 shards every ≥ 2-D weight along θ's rows.
* HSDP (a 2-D mesh, ``(Replicate(), Shard(d))``): the all-reduce runs over the shard
  dimension's process group; the replicas compute the same step.
* A layer whose placement is not a row shard (the default ``Shard(0)`` of a wide
  convolution shards θ's *columns*; tensor parallel; 2-D FSDP × TP placements), or a row
  shard whose Gram blocks cost more to sum than the matrix does to move, takes the **owner
  path** (:mod:`fgd_fast.owners`): each layer is sent whole to one rank, stepped there and
  sent back, exact. Where neither fits, θ, Φ and g are all-gathered (:func:`full_values`)
  and every rank computes the same step on the full matrices (said once in a warning).
  :func:`prepare_dtensors` makes the choice; never a per-shard orthonormalisation.
* The ranks must agree on the step: :func:`agree_across_ranks` runs first (one all-reduce
  of a few numbers), so different hyper-parameters, flags or backends on some rank raise the
  same ``ValueError`` on every rank instead of diverging silently or hanging in a collective
  that the other ranks never call.
* The step's checks stay collective: the non-finite-gradient counts travel in the same
  all-reduce as the Gram blocks and the distance ‖θᵀθ − I‖_F comes from the summed A, so
  every rank raises the same error before any rank writes anything.

Nothing here imports ``torch.distributed`` until a DTensor is seen.
"""

from __future__ import annotations

import torch

from ._compile import eager
from ._matrix import as_stiefel, stiefel_shape
from .backends.base import StepPlan
from .collectives import fold_float64, full_values, is_dtensor, summing_over, unfold_float64
from .owners import busiest_bytes, owner_bytes, owner_group, pieces_of, prepare_owned

__all__ = [
    "shard_placement",
    "is_dtensor",
    "row_mesh_dim",
    "full_value",
    "full_values",
    "SHARDINGS",
    "PATH_MARGIN",
    "path_bytes",
    "moved_to_owners",
    "write_shard",
    "gram64",
    "prepare_dtensors",
    "agree_across_ranks",
    "agree_mesh_by_mesh",
    "agree_on_local_checks",
    "checks_stay_in_groups",
    "in_rank_independent_order",
    "meshes_of",
    "summing_over",
    "fold_float64",
    "unfold_float64",
]

#: how DTensor layers step (``FGD(sharding=...)``): see :func:`prepare_dtensors`
SHARDINGS = ("auto", "rows", "owner", "gather")
#: "auto" moves row-sharded layers to the owner path only when that saves at least this many
#: bytes at the busiest rank (one more collective in the step costs about as much as a megabyte
#: on a fast interconnect)
PATH_MARGIN = 1 << 20


def shard_placement(param: torch.Tensor, world_size: int | None = None):
    """FSDP2 placement that shards a weight along the rows of its Stiefel matrix θ.

    Use as ``fully_shard(module, shard_placement_fn=fgd_fast.shard_placement)``. With
    ``W2 = W.reshape(c_o, m)``: when ``c_o <= m`` (θ = W2ᵀ, the rows of θ are the ``m``
    input features) the first dimension ``d >= 1`` that ``world_size`` divides gives
    ``Shard(d)`` (FSDP2 cannot shard a dimension other than 0 unevenly); when ``c_o > m``
    (θ = W2) or no such dimension exists, ``Shard(0)``. 0-D/1-D parameters get ``None``
    (FSDP2's default). ``world_size`` defaults to the default process group's size; for a
    mesh on a subgroup pass ``functools.partial(shard_placement, world_size=mesh.size())``.

    ``Shard(0)`` of a ``c_o <= m`` weight (e.g. a stem convolution with 3 input channels on
    2 ranks) shards θ's columns: FGD then steps it whole on its owner rank (:mod:`fgd_fast.owners`).
    """
    from torch.distributed.tensor import Shard

    if param.dim() < 2 or param.numel() == 0:
        return None
    if not stiefel_shape(param.shape).transposed:
        return Shard(0)  # θ = W2: its rows are dim 0, which FSDP2 may shard unevenly
    if world_size is None:
        import torch.distributed as dist

        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    for d in range(1, param.dim()):
        if param.shape[d] % world_size == 0:
            return Shard(d)  # a slab of W along an input dim = a set of θ's rows
    return Shard(0)


def row_mesh_dim(t) -> int | None:
    """The mesh dimension over which DTensor ``t`` (a parameter's shape) is split into whole
    rows of its θ — ``Shard(d≥1)`` when θ = W2ᵀ, ``Shard(0)`` when θ = W2, uneven and empty
    shards included — with every other mesh dimension replicating it (FSDP2's 1-D mesh, or
    HSDP's ``(Replicate(), Shard(d))``); None for any other placement."""
    from torch.distributed.tensor import Replicate, Shard

    shards = [i for i, pl in enumerate(t.placements) if isinstance(pl, Shard)]
    if len(shards) != 1 or not all(isinstance(pl, (Shard, Replicate)) for pl in t.placements):
        return None
    dim = t.placements[shards[0]].dim % t.dim()
    return shards[0] if (dim >= 1 if stiefel_shape(t.shape).transposed else dim == 0) else None


def _same_layout(a, b) -> bool:
    return is_dtensor(b) and b.device_mesh == a.device_mesh and tuple(b.placements) == tuple(a.placements)


def full_value(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (an all-gather for a sharded DTensor; ``t`` if plain)."""
    return t.full_tensor() if is_dtensor(t) else t


def write_shard(t: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of ``full`` (the whole tensor) into ``t`` (no communication)."""
    if not is_dtensor(t):
        if t.data_ptr() != full.data_ptr():
            t.copy_(full)
        return
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = t.to_local()
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    part = full
    for d, (size, start) in enumerate(zip(shape, offset)):
        part = part.narrow(d, start, size)
    if local.data_ptr() != part.data_ptr() or local.numel() == 0:
        local.copy_(part)


def _local_theta(t) -> torch.Tensor:
    """The rows of θ that DTensor ``t`` holds here (``t`` row-sharded), as ``n_local × p``."""
    _, p, transposed = stiefel_shape(t.shape)
    local = t.to_local()
    w2 = local.reshape(local.shape[0], local.numel() // local.shape[0] if local.shape[0] else p)
    return w2.t() if transposed else w2


@torch.no_grad()
def gram64(t: torch.Tensor) -> torch.Tensor:
    """``θᵀθ`` in float64 for the full θ of ``t``: partial Grams and an all-reduce when ``t``
    is row-sharded, an all-gather for other DTensors (a collective: call it on every rank)."""
    if is_dtensor(t) and row_mesh_dim(t) is not None:
        theta = _local_theta(t).to(torch.float64)
        gram = theta.t() @ theta
        summing_over(t.device_mesh.get_group(row_mesh_dim(t)))([gram])()  # (and wait for it)
        return gram
    theta = as_stiefel(full_value(t)).to(torch.float64)
    return theta.t() @ theta


def path_bytes(param, buf, ranks: int) -> dict[str, float]:
    """Bytes one rank moves per step for this layer on each path (R = ``ranks``):

    * ``"rows"`` — a ring all-reduce of the partial Gram blocks, ``2(R−1)/R · (2p² + 3p(p+1)/2
      + 1)`` numbers (E, B whole, A, C, UᵀU as triangles, ‖g‖²), whatever the shard;
    * ``"owner"`` — θ, g, Φ to the layer's owner and θ₊, Φ₊ back, ``(R−1)/R²`` of each whole
      matrix (:func:`fgd_fast.owners.owner_bytes`, the layers spread evenly over the ranks);
    * ``"gather"`` — θ, Φ and g all-gathered on every rank, ``(R−1)/R · 3np`` numbers.

    Summing wins for tall θ on few ranks (a convolution, n = 9p), the owner path for square
    and wide θ and, as R grows, for nearly everything else (its bytes fall as 1/R)."""
    n, p, _ = stiefel_shape(param.shape)
    item = param.element_size()
    phi_item = buf.element_size() if buf is not None else item
    compute = 8 if param.dtype == torch.float64 else 4  # the blocks are float32 (float64 for float64)
    share = (ranks - 1) / ranks
    return {
        "rows": 2 * share * (2 * p * p + 1.5 * p * (p + 1) + 1) * compute,
        "owner": owner_bytes(param, buf, ranks),
        "gather": share * n * p * (2 * item + phi_item),
    }


_chosen: dict[tuple, tuple[int, ...]] = {}


def moved_to_owners(summable: list, owned: list, ranks: int) -> tuple[int, ...]:
    """``sharding="auto"``'s choice on a 1-D mesh of ``ranks`` ranks: which of the row-shardable
    layers ``summable`` (``(param, buf)`` pairs; shapes only) leave the Gram all-reduce for the
    owner path, next to the layers ``owned`` that take it anyway (positions into ``summable``).

    A step's communication time is set by its busiest rank, so the cost of a choice is the
    owner path's busiest rank (:func:`fgd_fast.owners.busiest_bytes`: an owner receives its
    layers whole) plus the row all-reduce of the layers left (every rank alike,
    :func:`path_bytes`). The layers are ranked by their average saving and the cheapest number
    of them moves (an owner's load is lumpy: one large matrix may cost its owner more than it
    saves, many spread over the ranks do not); the move is kept if it saves at least
    :data:`PATH_MARGIN` bytes (three times that where the owner path would otherwise not run:
    its collectives). Square and wide θ move; tall θ (convolutions) on few ranks stay summed,
    and move as the ranks grow."""
    key = (
        tuple((tuple(p.shape), p.dtype, b.dtype if b is not None else None) for p, b in summable),
        tuple((tuple(p.shape), p.dtype, b.dtype if b is not None else None) for p, b in owned),
        ranks,
    )
    if key in _chosen:
        return _chosen[key]
    rows = [path_bytes(p, b, ranks)["rows"] for p, b in summable]
    average = [path_bytes(p, b, ranks)["owner"] for p, b in summable]

    def cost(moved: set) -> float:
        onto = owned + [summable[i] for i in sorted(moved)]
        return busiest_bytes(onto, ranks) + sum(r for i, r in enumerate(rows) if i not in moved)

    order = [i for i in sorted(range(len(summable)), key=lambda i: (average[i] - rows[i], i)) if average[i] < rows[i]]
    costs = [cost(set(order[:k])) for k in range(len(order) + 1)]  # the k largest average savings moved
    k = min(range(len(costs)), key=lambda k: (costs[k], k))
    moved, start, best = set(order[:k]), costs[0], costs[k]
    margin = PATH_MARGIN * (1 if owned else 3)
    _chosen[key] = tuple(sorted(moved)) if moved and start - best >= margin else ()
    return _chosen[key]


@eager  # DTensor shards and collectives run eagerly under torch.compile (a graph break)
def prepare_dtensors(
    resolve,
    idx,
    params,
    grads,
    bufs,
    fresh,
    *,
    lr,
    momentum,
    feedback,
    check_finite,
    precision,
    trust_radius=None,
    max_distance=None,
    variant="official",
    sharding="auto",
):
    """Plans for the DTensor layers ``idx`` (positions into the lists): ``[(layers, plan)]``.

    ``resolve(device_type)`` is the backend's ``prepare``. Each layer takes one of three exact
    paths (its gradient and Φ sharing θ's layout; otherwise it is gathered):

    * **rows** — θ split into whole rows (:func:`row_mesh_dim`) and a backend that takes row
      shards: one ``prepare`` per (mesh, sharded mesh dimension) with ``reduce`` (over that
      dimension's process group) and ``shapes``;
    * **owner** — any other placement on a mesh whose ranks form a process group
      (:func:`fgd_fast.owners.owner_group`): each layer stepped whole by one rank
      (:mod:`fgd_fast.owners`);
    * **gather** — θ, Φ, g all-gathered and stepped whole on every rank (:func:`full_values`).

    ``sharding="auto"`` steps every layer that is not a row shard on the owner path and, on a
    1-D mesh, sends row shards there too where that lightens the busiest rank
    (:func:`moved_to_owners`), else sums them; ``"rows"`` always sums row shards (owner path
    for the others); ``"owner"`` and ``"gather"`` take that path for every layer they can. A
    layer gathered because no other path fits is said once (a ``RuntimeWarning``).
    ``trust_radius``, ``max_distance``: the step guard, ``variant``: the update's, passed on to
    the backend.
    """
    rows: dict[tuple, list[int]] = {}
    owned: dict[tuple, list[int]] = {}
    undecided: dict[tuple, list[int]] = {}  # row shards that "auto" may send to owners (1-D meshes)
    whole: dict[torch.device, list[int]] = {}
    forced = []  # gathered because no other path fits
    for i in idx:
        p, g, b = params[i], grads[i], bufs[i]
        same = _same_layout(p, g) and (b is None or _same_layout(p, b))
        shardable = same and getattr(resolve(p.device.type), "row_shards", False) and row_mesh_dim(p) is not None
        group = owner_group(p) if same and sharding != "gather" else None
        if shardable and sharding == "auto" and group is not None and p.device_mesh.ndim == 1:
            undecided.setdefault((group, p.device), []).append(i)
        elif shardable and sharding in ("rows", "auto") or (shardable and sharding == "owner" and group is None):
            rows.setdefault((p.device_mesh, row_mesh_dim(p), p.device), []).append(i)
        elif group is not None:
            owned.setdefault((group, p.device), []).append(i)
        else:
            whole.setdefault(p.device, []).append(i)
            if sharding != "gather" and not shardable:
                forced.append(p)
    for key, layers in undecided.items():  # sharding="auto": the cheaper split at the busiest rank
        pairs = lambda ids: [(params[i], bufs[i]) for i in ids]  # noqa: E731
        moved = set(moved_to_owners(pairs(layers), pairs(owned.get(key, [])), params[layers[0]].device_mesh.size()))
        for k, i in enumerate(layers):
            if k in moved:
                owned.setdefault(key, []).append(i)
            else:
                rows.setdefault((params[i].device_mesh, row_mesh_dim(params[i]), params[i].device), []).append(i)
    for (group, device), layers in owned.items():  # pieces that do not tile θ: gathered instead
        layers.sort()  # (input order, as every rank has it)
        lay = pieces_of([params[i] for i in layers], group)
        for i in [i for i, ok in zip(layers, lay.ok) if not ok]:
            whole.setdefault(device, []).append(i)
            forced.append(params[i])
        layers[:] = [i for i, ok in zip(layers, lay.ok) if ok]
    if forced:  # (gathered by choice, by sharding=, is not worth a warning)
        _say_gathered(forced)
    options = dict(
        check_finite=check_finite,
        precision=precision,
        trust_radius=trust_radius,
        max_distance=max_distance,
        variant=variant,
    )

    def hyper(layers: list[int]) -> dict:  # per-layer η, β, α of these layers
        return {k: [v[i] for i in layers] for k, v in dict(lr=lr, momentum=momentum, feedback=feedback).items()}

    out = []
    with torch.no_grad():
        for (mesh, mesh_dim, device), layers in rows.items():
            plan = resolve(device.type)(
                [params[i].to_local() for i in layers],
                [grads[i].to_local() for i in layers],
                [bufs[i].to_local() if bufs[i] is not None else None for i in layers],
                [fresh[i] for i in layers],
                **hyper(layers),
                **options,
                reduce=summing_over(mesh.get_group(mesh_dim)),
                shapes=[params[i].shape for i in layers],
            )
            out.append((layers, plan))
        for (group, device), layers in owned.items():
            if layers:  # (those whose pieces tile θ; the same layout when all do)
                pick = lambda seq, layers=layers: [seq[i] for i in layers]  # noqa: E731
                lay = pieces_of(pick(params), group)
                plan = prepare_owned(
                    resolve(device.type),
                    lay,
                    pick(params),
                    pick(grads),
                    pick(bufs),
                    pick(fresh),
                    **hyper(layers),
                    **options,
                )
                out.append((layers, plan))
        for device, layers in whole.items():
            # every rank gets the same whole matrices: θ, Φ and g of these layers in one all-gather per dtype
            count = len(layers)
            gathered = full_values([params[i] for i in layers] + [bufs[i] for i in layers] + [grads[i] for i in layers])
            full_p, full_b, full_g = gathered[:count], gathered[count : 2 * count], gathered[2 * count :]
            plan = resolve(device.type)(full_p, full_g, full_b, [fresh[i] for i in layers], **hyper(layers), **options)
            out.append(
                (layers, _writing_back(plan, [params[i] for i in layers], full_p, [bufs[i] for i in layers], full_b))
            )
    return [(layers, _eager(plan)) for layers, plan in out]


def _eager(plan: StepPlan) -> StepPlan:
    """``plan`` whose ``apply`` (DTensor shards, collectives) runs outside ``torch.compile``."""
    plan.apply = torch.compiler.disable(plan.apply)
    return plan


_said: set[tuple] = set()


def _say_gathered(params: list) -> None:
    """Warn once per process and set of layers that these DTensor parameters are gathered
    whole every step (no silent fallback), with what it costs and how to avoid it."""
    what = tuple((tuple(p.shape), str(p.placements), p.device_mesh.ndim) for p in params)
    if what in _said:
        return
    _said.add(what)
    import warnings

    from .validation import user_stacklevel

    moved = sum(3 * p.numel() * p.element_size() for p in params if is_dtensor(p))  # θ, Φ, g
    listed = ", ".join(f"{tuple(p.shape)} {tuple(p.placements)}" for p in params[:6])
    listed += f" and {len(params) - 6} more" if len(params) > 6 else ""
    warnings.warn(
        f"FGD all-gathers {len(params)} sharded parameter(s) whole every step ({listed}): θ, Φ and g, "
        f"~{moved / 2**20:.1f} MiB received per rank and step, and each rank computes their whole step. "
        "Neither cheaper path fits them: the owner path needs a 1-D mesh or a mesh over every rank, "
        "gradients and momentum with the parameter's placement, and pieces that tile θ; row shards "
        "need a backend that takes them ('torch' or 'auto'). For FSDP2, "
        "fully_shard(..., shard_placement_fn=fgd_fast.shard_placement) shards θ's rows.",
        RuntimeWarning,
        stacklevel=user_stacklevel(),
    )


def _writing_back(plan: StepPlan, params, full_params, bufs, full_bufs) -> StepPlan:
    """``plan`` on gathered copies, whose ``apply`` also writes each rank's shard back."""

    def apply() -> None:
        plan.apply()
        with torch.no_grad():
            for p, fp, b, fb in zip(params, full_params, bufs, full_bufs):
                write_shard(p, fp)
                if b is not None:
                    write_shard(b, fb)

    return StepPlan(
        dist=plan.dist,
        finite=plan.finite,
        apply=apply,
        dist_next=plan.dist_next,
        finite_next=plan.finite_next,
        guarded=plan.guarded,
        checks=plan.checks,
    )


@eager
def agree_across_ranks(settings: dict[str, object], device: torch.device, mesh=None) -> None:
    """Raise the same ``ValueError`` on every rank (of ``mesh``, default all) when the ranks'
    ``settings`` differ.

    Each value becomes a float64 (numbers as themselves, other values — tuples of per-layer
    values included — by a 48-bit hash of their ``repr``, exact for floats); ``all_reduce(MAX)``
    of ``[x, −x]`` gives every rank the largest and the smallest of each, so every rank sees the
    same disagreement. On a mesh over only some ranks it reduces over each of the mesh's
    dimensions in turn (the maximum over the whole mesh), so ranks outside it are not waited
    for. It must be the step's first collective: a rank with another backend or layer count
    would otherwise call different collectives and hang."""
    import hashlib

    import torch.distributed as dist

    names = list(settings)

    def number(v: object) -> float:
        if isinstance(v, bool) or v is None or not isinstance(v, (int, float)):
            return float(int.from_bytes(hashlib.blake2b(repr(v).encode(), digest_size=6).digest(), "big"))
        return float(v)

    x = torch.tensor([number(settings[k]) for k in names], dtype=torch.float64, device=device)
    both = torch.cat([x, -x])
    whole = mesh is None or mesh.size() == dist.get_world_size()
    for group in [None] if whole else [mesh.get_group(d) for d in range(mesh.ndim)]:
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    hi, lo = both[: len(names)].tolist(), (-both[len(names) :]).tolist()
    differ = [k for k, a, b in zip(names, hi, lo) if a != b]
    if any(k.startswith("whether") for k in differ):  # (a verdict, a check or a failure, explains the rest)
        raise ValueError(
            f"the ranks disagree on {', '.join(differ)}: a check failed, or a step could not be prepared, on some "
            "rank(s) only, which raised the reason; the FGD step was not applied on any rank and nothing changed"
        )
    if differ:
        raise ValueError(
            f"the ranks disagree on {', '.join(differ)} of the FGD step; it was not applied on any rank and "
            "nothing changed. Every rank must build the optimizer with the same options and step the same "
            "parameters with the same hyper-parameters (a scheduler on every rank)"
        )


def checks_stay_in_groups(meshes: list) -> bool:
    """Whether a sharded layer's checks, shared within its own group only (the ranks of its mesh,
    or of one dimension of it: HSDP's shards, not its replicas), may miss ranks of this step:
    with several meshes, or a mesh of more than one dimension, a check that failed on some ranks
    reaches the others only by an agreement on the verdict."""
    return len(meshes) > 1 or any(m.ndim > 1 for m in meshes)


def meshes_of(tensors: list) -> tuple[list, dict]:
    """The device meshes of DTensors ``tensors`` in one order on every rank (see
    :func:`in_rank_independent_order`), and each mesh's device on this rank."""
    mesh_device: dict = {}
    for t in tensors:
        mesh_device.setdefault(t.device_mesh, t.device)
    meshes = list(mesh_device)
    if len(meshes) > 1:  # (which layers have gradients may differ between ranks)
        meshes = in_rank_independent_order(meshes)
    return meshes, mesh_device


def agree_mesh_by_mesh(settings_on, meshes: list, mesh_device: dict) -> ValueError | None:
    """The ranks of each mesh in turn agree on ``settings_on(mesh)``; returns the first
    disagreement (``None``: every mesh agreed). A disagreement on one mesh is carried into the
    later, wider meshes' agreements: the ranks outside the first mesh raise too instead of
    waiting for the ranks that raised."""
    disagreed: ValueError | None = None
    for mesh in meshes:
        settings = {**settings_on(mesh), "whether the ranks of another device mesh disagreed": disagreed is not None}
        try:
            agree_across_ranks(settings, mesh_device[mesh], mesh=mesh)
        except ValueError as error:
            disagreed = disagreed or error
    return disagreed


@eager
def in_rank_independent_order(meshes: list) -> list:
    """The device meshes in one order on every rank, the smaller first (by their ranks): the ranks'
    agreements on them are collectives, which every rank must call in the same order, and a
    disagreement on a sub-mesh reaches the wider meshes after it."""
    return sorted(meshes, key=lambda m: (m.mesh.numel(), tuple(m.mesh.shape), m.mesh.flatten().tolist()))


def agree_on_local_checks(
    passed: bool,
    meshes: list,
    mesh_device: dict,
    failed: Exception | None = None,
    *,
    what: str = "the orthogonal parameters passed the checks on this rank",
) -> None:
    """A check that failed on some ranks only (this rank's unsharded layers, or a sharded layer
    whose group is one sub-mesh or one dimension of an HSDP mesh) would leave the other ranks
    writing theirs, then waiting in the sharded layers' collectives: the ranks of each mesh agree
    on the verdict first, and every rank raises (this rank its own error) before anything is
    written. A disagreement on one
    mesh is carried into the later, wider meshes' agreements (as in the step's own agreement):
    the ranks outside the first mesh raise too instead of waiting."""
    disagreed = agree_mesh_by_mesh(lambda mesh: {f"whether {what}": passed}, meshes, mesh_device)
    if disagreed is not None:
        if failed is not None:
            raise failed from None
        raise disagreed
