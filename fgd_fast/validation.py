"""Argument validation: the host-side checks of what a caller passes (hyper-parameters,
options, parameters, gradients, state tensors), shared by every optimizer of the package.

(The step's own device-side guards, which look at what a step is about to write, live in
:mod:`fgd_fast.guards`.) Each helper raises a ``ValueError`` / ``TypeError`` whose message says how to fix the call.
They only read their arguments, so an optimizer can validate everything before it changes
anything.
"""

from __future__ import annotations

import math
import numbers
import os
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ._matrix import stiefel_shape

__all__ = [
    "check_real",
    "check_nonnegative",
    "check_unit_interval",
    "check_closed_unit_interval",
    "check_keys",
    "check_positive",
    "check_int_at_least",
    "check_bool",
    "check_choice",
    "check_nesterov",
    "check_fgd_momentum",
    "check_feedback",
    "check_dampening",
    "check_max_distance",
    "check_trust_radius",
    "check_orthogonal_params",
    "check_grad",
    "check_grad_fits",
    "check_lr",
    "check_state_tensor",
    "param_tensors",
    "ORTHOGONAL_DTYPES",
]


#: the dtypes an orthogonal parameter may have (its step computes in float32 or float64)
ORTHOGONAL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_real(name: str, value: Any) -> float:
    """``value`` as a finite Python float.

    Accepted: every ``numbers.Real`` (int, float, ``fractions.Fraction``, numpy scalars such as
    ``np.float32`` / ``np.int64``) and, as ``torch.optim`` does for ``lr``, a one-element real
    tensor on the CPU. Refused: bools (``True`` is an int, but never a hyper-parameter) and
    tensors elsewhere (reading one would synchronise with the device)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool or value.device.type != "cpu":
            raise TypeError(
                f"{name} as a tensor must hold one real number on the CPU, got {tuple(value.shape)} {value.dtype} "
                f"on {value.device}; pass a Python float"
            )
        value = value.item()
    if isinstance(value, bool) or is_numpy_bool(value) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name} must be a real number (int, float or a numpy scalar), got {type(value).__name__}: {value!r}"
        )
    value = float(value)
    if not -math.inf < value < math.inf:  # not NaN or ±Inf (math.isfinite cannot take a compiled step's SymFloat)
        raise ValueError(f"{name} must be finite, got {value}; check the schedule or configuration that produced it")
    return value


def check_lr(value: Any) -> float | torch.Tensor:
    """``lr``: a real number ≥ 0 (as :func:`check_nonnegative`), or a one-element floating tensor
    on any device, kept as it is (a scheduler may change it in place; backends that can read it
    on the device do, so a captured step sees the change). A tensor's value is checked where
    reading it costs nothing (on the CPU, outside ``torch.compile``); on a GPU only its shape and
    dtype (a read would synchronise every step). At most float32's largest value: the fused
    backends compute η·g in float32, where a larger η is Inf."""
    if not isinstance(value, torch.Tensor):
        return _check_lr_value(value)
    if value.numel() != 1 or not value.is_floating_point() or value.is_meta:
        raise TypeError(
            f"lr as a tensor must hold one floating-point number, got {tuple(value.shape)} {value.dtype} on "
            f"{value.device}; "
            "pass e.g. torch.tensor(0.01) (on the parameters' device for a captured step)"
        )
    if value.device.type == "cpu" and not torch.compiler.is_compiling():  # (a compiled step reads no tensor)
        _check_lr_value(float(value))
    return value


_FLOAT32_MAX = torch.finfo(torch.float32).max


def _check_lr_value(value: Any) -> float:
    value = check_nonnegative("lr", value)
    if value > _FLOAT32_MAX:
        raise ValueError(
            f"invalid lr={value}: beyond float32's range (3.4e38), in which the fused backends compute η·g "
            "(it would be Inf); pass a smaller lr"
        )
    return value


def check_nonnegative(name: str, value: Any) -> float:
    value = check_real(name, value)
    if value < 0.0:
        fix = "to ascend the objective, pass maximize=True" if name == "lr" else f"e.g. {name}=0.0 to disable it"
        raise ValueError(f"invalid {name}={value}: it must be >= 0 ({fix})")
    return value


def check_unit_interval(name: str, value: Any, hint: str = "") -> float:
    """``0 <= value < 1``."""
    value = check_real(name, value)
    if not 0.0 <= value < 1.0:
        extra = f" ({hint})" if hint else ""
        raise ValueError(f"invalid {name}={value}: it must lie in [0, 1){extra}")
    return value


def check_closed_unit_interval(name: str, value: Any, hint: str = "") -> float:
    """``0 <= value <= 1``."""
    value = check_real(name, value)
    if not 0.0 <= value <= 1.0:
        extra = f" ({hint})" if hint else ""
        raise ValueError(f"invalid {name}={value}: it must lie in [0, 1]{extra}")
    return value


def check_positive(name: str, value: Any, hint: str = "") -> float:
    """``value > 0`` (a finite real number)."""
    value = check_real(name, value)
    if not value > 0.0:
        extra = f" ({hint})" if hint else ""
        raise ValueError(f"invalid {name}={value}: it must be > 0{extra}")
    return value


def check_max_distance(value: Any) -> float:
    """``max_distance`` in (0, 1): the limit of the manifold check and the guard's target."""
    value = check_real("max_distance", value)
    if not 0.0 < value < 1.0:
        raise ValueError(
            f"invalid max_distance={value}: it must lie in (0, 1), inside the radius of the "
            "Neumann series 2I − θᵀθ ≈ (θᵀθ)⁻¹ (0.5 is the default)"
        )
    return value


