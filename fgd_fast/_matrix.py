"""The Stiefel matrix view of a parameter (one concern: shapes and views).

A parameter ``W`` of shape ``(c_o, *rest)`` is read as ``W2 = W.reshape(c_o, m)`` with
``m = prod(rest)``. Orthonormality is imposed along the smaller side, so the matrix the
algorithm sees is always ``θ`` of shape ``n × p`` with ``n >= p`` and target ``θᵀθ = I_p``:

* ``c_o <= m``: ``θ = W2ᵀ`` (``n = m``, ``p = c_o``; the rows of ``W2`` are orthonormal);
* ``c_o >  m``: ``θ = W2``  (``n = c_o``, ``p = m``; the columns of ``W2`` are orthonormal).
"""

from __future__ import annotations

import operator
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
    if not isinstance(shape, torch.Size) and not _is_shape(shape):  # (a torch.Size is one: SymInts too)
        raise TypeError(f"stiefel_shape expects a shape (a torch.Size or a tuple of ints >= 0), got {shape!r}")
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


def _is_shape(shape) -> bool:
    """Whether ``shape`` is a sequence of integers >= 0 (Python's, numpy's: anything ``__index__``)."""
    if isinstance(shape, (str, bytes)) or not isinstance(shape, (tuple, list)):
        return False
    return all(_is_dim(s) for s in shape)


def _is_dim(s) -> bool:
    if isinstance(s, bool):
        return False
    if isinstance(s, (int, torch.SymInt)):  # (a compiled step's SymInt compared as it is: no constant made of it)
        return s >= 0
    try:  # (numpy's integers, anything with __index__)
        return operator.index(s) >= 0
    except TypeError:
        return False


def as_stiefel(t: torch.Tensor) -> torch.Tensor:
    """``θ`` (``n × p``) for ``t``: a view when ``t``'s layout allows, else a copy.

    Writers must go through :func:`from_stiefel` + ``copy_`` rather than assume a view.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"as_stiefel expects a torch.Tensor, got {type(t).__name__}")
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
    if not isinstance(theta, torch.Tensor) or tuple(theta.shape) != (n, p):
        got = tuple(theta.shape) if isinstance(theta, torch.Tensor) else type(theta).__name__
        raise ValueError(
            f"from_stiefel: a weight of shape {tuple(shape)} holds θ of {n} × {p}, got {got}; pass "
            "as_stiefel(w)'s shape (stiefel_shape(w.shape) gives n, p)"
        )
    w2 = theta.t() if transposed else theta
    return w2.reshape(shape)
