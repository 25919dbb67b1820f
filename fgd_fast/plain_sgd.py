"""The step of the parameters without a Stiefel constraint: ``torch.optim.SGD``'s update, through
torch's own functional SGD, with a tensor lr read on the device where torch's fused kernel can
take it (:func:`sgd`). FGD's plain groups and the baselines' Euclidean groups step here."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.optim.sgd import sgd as _torch_sgd

from .distributed import is_dtensor

__all__ = ["sgd"]


def sgd(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    momentum_buffers: list[torch.Tensor | None],
    *,
    lr: float | torch.Tensor,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    maximize: bool = False,
) -> None:
    """``torch.optim.SGD``'s update, for the parameters without a Stiefel constraint: torch's
    own functional SGD (``torch.optim.sgd.sgd``, so its multi-tensor grouping and options).

    d ← ±g + λθ (−g with ``maximize``);  b ← μb + (1 − τ)d (b = d on the first step);
    d ← d + μb (Nesterov) or b;  θ ← θ − η d. New buffers are stored into ``momentum_buffers``.

    ``params``/``grads``: the weights and their gradients; ``momentum_buffers[i]``: b of
    ``params[i]`` or ``None``; ``lr`` η, ``momentum`` μ, ``dampening`` τ, ``weight_decay`` λ,
    ``nesterov``, ``maximize``: as ``torch.optim.SGD`` takes them (checked by ``FGD``, not here).
    ``lr`` may be a one-element tensor: a float32 one on a GPU, beside plain dense tensors on its
    device, is read there by torch's fused SGD kernel (no host synchronisation, so a captured step
    reads each new value; torch's multi-tensor SGD would read it on the host); elsewhere its value
    is used.
    """
    if not params:
        return
    kinds = {is_dtensor(p) for p in params}
    options = dict(weight_decay=weight_decay, momentum=momentum, dampening=dampening, nesterov=nesterov)
    if isinstance(lr, torch.Tensor):
        if _fused_reads(lr, params, grads, momentum_buffers, momentum):
            # η read on the device: d as above, θ ← θ − η d in one kernel per dtype
            _torch_sgd(params, grads, momentum_buffers, fused=True, lr=lr, maximize=maximize, **options)
            return
        lr = float(lr)  # (a host read: free on the CPU; else where the fused kernel cannot take the tensors)
    # (CUDA's multi-tensor kernels refuse DTensor and Tensor mixed)
    foreach = False if len(kinds) > 1 else None
    _torch_sgd(params, grads, momentum_buffers, foreach=foreach, lr=lr, maximize=maximize, **options)


#: where a plain group's tensor lr goes to torch's fused SGD rather than a host read (a CPU's read
#: is free; tests add "cpu" to run that path here)
_FUSED_LR_DEVICES = ("cuda",)


def _fused_reads(
    lr: torch.Tensor,
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    momentum_buffers: Sequence[torch.Tensor | None],
    momentum: float,
) -> bool:
    """Whether torch's fused SGD can take ``lr`` on the device: a one-element float32 GPU tensor
    (its CUDA kernel reads a ``float``), outside a compiled step (whose trace reads it), over what
    its CUDA kernel takes (it refuses the rest with an error, not a slower path): dense plain
    tensors on the lr's device, each gradient (and momentum buffer) of its parameter's dtype and
    strides, and with momentum, buffers all made or all to be made (its first step makes every
    buffer: a group where some parameter gets its first gradient later mixes them)."""
    if lr.device.type not in _FUSED_LR_DEVICES or lr.dtype != torch.float32 or lr.numel() != 1:
        return False
    if torch.compiler.is_compiling():
        return False
    if momentum != 0 and len({b is None for b in momentum_buffers}) > 1:
        return False

    def fits(p: torch.Tensor, t: torch.Tensor | None) -> bool:
        return t is None or (
            not is_dtensor(t)
            and t.layout == torch.strided
            and t.device == lr.device
            and t.dtype == p.dtype
            and t.stride() == p.stride()
        )

    return all(
        not is_dtensor(p)
        and p.layout == torch.strided
        and p.device == lr.device
        and p.dtype.is_floating_point
        and _dense(p)
        and fits(p, g)
        and g is not None
        and fits(p, b if momentum != 0 else None)
        for p, g, b in zip(params, grads, momentum_buffers)
    )


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s entries fill its memory span exactly once (contiguous in some order of its
    dims: channels_last too), as torch's fused kernels ask of every tensor."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True