def check_trust_radius(value: Any) -> float:
    """``trust_radius`` ρ > 0: the guard's safety radius on ``‖Φ‖_F + η‖g‖_F``."""
    return check_positive("trust_radius", value, "the guard's safety radius on ‖Φ‖ + η‖g‖; 4 is the default")


def check_int_at_least(name: str, value: Any, minimum: int, hint: str = "") -> int:
    """``value`` is a Python int (not a bool, not a float) with ``value >= minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}: {value!r}; pass a Python int")
    if value < minimum:
        extra = f" ({hint})" if hint else ""
        raise ValueError(f"invalid {name}={value}: it must be an int >= {minimum}{extra}")
    return value


def check_keys(group: dict, names: Iterable[str]) -> None:
    """Every key of ``names`` is in ``group`` (a ``ValueError`` names the missing ones)."""
    missing = [k for k in names if k not in group]
    if missing:
        raise ValueError(
            f"the parameter group has no {', '.join(map(repr, missing))}; a group gets every key from the optimizer's "
            "defaults when it is added, so put the key(s) back (e.g. group[key] = opt.defaults[key])"
        )


def is_numpy_bool(value: Any) -> bool:
    """Whether ``value`` is numpy's bool (``numpy.bool_``, named ``bool`` from numpy 2 on),
    without importing numpy."""
    kind = type(value)
    return kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_")


def check_bool(name: str, value: Any) -> bool:
    if is_numpy_bool(value):  # (as torch.optim takes it)
        value = bool(value)
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__}: {value!r}")
    return value


def check_choice(name: str, value: Any, choices: Iterable[str]) -> str:
    choices = tuple(choices)
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"unknown {name}={value!r}: choose one of {', '.join(map(repr, choices))}")
    return value


def param_tensors(params: Any) -> list[torch.Tensor]:
    """The tensors of a ``params`` entry (a tensor, or a list of tensors / (name, tensor))."""
    if isinstance(params, torch.Tensor):
        return [params]
    return [p[1] if isinstance(p, tuple) else p for p in params]


def check_writable(
    params: Iterable[torch.Tensor], labels: list[str] | None = None, *, inside_inference_mode: bool = False
) -> None:
    """Every parameter can be written in place by a step: no two of its entries share memory (a
    tensor made by ``expand()``, say) and it is no inference tensor (made inside
    ``torch.inference_mode``), which an in-place update outside the mode refuses — in the middle
    of a step, after other parameters were written (the failed-step contract), so it is refused
    when added and at the step. ``inside_inference_mode``: the caller writes in the current mode
    (the functional step), where an inference tensor can be written inside the mode."""
    inference_ok = inside_inference_mode and torch.is_inference_mode_enabled()
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            continue
        what = labels[i] if labels is not None else f"parameter {i} of the group"
        if p.layout != torch.strided:
            raise ValueError(
                f"{what} is a sparse tensor ({p.layout}), which no step of fgd_fast updates; use a dense "
                "parameter (nn.Parameter(t.to_dense()))"
            )
        if torch._debug_has_internal_overlap(p) == 1:  # 1: overlap for sure
            raise ValueError(
                f"{what} (shape {tuple(p.shape)}, strides {p.stride()}) has entries that share "
                "memory (e.g. made by expand()), so no in-place update can write it; give it memory of its own, "
                "e.g. nn.Parameter(t.clone())"
            )
        if p.is_inference() and not inference_ok:
            raise ValueError(
                f"{what} is an inference tensor (made inside torch.inference_mode), which a step outside that mode "
                "(the optimizers' steps always are) cannot update in place; make the model outside inference_mode, "
                "or give it an ordinary copy made outside it (nn.Parameter(t.clone()))"
            )


def check_no_shared_memory(
    tensors: list[torch.Tensor],
    labels: list[str] | Callable[[int], str],
    guarded: list[bool],
    outcome: str = "the step was not applied and nothing changed",
    read_only: list[bool] | None = None,
) -> None:
    """No two of ``tensors`` (plain tensors) share memory where one of them is ``guarded`` (an
    orthogonal parameter or its state): two Parameters made from one tensor, a momentum buffer set
    to its parameter's memory or to another layer's. A step would write such memory twice, each
    update over the other's, and the guard's prediction (made for each tensor alone) would not
    hold: θ was stored beyond ``max_distance``. ``read_only`` marks tensors the step reads only
    (gradients): two of them may share memory; one sharing a written tensor's would be read after
    that write by some backends (the torch backend writes a layer before reading the next one's
    gradient), so the step would depend on the backend's order. Costs a storage lookup per tensor
    where no two share a storage; where two do (views of one flat buffer), their spans, then their
    entries."""
    first: dict[int, int] = {}
    shared: dict[int, list[int]] = {}
    for i, t in enumerate(tensors):  # (a storage's address alone: ~0.1 µs a tensor, where t.device costs 0.3)
        at = t.untyped_storage().data_ptr()
        if at == 0:  # (no memory: the meta device, an empty tensor)
            continue
        if at in first:
            shared.setdefault(at, [first[at]]).append(i)
        else:
            first[at] = i
    for idx in shared.values():
        if read_only is not None and all(read_only[i] for i in idx):  # (gradients alone: a DDP bucket's views)
            continue
        spans = sorted((_span(tensors[i]), i) for i in idx if tensors[i].numel())
        for a, ((_, end), i) in enumerate(spans):
            for (start, _), j in spans[a + 1 :]:
                if start >= end:  # (sorted by start: no later span reaches this one)
                    break
                read = (read_only[i], read_only[j]) if read_only is not None else (False, False)
                if read == (True, True) or not (guarded[i] or guarded[j]) or not _overlap(tensors[i], tensors[j]):
                    continue
                first, second = sorted((i, j))
                name = labels if callable(labels) else labels.__getitem__
                if any(read):  # a gradient and a tensor the step writes
                    grad, other = (i, j) if read[0] else (j, i)
                    raise ValueError(
                        f"{name(grad)} shares memory with {name(other)}, which the step writes: the step would "
                        f"read the gradient after part of that write (the result would depend on the backend); "
                        f"{outcome}. Give the gradient its own memory (p.grad = p.grad.clone())"
                    )
                raise ValueError(
                    f"{name(first)} and {name(second)} share memory, so a step would write it twice, each "
                    f"update over the other's, and leave the Stiefel manifold; {outcome}. Give each its own "
                    "memory: nn.Parameter(t.clone()) for a parameter, "
                    "opt.state[param]['momentum_buffer'] = buf.clone() for a buffer"
                )


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``[start, end)`` a (non-empty) tensor's entries lie in."""
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + extent * t.element_size()


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one storage whose spans meet have an entry in common (interleaved
    views, e.g. the even and odd columns of one matrix, do not); of other entry sizes: yes."""
    if a.element_size() != b.element_size():
        return True

    def offsets(t: torch.Tensor) -> torch.Tensor:  # each entry's place in the storage, in entries
        at = torch.tensor(t.storage_offset())
        for size, stride in zip(t.shape, t.stride()):
            at = at.unsqueeze(-1) + torch.arange(size) * stride
        return at.flatten()

    return bool(torch.isin(offsets(a), offsets(b)).any())


def check_fgd_momentum(value: Any) -> float:
    """FGD's β in [0, 1) (the paper's γ = 1 − β must be positive)."""
    return check_unit_interval("momentum", value, "the paper's γ = 1 − momentum must be positive; e.g. 0.9")


def check_feedback(value: Any) -> float:
    """FGD's α in [0, 1)."""
    return check_unit_interval("feedback", value, "0.3–0.5 is typical; 0.5 cancels first-order drift")


