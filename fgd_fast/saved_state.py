"""Checks of a state_dict before ``load_state_dict`` installs it: its outline, each saved state
tensor (shape, floating, materialised, finite in the dtype it will have) and, with sharded
(DTensor) parameters, the ranks' agreement on the verdict. Each raises a ``ValueError`` with the
fix before anything is loaded."""

from __future__ import annotations

from typing import Any

import torch

from .backends import compute_dtype
from .distributed import is_dtensor


def state_dtype(p: torch.Tensor, group: dict[str, Any]) -> torch.dtype:
    """The dtype of ``p``'s floating state: float32 for a float16/bfloat16 orthogonal parameter,
    else the parameter's own."""
    return compute_dtype(p.dtype) if group["orthogonal"] else p.dtype


def check_saved_structure(state_dict: Any) -> None:
    """A state_dict's outline: a dict with a ``state`` dict of dicts and a ``param_groups`` list of
    dicts with ``params`` (else torch fails half-way through the load, or later, at a step)."""
    how = "; nothing was loaded. Pass what the optimizer's state_dict() returned (or torch.load of it)"
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
        got = f"keys {sorted(map(str, state_dict))}" if isinstance(state_dict, dict) else type(state_dict).__name__
        raise ValueError(
            f"cannot load this state_dict: expected a dict with 'state' and 'param_groups', got {got}{how}"
        )
    saved, groups = state_dict["state"], state_dict["param_groups"]
    if not isinstance(saved, dict):
        raise ValueError(f"cannot load this state_dict: its 'state' is a {type(saved).__name__}, expected a dict{how}")
    for key, entry in saved.items():
        if not isinstance(entry, dict):
            raise ValueError(
                f"cannot load this state_dict: state_dict['state'][{key!r}] is a {type(entry).__name__}, expected "
                f"a dict of that parameter's state{how}"
            )
    if not isinstance(groups, (list, tuple)) or not all(isinstance(g, dict) and "params" in g for g in groups):
        raise ValueError(
            f"cannot load this state_dict: its 'param_groups' must be a list of dicts, each with 'params'{how}"
        )


def check_saved_tensor(value: Any, p: torch.Tensor, text: str, name: str, dtype: torch.dtype) -> None:
    """A saved floating state tensor of ``p``: its shape, floating, materialised, finite in
    ``dtype``, the dtype it will have (``load_state_dict`` casts it to the parameter's dtype and
    device: a float32 buffer past 65504 would be Inf in a float16 one). A sharded (DTensor)
    value is checked on this rank's shard: the ranks agree on the verdict afterwards."""
    dense = isinstance(value, torch.Tensor) and value.layout == torch.strided
    if not dense or value.shape != p.shape or not value.is_floating_point():
        got = f"{tuple(value.shape)} {value.dtype}" if isinstance(value, torch.Tensor) else repr(value)
        got += f" ({value.layout})" if isinstance(value, torch.Tensor) and not dense else ""
        raise ValueError(
            f"cannot load this state_dict: parameter {text}'s {name} is {got}, expected a dense floating tensor of "
            f"shape {tuple(p.shape)}; was it saved for another model? Nothing was loaded"
        )
    local = value.to_local() if is_dtensor(value) else value
    if local.is_meta:
        raise ValueError(
            f"cannot load this state_dict: parameter {text}'s {name} is on the meta device (it holds no values); "
            "nothing was loaded. Load a state_dict with materialised tensors"
        )
    if not bool(torch.isfinite(local.detach().to(dtype)).all()):
        what = "has NaN/Inf values" if dtype == local.dtype else f"has NaN/Inf values once cast to {dtype}"
        raise ValueError(
            f"cannot load this state_dict: parameter {text}'s {name} {what}; nothing was loaded "
            "(drop that entry from state_dict['state'] to restart its momentum)"
        )


def agree_on_saved_state(failed: ValueError | None, params: list[torch.Tensor]) -> None:
    """Raise ``failed`` (this rank's verdict on the saved state); with sharded parameters, first
    agree with the other ranks of their meshes, so that every rank raises or none does (a rank
    that loaded while another refused would step with other state, or wait in its collectives)."""
    from .distributed import agree_on_local_checks, meshes_of

    meshes, mesh_device = meshes_of([p for p in params if is_dtensor(p)])
    if meshes:
        try:
            verdict = "the saved state passed the checks"
            agree_on_local_checks(failed is None, meshes, mesh_device, failed, what=verdict)
        except ValueError as error:
            if error is failed:
                raise
            raise ValueError(
                "cannot load this state_dict: another rank refused its shard of the saved state (its error names "
                "the parameter and the fix); nothing was loaded on any rank"
            ) from error
    if failed is not None:
        raise failed
