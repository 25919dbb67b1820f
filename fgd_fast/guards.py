"""The step's guards: what the device computes about a step before it writes, read on the host.

Argument validation (types, ranges, shapes of what a caller passes) is in
:mod:`fgd_fast.validation`; this module is about the *numbers* of one step. Every backend
returns, per orthogonal layer, device tensors (no host synchronisation):

* ``dist`` — ``‖θᵀθ − I‖_F`` of the parameter now (from the Gram block ``A``);
* ``finite`` — the step's inputs g and Φ are finite (with ``check_finite``);
* ``dist_next`` — ``‖θ₊ᵀθ₊ − I‖_F`` after the step, computed exactly (to rounding) from the
  ``p × p`` blocks before anything is written (:func:`fgd_fast.backends.algebra.middle`);
* ``finite_next`` — θ₊ and Φ₊ will be finite;
* ``guarded`` — what the guard did: :data:`KEPT` (the authors' update), :data:`SCALED`
  (a fraction of the update written, or the inputs scaled into the safety radius) or
  :data:`RESET` (the step replaced by the
  feedback pull-back with Φ₊ = 0).

:func:`raise_if_invalid` reads them with **one** ``.tolist()`` per device (the only host
synchronisation of a step, and only when a check is on) and raises before any backend
writes, so a failing step changes nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ._matrix import stiefel_shape
from .backends.guard_rule import guard_target, store_unit

__all__ = [
    "MAX_DISTANCE",
    "TRUST_RADIUS",
    "KEPT",
    "SCALED",
    "RESET",
    "raise_if_invalid",
    "check_guard_room",
]

#: Default limit on ‖θᵀθ − I‖_F. The truncated Neumann series 2I − θᵀθ approximates
#: (θᵀθ)⁻¹ with error ‖(I − θᵀθ)²‖, which stops being small well before the series'
#: radius ‖I − θᵀθ‖ < 1; 0.5 catches an un-projected initialisation (distance ~√p or more)
#: while leaving room for the transients of aggressive settings.
MAX_DISTANCE = 0.5

#: Default safety radius ρ of the guard on ``‖Φ‖_F + η‖g‖_F`` (per layer): the step's inputs
#: are scaled into it before the middle, so its fp32 terms stay ≤ ~ρ⁴ and keep the exact
#: distance accurate to ~1e-5. What decides whether a step is written in full is that distance
#: (:mod:`fgd_fast.backends.algebra`), not ρ; 4 is far above what training produces (the
#: largest ``r`` measured: ``benchmarks/results/cpu-2026-11-26-guard-rule.md``).
TRUST_RADIUS = 4.0

KEPT, SCALED, RESET = 0, 1, 2

_RESET_ADVICE = (
    "Call opt.reset_parameter(param) (projects θ onto the manifold and clears its momentum), "
    "lower the learning rate or clip the gradient, or keep guard=True (the default), which scales "
    "such steps instead"
)


def check_guard_room(params: Sequence[torch.Tensor], labels: Sequence[str], max_distance: float) -> None:
    """Before a guarded step: every float16/bfloat16 parameter leaves the guard some room. Its
    target is ``max_distance`` less the rounding margin of storing θ₊ in that dtype, which grows
    as √p (:func:`.backends.guard_rule.guard_target`, a bound that a θ rounded up by one relative
    unit everywhere reaches); where the margin takes all of it (at the default 0.5: bfloat16 from
    p = 2,328, float16 from p ≈ 150,000), no step fits: the guard would reset every step, and
    training would silently stop."""
    for p, text in zip(params, labels):
        if p.dtype not in (torch.float16, torch.bfloat16) or p.dim() < 2:
            continue
        cols = stiefel_shape(p.shape).p
        target = guard_target(max_distance, cols, store_unit(p.dtype))
        if target <= 0.0:
            margin = max_distance - target
            raise ValueError(
                f"orthogonal parameter {text} ({p.dtype}, p = {cols}): the guard can take no step of it, since "
                f"storing θ in {str(p.dtype).removeprefix('torch.')} may alone move it up to {margin:.2g} from the "
                f"manifold, beyond max_distance={max_distance}; every step would be reset and training would stop. "
                "Keep orthogonal parameters in float32 (torch.autocast still computes in 16 bits), or pass "
                "guard=False (check_manifold then checks the computed step, without the rounding margin)"
            )


def raise_if_invalid(
    dist: Sequence[torch.Tensor],
    finite: Sequence[torch.Tensor | None],
    index: Sequence[Sequence[int]],
    labels: Sequence[str],
    *,
    check_finite: bool,
    check_manifold: bool,
    max_distance: float = MAX_DISTANCE,
    dist_next: Sequence[torch.Tensor | None] | None = None,
    finite_next: Sequence[torch.Tensor | None] | None = None,
    guarded: Sequence[torch.Tensor | None] | None = None,
    tables: Sequence[torch.Tensor | None] | None = None,
    carried: bool = False,
    fgd: bool = True,
    params: Sequence[torch.Tensor] | None = None,
) -> list[int] | None:
    """Raise if any layer failed a check; return the guard's per-layer decisions read at the
    same synchronisation (``None`` when no check is on: nothing is read). ``carried``: the step
    may have read θᵀθ carried from the last one (``gram_refresh > 1``): the off-manifold message
    then names the write that carried blocks cannot see. ``fgd=False``: the messages of a
    baseline optimizer (no ``reset_parameter``, no guard, no fused backends to name).
    ``params`` (the layers' tensors, in ``labels``' order): read only where a step is refused
    as non-finite, to name a parameter that is itself NaN/Inf rather than advise a smaller lr.

    ``dist[k]``, ``finite[k]``, … are per-layer device tensors of one backend call whose
    layers are ``index[k]`` (positions into ``labels``). One ``.tolist()`` per device.
    ``tables[k]``: the same five values as one ``(L, 5)`` float64 table where the backend
    call has one (:attr:`fgd_fast.backends.base.StepPlan.checks`): a device with one call
    reads it as it is (no op to gather the fields first).
    """
    if not (check_finite or check_manifold) or not labels:
        return None
    count = len(dist)
    dist_next = list(dist_next) if dist_next is not None else [None] * count
    finite_next = list(finite_next) if finite_next is not None else [None] * count
    guarded = list(guarded) if guarded is not None else [None] * count
    # layers in no batch (zero-size) are trivially on the manifold, finite and untouched
    values = {
        name: [fill] * len(labels)
        for name, fill in (("dist", 0.0), ("finite", 1.0), ("dist_next", 0.0), ("finite_next", 1.0), ("guarded", 0.0))
    }
    by_device: dict[torch.device, list[int]] = {}
    for k, d in enumerate(dist):
        by_device.setdefault(d.device, []).append(k)
    fields = ("dist", "finite", "dist_next", "finite_next", "guarded")
    for ks in by_device.values():
        table = tables[ks[0]] if tables is not None and len(ks) == 1 else None
        if table is not None:  # one backend call's table: its rows, one read
            for i, row in zip(index[ks[0]], table.tolist()):
                for name, v in zip(fields, row):
                    values[name][i] = v
            continue
        parts = []
        for k in ks:
            d = dist[k].reshape(-1)
            for t, fill in (
                (dist[k], 0.0),
                (finite[k], 1.0),
                (dist_next[k], 0.0),
                (finite_next[k], 1.0),
                (guarded[k], 0.0),
            ):
                if t is None:
                    parts.append(torch.full_like(d, fill, dtype=torch.float64))
                else:
                    parts.append(t.reshape(-1).to(torch.float64))
        read = torch.cat(parts).tolist()  # the one host synchronisation of a step
        at = 0
        for k in ks:
            n = len(index[k])
            for name in ("dist", "finite", "dist_next", "finite_next", "guarded"):
                for i, v in zip(index[k], read[at : at + n]):
                    values[name][i] = v
                at += n
    dist_all, dist_next_all = values["dist"], values["dist_next"]
    fin_all = [v != 0.0 for v in values["finite"]]
    fin_next_all = [v != 0.0 for v in values["finite_next"]]
    if check_manifold:  # a non-finite parameter first: fused backends' finite flags see it too (θᵀg)
        _raise_if_off_manifold(dist_all, labels, max_distance, only_non_finite=True)
    if check_finite:
        bad = [labels[i] for i, ok in enumerate(fin_all) if not ok]
        if bad and params is not None:
            _raise_if_a_param_is_not_finite(params, labels, [i for i, ok in enumerate(fin_all) if not ok])
        if bad and not fgd:
            raise FloatingPointError(
                f"non-finite gradient or optimizer state (NaN or Inf) for orthogonal parameter(s) {', '.join(bad)}; "
                "the step was not applied and no parameter or state changed. Skip this step (torch.amp.GradScaler "
                "does) or find the overflow; a non-finite state entry is cleared by deleting it "
                "(opt.state[param].clear()); check_finite=False turns this check off"
            )
        if bad:
            raise FloatingPointError(
                f"non-finite gradient or momentum_buffer (NaN or Inf) for orthogonal parameter(s) {', '.join(bad)}; "
                "on a GPU or with the Triton backend also a float32 momentum_buffer so large that its Gram ΦᵀΦ "
                "overflows (entries past ~1e19, e.g. edited into a checkpoint); the step was not applied and no "
                "parameter or state changed. Skip this step (torch.amp.GradScaler does) or find the overflow; a "
                "non-finite momentum_buffer is cleared by opt.reset_parameter(param); check_finite=False turns this "
                "check off"
            )
    if check_manifold:
        _raise_if_off_manifold(dist_all, labels, max_distance, carried=carried)
    if check_finite:
        bad = [labels[i] for i, ok in enumerate(fin_next_all) if not ok]
        if bad and params is not None:
            _raise_if_a_param_is_not_finite(params, labels, [i for i, ok in enumerate(fin_next_all) if not ok])
        if bad:
            advice = _RESET_ADVICE if fgd else "Lower the learning rate or clip the gradient"
            raise FloatingPointError(
                f"this step would write non-finite values (overflow) into orthogonal parameter(s) {', '.join(bad)} "
                f"or their optimizer state; it was not applied and nothing changed. {advice}"
            )
    if check_manifold:
        for i, dv in enumerate(dist_next_all):  # a non-finite prediction too (check_finite off: overflow)
            if not dv <= max_distance:
                finite_dv = math.isfinite(dv)
                where = f"‖θᵀθ − I‖_F = {dv:.4g} (computed before writing)" if finite_dv else "a non-finite distance"
                raise ValueError(
                    f"this step would move orthogonal parameter {labels[i]} to {where}, beyond "
                    f"max_distance={max_distance}; it was not applied and nothing changed. {_RESET_ADVICE}"
                )
    return [int(v) for v in values["guarded"]]


def _raise_if_off_manifold(
    dist_all: list[float],
    labels: Sequence[str],
    max_distance: float,
    *,
    only_non_finite: bool = False,
    carried: bool = False,
) -> None:
    for i, dv in enumerate(dist_all):
        if only_non_finite and math.isfinite(dv):  # (Inf too: an Inf entry makes ‖θᵀθ − I‖ Inf or NaN)
            continue
        if not dv <= max_distance:  # also catches NaN
            if not math.isfinite(dv):  # (θ with an Inf entry: ‖θᵀθ − I‖ is Inf or NaN)
                raise ValueError(
                    f"orthogonal parameter {labels[i]} is not finite (NaN or Inf entries); the step was not "
                    "applied. No projection recovers it: re-initialise it (e.g. torch.nn.init.orthogonal_(param)), "
                    "then call opt.reset_parameter(param), which also clears its momentum"
                )
            raise ValueError(
                f"orthogonal parameter {labels[i]} is ‖θᵀθ − I‖_F = {dv:.4g} from the Stiefel manifold (the "
                f"limit is max_distance={max_distance}; 2I − θᵀθ must approximate (θᵀθ)⁻¹); the step was not "
                "applied. Project it first with fgd_fast.orthogonalize_(param) (stiefel_param_groups does this "
                "for you), or call opt.reset_parameter(param), which also clears its momentum; "
                "check_manifold=False turns this check off"
                + (
                    ". With gram_refresh > 1, θᵀθ may be carried from the last step: a write to θ through "
                    "param.data since then is not seen (param.copy_ under torch.no_grad() is); call "
                    "fgd_fast.backends.carry.forget() after such a write"
                    if carried
                    else ""
                )
            )


def _raise_if_a_param_is_not_finite(params: Sequence[torch.Tensor], labels: Sequence[str], refused: list[int]):
    """A step refused as non-finite (layers ``refused``): where such a parameter itself has NaN/Inf
    entries, say that (the refusal's advice, a smaller lr or clipping, does not help then). Read
    on the refusal's path only: an ordinary step pays nothing for it."""
    for i in refused:
        if not bool(torch.isfinite(params[i].detach()).all()):
            raise ValueError(
                f"orthogonal parameter {labels[i]} is not finite (NaN or Inf entries); the step was not applied "
                "and nothing changed. No retraction recovers it: re-initialise it (e.g. "
                "torch.nn.init.orthogonal_(param)) and clear its state (opt.state[param].clear())"
            ) from None
