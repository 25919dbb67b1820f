"""Torch backend: the two-pass form of the step with torch's BLAS products, in place.

Layers are bucketed by ``(n, p, layout, dtype, device, η, β, α, reads Φ, writes Φ)``.

``prepare`` (writes nothing) runs, per bucket, in chunks of layers (the middle chunks of
buckets that share p and the block layout are grouped, so one middle serves them all):

1. Gram pass: ``A = θᵀθ, B = θᵀΦ, C = ΦᵀΦ, E = θᵀg`` (``bmm`` into ``(c, p, p)`` blocks; B and
   C only when Φ is read). ``precision="tf32x3"`` computes A in IEEE fp32 and the others in
   TF32 (cuBLAS's tensor cores truncate their adds: a TF32 split of A would be exact in its
   inputs and still biased; see ``_ieee_gram``).
2. O(p³) middle (:mod:`.algebra`; the math: docs/algorithm.md §3), one call per group:
   ``M_Φ``, ``F = −α(A − I)`` and ``M_θ = M_Φ + F``; kept until ``apply``, with the distance
   ``‖A − I‖_F``; with the step
   guard also its per-layer scale ``s`` (inputs from ``‖g‖²`` per layer in
   float64, taken in the Gram pass, reduced with the Grams under row shards) and its
   prediction of the step's outcome. The prediction's velocity Gram ``UᵀU`` (``U = βΦ − ηg``)
   comes from the Gram pass, or, where a host read is free and ``exact_next=False`` (what
   :func:`fgd_fast.functional.fgd` passes for parameters that are not DTensors), from a pass of
   its own only if the middle's bound of it leaves the target (:func:`.algebra.velocity_bound`).

and allocates every buffer that ``apply`` will need. ``apply`` then allocates nothing and
writes in place, layer by layer (or chunk by chunk):

3. ``Φ ← (sβ)Φ − (sη)g`` (``sU``), ``Φ ← Φ + θ M_Φ`` (``Φ₊ = sU + θM_Φ``), ``O ← Φ₊ + θF``,
   ``θ ← θ + O`` (``θ₊ = θ + sU + θM_θ = θ + Φ₊ + θF``); without Φ (``momentum == 0``)
   ``O ← −(sη)g + θM_θ``, ``θ ← θ + O``. The coefficients carry the guard's scale (s = 1
   exactly where it does not bind, and without a guard).

So a step that fails in ``prepare`` — a check, or lack of memory — has written nothing, and
the step's extra memory is the p × p matrices plus a bounded scratch, not copies of θ, Φ and g.
On a CPU (eager, without row shards) both run in ``torch.inference_mode`` (:func:`_scratch_mode`):
the temporaries skip autograd's tracking, θ and Φ stay normal tensors.

Operands. On a CPU a layer of at least ``_CPU_STACK_BELOW`` (2¹⁴) elements is read where it is
(``W.view(c_o, −1)``; no copies), and smaller equal-shape layers are staged into stacks (one
``torch.stack`` each way) so that they share one ``bmm`` call; a layer whose tensors cannot be
viewed that way (e.g. ``channels_last``) is staged through the scratch. On a GPU, equal-shape
layers are staged into stacks of at most ``_STACK_FRACTION`` of the constrained bytes, so that
small layers share one ``bmm`` launch. Layout: when ``θ = W2ᵀ`` (``c_o ≤ m``, the usual case)
the memory holds the rows ``R = θᵀ``, and every product is taken in that layout
(``(θM)ᵀ = MᵀR``).

Memory (extra bytes of a step, ``s`` the item size): ``2·Σp²·s`` for ``M_Φ, F`` of every layer,
plus the scratch (one output slot of the largest layer on a CPU; three stack slots of at most
``_STACK_FRACTION`` of the constrained bytes ``P`` each on a GPU), plus the transient blocks of
one middle chunk (at most ``P``; on a CPU the chunks may hold ``2²³`` elements and the stacks
``2²⁰`` whatever P, so that a small model's middle runs in one chunk per bucket). The benchmark
report records the measured peak per workload.

Row shards (``reduce=``, see :mod:`.base`): each ``params[i]`` holds some rows of a larger θ
(``shapes[i]`` is the full parameter's shape). ``prepare`` then runs the Gram pass of every
bucket first (partial blocks of the local rows, held: ``4·Σp²`` numbers, ``5·Σp²`` with the
guard's UᵀU), ``reduce`` sums them — in buckets of ``reduce.bucket_bytes`` sent while the next
Grams are computed, one call for a small model — A, C and UᵀU as upper triangles: ``3p² +
p`` numbers per layer, ``3.5p² + 1.5p + 1`` with the guard's UᵀU and ‖g‖² — and, without a
prediction, the per-layer non-finite-gradient counts over the ranks, and then runs
the middle on the summed blocks; ``apply`` updates the local rows as above (the update of a
row of θ needs only that row of θ, Φ and g). Middle chunks then follow the full parameters'
sizes, so that every rank packs the same list.
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict

import torch

from .._matrix import stiefel_shape
from ..collectives import packed
from . import carry
from .algebra import Middle, host_reads_free, join_checks, middle, store_unit
from .base import (
    StepPlan,
    check_precision,
    compute_dtype,
    device_of,
    fp32_matmuls,
    full_precision,
    layer_classes,
    plan_of,
)
from .layout import Layout
from .layout import rows as _rows

__all__ = ["prepare_torch"]

_MIDDLE_BLOCKS = 32  # (p, p) blocks alive at once in the middle of a layer (A, B, C, E, G, H, N, S, …, Δ, D₀, X₁, X₂)
_STACK_FRACTION = 1 / 6  # a stack slot holds at most this share of the constrained bytes
# symmetric Grams from this p on as block halves (¾ of the flops, one more call and a mirror copy);
# one CPU thread (Intel Xeon, MKL; benchmarks/studies/cpu_host_ops.py): 1.1–2× slower up to
# p = 128, even near p = 128–192, faster from p ≈ 256 (an AMD EPYC broke even near p = 96)
_HALVES_FROM = 160
# on a CPU (memory is plentiful, each call costs host time) a middle chunk may hold this many
# elements and a stack slot this many, even for a model whose bytes would allow less (32 + 4 MB in fp32)
_CPU_MIDDLE_FLOOR, _CPU_STACK_FLOOR = 1 << 23, 1 << 20
# on a CPU only layers of fewer elements are stacked (per-call overhead against the copies): 2¹⁴
# measured 2–8% faster per step than 2¹⁶ on every CPU workload, 2¹⁷ 4–28% slower than 2¹⁶
# (benchmarks/studies/torch_knobs.py)
_CPU_STACK_BELOW = 1 << 14
# on a CPU (eager, without row shards) the step runs in torch.inference_mode: its temporaries and
# their views skip autograd's version and view tracking, measured 3–6% faster per step on three CPU
# workloads, no gain on VGG-16 ×0.2 (benchmarks/studies/torch_knobs.py); see _scratch_mode
_CPU_INFERENCE_MODE = 1


def _w2(t: torch.Tensor) -> torch.Tensor | None:
    """``W2 = t.view(c_o, −1)`` as a (1, c_o, m) view of ``t``'s memory, or None if not a view."""
    try:
        return t.view(1, t.shape[0], -1)
    except RuntimeError:
        return None