def check_dampening(value: Any) -> float:
    """SGD's τ in [0, 1], as ``torch.optim.SGD`` takes it."""
    return check_closed_unit_interval("dampening", value, "as torch.optim.SGD's: 0 is no dampening")


def check_nesterov(nesterov: Any, momentum: float, dampening: float, at_step: bool = False) -> bool:
    """``nesterov`` as a bool, refused (as ``torch.optim.SGD``'s constructor does) without
    momentum or with dampening. ``at_step``: the check of a step, where momentum 0 is accepted
    (a schedule that takes momentum to 0, e.g. ``OneCycleLR(base_momentum=0)``: torch's SGD then
    steps without momentum, so Nesterov has nothing to act on)."""
    check_bool("nesterov", nesterov)
    if nesterov and ((momentum <= 0 and not (at_step and momentum == 0)) or dampening != 0):
        raise ValueError(
            f"nesterov=True requires momentum > 0 and dampening=0 (as in torch.optim.SGD), got momentum={momentum}, "
            f"dampening={dampening}: set momentum (e.g. 0.9) and dampening=0, or nesterov=False"
        )
    return nesterov


def check_orthogonal_params(params: Iterable[torch.Tensor], names: list[str] | None = None) -> None:
    """Every Stiefel-constrained parameter must be a real floating tensor with >= 2 dims, listed
    once (twice, it would be stepped twice per step, off the manifold: torch.optim only warns)."""
    first: dict[int, str] = {}
    for i, p in enumerate(params):
        label = names[i] if names else f"parameter {i} of the group"
        if not isinstance(p, torch.Tensor):
            continue  # torch.optim reports non-tensors itself
        if id(p) in first:
            raise ValueError(
                f"orthogonal {label} is the same tensor as {first[id(p)]}: listed twice, it would be stepped "
                "twice in every step and leave the Stiefel manifold; list each parameter once"
            )
        first[id(p)] = label
        if p.dim() < 2:
            raise ValueError(
                f"orthogonal {label} has shape {tuple(p.shape)}: a Stiefel constraint needs at "
                "least 2 dims; move it to a group without orthogonal=True"
            )
        if p.dtype not in ORTHOGONAL_DTYPES:
            raise ValueError(
                f"orthogonal {label} has dtype {p.dtype}: only real floating-point parameters (float16, bfloat16, "
                "float32, float64) can be orthogonal; cast it (e.g. param.data = param.data.float()) or move it "
                "to a group without orthogonal=True"
            )
        stiefel_shape(p.shape)


