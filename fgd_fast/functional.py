"""Functional entry points: :func:`fgd` (orthogonal parameters) and :func:`sgd` (the rest, from
:mod:`fgd_fast.plain_sgd`).

As in ``torch.optim``, the optimizer class collects state and validates arguments; these
functions do the arithmetic. :func:`fgd` dispatches to one backend implementation per device
(see :mod:`fgd_fast.backends`); all of them share one signature, compute the same update
(docs/algorithm.md §2), guard it (:mod:`fgd_fast.backends.algebra`) and check the step before
writing (:mod:`fgd_fast.guards`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, MutableSequence, Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import NamedTuple

import torch

from . import distributed
from ._compile import eager
from .backends import Backend, BackendUnavailable, checked_precision, compute_dtype, resolve_backend
from .backends.algebra import VARIANTS
from .backends.carry import GRAM_REFRESH
from .distributed import SHARDINGS, is_dtensor, prepare_dtensors
from .guards import MAX_DISTANCE, TRUST_RADIUS, check_guard_room, raise_if_invalid
from .manifold import check_materialised
from .plain_sgd import sgd
from .validation import (
    check_bool,
    check_feedback,
    check_fgd_momentum,
    check_grad_fits,
    check_lr,
    check_max_distance,
    check_no_shared_memory,
    check_orthogonal_params,
    check_state_tensor,
    check_trust_radius,
    check_writable,
)

__all__ = ["fgd", "sgd", "backend_for", "GuardReport"]


class GuardReport(NamedTuple):
    """What the guard did in one :func:`fgd` step.

    ``guarded``: per parameter, a 0-d int8 device tensor, ``KEPT`` (0: the update as computed),
    ``SCALED`` (1: a fraction of it) or ``RESET`` (2: the feedback pull-back alone, Φ₊ = 0), or
    ``None`` where the guard was off; read-only (on a CPU the torch backend makes it in
    ``torch.inference_mode``: usable anywhere, not writable in place outside it). ``read``: the
    same as ints where the checks synchronised with the host this step, else ``None`` (reading
    ``guarded`` later costs a synchronisation). ``distance``: per parameter, ‖θ₊ᵀθ₊ − I‖_F as the
    step computed it (0-d, exact to rounding), or ``None`` where not predicted or where the backend
    only bounded it within the target (``prepare.bounds_next``: the torch backend, for parameters
    that are not DTensors).
    """

    guarded: list[torch.Tensor | None]
    read: list[int] | None
    distance: list[torch.Tensor | None] | None = None


_resolved: dict[tuple[str, str, str], tuple[str, Backend]] = {}


def on_device(device: torch.device):
    """The context in which a step's kernels for tensors on ``device`` launch: that GPU (Triton
    launches on the current device, not the tensors'; a model on ``cuda:1`` while ``cuda:0`` is
    current is common where a script moves it without ``torch.cuda.set_device``)."""
    if device.type != "cuda" or torch.compiler.is_compiling():
        return nullcontext()
    index = device.index if device.index is not None else torch.cuda.current_device()
    return nullcontext() if index == torch.cuda.current_device() else torch.cuda.device(index)


def _cached_backend(name: str, device: torch.device | str, precision: str = "ieee") -> tuple[str, Backend]:
    """``resolve_backend`` once per (name, device, precision): per GPU, whose kind decides
    ``"auto"`` (two GPUs of a machine may differ); a plain dict, which ``torch.compile`` reads
    (and guards on) like any global."""
    device = torch.device(device)
    key = (name, device.type, device.index, precision)
    if key not in _resolved:
        _resolved[key] = resolve_backend(name, device, precision)
    return _resolved[key]


def backend_for(name: str, device: torch.device | str, precision: str = "ieee") -> str:
    """The backend ``name`` resolves to for tensors on ``device`` at ``precision`` (raises if
    it cannot run)."""
    return _cached_backend(name, device, precision)[0]


def outside_inference_mode() -> AbstractContextManager:
    """Where a step makes state that later steps update in place (Φ, the guard's counters):
    outside ``torch.inference_mode`` even in a step taken inside it (an inference tensor cannot
    be written in place by a step outside it: the next step raised after writing some layers)."""
    if torch.compiler.is_compiling():  # (Dynamo cannot trace the mode's query; a compiled step is not in it)
        return nullcontext()
    return torch.inference_mode(False) if torch.is_inference_mode_enabled() else nullcontext()


#: the device types whose torch.autocast a step turns off (those of the backends)
AUTOCAST_DEVICES = ("cpu", "cuda")


def autocast_on() -> tuple[tuple[str, torch.dtype], ...]:
    """The device types where the caller's ``torch.autocast`` is on, with its dtype (none while
    compiling: a compiled step's autocast is the trace's)."""
    if torch.compiler.is_compiling():
        return ()
    return tuple((d, torch.get_autocast_dtype(d)) for d in AUTOCAST_DEVICES if torch.is_autocast_enabled(d))


def autocast_set(devices: Sequence[tuple[str, torch.dtype]], enabled: bool) -> ExitStack:
    """A context turning ``torch.autocast`` on (at each one's dtype) or off for ``devices``."""
    stack = ExitStack()
    for device_type, dtype in devices:
        stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
    return stack


def outside_autocast(fn: Callable) -> Callable:
    """Run ``fn`` with any ``torch.autocast`` its caller entered turned off: a step computes in its
    parameters' dtypes (in a loop that wraps the optimizer step in autocast, a float32 step's
    products ran in bfloat16, and the torch backend's in-place products refused the mixed dtypes
    after the checks)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        devices = autocast_on()
        if not devices:
            return fn(*args, **kwargs)
        with autocast_set(devices, enabled=False):
            return fn(*args, **kwargs)

    return wrapper


def zero_momentum(p: torch.Tensor) -> torch.Tensor:
    """A first step's Φ = 0 for ``p``: float32 for float16/bfloat16 parameters, else ``p``'s
    dtype; a DTensor parameter's Φ is a DTensor with its placement. Never an inference tensor."""
    cdt = compute_dtype(p.dtype)
    with outside_inference_mode():
        return _zero_dtensor(p, cdt) if is_dtensor(p) else torch.zeros(p.shape, dtype=cdt, device=p.device)


@eager  # traced, zeros_like gave an uneven shard the even shards' local shape
def _zero_dtensor(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros_like(p, dtype=dtype)


def _given(value) -> list:
    """The distinct values of a hyper-parameter given as one value or one per layer (each
    tensor once, by identity)."""
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    return list({id(v): v for v in values}.values())  # (the layers of a group share its objects)


def _checked_options(
    *, precision, backend, variant, gram_refresh, sharding, max_distance, trust_radius, flags, hyper, validated
) -> tuple[str, float, float]:
    """The step's options checked (``validated``: ``FGD.step`` checked the flags, limits and
    hyper-parameters this step already); returns the precision, ``max_distance`` and
    ``trust_radius`` to use."""
    precision = checked_precision(precision, backend)  # (FGD passes its own, checked: this returns it)
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant={variant!r}: choose one of {', '.join(map(repr, VARIANTS))}")
    if isinstance(gram_refresh, bool) or not isinstance(gram_refresh, int) or gram_refresh < 1:
        raise ValueError(f"invalid gram_refresh={gram_refresh!r}: give an int >= 1 (1 reads the Grams every step)")
    if not validated:  # (FGD.step has checked its options and groups this step: not twice on the hot path)
        max_distance = check_max_distance(max_distance)  # (the guard's target and the manifold check's limit)
        trust_radius = check_trust_radius(trust_radius)
        for name, flag in flags.items():
            check_bool(name, flag)
        # the hyper-parameters as given (before they become floats: "0.1" or True is no lr)
        for v in _given(hyper["lr"]):
            check_lr(v)
        for v in _given(hyper["momentum"]):
            check_fgd_momentum(v)
        for v in _given(hyper["feedback"]):
            check_feedback(v)
    if sharding not in SHARDINGS:
        raise ValueError(f"unknown sharding={sharding!r}: choose one of {', '.join(map(repr, SHARDINGS))}")
    return precision, max_distance, trust_radius


def _checked_lists(params, grads, momentum_buffers, labels) -> int:
    """The per-parameter lists: list-like, one entry per parameter, buffers writable; returns the
    count."""
    for name, value in (("params", params), ("grads", grads), ("momentum_buffers", momentum_buffers)):
        if not _listlike(value):
            raise TypeError(f"{name} must be a list (one entry per parameter), got {type(value).__name__}")
    if labels is not None and not _listlike(labels):
        raise TypeError(f"labels must be a list of names (one per parameter) or None, got {type(labels).__name__}")
    count = len(params)
    if len(grads) != count or len(momentum_buffers) != count:
        raise ValueError(
            f"got {count} params, {len(grads)} grads and {len(momentum_buffers)} momentum_buffers: pass one "
            "gradient and one buffer (None before the first step) per parameter"
        )
    if not isinstance(momentum_buffers, MutableSequence):  # (before any write: the new Φ are stored into it)
        raise TypeError(
            f"momentum_buffers must be a list (the step stores the new buffers into it), got "
            f"{type(momentum_buffers).__name__}; pass list(momentum_buffers)"
        )
    if labels is not None and len(labels) != count:
        raise ValueError(f"got {len(labels)} labels for {count} params: pass one label per parameter, or None")
    return count


def _per_layer(name: str, value, count: int, tensors: bool = False) -> list:
    """One value per layer (floats; with ``tensors``, a tensor is kept as it is)."""
    keep = (lambda v: v if isinstance(v, torch.Tensor) else float(v)) if tensors else float  # noqa: E731
    if not isinstance(value, (list, tuple)):
        return [keep(value)] * count
    values = [keep(v) for v in value]
    if len(values) != count:
        raise ValueError(
            f"{name} has {len(values)} entries for {count} parameters: pass one value per parameter, "
            "or a single value for all"
        )
    return values


def fgd(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    momentum_buffers: list[torch.Tensor | None],
    *,
    lr: float | torch.Tensor | Sequence[float | torch.Tensor],
    momentum: float | Sequence[float],
    feedback: float | Sequence[float],
    backend: str = "auto",
    check_finite: bool = True,
    check_manifold: bool = True,
    max_distance: float = MAX_DISTANCE,
    precision: str | None = None,
    labels: Sequence[str] | None = None,
    guard: bool = True,
    trust_radius: float = TRUST_RADIUS,
    variant: str = "official",
    sharding: str = "auto",
    gram_refresh: int = GRAM_REFRESH,
    maximize: bool = False,
) -> GuardReport:
    """One FGD step for Stiefel-constrained ``params`` (in place).

    ``params``: the constrained weights (any shape whose Stiefel view is n × p, n ≥ p; see
    :func:`fgd_fast.stiefel_shape`), each within ``max_distance`` of the manifold; ``grads[i]``:
    the gradient of ``params[i]``, same shape; ``labels[i]``: the name an error or warning gives
    ``params[i]`` (default: its index); ``momentum`` (β) and ``feedback`` (α): one value or one
    per layer, like ``lr``; ``backend``: ``"auto"``, ``"reference"``, ``"torch"``, ``"triton"``
    or ``"cuda"`` (see :class:`fgd_fast.FGD`); ``check_finite``: refuse non-finite gradients, Φ
    and steps (``check_manifold``: a θ too far off), before writing anything.
    ``momentum_buffers[i]`` is Φ of ``params[i]`` or ``None``. Where ``momentum[i] > 0`` and
    the buffer is ``None`` (first step), a new float32/float64 buffer is created and stored
    into the list, as ``torch.optim.sgd`` does. With ``check_finite``/``check_manifold`` the
    step raises ``FloatingPointError``/``ValueError`` **before** writing anything if a
    gradient or Φ is not finite or a θ is more than ``max_distance`` from the manifold, or if
    the step would write a non-finite value or a θ beyond ``max_distance`` (computed exactly
    from the ``p × p`` blocks). With ``guard`` (default) the step written is the largest
    fraction of the update whose θ₊ stays within ``max_distance`` (down to the feedback
    pull-back with Φ₊ = 0), after Φ, g are scaled into the safety radius
    ``‖Φ‖ + η‖g‖ ≤ trust_radius``; all on the device (:mod:`fgd_fast.backends.guard_rule`).
    Returns what the guard did (:class:`GuardReport`). ``variant``: ``"official"`` (the
    authors' code) or ``"paper"`` (Algorithm 1 as printed; see :class:`fgd_fast.FGD`);
    ``sharding``: how row-sharded DTensor layers step (see :class:`fgd_fast.FGD`);
    ``precision``: the fp32 products' precision, as :class:`fgd_fast.FGD` takes it (``None``:
    ``"tf32x3"`` for the backends that honour it, ``"ieee"`` for ``"reference"`` and ``"cuda"``);
    ``lr``: one value or one per layer, numbers or one-element tensors (a tensor reaches the
    backends that read η on the device as it is, so a captured step sees it change; the others
    get its value); at lr = 0 this function still applies the feedback pull-back −αθD and
    Φ₊ = βΦ's projection (``FGD`` instead leaves a group at lr = 0 alone);
    ``gram_refresh``: at most how many steps the torch backend on a CPU carries θᵀθ, θᵀΦ, ΦᵀΦ
    from step to step before reading them from the parameters again (1: every step; see
    :class:`fgd_fast.FGD`).
    ``maximize``: ascend the objective (the gradients negated, as ``torch.optim.SGD(maximize=True)``).

    Parameters may be DTensors (FSDP2's ``fully_shard``): the step is the one a single process
    would take on the full matrices, and the checks raise on every rank alike (see
    :mod:`fgd_fast.distributed`); every rank must then call this with the same layers.
    """
    return _fgd(
        params,
        grads,
        momentum_buffers,
        lr=lr,
        momentum=momentum,
        feedback=feedback,
        backend=backend,
        check_finite=check_finite,
        check_manifold=check_manifold,
        max_distance=max_distance,
        precision=precision,
        labels=labels,
        guard=guard,
        trust_radius=trust_radius,
        variant=variant,
        sharding=sharding,
        gram_refresh=gram_refresh,
        maximize=maximize,
    )


@torch.no_grad()  # (an in-place step on leaf parameters; FGD.step is under no_grad already)
@outside_autocast
def _fgd(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    momentum_buffers: list[torch.Tensor | None],
    *,
    lr: float | torch.Tensor | Sequence[float | torch.Tensor],
    momentum: float | Sequence[float],
    feedback: float | Sequence[float],
    backend: str = "auto",
    check_finite: bool = True,
    check_manifold: bool = True,
    max_distance: float = MAX_DISTANCE,
    precision: str | None = None,
    labels: Sequence[str] | None = None,
    guard: bool = True,
    trust_radius: float = TRUST_RADIUS,
    variant: str = "official",
    sharding: str = "auto",
    gram_refresh: int = GRAM_REFRESH,
    maximize: bool = False,
    _validated: bool = False,
    _rest_sharded_at_zero_lr: bool = False,
    _unsharded_beside_sharded: bool | None = None,
    _idle_dtensors: Sequence[torch.Tensor] = (),
    _held: Exception | None = None,
    _before_writes: Callable[[], None] | None = None,
) -> GuardReport:
    """:func:`fgd` with ``FGD.step``'s internal arguments (the public function's arguments and
    step as documented there).

    ``_validated``: internal, for ``FGD.step``, which checked lr, momentum, feedback,
    ``max_distance`` and ``trust_radius`` this step already (skips checking them again).
    ``_rest_sharded_at_zero_lr``: internal, for ``FGD.step``: DTensor layers at lr = 0 join
    the ranks' agreement (a rank whose scheduler alone gave lr = 0 makes every rank raise,
    where skipping the step left the others waiting in it), get their state, and are not
    stepped (``FGD`` moves no weight at lr = 0). ``_unsharded_beside_sharded``: internal, whether
    plain orthogonal layers step beside DTensor ones, the same on every rank (``FGD`` knows it
    from its groups; default: whether ``params`` mixes both kinds), so the ranks agree on the
    plain layers' checks even where only some ranks have gradients for them. ``_idle_dtensors``:
    internal, ``FGD``'s orthogonal DTensor parameters without a gradient on this rank: their
    meshes join the ranks' agreement (a rank whose DTensor gradients were all None skipped it and
    left the others waiting; now every rank raises that they disagree on the layer count).
    ``_held``: internal, ``FGD.step``'s own refusal on this rank (no layers passed): the step joins
    the ranks' agreement with it, so the others raise too, and raises it. ``_before_writes``:
    internal, what ``FGD.step`` does that allocates memory (the plain groups' SGD, the state a
    first step makes), called after every check and before the first write of θ or Φ, so that an
    out-of-memory error there leaves the orthogonal layers as they were; in a step with DTensor
    layers, after the writes (a rank failing between the ranks' agreement and their collective
    writes would leave the others waiting).
    """
    precision, max_distance, trust_radius = _checked_options(
        precision=precision,
        backend=backend,
        variant=variant,
        gram_refresh=gram_refresh,
        sharding=sharding,
        max_distance=max_distance,
        trust_radius=trust_radius,
        flags=dict(maximize=maximize, guard=guard, check_finite=check_finite, check_manifold=check_manifold),
        hyper=dict(lr=lr, momentum=momentum, feedback=feedback),
        validated=_validated,
    )
    count = _checked_lists(params, grads, momentum_buffers, labels)
    lrs = _per_layer("lr", lr, count, tensors=True)  # a tensor lr reaches the backends that read it on the device
    host_read: list[list[float]] = []  # (not functools.cache: torch.compile traces this function)

    def host_lrs() -> list[float]:  # read from tensors only where needed (a GPU tensor's read synchronises)
        if not host_read:
            host_read.append([float(v) for v in lrs])
        return host_read[0]

    betas = _per_layer("momentum", momentum, count)
    alphas = _per_layer("feedback", feedback, count)
    labels = list(labels) if labels is not None else [f"params[{i}]" for i in range(count)]
    if not _validated:  # (FGD checked its groups' parameters when they were added)
        for i, p in enumerate(params):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"{labels[i]} must be a torch.Tensor, got {type(p).__name__}")
            check_materialised(p, f"fgd ({labels[i]})")
        check_orthogonal_params(params, labels)

    live = [i for i in range(count) if params[i].numel() > 0]  # a DTensor's numel is the full one's
    sharded = [i for i in live if is_dtensor(params[i])]
    by_device: dict[torch.device, list[int]] = {}
    for i in live:
        if not is_dtensor(params[i]):
            by_device.setdefault(params[i].device, []).append(i)
    if maximize:  # ascend along g (checked above; the ranks of a sharded step agree on it, below)
        grads = [-g if isinstance(g, torch.Tensor) else g for g in grads]
    predict = guard or check_finite or check_manifold
    steering = dict(
        trust_radius=trust_radius if guard else None,
        max_distance=max_distance if predict else None,
        variant=variant,
    )
    plans, index, bounded = [], [], []  # bounded: plans whose dist_next may be a bound
    # (the ranks agree per device mesh: FSDP2 may run on a mesh over some of them)
    meshes, mesh_device = distributed.meshes_of([params[i] for i in sharded] + list(_idle_dtensors))
    # A rank that fails before the ranks' first collective (input that does not fit on this rank
    # only, a backend that loads on some nodes only, memory) holds its error until the agreement,
    # where the others learn of it and raise too, instead of waiting for it in a collective.
    held: list[Exception] = [_held] if _held is not None else []
    bufs: list[torch.Tensor | None] = []
    fresh: list[bool] = []
    try:
        bufs, fresh = _checked_inputs(
            params, grads, momentum_buffers, betas, labels, guard=guard, max_distance=max_distance, validated=_validated
        )
        for device, idx in by_device.items():
            _, prepare = _cached_backend(backend, device, precision)
            if getattr(prepare, "bounds_next", False):  # (only DTensors' distances are read: orthogonality())
                bounded.append(len(plans))
            layer_lrs = lrs if getattr(prepare, "device_lr", False) else host_lrs()
            with on_device(device):
                plans.append(
                    _prepare_on(
                        prepare,
                        device,
                        [params[i] for i in idx],
                        [grads[i] for i in idx],
                        [bufs[i] for i in idx],
                        [fresh[i] for i in idx],
                        lrs=[layer_lrs[i] for i in idx],
                        betas=[betas[i] for i in idx],
                        alphas=[alphas[i] for i in idx],
                        check_finite=check_finite,
                        precision=precision,
                        gram_refresh=gram_refresh,
                        steering=steering,
                    )
                )
            index.append(idx)
    except Exception as error:
        if not meshes:
            raise
        held.append(error)
    if held and not meshes:
        raise held[0]

    def settings_on(mesh) -> dict:  # DTensor parameters (FSDP2): row shards with one all-reduce, or gathered whole
        on_mesh = [i for i in sharded if params[i].device_mesh == mesh]
        # (the backend as named and as resolved: "auto" on a rank where Triton does not load would take
        # other collectives than on the others; an explicit one may load on some ranks only)
        try:
            resolved = _cached_backend(backend, mesh_device[mesh], precision)[0]
        except BackendUnavailable as error:
            held.append(error)
            resolved = None
        return {  # (the per-layer values as tuples: compared whole, by a hash of their repr)
            "whether every rank could prepare its step (one that could not raised its own error)": not held,
            "the number of sharded orthogonal parameters": len(on_mesh),
            "the sharded orthogonal parameters": tuple(labels[i] for i in on_mesh),
            "lr": tuple(host_lrs()[i] for i in on_mesh),
            "momentum": tuple(betas[i] for i in on_mesh),
            "feedback": tuple(alphas[i] for i in on_mesh),
            "maximize": maximize,
            "backend": (backend, resolved),
            "precision": precision,
            "variant": variant,
            "sharding": sharding,
            "check_finite": check_finite,
            "check_manifold": check_manifold,
            "max_distance": max_distance,
            "guard": guard,
            "trust_radius": trust_radius,
        }

    disagreed = distributed.agree_mesh_by_mesh(settings_on, meshes, mesh_device)
    if held:
        raise held[0]
    if disagreed is not None:
        raise disagreed
    beside = _unsharded_beside_sharded
    if beside is None:  # (a direct call: its layers, which every rank passes alike)
        beside = bool(sharded) and any(not is_dtensor(p) for p in params)
    # (with the checks off too: an owner's failure, e.g. out of memory, reaches the other replicas
    # of an HSDP mesh, or the ranks of another mesh, only by this agreement)
    agree = bool(meshes) and (beside or distributed.checks_stay_in_groups(meshes))
    if _rest_sharded_at_zero_lr:  # (agreed above; FGD's lr = 0 moves nothing: only their state is made)
        sharded = [i for i in sharded if host_lrs()[i] != 0.0]
    if sharded:  # (a rank's DTensors share its device: the kernels launch there, as above)
        try:
            with on_device(params[sharded[0]].device):
                dtensor_plans = prepare_dtensors(
                    lambda device_type: _cached_backend(backend, device_type, precision)[1],
                    sharded,
                    params,
                    grads,
                    bufs,
                    fresh,
                    lr=host_lrs(),
                    momentum=betas,
                    feedback=alphas,
                    check_finite=check_finite,
                    precision=precision,
                    sharding=sharding,
                    **steering,
                )
        except Exception as failed:  # (an owner's failure, raised by every rank of its group alike:
            if agree:  # the other replicas and meshes learn of it here instead of waiting)
                distributed.agree_on_local_checks(False, meshes, mesh_device, failed)
            raise
        for idx, plan in dtensor_plans:
            plans.append(plan)
            index.append(idx)
    try:
        read = raise_if_invalid(
            [pl.dist for pl in plans],
            [pl.finite for pl in plans],
            index,
            labels,
            check_finite=check_finite,
            check_manifold=check_manifold,
            max_distance=max_distance,
            dist_next=[pl.dist_next for pl in plans],
            finite_next=[pl.finite_next for pl in plans],
            guarded=[pl.guarded for pl in plans],
            tables=[pl.checks for pl in plans],
            carried=gram_refresh > 1,
        )
    except (ValueError, FloatingPointError) as failed:
        if agree:
            distributed.agree_on_local_checks(False, meshes, mesh_device, failed)
        raise
    if _before_writes is not None and not meshes:  # (a step of this process alone: before its first write)
        _before_writes()
    if agree:  # (this rank's verdict is not every rank's; the sharded apply is collective)
        distributed.agree_on_local_checks(True, meshes, mesh_device)
    for pl, idx in zip(plans, index):
        with on_device(params[idx[0]].device):
            pl.apply()
    if _before_writes is not None and meshes:  # (after the ranks' collectives: one rank's failure here stops none)
        _before_writes()
    for i in range(count):
        if bufs[i] is not None:
            momentum_buffers[i] = bufs[i]
    return _guard_report(plans, index, bounded, count, read)


def _checked_inputs(
    params, grads, momentum_buffers, betas, labels, *, guard: bool, max_distance: float, validated: bool
) -> tuple[list, list[bool]]:
    """The checks of :func:`fgd`'s tensors that come before any plan (writable parameters, the
    gradients and momentum buffers, no memory shared with what the step writes, room for the
    guard), and each layer's Φ with whether it is a first step's zero (see :func:`_momentum_buffers`)."""
    if not validated and not torch.compiler.is_compiling():  # (FGD.step checked them; Dynamo cannot trace it)
        check_writable(params, labels, inside_inference_mode=True)  # (else an error after earlier layers' writes)
    bufs, fresh = _momentum_buffers(params, grads, momentum_buffers, betas, labels)
    if not validated and not torch.compiler.is_compiling():  # (FGD.step checked them with their state)
        seen = [(t, text, False) for t, text in zip(params, labels)]  # (tensor, label, read only)
        seen += [(b, f"{text}'s momentum_buffer", False) for b, text in zip(bufs, labels) if b is not None]
        seen += [(g, f"{text}'s gradient", True) for g, text in zip(grads, labels) if isinstance(g, torch.Tensor)]
        seen = [entry for entry in seen if not is_dtensor(entry[0])]
        tensors, texts, read_only = (list(column) for column in zip(*seen)) if seen else ([], [], [])
        check_no_shared_memory(tensors, texts, [True] * len(tensors), read_only=read_only)
    if guard:
        check_guard_room(params, labels, max_distance)
    return bufs, fresh


def _prepare_on(
    prepare,
    device: torch.device,
    params,
    grads,
    bufs,
    fresh,
    *,
    lrs,
    betas,
    alphas,
    check_finite: bool,
    precision: str,
    gram_refresh: int,
    steering: dict,
):
    """One device's plain (not DTensor) layers' plan from its backend's ``prepare``: the options
    that backend takes (a carried Gram's refresh, a bound for the next distance), and lr as the
    backend reads it."""
    carrying = dict(gram_refresh=gram_refresh) if getattr(prepare, "carries_grams", False) else {}
    if getattr(prepare, "bounds_next", False):  # (only DTensors' distances are read: orthogonality())
        carrying["exact_next"] = False
    if device.type != "cpu" and not torch.compiler.is_compiling():
        # (a CPU tensor's value, read where that is free: as a tensor it would be copied to the
        # GPU every step, a blocking copy that a CUDA-graph capture refuses)
        lrs = [float(v) if isinstance(v, torch.Tensor) and v.device.type == "cpu" else v for v in lrs]
    return prepare(
        params,
        grads,
        bufs,
        fresh,
        lr=lrs,
        momentum=betas,
        feedback=alphas,
        check_finite=check_finite,
        precision=precision,
        **steering,
        **carrying,
    )


def _guard_report(plans, index, bounded, count: int, read) -> GuardReport:
    """What the plans' guard did and the distances they wrote, per parameter (``bounded``: the
    plans whose next distance is only a bound, not reported)."""
    per_param: list[torch.Tensor | None] = [None] * count
    distance: list[torch.Tensor | None] = [None] * count
    for k, (pl, idx) in enumerate(zip(plans, index)):
        if pl.guarded is not None:
            for i, t in zip(idx, pl.guarded.unbind(0)):
                per_param[i] = t
        if pl.dist_next is not None and k not in bounded:
            for i, t in zip(idx, pl.dist_next.unbind(0)):
                distance[i] = t
    return GuardReport(per_param, read, distance)


def _momentum_buffers(params, grads, momentum_buffers, betas, labels) -> tuple[list, list[bool]]:
    """Each layer's Φ and whether it is a first step's zero (checked against its parameter; a
    gradient that does not fit is refused), before anything is written."""
    bufs: list[torch.Tensor | None] = []
    fresh: list[bool] = []
    for i, (p, g, buf) in enumerate(zip(params, grads, momentum_buffers)):
        if g is None:
            raise ValueError(f"{labels[i]}: its gradient is None; pass only the parameters that have one")
        if not isinstance(g, torch.Tensor):
            raise TypeError(f"{labels[i]}: its gradient must be a torch.Tensor, got {type(g).__name__}")
        if g.layout != torch.strided:
            raise ValueError(f"{labels[i]}: its gradient is {g.layout}; FGD needs dense gradients")
        check_grad_fits(p, g, labels[i], "pass grads[i] with params[i]'s shape, dtype and device")
        if betas[i] == 0.0:
            bufs.append(None)
            fresh.append(True)
            continue
        if buf is None:  # Φ = 0: first step
            bufs.append(zero_momentum(p))
            fresh.append(True)
            continue
        check_state_tensor(buf, p, compute_dtype(p.dtype), labels[i], "momentum_buffer")
        bufs.append(buf)
        fresh.append(False)
    return bufs, fresh


def _listlike(value) -> bool:
    """A sized, indexable collection of entries (a list, a tuple, an ``nn.ParameterList``, a numpy
    array of names), not a string or a tensor."""
    return hasattr(value, "__len__") and hasattr(value, "__getitem__") and not isinstance(value, (str, torch.Tensor))
