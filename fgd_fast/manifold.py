"""Projection onto, and distance from, the Stiefel manifold St(n, p) = {θ : θᵀθ = I_p}."""

from __future__ import annotations

import torch

from ._matrix import as_stiefel, from_stiefel
from .distributed import full_value, gram64, is_dtensor, write_shard
from .validation import check_writable

__all__ = ["orthogonalize_", "sign_fixed_q", "stiefel_distance"]


@torch.no_grad()
def orthogonalize_(tensor: torch.Tensor) -> torch.Tensor:
    """Project ``tensor`` onto the Stiefel manifold in place and return it.

    With ``θ`` the ``n × p`` matrix view of the tensor (orthonormal along the smaller side
    of ``tensor.reshape(c_o, -1)``, see :mod:`fgd_fast._matrix`) and ``θ = QR`` its reduced
    QR factorisation, ``θ ← Q·diag(sign(diag R))`` (``sign(0) := 1``). The sign fix makes the
    result unique and continuous in ``θ`` and keeps an already orthonormal ``θ`` unchanged
    (up to rounding). The QR runs in float64 whatever the tensor's dtype; only the stored
    tensor is rounded.

    A DTensor (FSDP2 parameter) is gathered, projected whole (every rank computes the same
    Q) and each rank keeps its own shard: a collective, call it on every rank.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"orthogonalize_ expects a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_floating_point():
        raise ValueError(
            f"orthogonalize_ needs a real floating-point tensor, got {tensor.dtype}; convert it first (e.g. t.float())"
        )
    if tensor.dim() < 2:
        raise ValueError(
            f"orthogonalize_ needs a tensor with at least 2 dims (a matrix, or a weight viewed as "
            f"(c_o, -1)), got shape {tuple(tensor.shape)}"
        )
    check_materialised(tensor, "orthogonalize_")
    check_writable([tensor], ["orthogonalize_'s tensor"], inside_inference_mode=True)  # (sparse, expand()ed)
    if tensor.numel() == 0:
        return tensor
    if is_dtensor(tensor):
        write_shard(tensor, orthogonalize_(full_value(tensor).clone()))
        return tensor
    theta = as_stiefel(tensor).to(torch.float64)
    if not bool(torch.isfinite(theta).all()):  # a QR of NaN/Inf is NaN: nothing to project
        raise ValueError(
            "orthogonalize_ got a tensor with NaN or Inf entries, which no projection can recover; "
            "re-initialise it (e.g. torch.nn.init.orthogonal_(param)), then call opt.reset_parameter(param) "
            "to clear its momentum"
        )
    q = sign_fixed_q(theta)
    tensor.copy_(from_stiefel(q, tensor.shape))
    return tensor


def check_materialised(tensor: torch.Tensor, who: str) -> None:
    """A tensor on the meta device holds no values to project or measure: say what to do."""
    if tensor.device.type == "meta":
        raise ValueError(
            f"{who} got a tensor on the meta device, which holds no values; materialise the model first "
            "(model.to_empty(device=...), then initialise its weights), then build the param groups and the "
            "optimizer from it (to_empty makes new parameters: groups made before it hold the meta ones)"
        )


def sign_fixed_q(theta: torch.Tensor) -> torch.Tensor:
    """``Q·diag(sign(diag R))`` (``sign(0) := 1``) of the reduced QR factorisation ``θ = QR``
    of an ``n × p`` matrix or a batch of them, in ``θ``'s dtype."""
    q, r = torch.linalg.qr(theta, mode="reduced")
    sign = torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))
    sign = torch.where(sign == 0, torch.ones_like(sign), sign)
    return q * sign.unsqueeze(-2)  # scales column j of Q by sign(R_jj)


@torch.no_grad()
def stiefel_distance(tensor: torch.Tensor) -> float:
    """``‖θᵀθ − I‖_F`` for the ``n × p`` matrix view ``θ`` of ``tensor``, in float64.

    This is the paper's stability metric; FGD keeps it near the rounding floor of the
    parameter's dtype (≈1e-6 for float32). For a DTensor it is the full matrix's distance
    (partial Grams of the local rows and one all-reduce; a collective, call it on every rank).
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"stiefel_distance expects a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() < 2:
        raise ValueError(
            f"stiefel_distance needs a tensor with at least 2 dims (a matrix, or a weight viewed as "
            f"(c_o, -1)), got shape {tuple(tensor.shape)}"
        )
    if not tensor.is_floating_point() or tensor.layout != torch.strided:
        raise ValueError(
            f"stiefel_distance needs a dense real floating-point tensor, got {tensor.dtype} ({tensor.layout}); "
            "convert it first (e.g. t.to_dense().float())"
        )
    check_materialised(tensor, "stiefel_distance")
    gram = gram64(tensor.detach())
    gram.diagonal().sub_(1.0)
    return float(torch.linalg.matrix_norm(gram, "fro"))