def entries_share_memory(t: torch.Tensor) -> bool:
    """Whether two entries of state tensor ``t`` lie at one address (made by ``expand()``, say)."""
    return torch._debug_has_internal_overlap(t) == 1  # (1: for sure; 2: too hard to tell, as torch's own)


def check_state_tensor(
    value: Any, p: torch.Tensor, dtype: torch.dtype, label: str, name: str, shape: tuple | None = None
) -> None:
    """A state tensor of ``p`` must have its shape (or ``shape``: the guard's two counters),
    ``dtype`` and its device (e.g. after ``load_state_dict`` from another model, or a model moved
    after a step), and, outside ``torch.inference_mode``, be no inference tensor (a step outside
    the mode cannot update one in place)."""
    shape = p.shape if shape is None else torch.Size(shape)
    fits = isinstance(value, torch.Tensor) and (value.shape, value.dtype, value.device) == (shape, dtype, p.device)
    inside = torch.compiler.is_compiling() or torch.is_inference_mode_enabled()  # (inside, it can be written)
    if fits and not inside and value.is_inference():
        raise ValueError(
            f"{label}: {name} is an inference tensor (made inside torch.inference_mode), which a step outside that "
            f"mode (FGD's step always is) cannot update in place; the step was not applied and nothing changed. "
            f"Give it an ordinary copy made outside the mode (opt.state[param][{name!r}] = "
            f"opt.state[param][{name!r}].clone()) before stepping, or drop it (opt.state[param].pop({name!r}))"
        )
    if fits and not torch.compiler.is_compiling() and entries_share_memory(value):
        raise ValueError(
            f"{label}: {name} (strides {value.stride()}) has entries that share memory (e.g. made by expand()), "
            "which no in-place update can write; the step was not applied and nothing changed. Give it memory of "
            f"its own (opt.state[param][{name!r}] = opt.state[param][{name!r}].clone())"
        )
    if not fits:
        got = (
            f"{tuple(value.shape)} {value.dtype} on {value.device}" if isinstance(value, torch.Tensor) else repr(value)
        )
        same_shape = isinstance(value, torch.Tensor) and value.shape == shape
        keep = (
            f"move or cast the entry with it, which keeps it (opt.state[param][{name!r}] = "
            f"opt.state[param][{name!r}].to(device={str(p.device)!r}, dtype={dtype})), or drop it"
            if same_shape
            else "drop the entry"
        )
        raise ValueError(
            f"{label}: {name} is {got}, expected {tuple(shape)} {dtype} on {p.device}; the step was not applied "
            f"and nothing changed. If the model was moved or cast (model.to(...), .double()) after the optimizer "
            f"stepped, {keep} (opt.state[param].pop({name!r})), or move or cast the model before building the "
            "optimizer; if this state was loaded, it belongs to another model"
        )