def _parts(x: torch.Tensor, sizes: list[int]) -> list[torch.Tensor] | tuple[torch.Tensor, ...]:
    """``x`` cut along dim 0 into consecutive parts of ``sizes`` rows (one op for all of them:
    each ``narrow`` costs host time), or ``[x]`` where one part is all of it."""
    return [x] if len(sizes) == 1 and sizes[0] == x.shape[0] else x.split(sizes)


class _Chunk:
    """Consecutive layers of a bucket, positions ``[s, e)``; ``staged``: their operands go
    through the scratch stacks (else each layer's products read its tensors in place)."""

    def __init__(self, s: int, e: int, staged: bool):
        self.s, self.e, self.staged = s, e, staged


class _Bucket:
    """Equal-shape layers: the p × p matrices of the step, and ``apply`` that writes it."""

    def __init__(self, idx, params, grads, bufs, key, precision):
        n, p, rows, dtype, device, lr, beta, alpha, reads_phi, writes_phi = key[:10]
        self.layers, self.n, self.p, self.rows = idx, n, p, rows
        self.lr, self.beta, self.alpha = lr, beta, alpha
        self.reads_phi, self.writes_phi = reads_phi, writes_phi
        self.cdt = compute_dtype(dtype)
        self.unit, self.dtype = store_unit(dtype), dtype  # the guard's rounding allowance for the stored θ₊
        self.ieee_a = precision == "tf32x3" and self.cdt == torch.float32  # A in IEEE fp32, the rest in TF32
        self.params = [params[i] for i in idx]
        self.grads = [grads[i] for i in idx]
        self.bufs = [bufs[i] for i in idx] if writes_phi else []
        self.c_o, self.m = (p, n) if rows else (n, p)  # W2 is c_o × m (a row shard may hold 0 rows)
        self.numel = n * p
        self.viewable = [  # (a contiguous non-empty tensor is: no view made to find out)
            all((t.numel() > 0 and t.is_contiguous() or _w2(t) is not None) and t.dtype == self.cdt for t in ts)
            for ts in zip(self.params, self.grads, *([self.bufs] if writes_phi else []))
        ]

    # -- planning -------------------------------------------------------------------------
    def chunks(self, middle_numel: int) -> list[list[_Chunk]]:
        """Middle chunks (lists of GEMM chunks): at most ``middle_numel`` elements of p × p
        blocks per middle chunk, at most ``self.stack_numel`` elements per stack slot (0: no
        stacking) per GEMM chunk; at least one layer each."""
        count, stack_numel = len(self.layers), self.stack_numel
        per_middle = max(1, middle_numel // max(1, _MIDDLE_BLOCKS * self.p * self.p))
        per_stack = max(1, stack_numel // max(1, self.numel)) if stack_numel else 1
        out = []
        for s in range(0, count, per_middle):
            e = min(count, s + per_middle)
            gemm = []
            if stack_numel:  # (a chunk of one layer is staged only if its tensors cannot be viewed)
                gemm = [_Chunk(a, min(e, a + per_stack), True) for a in range(s, e, per_stack)]
                gemm = [_Chunk(c.s, c.e, c.e - c.s > 1 or not self.viewable[c.s]) for c in gemm]
            else:
                gemm = [_Chunk(a, a + 1, not self.viewable[a]) for a in range(s, e)]
            out.append(gemm)
        return out

    # -- operands -------------------------------------------------------------------------
    def _slot(self, slot: torch.Tensor, ch: _Chunk) -> torch.Tensor:
        """The first ``c`` layers' worth of ``slot`` as a (c, c_o, m) stack (W2 layout)."""
        c = ch.e - ch.s  # (one op: the slot is a flat scratch tensor, from its own storage offset)
        return slot.as_strided((c, self.c_o, self.m), (self.numel, self.m, 1))

    @staticmethod
    def _shaped(stack: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The layers of a stack, each viewed in its tensor's shape (two ops where they share one)."""
        shape = tensors[0].shape
        if all(t.shape == shape for t in tensors):
            return list(stack.view(len(tensors), *shape).unbind(0))
        return [w.view(t.shape) for w, t in zip(stack.unbind(0), tensors)]

    def _stack(self, slot: torch.Tensor, tensors: list[torch.Tensor], ch: _Chunk) -> torch.Tensor:
        """``tensors[s:e]`` copied into ``slot`` as a (c, c_o, m) stack (W2 layout)."""
        stack = self._slot(slot, ch)
        part = tensors[ch.s : ch.e]
        shape = part[0].shape
        if all(t.shape == shape for t in part):  # one op, no per-layer views (measured 1.7× faster)
            torch.stack(part, out=stack.view(len(part), *shape))
        else:
            torch._foreach_copy_(self._shaped(stack, part), part)
        return stack

    def _operand(self, slot, tensors, ch: _Chunk) -> torch.Tensor:
        """The (c, c_o, m) W2 operand of the chunk: staged, or the tensor's own memory."""
        return self._stack(slot, tensors, ch) if ch.staged else _w2(tensors[ch.s])

    def _col(self, w2: torch.Tensor) -> torch.Tensor:
        """(c, n, p) column view θ of a W2 operand."""
        return w2.transpose(1, 2) if self.rows else w2

    def _gram(self, x: torch.Tensor, y: torch.Tensor, out: torch.Tensor) -> None:
        """``out = xᵀy`` for W2 operands (column views ``(c, n, p)``). For ``y is x`` and
        ``p >= _HALVES_FROM``, only the upper block triangle: ``[x₁ᵀx; x₂ᵀx₂]`` with x = [x₁ | x₂]
        (¾ of the flops), the lower-left block mirrored."""
        xt = x if self.rows else x.transpose(1, 2)  # θᵀ (rows: the W2 operand itself)
        if y is not x or self.p < _HALVES_FROM:
            torch.bmm(xt, self._col(y), out=out)
            return
        h = self.p // 2
        torch.bmm(xt[:, :h], xt.transpose(1, 2), out=out[:, :h])  # [x₁ᵀx₁ | x₁ᵀx₂]
        torch.bmm(xt[:, h:], xt[:, h:].transpose(1, 2), out=out[:, h:, h:])  # x₂ᵀx₂
        out[:, h:, :h] = out[:, :h, h:].transpose(1, 2)  # x₂ᵀx₁ = (x₁ᵀx₂)ᵀ

    def _add_theta_times(
        self,
        y: torch.Tensor,
        theta: torch.Tensor,
        m: torch.Tensor,
        *,
        beta: float = 1.0,
        out: torch.Tensor | None = None,
    ) -> None:
        """``β·y + θM`` in W2 layout (rows: ``βyᵀ + MᵀR``), into ``out`` or in place into ``y``."""
        a, b = (m.transpose(1, 2), theta) if self.rows else (theta, m)
        if out is None:
            y.baddbmm_(a, b, beta=beta)
        else:
            torch.baddbmm(y, a, b, beta=beta, out=out)

    # -- prepare: Gram pass and middle ----------------------------------------------------
    def start(
        self,
        middle_numel: int,
        trust_radius: float | None = None,
        max_distance: float | None = None,
        variant: str = "official",
    ) -> None:
        self.plan = self.chunks(middle_numel)
        self.device = self.params[0].device
        self.m_phi = self.m_second = None  # M_Φ and F (with Φ) or M_θ (without): (count, p, p), made by take
        self.guard = dict(radius=trust_radius, limit=max_distance, variant=variant)
        self.predict = trust_radius is not None or max_distance is not None
        self.mids, self.coefs, self.no_reset = [], [], True

    def block_count(self) -> int:
        """How many ``(p, p)`` Gram blocks :meth:`grams` fills per layer."""
        return (4 if self.reads_phi else 2) + (1 if self.predict else 0)

    def grams(
        self,
        scratch: list[torch.Tensor],
        gemm_chunks: list[_Chunk],
        out: list[torch.Tensor],
        carried: int = 0,
        velocity: bool = True,
    ) -> None:
        """Into ``out``: ``[A, E]`` or ``[A, E, B, C]`` of a middle chunk (``(c, p, p)`` each), sums
        over the (local) rows of θ; with a prediction and ``velocity`` also the guard's velocity
        Gram (:meth:`_velocity`; ``‖g‖²`` is the group's, :func:`_grad_sq`). ``carried``: 1 where
        A, 3 where A, B and C are already in ``out`` (carried from the last step: :mod:`.carry`),
        not formed again."""
        sizes = [ch.e - ch.s for ch in gemm_chunks]
        # each block's rows per GEMM chunk ([A, E(, B, C)(, UᵀU or G)]; an unfilled block None)
        blocks = [_parts(b, sizes) if b is not None else None for b in out[: self.block_count()]]
        velocity = velocity and self.predict
        for k, ch in enumerate(gemm_chunks):
            theta = self._operand(scratch[0], self.params, ch)
            grad = self._operand(scratch[2], self.grads, ch)
            self._gram(theta, grad, blocks[1][k])  # E = θᵀg
            if carried:
                pass  # A carried
            elif self.ieee_a:  # (cuBLAS's TF32 accumulation is biased: see _ieee_gram)
                self._ieee_gram(theta, blocks[0][k])
            else:
                self._gram(theta, theta, blocks[0][k])  # A = θᵀθ
            phi = self._operand(scratch[1], self.bufs, ch) if self.reads_phi else None
            if self.reads_phi and carried < 3:
                self._gram(theta, phi, blocks[2][k])  # B = θᵀΦ
                self._gram(phi, phi, blocks[3][k])  # C = ΦᵀΦ
            if velocity:
                self._velocity(scratch, ch, grad, phi, blocks[-1][k])

    def _velocity(self, scratch, ch: _Chunk, grad, phi, out: torch.Tensor) -> None:
        """``out`` = the guard's ``UᵀU`` of a GEMM chunk (``U = βΦ − ηg`` formed in the g slot: one
        Gram instead of ``gᵀg`` and ``Φᵀg``; g itself is read again by the update), or without Φ
        ``G = gᵀg`` (U = −ηg)."""
        if phi is None:
            self._gram(grad, grad, out)  # G = gᵀg
            return
        u = scratch[2][: (ch.e - ch.s) * self.numel].view(grad.shape)
        torch.mul(grad, -self.lr, out=u).add_(phi, alpha=self.beta)
        self._gram(u, u, out)  # UᵀU

    def velocity_grams(self, scratch: list[torch.Tensor], gemm_chunks: list[_Chunk], out: torch.Tensor) -> None:
        """Into ``out`` (``(c, p, p)``): the velocity Grams of a middle chunk alone, in a pass of their
        own (where the middle asks for them after all: :meth:`_Group.middle`)."""
        for ch, part in zip(gemm_chunks, _parts(out, [ch.e - ch.s for ch in gemm_chunks])):
            grad = self._operand(scratch[2], self.grads, ch)
            phi = self._operand(scratch[1], self.bufs, ch) if self.reads_phi else None
            self._velocity(scratch, ch, grad, phi, part)

    def symmetric_slots(self) -> tuple[int, ...]:
        """Positions of the symmetric blocks (A, C, UᵀU or G) in what :meth:`grams` returns."""
        if self.reads_phi:
            return (0, 3, 4) if self.predict else (0, 3)
        return (0, 2) if self.predict else (0,)

    def take(self, gemm_chunks: list[_Chunk], mid: Middle, coef: torch.Tensor, no_reset: bool) -> None:
        """Keep a middle chunk's ``M_Φ`` and ``F`` (or ``M_θ``), its per-layer checks and the
        update's coefficients ``(c, 2)`` [sβ, −sη] (``no_reset``: none is 0, known on the host)."""
        s, e = gemm_chunks[0].s, gemm_chunks[-1].e
        second = mid.feedback if self.writes_phi else mid.m_theta
        if s == 0 and e == len(self.layers):  # the whole bucket in one middle chunk: its matrices as they are
            self.m_phi, self.m_second = mid.m_phi, second
        else:
            if self.m_phi is None:
                self.m_phi = torch.empty((len(self.layers), self.p, self.p), dtype=self.cdt, device=self.device)
                self.m_second = torch.empty_like(self.m_phi)
            self.m_phi[s:e], self.m_second[s:e] = mid.m_phi, second
        self.mids.append(mid.checks())  # keep only the per-layer checks
        self.coefs.append(coef)
        self.no_reset = self.no_reset and no_reset

    def finite_flags(self) -> torch.Tensor:
        """(L,) bool: g is finite iff its min and max are (both propagate NaN); an empty
        row shard is finite."""
        flags = [
            torch.isfinite(torch.stack(torch.aminmax(g))).all()
            if g.numel()
            else torch.ones((), dtype=torch.bool, device=g.device)
            for g in self.grads
        ]
        return torch.stack(flags)

    def finish(self, check_finite: bool, flags: torch.Tensor | None = None) -> None:
        """Collect the middle's checks. With ``check_finite`` the inputs' finiteness is the
        middle's (with a prediction) or ``flags`` (without one)."""
        checks = join_checks(self.mids)
        self.dist, self.dist_next, self.finite_next, self.guarded = (
            checks.dist,
            checks.dist_next,
            checks.finite_next,
            checks.guarded,
        )
        if not check_finite:
            self.finite = None
        else:
            self.finite = checks.finite if self.predict else flags  # with a prediction: g and Φ
        # the update's coefficients [sβ, −sη] per layer (s = 1 without a guard), from the middle chunks
        count = len(self.layers)
        self.coef = (self.coefs[0] if len(self.coefs) == 1 else torch.cat(self.coefs)).view(count, 2, 1, 1)
        # a zero coefficient reads nothing (apply allocates nothing, so the masks are made here):
        # a reset (s = 0) over a non-finite g or Φ writes the pull-back, not 0·Inf
        self.scalars = None
        if self.no_reset:
            self.zero_g = self.zero_u = None  # no layer resets (−sη ≠ 0 everywhere): no masks to apply
            # (known where a host read is free) one [sβ, −sη] for every layer: sβΦ inside the product
            rows = self.coef.view(count, 2).tolist()
            self.scalars = tuple(rows[0]) if all(r == rows[0] for r in rows) else None
            return
        self.zero_g = self.coef[:, 1] == 0  # (count, 1, 1): −sη = 0
        self.zero_u = self.zero_g & (self.coef[:, 0] == 0)  # and sβ = 0: U = 0, and M_Φ = 0, so Φ₊ = 0

    def _ieee_gram(self, theta: torch.Tensor, out: torch.Tensor) -> None:
        """``A = θᵀθ`` in IEEE fp32 while the other products of ``"tf32x3"`` run in TF32.

        A sets the distance the feedback settles at, so it needs fp32 accuracy. A TF32 split
        (``A ≈ hiᵀhi + hiᵀlo + loᵀhi``) is exact in its inputs, but cuBLAS's tensor cores add
        into the running sum with truncation: a bias of ~½ ulp(sum) per instruction, ~1e-5 on
        A's diagonal at n = 5,760, which the feedback writes into θ (measured on an H200: 74×
        the IEEE distance after 1,000 steps). cuBLAS offers no way to round those adds, so A is
        one IEEE product (the Triton backend flushes every K-step instead)."""
        with full_precision():
            self._gram(theta, theta, out)  # A = θᵀθ

    # -- apply: every write of the step ---------------------------------------------------
    def apply(self, scratch: list[torch.Tensor]) -> None:
        chunks = [ch for gemm_chunks in self.plan for ch in gemm_chunks]
        sizes = [ch.e - ch.s for ch in chunks]
        # M_Φ and F (or M_θ) per GEMM chunk (M_Φ None without Φ)
        m_phi = _parts(self.m_phi, sizes) if self.writes_phi else [None] * len(chunks)
        for ch, mp, ms in zip(chunks, m_phi, _parts(self.m_second, sizes)):
            self._update(scratch, ch, mp, ms)

    def _update(self, scratch, ch: _Chunk, m_phi: torch.Tensor | None, m_second: torch.Tensor) -> None:
        """The chunk's writes, with its rows ``m_phi`` of M_Φ and ``m_second`` of F (or M_θ)."""
        i = slice(ch.s, ch.e)
        theta = self._operand(scratch[0], self.params, ch)
        out = self._slot(scratch[2], ch)
        grads, params = self.grads[i], self.params[i]
        if self.scalars is not None:  # one [sβ, −sη] for every layer, as numbers
            beta_s, eta_s = self.scalars
        else:
            beta_s, eta_s = self.coef[i, 0], self.coef[i, 1]  # (c, 1, 1): sβ and −sη
        skip_g, skip_u = (m[i] if m is not None else None for m in (self.zero_g, self.zero_u))  # (see finish)
        if ch.staged:
            g_views = None  # g is added layer by layer, in its own shape
        else:
            g_views = _w2(grads[0])
        if self.writes_phi:
            bufs = self.bufs[i]
            if not ch.staged:
                phi = _w2(bufs[0])  # Φ's own storage
            elif self.reads_phi:
                phi = self._stack(scratch[1], self.bufs, ch)
            else:  # Φ = 0 is not read: the slot starts as g
                phi = self._stack(scratch[1], self.grads, ch)
            if self.reads_phi:
                if self.scalars is not None:  # sβΦ + θ M_Φ in one product (no pass of its own over Φ)
                    self._add_theta_times(phi, theta, m_phi, beta=self.scalars[0])
                else:
                    phi.mul_(beta_s)  # sβΦ
                    self._add_theta_times(phi, theta, m_phi)  # sβΦ + θ M_Φ
                # Φ₊ = sβΦ − sηg + θ M_Φ (a staged g goes through the output slot, written after)
                g_term = self._stack(scratch[2], self.grads, ch) if g_views is None else g_views
                if self.scalars is not None:
                    phi.add_(g_term, alpha=eta_s)
                else:
                    phi.addcmul_(g_term, eta_s)
                _zero_where(phi, skip_u)  # reset: Φ₊ = 0
            elif g_views is None:
                _zero_where(phi.mul_(eta_s), skip_g)  # the slot holds g: −sηg
                self._add_theta_times(phi, theta, m_phi)  # Φ₊ = −sηg + θ M_Φ
            else:
                _zero_where(torch.mul(g_views, eta_s, out=phi), skip_g)  # −sηg
                self._add_theta_times(phi, theta, m_phi)  # Φ₊ = −sηg + θ M_Φ
            self._add_theta_times(phi, theta, m_second, out=out)  # O = Φ₊ + θF
            if ch.staged:
                torch._foreach_copy_(bufs, self._shaped(phi, bufs))  # Φ ← Φ₊
        elif g_views is None:
            torch._foreach_copy_(self._shaped(out, grads), grads)
            _zero_where(out.mul_(eta_s), skip_g)  # −sηg
            self._add_theta_times(out, theta, m_second)  # O = −sηg + θ M_θ
        else:
            _zero_where(torch.mul(g_views, eta_s, out=out), skip_g)  # −sηg
            self._add_theta_times(out, theta, m_second)  # O = −sηg + θ M_θ
        if ch.staged:
            torch._foreach_add_(params, self._shaped(out, params))  # θ₊ = θ + O
        else:
            theta.add_(out)


def _grad_sq(grads: list[torch.Tensor], out: torch.Tensor) -> None:
    """``out = ‖g‖²`` per layer, in float64 (one multi-tensor norm for every layer of a middle).
    Where a host read is free (a CPU) and g is float32, the norms are taken in float32 (a fifth
    of the float64 pass's time) and redone in float64 only if one overflowed or g is not
    finite: the same value to float32 rounding, which is all the guard's safety radius needs."""
    if all(g.dtype == torch.float32 for g in grads) and host_reads_free(out.device):
        norms = torch.stack(torch._foreach_norm(grads))
        if math.isfinite(float(norms.sum())):  # (an Inf or NaN norm makes the sum one)
            torch.square(norms.to(torch.float64), out=out)
            return
    torch.square(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float64)), out=out)


def _zero_where(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x[k] ← 0`` where the ``(c, 1, 1)`` per-layer ``mask`` holds (``x``: ``(c, …)``, or one
    layer's 2-D view when ``c = 1``); in place, returns ``x`` (``mask=None``: nothing to zero)."""
    if mask is None:
        return x
    return x.masked_fill_(mask.reshape((mask.shape[0],) + (1,) * (x.dim() - 1)), 0.0)


class _Group:
    """Middle chunks of buckets that share the block layout (compute and stored dtype, Φ read
    and written), in order of p: their Grams go into one set of blocks (a :class:`.Layout` of
    their p's: one ``(L, p, p)`` batch, or several p in one flat buffer) and one middle call
    serves them all (per-layer η, β, α where the buckets differ)."""

    def __init__(self, members: list[tuple[_Bucket, list[_Chunk]]], refresh: int = 1, lazy: bool = False):
        self.members = members
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
        self.key = ("carry", self.layout.groups, b.cdt) + tuple(id(t) for t in self.tensors)

    def symmetric_slots(self) -> tuple[int, ...]:
        return self.first.symmetric_slots()

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
            _grad_sq(self._of("grads"), blocks[-1])
        return blocks

    def _hyper(self, name: str, dtype: torch.dtype | None = None):
        """η, β or α: a float where every member has the same, else ``(L,)`` per layer (in
        ``dtype``, default the compute dtype)."""
        values = [getattr(m, name) for m, _ in self.members]
        if all(v == values[0] for v in values):
            return values[0]
        per_layer = [v for v, size in zip(values, self.sizes) for _ in range(size)]
        return torch.tensor(per_layer, dtype=dtype or self.first.cdt, device=self.layout.device)

    def middle(self, blocks: list[torch.Tensor], scratch: dict[torch.dtype, list[torch.Tensor]]) -> None:
        """One middle over every member's layers (:func:`.algebra.middle`), handed back per member
        (``scratch``: for the velocity Grams, where :attr:`lazy` and the middle asks for them)."""
        b, lay = self.first, self.layout
        g_sq = blocks[-1] if b.predict else None
        grams = blocks[:-1] if b.predict else blocks
        a, g_blk, phi_b, c = grams[:4] if b.reads_phi else (*grams[:2], None, None)
        gg = grams[2] if b.predict and not b.reads_phi else None
        uu = grams[4] if b.predict and b.reads_phi else None
        hyper = {name: self._hyper(name) for name in ("lr", "beta", "alpha")}
        # carried blocks are off the stored θ by one rounding per step carried: the guard's margin takes as many
        unit = b.unit * (self.refresh if self.carry else 1)
        extra = dict(g_sq=g_sq, gg=gg, uu=uu, unit=unit, stored=b.dtype, carry=self.carry, layout=lay)
        if self.lazy:  # UᵀU only if the middle's bound leaves the target
            extra.update(gg=None, uu=None, uu_later=lambda: self.velocity_grams(lay.empty(b.cdt), scratch))
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
        # no zero coefficient (so no masks for the update), where a host read is free to say so
        lrs_nonzero = all(m.lr != 0 for m, _ in self.members)
        no_reset = host and lrs_nonzero and (smallest is None or smallest > 0)
        for member, gemm_chunks, s, e in self._spans():
            blocks_of = (lay.layers(f, s, e) for f in mid[:3])  # M_θ, M_Φ, F
            per_layer = (_rows(f, s, e) if f is not None else None for f in mid[3:])
            member.take(gemm_chunks, Middle(*blocks_of, *per_layer), _rows(coef, s, e), no_reset)

    def velocity_grams(self, out: torch.Tensor, scratch: dict[torch.dtype, list[torch.Tensor]]) -> torch.Tensor:
        """``out`` = every member's velocity block of :meth:`grams` (``UᵀU``, ``U = βΦ − ηg``;
        without Φ ``gᵀg``) in the layout, in a pass of its own."""
        for member, gemm_chunks, s, e in self._spans():
            member.velocity_grams(scratch[member.cdt], gemm_chunks, self.layout.layers(out, s, e))
        return out


def _groups(
    buckets: list[_Bucket], middle_numel: int, refresh: int = 1, by_p: bool = False, lazy: bool = False
) -> list[_Group]:
    """The buckets' middle chunks, packed into groups of one block layout and at most
    ``middle_numel`` elements of live ``p × p`` blocks (as a bucket's middle chunks are), in a
    fixed order (the same on every rank). ``by_p``: one p per group (row shards: their Gram
    blocks are summed as ``(L, p, p)`` upper triangles)."""
    by_layout: dict[tuple, list[tuple[_Bucket, list[_Chunk]]]] = defaultdict(list)
    for b in buckets:
        for gemm_chunks in b.plan:
            key = (b.cdt, b.dtype, b.reads_phi, b.writes_phi) + ((b.p,) if by_p else ())
            by_layout[key].append((b, gemm_chunks))
    # a middle chunk's live elements (its layers' blocks)
    numel = lambda member: (member[1][-1].e - member[1][0].s) * _MIDDLE_BLOCKS * member[0].p ** 2  # noqa: E731
    return [
        _Group(run, refresh, lazy)
        for members in by_layout.values()
        for run in packed(sorted(members, key=lambda m: m[0].p), numel, max(1, middle_numel))
    ]


def _scratch_mode(device: torch.device, reduce) -> contextlib.AbstractContextManager:
    """``torch.inference_mode()`` for a step on a CPU (eager, without row shards; a null context
    elsewhere). Inside it the step's temporaries (scratch, Gram blocks, the middle's matrices)
    are inference tensors, which skip autograd's version and view tracking; the parameters and
    momentum buffers it writes in place stay normal tensors (their version counters bumped, so a
    graph that saved θ still refuses to backpropagate through the step). What outlives the step is
    built outside it (layout indices and tables: ``torch.inference_mode(False)`` where they are
    made), but for the plan's per-layer checks (read only) and the Gram blocks carried to the next
    step (:mod:`.carry`, made and read only on this path)."""
    if _CPU_INFERENCE_MODE and device.type == "cpu" and reduce is None and not torch.compiler.is_compiling():
        return torch.inference_mode()
    return contextlib.nullcontext()


class _Step:
    """The buckets of one device, the scratch they share, and the precision of their products."""

    def __init__(self, buckets, scratch, precision, groups=(), mode=contextlib.nullcontext):
        self.units, self.scratch, self.precision, self.groups = buckets, scratch, precision, groups
        self.mode = mode  # makes the context apply runs in (see _scratch_mode)

    def apply(self) -> None:
        # (contexts, not decorators: torch.compile traces them)
        with torch.no_grad(), fp32_matmuls(self.precision), self.mode():
            for b in self.units:
                b.apply(self.scratch[b.cdt])
        for g in self.groups:  # stamped with the versions the writes left
            g.keep()


@torch.no_grad()  # products into preallocated outputs, in-place writes of leaf parameters
def prepare_torch(
    params,
    grads,
    bufs,
    fresh,
    *,
    lr,
    momentum,
    feedback,
    check_finite,
    precision="ieee",
    reduce=None,
    shapes=None,
    trust_radius=None,
    max_distance=None,
    variant="official",
    gram_refresh=1,
    exact_next=True,
):
    check_precision(precision)
    device = device_of(params)

    def key(i: int) -> tuple:
        param = params[i]
        # a row shard has the full parameter's orientation and p, and its own (local) row count
        _, p, rows = stiefel_shape(param.shape if shapes is None else shapes[i])
        n = param.numel() // max(p, 1)
        reads_phi = bufs[i] is not None and not fresh[i]
        bucket = (
            n,
            p,
            rows,
            param.dtype,
            param.device,
            lr[i],
            momentum[i],
            feedback[i],
            reads_phi,
            bufs[i] is not None,
        )
        if shapes is not None:  # the full shape keeps the buckets (so the reduced list) alike on every rank
            bucket += (tuple(shapes[i]), tuple(param.shape))
        return bucket

    mode = lambda: _scratch_mode(device, reduce)  # noqa: E731
    options = dict(check_finite=check_finite, reduce=reduce, gram_refresh=gram_refresh, exact_next=exact_next)
    options.update(trust_radius=trust_radius, max_distance=max_distance, variant=variant)
    with mode():
        return _prepared(params, grads, bufs, key, device, precision, shapes, mode, **options)


def _prepared(params, grads, bufs, key, device, precision, shapes, mode, **options) -> StepPlan:
    """:func:`prepare_torch` after its arguments are checked: the buckets, then :func:`_planned`."""
    groups = layer_classes(len(params), key)
    buckets = [_Bucket(idx, params, grads, bufs, key, precision) for key, idx in groups.items()]
    total = sum(b.numel * len(b.layers) for b in buckets)  # constrained elements P
    floor = _CPU_STACK_FLOOR if device.type == "cpu" else 0
    for b in buckets:
        stacks = len(b.layers) > 1 and (device.type == "cuda" or b.numel < _CPU_STACK_BELOW)
        b.stack_numel = max(int(total * _STACK_FRACTION), floor) if stacks else 0
    # middle chunks from the full sizes with row shards: the same chunks (so reduced list) on every rank
    middle_numel = total if shapes is None else sum(math.prod(shape) for shape in shapes)
    middle_numel = max(middle_numel, _CPU_MIDDLE_FLOOR if device.type == "cpu" else 0)
    return _planned(buckets, device, middle_numel, precision, mode, **options)


def _planned(
    buckets,
    device,
    middle_numel,
    precision,
    mode,
    *,
    check_finite,
    reduce,
    gram_refresh,
    exact_next,
    trust_radius,
    max_distance,
    variant,
):
    """:func:`prepare_torch`'s step over its ``buckets``: scratch, Gram pass, middle, checks."""
    scratch = _scratch(buckets, middle_numel, device)
    for b in buckets:
        b.start(middle_numel, trust_radius, max_distance, variant)
    # Grams carried between steps (:mod:`.carry`): where host reads are free (a CPU), with a prediction, whole matrices
    carrying = gram_refresh > 1 and reduce is None and host_reads_free(device)
    # the guard's velocity Grams only where a bound leaves the target: where a host read decides it
    lazy = not exact_next and reduce is None and host_reads_free(device)
    groups = _groups(buckets, middle_numel, gram_refresh if carrying else 1, by_p=reduce is not None, lazy=lazy)
    with fp32_matmuls(precision):  # IEEE fp32 or TF32 products, whatever the global setting
        if reduce is None:
            for g in groups:  # the Grams of one group alive at once
                g.middle(g.grams(scratch), scratch)
            # with a prediction the middle's finiteness (‖g‖², tr C) is the check: no pass over g
            for b in buckets:
                b.finish(check_finite, b.finite_flags() if check_finite and not b.predict else None)
        else:  # every group's partial Grams, summed over the ranks as they are made, then every middle
            sums = _Overlapped(reduce)
            held = []
            for g in groups:
                held.append(g.grams(scratch))
                sums.add(held[-1], g.symmetric_slots())  # (sent once a bucket is full; the next Grams meanwhile)
            # non-finite counts, only without a prediction: with one, the summed ‖g‖², tr C and E say it
            counted = check_finite and not any(b.predict for b in buckets)
            bad = [(~b.finite_flags()).to(b.cdt) for b in buckets] if counted else []
            sums.finish(bad)
            for g, blocks in zip(groups, held):
                g.middle(blocks, scratch)
            for i, b in enumerate(buckets):
                b.finish(check_finite, bad[i] == 0 if counted else None)
    step = _Step(buckets, scratch, precision, [g for g in groups if g.carry], mode)
    plan = plan_of(buckets, device, check_finite)
    plan.apply = step.apply
    return plan


class _Overlapped:
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
        self.waits.append(_reduce_packed(self.reduce, self.pending, extra))
        self.pending, self.bytes = [], 0

    def finish(self, extra: list[torch.Tensor]) -> None:
        if self.pending or extra or not self.waits:  # (at least one call: every rank makes it)
            self._send(extra)
        for wait in self.waits:
            wait()


def _reduce_packed(reduce, chunks: list[tuple[list[torch.Tensor], tuple[int, ...]]], extra: list[torch.Tensor]):
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


def _scratch(buckets, total: int, device) -> dict[torch.dtype, list[torch.Tensor]]:
    """Per compute dtype, the stack slots θ, Φ and the output O (also g's stack in the Gram
    pass), sized for the largest chunk; θ and Φ slots only where a chunk is staged."""
    sizes: dict[torch.dtype, list[int]] = defaultdict(lambda: [0, 0, 0])
    for b in buckets:
        size = sizes[b.cdt]
        for gemm_chunks in b.chunks(total):
            for ch in gemm_chunks:
                numel = (ch.e - ch.s) * b.numel
                size[2] = max(size[2], numel)
                if ch.staged:
                    size[0] = max(size[0], numel)
                    size[1] = max(size[1], numel if b.writes_phi else 0)
    return {dt: [torch.empty(k, dtype=dt, device=device) for k in size] for dt, size in sizes.items()}


prepare_torch.row_shards = True  # accepts reduce= and shapes= (row shards of larger matrices)
prepare_torch.carries_grams = True  # accepts gram_refresh= (Gram blocks carried between steps on a CPU)
prepare_torch.bounds_next = True  # accepts exact_next=False (dist_next may be a bound within the target)
