"""The Stiefel matrix view of a parameter (one concern: shapes and views).

A parameter ``W`` of shape ``(c_o, *rest)`` is read as ``W2 = W.reshape(c_o, m)`` with
``m = prod(rest)``. Orthonormality is imposed along the smaller side, so the matrix the
algorithm sees is always ``θ`` of shape ``n × p`` with ``n >= p`` and target ``θᵀθ = I_p``:

* ``c_o <= m``: ``θ = W2ᵀ`` (``n = m``, ``p = c_o``; the rows of ``W2`` are orthonormal);
* ``c_o >  m``: ``θ = W2``  (``n = c_o``, ``p = m``; the columns of ``W2`` are orthonormal).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["StiefelShape", "stiefel_shape", "as_stiefel", "as_w2", "from_stiefel"]


class StiefelShape(NamedTuple):
    """``n × p`` of ``θ`` and whether ``θ = W2ᵀ`` (``transposed``)."""

    n: int
    p: int
    transposed: bool


def stiefel_shape(shape: torch.Size | tuple[int, ...]) -> StiefelShape:
    """Return ``(n, p, transposed)`` for a parameter of ``shape`` (at least 2-D)."""
    if len(shape) < 2:
        raise ValueError(
            f"a Stiefel-constrained parameter needs at least 2 dims, got shape {tuple(shape)}; "
            "put 0-D/1-D parameters (biases, norms) in a group without orthogonal=True"
        )
    c_o = int(shape[0])
    m = 1
    for s in shape[1:]:
        m *= int(s)
    if c_o <= m:
        return StiefelShape(m, c_o, True)
    return StiefelShape(c_o, m, False)


def as_stiefel(t: torch.Tensor) -> torch.Tensor:
    """``θ`` (``n × p``) for ``t``: a view when ``t``'s layout allows, else a copy.

    Writers must go through :func:`from_stiefel` + ``copy_`` rather than assume a view.
    """
    n, p, transposed = stiefel_shape(t.shape)
    w2 = t.reshape(t.shape[0], n if transposed else p)  # explicit: a 0-size -1 is ambiguous
    return w2.t() if transposed else w2


def as_w2(t: torch.Tensor) -> torch.Tensor:
    """``W2 = t.reshape(c_o, -1)``, the memory order of ``t``: the rows ``θᵀ`` when
    ``θ = W2ᵀ``, else ``θ`` itself; a view when possible (the layout batched code stacks)."""
    return t.reshape(t.shape[0], -1)


def from_stiefel(theta: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """Inverse of :func:`as_stiefel`: a tensor of ``shape`` holding ``theta`` (``n × p``), e.g.
    ``w.copy_(fgd_fast.from_stiefel(theta, w.shape))`` writes θ back into the weight ``w``."""
    n, p, transposed = stiefel_shape(shape)
    w2 = theta.t() if transposed else theta
    return w2.reshape(shape)