def check_grad(p: torch.Tensor, label: str) -> None:
    """Refuse gradients no optimizer of this package can use."""
    g = p.grad
    if g is None:
        return
    if g.is_sparse or g.layout != torch.strided:
        raise ValueError(
            f"{label} has a sparse gradient ({g.layout}); fgd_fast optimizers need dense "
            "gradients (use a dense embedding, or torch.optim.SparseAdam for that parameter)"
        )
    if p.is_complex():
        raise ValueError(
            f"{label} is complex ({p.dtype}); fgd_fast optimizers support real parameters only "
            "(split it with torch.view_as_real)"
        )
    if g.is_complex():
        raise ValueError(
            f"{label}'s gradient is complex ({g.dtype}) but the parameter is {p.dtype}; gradients must be real, "
            "of the parameter's dtype (set .grad to a real tensor, e.g. its real part)"
        )
    if not p.is_floating_point():  # (torch's SGD raises too, but only after the parameters before it were written)
        raise ValueError(
            f"{label} is {p.dtype} and has a gradient; fgd_fast optimizers step floating-point parameters only "
            "(leave it out of the optimizer's groups, or make it a float tensor)"
        )
    check_grad_fits(
        p,
        g,
        label,
        "after changing a parameter's dtype, device or shape set its .grad to None (opt.zero_grad()) and run "
        "backward again",
    )


def check_grad_fits(p: torch.Tensor, g: torch.Tensor, label: str, fix: str) -> None:
    """The gradient ``g`` has ``p``'s shape, dtype and device."""
    if g.shape != p.shape or g.dtype != p.dtype or g.device != p.device:
        raise ValueError(
            f"{label}: gradient {tuple(g.shape)} {g.dtype} on {g.device} does not match the parameter "
            f"{tuple(p.shape)} {p.dtype} on {p.device}; {fix}"
        )


_OURS = (os.path.dirname(os.path.abspath(__file__)), os.path.join("torch", "optim"), os.path.join("torch", "utils"))


def user_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` issued by the caller of this function that
    points at the user's line: the first frame outside this package and torch's optimizer
    machinery (``Optimizer.__init__``, the step hooks' wrappers)."""
    frame, level = sys._getframe(2), 2  # the frame that called the function warning
    while frame is not None and any(part in os.path.abspath(frame.f_code.co_filename) for part in _OURS):
        frame, level = frame.f_back, level + 1
    return level
