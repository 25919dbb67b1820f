"""Step-time safety checks read from device flags with one host synchronisation.

Every backend computes, for each orthogonal layer in its batch, ``dist = ‖θᵀθ − I‖_F`` (from
the Gram block ``A`` it needs anyway) and, when asked, whether the gradient is finite. The
functional entry point gathers those device tensors, reads them **once**, and raises before
any backend writes a parameter or a state tensor, so a failing step changes nothing.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["MAX_DISTANCE", "raise_if_invalid"]

#: Default limit on ‖θᵀθ − I‖_F. The truncated Neumann series 2I − θᵀθ approximates
#: (θᵀθ)⁻¹ with error ‖(I − θᵀθ)²‖, which stops being small well before the series'
#: radius ‖I − θᵀθ‖ < 1; 0.5 catches an un-projected initialisation (distance ~√p or more)
#: while leaving room for the transients of aggressive settings.
MAX_DISTANCE = 0.5


def raise_if_invalid(
    dist: Sequence[torch.Tensor],
    finite: Sequence[torch.Tensor | None],
    index: Sequence[Sequence[int]],
    labels: Sequence[str],
    *,
    check_finite: bool,
    check_manifold: bool,
    max_distance: float = MAX_DISTANCE,
) -> None:
    """Raise if any layer failed a check.

    ``dist[k]``/``finite[k]`` are per-layer device tensors of one backend call whose layers
    are ``index[k]`` (positions into ``labels``). One ``.tolist()`` per device.
    """
    if not (check_finite or check_manifold) or not labels:
        return
    dist_all = [0.0] * len(labels)  # layers in no batch (zero-size) are trivially on the manifold
    fin_all = [True] * len(labels)
    by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor | None, Sequence[int]]]] = {}
    for d, f, idx in zip(dist, finite, index):
        by_device.setdefault(d.device, []).append((d, f, idx))
    for items in by_device.values():
        parts = [d.to(torch.float64).reshape(-1) for d, _, _ in items]
        parts += [
            (f if f is not None else torch.ones_like(d, dtype=torch.bool)).to(torch.float64).reshape(-1)
            for d, f, _ in items
        ]
        values = torch.cat(parts).tolist()  # the one host synchronisation of a step
        n_layers = sum(len(idx) for _, _, idx in items)
        dists, fins = values[:n_layers], values[n_layers:]
        flat_idx = [i for _, _, idx in items for i in idx]
        for i, dv, fv in zip(flat_idx, dists, fins):
            dist_all[i], fin_all[i] = dv, fv != 0.0
    if check_manifold:  # a non-finite parameter first: fused backends' finite flags see it too (θᵀg)
        _raise_if_off_manifold(dist_all, labels, max_distance, only_non_finite=True)
    if check_finite:
        bad = [labels[i] for i, ok in enumerate(fin_all) if not ok]
        if bad:
            raise FloatingPointError(
                f"non-finite gradient (NaN or Inf) for orthogonal parameter(s) {', '.join(bad)}; "
                "the step was not applied and no parameter or state changed. Skip this step "
                "(torch.amp.GradScaler does) or find the overflow; check_finite=False turns "
                "this check off"
            )
    if check_manifold:
        _raise_if_off_manifold(dist_all, labels, max_distance)


def _raise_if_off_manifold(
    dist_all: list[float], labels: Sequence[str], max_distance: float, *, only_non_finite: bool = False
) -> None:
    for i, dv in enumerate(dist_all):
        if only_non_finite and dv == dv:
            continue
        if not dv <= max_distance:  # also catches NaN
            what = "is not finite" if dv != dv else f"is ‖θᵀθ − I‖_F = {dv:.4g} from the Stiefel manifold"
            raise ValueError(
                f"orthogonal parameter {labels[i]} {what} (the limit is max_distance={max_distance};  "
                "2I − θᵀθ must approximate (θᵀθ)⁻¹); the step was not applied. Project it "
                "first with fgd_fast.orthogonalize_(param) (stiefel_param_groups does this "
                "for you); check_manifold=False turns this check off"
            )
