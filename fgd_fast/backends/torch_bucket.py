"""One bucket of the torch backend: equal-shape layers with one set of hyper-parameters.

A :class:`Bucket` holds its layers' tensors and runs, per chunk of layers (:class:`Chunk`), the
two passes over them that :mod:`.torch_batched` describes: the Gram pass (``A = θᵀθ, E = θᵀg``,
``B = θᵀΦ``, ``C = ΦᵀΦ``, the guard's velocity Gram) into the middle's blocks, and ``apply``,
the in-place writes ``Φ₊ = sU + θM_Φ``, ``θ₊ = θ + Φ₊ + θF`` (``θ₊ = θ − sηg + θM_θ`` without
Φ). Between them it keeps what the middle (:mod:`.torch_groups`) hands back: ``M_Φ``, ``F`` or
``M_θ``, the per-layer checks and the update's coefficients ``[sβ, −sη]``.

A layer's operand is its own memory viewed as ``W2 = W.view(c_o, −1)`` (:func:`w2`), or a stack
of equal-shape layers copied into a scratch slot (a *staged* chunk). When ``θ = W2ᵀ`` (``c_o ≤ m``)
the memory holds the rows ``R = θᵀ`` and every product is taken in that layout
(``(θM)ᵀ = MᵀR``).
"""

from __future__ import annotations

import torch

from .algebra import Middle, join_checks
from .base import compute_dtype, full_precision
from .guard_rule import TF32_UNIT, store_unit

# symmetric Grams from this p on as block halves (¾ of the flops, one more call and a mirror copy);
# one CPU thread (Intel Xeon, MKL; benchmarks/studies/cpu_host_ops.py): 1.1–2× slower up to
# p = 128, even near p = 128–192, faster from p ≈ 256 (an AMD EPYC broke even near p = 96)
_HALVES_FROM = 160
MIDDLE_BLOCKS = 32  # (p, p) blocks alive at once in the middle of a layer (A, B, C, E, G, H, N, S, …, Δ, D₀, X₁, X₂)


def w2(t: torch.Tensor) -> torch.Tensor | None:
    """``W2 = t.view(c_o, −1)`` as a (1, c_o, m) view of ``t``'s memory, or None if not a view."""
    try:
        return t.view(1, t.shape[0], -1)
    except RuntimeError:
        return None


def parts(x: torch.Tensor, sizes: list[int]) -> list[torch.Tensor] | tuple[torch.Tensor, ...]:
    """``x`` cut along dim 0 into consecutive parts of ``sizes`` rows (one op for all of them:
    each ``narrow`` costs host time), or ``[x]`` where one part is all of it."""
    return [x] if len(sizes) == 1 and sizes[0] == x.shape[0] else x.split(sizes)


class Chunk:
    """Consecutive layers of a bucket, positions ``[s, e)``; ``staged``: their operands go
    through the scratch stacks (else each layer's products read its tensors in place)."""

    def __init__(self, s: int, e: int, staged: bool):
        self.s, self.e, self.staged = s, e, staged


