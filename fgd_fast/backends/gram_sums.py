"""Gram blocks summed over the ranks, for the torch backend's row shards.

Each rank holds some rows of a layer, so its Gram blocks are partial sums; the step's middle
needs their sums. :class:`OverlappedSums` sends the pending blocks as soon as they fill a bucket
of ``reduce.bucket_bytes`` and lets the next Grams be computed while they travel;
:func:`reduce_packed` packs the symmetric blocks (A, C and the guard's velocity Gram) as their
upper triangles.
"""

from __future__ import annotations

import torch


class OverlappedSums:
    """Sums Gram blocks over the ranks as they are made: the pending blocks go out in one
    ``reduce`` call once they hold ``reduce.bucket_bytes`` (when the reducer has it; else all in
    one call at the end), and the next Grams are computed while they travel (the reducer may
    return a ``wait`` callable: an asynchronous collective). :meth:`finish` sends the rest (and
    ``extra``) and waits for every call. The calls depend only on the blocks' sizes, so every
    rank makes the same ones."""

    def __init__(self, reduce):
        self.reduce, self.limit = reduce, getattr(reduce, "bucket_bytes", None)
        self.pending: list = []
        self.bytes = 0
        self.waits: list = []

    def add(self, blocks: list[torch.Tensor], sym_slots: tuple[int, ...]) -> None:
        self.pending.append((blocks, sym_slots))
        self.bytes += sum(b.nbytes for b in blocks)
        if self.limit is not None and self.bytes >= self.limit:
            self._send([])

    def _send(self, extra: list[torch.Tensor]) -> None:
        self.waits.append(reduce_packed(self.reduce, self.pending, extra))
        self.pending, self.bytes = [], 0

    def finish(self, extra: list[torch.Tensor]) -> None:
        if self.pending or extra or not self.waits:  # (at least one call: every rank makes it)
            self._send(extra)
        for wait in self.waits:
            wait()


def reduce_packed(reduce, chunks: list[tuple[list[torch.Tensor], tuple[int, ...]]], extra: list[torch.Tensor]):
    """Sum every chunk's blocks (``[A, E(, B, C)(, G(, H))(, ‖g‖²)]``) and ``extra`` over the
    ranks in one ``reduce``, the symmetric ones (A, C, G: positions given with each chunk) as
    their upper triangles (``p(p+1)/2`` numbers instead of ``p²``). Returns ``wait()``: once it
    returns, the sums are in the blocks, mirrored back (so exactly symmetric)."""
    sent, symmetric = [], []
    for chunk, sym_slots in chunks:
        for j, block in enumerate(chunk):
            if j in sym_slots:  # A, C, G
                p = block.shape[-1]
                upper = _upper_indices(p, block.device)
                tri = block[:, upper[0], upper[1]]  # (L, p(p+1)/2)
                symmetric.append((block, upper, tri))
                sent.append(tri)
            else:
                sent.append(block)
    pending = reduce(sent + extra)  # in place; an asynchronous reducer returns its wait

    def wait() -> None:
        if callable(pending):
            pending()
        for block, upper, tri in symmetric:
            block[:, upper[0], upper[1]] = tri
            block[:, upper[1], upper[0]] = tri  # the mirror

    return wait


_upper = {}


def _upper_indices(p: int, device: torch.device) -> torch.Tensor:
    key = (p, device)
    if key not in _upper:
        with torch.inference_mode(False):  # (kept across steps)
            _upper[key] = torch.triu_indices(p, p, device=device)
    return _upper[key]
