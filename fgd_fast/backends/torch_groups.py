"""Middle groups of the torch backend: one middle call for the layers of many buckets.

A :class:`Group` gathers middle chunks of buckets (:mod:`.torch_bucket`) that share the block
layout — compute and stored dtype, Φ read and written — in order of p: their Gram blocks go into
one :class:`.Layout` (one ``(L, p, p)`` batch, or several p in one flat buffer), one
:func:`.algebra.middle` call serves them all (per-layer η, β, α where the buckets differ), and its
``M_Φ``, ``F`` (or ``M_θ``), checks and the update's coefficients ``[sβ, −sη]`` are handed back to
each bucket. Gram blocks carried between steps (:mod:`.carry`) are kept per group.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from ..collectives import packed
from . import carry
from .algebra import Middle, grad_norm, grad_sq, middle
from .gram_sums import reduce_packed
from .guard_rule import host_reads_free
from .layout import Layout
from .layout import rows as _rows
from .torch_bucket import MIDDLE_BLOCKS, Bucket, Chunk


def grad_sq_into(grads: list[torch.Tensor], out: torch.Tensor) -> None:
    """``out = ‖g‖²`` per layer, in float64 (one multi-tensor norm for every layer of a middle).
    Where a host read is free (a CPU) and g is float32, the norms are taken in float32 (a fifth
    of the float64 pass's time) and redone in float64 only if one overflowed or g is not
    finite: the same value to float32 rounding, which is all the guard's safety radius needs
    (else :func:`.algebra.grad_norm` squared)."""
    if all(g.dtype == torch.float32 for g in grads) and host_reads_free(out.device):
        norms = torch.stack(torch._foreach_norm(grads))
        if math.isfinite(float(norms.sum())):  # (an Inf or NaN norm makes the sum one)
            torch.square(norms.to(torch.float64), out=out)
            return
    torch.square(grad_norm(grads), out=out)


class Group:
    """Middle chunks of buckets that share the block layout (compute and stored dtype, Φ read
    and written), in order of p: their Grams go into one set of blocks (a :class:`.Layout` of
    their p's: one ``(L, p, p)`` batch, or several p in one flat buffer) and one middle call
    serves them all (per-layer η, β, α where the buckets differ)."""

    def __init__(self, members: list[tuple[Bucket, list[Chunk]]], refresh: int = 1, lazy: bool = False, reduce=None):
        self.members = members
        self.reduce = reduce  # row shards: their Grams are partial sums, summed over the ranks by this
        self.sizes = [gc[-1].e - gc[0].s for _, gc in members]
        self.first = b = members[0][0]
        runs: list[list[int]] = []  # [p, layers] of consecutive members with one p
        for (m, _), size in zip(members, self.sizes):
            if runs and runs[-1][0] == m.p:
                runs[-1][1] += size
            else:
                runs.append([m.p, size])
        self.layout = Layout([(n, p) for p, n in runs], b.device)
        self.refresh, self.ahead, self.age = refresh, None, 0
        # Gram blocks carried to the next step (:mod:`.carry`): A where the guard's exact distance
        # gives it (θ₊ᵀθ₊ − I), B and C too where every layer's Grams (5np² flop) cost well more
        # than the four p³ products that carry them (8p³): n ≥ 2p; never for a float16/bfloat16 θ
        self.carry = 0
        if refresh > 1 and b.predict and b.dtype == b.cdt:
            wide = all(m.n >= 2 * m.p for m, _ in members)
            self.carry = 3 if b.writes_phi and wide else 1
        # the velocity Gram formed only where the middle's bound asks for it (see middle(uu_later=))
        self.lazy = lazy and b.predict and not self.carry
        self.tensors = self._of("params") + (self._of("bufs") if b.writes_phi else [])
        # the carried blocks' key, only where they are carried (Dynamo of torch 2.11 cannot trace
        # id() of a tensor made inside a compiled step, e.g. the first step's momentum buffers)
        self.key = ("carry", self.layout.groups, b.cdt) + tuple(id(t) for t in self.tensors) if self.carry else None

    def symmetric_slots(self) -> tuple[int, ...]:
        return self.first.symmetric_slots()

    def _phi_sq(self) -> torch.Tensor:
        """``(L,)`` float64 ‖Φ‖² of the layers from Φ itself; of row shards, summed over the ranks
        (this rank's rows alone would call a NaN in another rank's rows finite: the ranks would
        decide apart, one raising, one stepping). Every rank calls it alike: the middle asks only
        where the summed ``tr C`` is not finite."""
        phi_sq = grad_sq(self._of("bufs"))
        if self.reduce is not None:
            reduce_packed(self.reduce, [], [phi_sq])()  # Σ over the ranks, in place
        return phi_sq

    def _of(self, name: str) -> list[torch.Tensor]:
        """The members' ``params``, ``grads`` or ``bufs`` of the group's layers, in its order."""
        return [t for m, gc in self.members for t in getattr(m, name)[gc[0].s : gc[-1].e]]

    def keep(self) -> None:
        """After the step's writes: keep the next step's blocks (where this step made them)."""
        if self.ahead is not None:
            carry.keep(self.key, self.ahead, self.tensors, self.age)
            self.ahead = None

    def _spans(self):
        """(member, its GEMM chunks, its first and end layer in the layout)."""
        at = 0
        for (member, gemm_chunks), size in zip(self.members, self.sizes):
            yield member, gemm_chunks, at, at + size
            at += size

    def grams(self, scratch: dict[torch.dtype, list[torch.Tensor]]) -> list[torch.Tensor]:
        """Every member's Gram blocks, ``[A, E(, B, C)(, UᵀU or G)(, ‖g‖²)]`` in the layout (the
        velocity block left unfilled where :attr:`lazy`)."""
        b, lay = self.first, self.layout
        blocks = [lay.empty(b.cdt) for _ in range(b.block_count() - (1 if self.lazy else 0))]
        if self.lazy:
            blocks.append(None)  # the velocity block: made if the middle asks (velocity_grams)
        if b.predict:
            blocks.append(torch.empty((lay.count,), dtype=torch.float64, device=lay.device))
        entry = carry.take(self.key, self.tensors, self.refresh) if self.carry else None
        carried = 0
        if entry is not None:  # the carried blocks are this step's scratch (the middle scales B, C)
            carried = 3 if b.reads_phi and len(entry.blocks) == 3 else 1
            blocks[0] = entry.blocks[0]  # A
            if carried == 3:
                blocks[2], blocks[3] = entry.blocks[1:]  # B, C
        self.age = entry.age + 1 if entry is not None else 0
        for member, gemm_chunks, s, e in self._spans():
            views = [lay.layers(blk, s, e) if blk is not None else None for blk in blocks[: b.block_count()]]
            member.grams(scratch[member.cdt], gemm_chunks, views, carried, velocity=not self.lazy)
        if b.predict:  # ‖g‖² per layer (float64: no overflow for a finite g), last
            grad_sq_into(self._of("grads"), blocks[-1])
        return blocks

    def _hyper(self, name: str, dtype: torch.dtype | None = None):
        """η, β or α: a float where every member has the same, else ``(L,)`` per layer (in
        ``dtype``, default the compute dtype). An η given as a tensor is read on the device (no
        host read: a compiled or captured step follows a scheduler's in-place changes)."""
        values = [getattr(m, name) for m, _ in self.members]
        dtype, device = dtype or self.first.cdt, self.layout.device
        v_full = lambda v: torch.full((1,), v, dtype=dtype, device=device)  # noqa: E731
        if any(isinstance(v, torch.Tensor) for v in values):  # (L,): each member's value over its layers
            parts = [
                (v.reshape(1).to(device=device, dtype=dtype) if isinstance(v, torch.Tensor) else v_full(v)).expand(size)
                for v, size in zip(values, self.sizes)
            ]
            return parts[0] if len(parts) == 1 else torch.cat(parts)
        if all(v == values[0] for v in values):
            return values[0]
        # fills, not a table built on the host: its copy to a GPU would synchronise (and fail in a capture)
        return torch.cat([v_full(v).expand(size) for v, size in zip(values, self.sizes)])

    def middle(self, blocks: list[torch.Tensor], scratch: dict[torch.dtype, list[torch.Tensor]]) -> None:
        """One middle over every member's layers (:func:`.algebra.middle`), handed back per member
        (``scratch``: for the velocity Grams, where :attr:`lazy` and the middle asks for them)."""
        b, lay = self.first, self.layout
        g_sq = blocks[-1] if b.predict else None
        grams = blocks[:-1] if b.predict else blocks
        a, g_blk, phi_b, c = grams[:4] if b.reads_phi else (*grams[:2], None, None)
        # the velocity Gram: None where lazy (uu_later forms it if the middle's bound leaves the target)
        gg = grams[2] if b.predict and not b.reads_phi else None
        uu = grams[4] if b.predict and b.reads_phi else None
        hyper = {name: self._hyper(name) for name in ("lr", "beta", "alpha")}
        # carried blocks are off the stored θ by one rounding per step carried: the guard's margin takes as many
        unit = b.unit * (self.refresh if self.carry else 1)
        extra = dict(g_sq=g_sq, gg=gg, uu=uu, unit=unit, stored=b.dtype, carry=self.carry, layout=lay)
        if b.predict and b.reads_phi:  # ‖Φ‖² from Φ, where its float32 Gram overflowed
            extra.update(phi_sq_later=self._phi_sq)
        if b.predict:  # (also s²UᵀU from sU, where the unscaled Gram overflowed float32)
            extra.update(uu_later=lambda scale=None: self.velocity_grams(lay.empty(b.cdt), scratch, scale))
        mid = middle(a, phi_b, c, g_blk, **hyper, **extra, **b.guard)
        self.ahead, mid = mid.carried, mid._replace(carried=None, dist=mid.dist.to(torch.float64))
        # the update's coefficients [sβ, −sη] of every layer (s = 1 without a guard), in the compute dtype
        scale = mid.scale if mid.scale is not None else torch.ones(lay.count, dtype=torch.float64, device=lay.device)
        beta, lr = (self._hyper(name, torch.float64) for name in ("beta", "lr"))
        host = host_reads_free(lay.device)
        smallest = float(scale.min()) if host and mid.scale is not None else None
        if host and smallest in (None, 1.0) and not isinstance(beta, torch.Tensor) and not isinstance(lr, torch.Tensor):
            # s = 1 everywhere and one β, η: the [β, −η] rows from the host
            coef = torch.tensor([[beta, -lr]] * lay.count, dtype=b.cdt, device=lay.device)
        else:
            coef = torch.stack([scale * beta, scale * -lr], 1).to(b.cdt)
            # a reset (s = 0) reads no η: exact zeros even for an lr tensor that is not finite (0·NaN)
            coef = torch.where(scale.unsqueeze(1) == 0, 0.0, coef) if isinstance(lr, torch.Tensor) else coef
        # no zero coefficient (so no masks for the update), where a host read is free to say so
        lrs_nonzero = host and all(float(m.lr) != 0 for m, _ in self.members)  # (a tensor's read is free here)
        no_reset = host and lrs_nonzero and (smallest is None or smallest > 0)
        for member, gemm_chunks, s, e in self._spans():
            blocks_of = (lay.layers(f, s, e) for f in mid[:3])  # M_θ, M_Φ, F
            per_layer = (_rows(f, s, e) if f is not None else None for f in mid[3:])
            member.take(gemm_chunks, Middle(*blocks_of, *per_layer), _rows(coef, s, e), no_reset)

    def velocity_grams(
        self, out: torch.Tensor, scratch: dict[torch.dtype, list[torch.Tensor]], scale: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``out`` = every member's velocity block of :meth:`grams` (``UᵀU``, ``U = βΦ − ηg``;
        without Φ ``gᵀg``) in the layout, in a pass of its own; with ``scale`` (``(L,)``, the trust
        scales s) ``(sU)ᵀ(sU)`` with Φ or without. Row shards: each rank's rows give a partial sum,
        summed over the ranks here (a collective: the middle asks for it from blocks and scales
        already summed, so every rank asks alike)."""
        for member, gemm_chunks, s, e in self._spans():
            part = scale[s:e] if scale is not None else None
            member.velocity_grams(scratch[member.cdt], gemm_chunks, self.layout.layers(out, s, e), part)
        if self.reduce is not None:  # Σ over the ranks (a symmetric block: its upper triangle)
            reduce_packed(self.reduce, [([out], (0,))], [])()
        return out


def middle_groups(
    buckets: list[Bucket], middle_numel: int, refresh: int = 1, lazy: bool = False, reduce=None
) -> list[Group]:
    """The buckets' middle chunks, packed into groups of one block layout and at most
    ``middle_numel`` elements of live ``p × p`` blocks (as a bucket's middle chunks are), in a
    fixed order (the same on every rank). ``reduce`` (row shards: the ranks' sum): one p per
    group (their Gram blocks are summed as ``(L, p, p)`` upper triangles)."""
    by_layout: dict[tuple, list[tuple[Bucket, list[Chunk]]]] = defaultdict(list)
    for b in buckets:
        for gemm_chunks in b.plan:
            key = (b.cdt, b.dtype, b.reads_phi, b.writes_phi) + ((b.p,) if reduce is not None else ())
            by_layout[key].append((b, gemm_chunks))
    # a middle chunk's live elements (its layers' blocks)
    numel = lambda member: (member[1][-1].e - member[1][0].s) * MIDDLE_BLOCKS * member[0].p ** 2  # noqa: E731
    return [
        Group(run, refresh, lazy, reduce)
        for members in by_layout.values()
        for run in packed(sorted(members, key=lambda m: m[0].p), numel, max(1, middle_numel))
    ]