class Bucket:
    """Equal-shape layers: the p × p matrices of the step, and ``apply`` that writes it."""

    def __init__(self, idx, params, grads, bufs, key, precision, lr):
        n, p, rows, dtype, device, _, beta, alpha, reads_phi, writes_phi = key[:10]  # (lr: a float or a tensor)
        self.layers, self.n, self.p, self.rows = idx, n, p, rows
        self.lr, self.beta, self.alpha = lr, beta, alpha
        self.reads_phi, self.writes_phi = reads_phi, writes_phi
        self.cdt = compute_dtype(dtype)
        self.ieee_a = precision == "tf32x3" and self.cdt == torch.float32  # A in IEEE fp32, the rest in TF32
        tf32_grams = precision == "tf32" and device.type == "cuda"  # (θᵀθ in one TF32 pass: a GPU's at "tf32")
        self.unit, self.dtype = store_unit(dtype, tf32_grams), dtype  # the guard's rounding allowance for θ₊
        # (the update's θM_θ runs in cuBLAS at the step's precision: TF32 operands on a GPU but at "ieee")
        tf32_products = precision != "ieee" and self.cdt == torch.float32 and device.type == "cuda"
        self.operand_unit = TF32_UNIT if tf32_products else 0.0
        self.params = [params[i] for i in idx]
        self.grads = [grads[i] for i in idx]
        self.bufs = [bufs[i] for i in idx] if writes_phi else []
        self.c_o, self.m = (p, n) if rows else (n, p)  # W2 is c_o × m (a row shard may hold 0 rows)
        self.numel = n * p
        self.viewable = [  # (a contiguous non-empty tensor is: no view made to find out)
            all((t.numel() > 0 and t.is_contiguous() or w2(t) is not None) and t.dtype == self.cdt for t in ts)
            for ts in zip(self.params, self.grads, *([self.bufs] if writes_phi else []))
        ]

    # -- planning -------------------------------------------------------------------------
    def chunks(self, middle_numel: int) -> list[list[Chunk]]:
        """Middle chunks (lists of GEMM chunks): at most ``middle_numel`` elements of p × p
        blocks per middle chunk, at most ``self.stack_numel`` elements per stack slot (0: no
        stacking) per GEMM chunk; at least one layer each."""
        count, stack_numel = len(self.layers), self.stack_numel
        per_middle = max(1, middle_numel // max(1, MIDDLE_BLOCKS * self.p * self.p))
        per_stack = max(1, stack_numel // max(1, self.numel)) if stack_numel else 1
        out = []
        for s in range(0, count, per_middle):
            e = min(count, s + per_middle)
            gemm = []
            if stack_numel:  # (a chunk of one layer is staged only if its tensors cannot be viewed)
                gemm = [Chunk(a, min(e, a + per_stack), True) for a in range(s, e, per_stack)]
                gemm = [Chunk(c.s, c.e, c.e - c.s > 1 or not self.viewable[c.s]) for c in gemm]
            else:
                gemm = [Chunk(a, a + 1, not self.viewable[a]) for a in range(s, e)]
            out.append(gemm)
        return out

    # -- operands -------------------------------------------------------------------------
    def _slot(self, slot: torch.Tensor, ch: Chunk) -> torch.Tensor:
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

    def _stack(self, slot: torch.Tensor, tensors: list[torch.Tensor], ch: Chunk) -> torch.Tensor:
        """``tensors[s:e]`` copied into ``slot`` as a (c, c_o, m) stack (W2 layout)."""
        stack = self._slot(slot, ch)
        part = tensors[ch.s : ch.e]
        shape = part[0].shape
        if all(t.shape == shape for t in part):  # one op, no per-layer views (measured 1.7× faster)
            torch.stack(part, out=stack.view(len(part), *shape))
        else:
            torch._foreach_copy_(self._shaped(stack, part), part)
        return stack

    def _operand(self, slot, tensors, ch: Chunk) -> torch.Tensor:
        """The (c, c_o, m) W2 operand of the chunk: staged, or the tensor's own memory."""
        return self._stack(slot, tensors, ch) if ch.staged else w2(tensors[ch.s])

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
        self.guard = dict(radius=trust_radius, limit=max_distance, variant=variant, operand_unit=self.operand_unit)
        self.predict = trust_radius is not None or max_distance is not None
        self.mids, self.coefs, self.no_reset = [], [], True

    def block_count(self) -> int:
        """How many ``(p, p)`` Gram blocks :meth:`grams` fills per layer."""
        return (4 if self.reads_phi else 2) + (1 if self.predict else 0)

    def grams(
        self,
        scratch: list[torch.Tensor],
        gemm_chunks: list[Chunk],
        out: list[torch.Tensor],
        carried: int = 0,
        velocity: bool = True,
    ) -> None:
        """Into ``out``: ``[A, E]`` or ``[A, E, B, C]`` of a middle chunk (``(c, p, p)`` each), sums
        over the (local) rows of θ; with a prediction and ``velocity`` also the guard's velocity
        Gram (:meth:`_velocity`; ``‖g‖²`` is the group's, :func:`.torch_groups.grad_sq_into`). ``carried``: 1 where
        A, 3 where A, B and C are already in ``out`` (carried from the last step: :mod:`.carry`),
        not formed again."""
        sizes = [ch.e - ch.s for ch in gemm_chunks]
        # each block's rows per GEMM chunk ([A, E(, B, C)(, UᵀU or G)]; an unfilled block None)
        blocks = [parts(b, sizes) if b is not None else None for b in out[: self.block_count()]]
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

    def _velocity(self, scratch, ch: Chunk, grad, phi, out: torch.Tensor, scale: torch.Tensor | None = None) -> None:
        """``out`` = the guard's ``UᵀU`` of a GEMM chunk (``U = βΦ − ηg`` formed in the g slot: one
        Gram instead of ``gᵀg`` and ``Φᵀg``; g itself is read again by the update), or without Φ
        ``G = gᵀg`` (U = −ηg). With ``scale`` (the chunk's trust scales s, ``(c,)``): ``(sU)ᵀ(sU)``,
        with Φ or without: a finite U too large for its float32 Gram (‖U‖ > ~1.8e19) gives the
        scaled velocity the reference forms from sΦ and sg, not an overflow."""
        if phi is None and scale is None:
            self._gram(grad, grad, out)  # G = gᵀg
            return
        u = scratch[2][: (ch.e - ch.s) * self.numel].view(grad.shape)
        if scale is None:
            torch.mul(grad, -self.lr, out=u).add_(phi, alpha=self.beta)  # U = βΦ − ηg
        else:
            s = scale.to(self.cdt).view(-1, 1, 1)
            torch.mul(grad, s * -self.lr, out=u)  # sU = −sηg …
            if phi is not None:
                u.addcmul_(phi, s * self.beta)  # … + sβΦ
        self._gram(u, u, out)  # UᵀU (or (sU)ᵀ(sU))

    def velocity_grams(
        self,
        scratch: list[torch.Tensor],
        gemm_chunks: list[Chunk],
        out: torch.Tensor,
        scale: torch.Tensor | None = None,
    ) -> None:
        """Into ``out`` (``(c, p, p)``): the velocity Grams of a middle chunk alone, in a pass of their
        own (where the middle asks for them after all: :meth:`.torch_groups.Group.middle`); with
        ``scale`` (``(c,)``), those of sU (:meth:`_velocity`)."""
        sizes = [ch.e - ch.s for ch in gemm_chunks]
        scales = parts(scale, sizes) if scale is not None else [None] * len(sizes)
        for ch, part, s in zip(gemm_chunks, parts(out, sizes), scales):
            grad = self._operand(scratch[2], self.grads, ch)
            phi = self._operand(scratch[1], self.bufs, ch) if self.reads_phi else None
            self._velocity(scratch, ch, grad, phi, part, s)

    def symmetric_slots(self) -> tuple[int, ...]:
        """Positions of the symmetric blocks (A, C, UᵀU or G) in what :meth:`grams` returns."""
        if self.reads_phi:
            return (0, 3, 4) if self.predict else (0, 3)
        return (0, 2) if self.predict else (0,)

    def take(self, gemm_chunks: list[Chunk], mid: Middle, coef: torch.Tensor, no_reset: bool) -> None:
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
        m_phi = parts(self.m_phi, sizes) if self.writes_phi else [None] * len(chunks)
        for ch, mp, ms in zip(chunks, m_phi, parts(self.m_second, sizes)):
            self._update(scratch, ch, mp, ms)

    def _update(self, scratch, ch: Chunk, m_phi: torch.Tensor | None, m_second: torch.Tensor) -> None:
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
            g_views = w2(grads[0])
        if self.writes_phi:
            bufs = self.bufs[i]
            if not ch.staged:
                phi = w2(bufs[0])  # Φ's own storage
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
                zero_where(phi, skip_u)  # reset: Φ₊ = 0
            elif g_views is None:
                zero_where(phi.mul_(eta_s), skip_g)  # the slot holds g: −sηg
                self._add_theta_times(phi, theta, m_phi)  # Φ₊ = −sηg + θ M_Φ
            else:
                zero_where(torch.mul(g_views, eta_s, out=phi), skip_g)  # −sηg
                self._add_theta_times(phi, theta, m_phi)  # Φ₊ = −sηg + θ M_Φ
            self._add_theta_times(phi, theta, m_second, out=out)  # O = Φ₊ + θF
            if ch.staged:
                torch._foreach_copy_(bufs, self._shaped(phi, bufs))  # Φ ← Φ₊
        elif g_views is None:
            torch._foreach_copy_(self._shaped(out, grads), grads)
            zero_where(out.mul_(eta_s), skip_g)  # −sηg
            self._add_theta_times(out, theta, m_second)  # O = −sηg + θ M_θ
        else:
            zero_where(torch.mul(g_views, eta_s, out=out), skip_g)  # −sηg
            self._add_theta_times(out, theta, m_second)  # O = −sηg + θ M_θ
        if ch.staged:
            torch._foreach_add_(params, self._shaped(out, params))  # θ₊ = θ + O
        else:
            theta.add_(out)


def zero_where(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x[k] ← 0`` where the ``(c, 1, 1)`` per-layer ``mask`` holds (``x``: ``(c, …)``, or one
    layer's 2-D view when ``c = 1``); in place, returns ``x`` (``mask=None``: nothing to zero)."""
    if mask is None:
        return x
    return x.masked_fill_(mask.reshape((mask.shape[0],) + (1,) * (x.dim() - 1)), 0.0)
