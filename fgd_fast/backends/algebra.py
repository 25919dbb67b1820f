"""The O(p³) middle of the two-pass step (docs/algorithm.md §3), shared by every batched
backend, and the step guard.

Given the Gram blocks of a batch of layers with the same p — ``A = θᵀθ``, ``B = θᵀΦ``,
``C = ΦᵀΦ``, ``E = θᵀg``, each ``(L, p, p)`` — it returns ``M_Φ`` and ``M_θ`` of the update
pass (``Φ₊ = sU + θ M_Φ``, ``θ₊ = θ + sU + θ M_θ``, ``U = βΦ − ηg``, with the guard's scale
``s``: 1 where it does not bind, and then this is exactly the authors' update) and the
per-layer checks. Without Φ (first step, ``momentum == 0``) pass ``b = c = None``.

**The guard** (``guard=``). Its one rule, the same in every backend (reference included):
the step written is the one of largest weight ``t ∈ [0, 1]`` whose distance after the step,
``‖θ₊ᵀθ₊ − I‖_F``, computed exactly (to rounding) before anything is written, is within the
target ``limit − margin``.

* Inputs. With ``r = ‖Φ‖_F + η‖g‖_F`` (``‖Φ‖² = tr C``, ``‖g‖²`` from the backend in
  float64), Φ and g are scaled by ``s = min(1, ρ/r)`` (``s = 0`` where r overflows). ρ is a
  numerical safety net (default 4: the middle's terms stay ≤ ρ⁴ and fp32 keeps ~1e-5 of the
  distance), far above what training produces; the distance decides the rest.
* Exact distance. ``θ₊ = θK + sU`` with ``K = I + M_θ``, so ``θ₊ᵀθ₊ − I =
  KᵀAK + KᵀT + TᵀK − I + s²UᵀU`` with ``T = θᵀ(sU)`` and ``UᵀU = β²C − βη(H + Hᵀ) + η²G``
  from the Gram blocks ``H = Φᵀg``, ``G = gᵀg``: every term is a ``p × p`` block the step
  has, so the prediction is the distance itself, not a bound. (Where a host read is free the
  torch backend may first bound ``‖s²UᵀU‖_F`` by :func:`velocity_bound`, and the rest by
  :func:`step_bound` from norms, and form the rest's two products and then ``UᵀU`` only when a
  layer's bounded distance leaves the target: ``middle(uu_later=)``; the decisions are those of
  the exact distances.)
* Blend. The pull-back ``θ₊ = θK₀``, ``K₀ = I − αD`` (D = A − I), ``Φ₊ = 0`` is the step of
  weight 0; weight t writes ``θ₊ = θK₀ + t(θΔ + sU)`` with ``Δ = K − K₀`` and ``Φ₊ = t·Φ₊``,
  so ``θ₊ᵀθ₊ − I = D₀ + tX₁ + t²X₂``: ``D₀ = (1 − 2α)D + (α² − 2α)D² + α²D³`` (exact: K₀ is
  a polynomial in D), ``X₁ = 2 sym(K₀(AΔ + T))``, ``X₂ = ΔᵀAΔ + ΔᵀT + TᵀΔ + s²UᵀU``.
  ``t`` is the largest of 1, 2^−½, 2^−1, …, 2^−7 whose distance is within the target (its
  square is a quartic in t from six inner products), else 0: KEPT (``t = s = 1``), SCALED, or
  RESET (``t = 0``). A reset whose pull-back is itself beyond the target takes ``α = ½``
  instead, ``θ₊ = θ(3I − A)/2`` (Newton–Schulz: distance ``‖¾D² − ¼D³‖``, second order), when
  that is nearer. So with the guard on, a finite step never needs to raise. Where a host read
  is free (:data:`HOST_READ_DEVICES`: a CPU) the full step's distance (:func:`step_distance`,
  two products) is computed first and the blend only when some layer's leaves the target.
* Margin. The parameter is stored after rounding; with the unit roundoff ``u`` of its dtype
  (and a few of the compute dtype), ``θ̃ = θ₊ + E``, ``‖E‖_F ≤ u‖θ₊‖_F``, moves the distance by
  at most ``2‖θ₊‖₂‖E‖_F + ‖E‖²_F`` with ``‖θ₊‖₂² ≤ 1 + L``, ``‖θ₊‖²_F ≤ p + √p·L`` (L the
  limit): that is subtracted from the limit (~1e-5 for float32, ~0.08 for a 64-column
  bfloat16 layer).

**Variants** (``variant=``). ``"official"`` is the authors' code: ``θ₊ = θ + Φ₊ − αθ(A − I)``.
``"paper"`` is Algorithm 1 as printed, read as "Φ first, then θ with the new Φ": the θ step
takes only the tangent part of the velocity, ``θ₊ = θ + Φ₊ − θN sym(θᵀΦ₊) − αθ(A − I)``. With
``θᵀΦ₊ = θᵀ(sU) + A M_Φ = T + A M_Φ`` that is one more ``p × p`` term in ``M_θ``:
``M_θ = M_Φ + F``, ``F = −α(A − I) − N sym(T + A M_Φ)``; the update pass is unchanged.

``lr``, ``beta``, ``alpha`` are floats or ``(L, 1, 1)`` tensors (per-layer values).

**Products.** Every ``p × p`` product goes through :func:`mm`, :func:`mm_add` or
:func:`i_plus_d` (one place, so a check can run them at another precision), and every product
with ``N = 2I − A = I − D`` or ``A = I + D`` is written as ``X ∓ D·X`` (:func:`i_plus_d`): the
identity's part is exact and only the small correction ``D·X`` (``‖D‖`` ~1e-6…1e-2) is a
product. So a middle run on TF32 tensor cores (``precision="tf32"``/``"tf32x3"``) keeps fp32
accuracy where it matters: TF32's ~2⁻¹¹ relative error touches ``D·X`` and the second-order
terms, not ``X``; in ``(I − D)·X`` it would round ``I − D`` itself (``1 − 1e-6`` is 1 in
TF32) and lose D altogether (``benchmarks/studies/tf32_middle.py`` measures both on the
workloads with TF32 emulated: :func:`.tf32.emulated_tf32_middle`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._matrix import as_stiefel
from .layout import Layout

VARIANTS = ("official", "paper")

__all__ = [
    "VARIANTS",
    "Middle",
    "middle",
    "sym",
    "trust_scale",
    "WEIGHTS",
    "store_unit",
    "guard_target",
    "storable",
    "choose_weight",
    "pull_back_distances",
    "velocity_gram",
    "velocity_bound",
    "step_distance",
    "next_grams",
    "full_steps_fit",
    "guard_codes",
    "HOST_READ_DEVICES",
    "host_reads_free",
    "join_checks",
    "grad_sq",
    "velocity_blocks",
    "scaled_hyper",
]

Scalar = float | torch.Tensor


class Middle(NamedTuple):
    m_theta: torch.Tensor  # (L, p, p) M_θ = M_Φ + F
    m_phi: torch.Tensor  # (L, p, p) M_Φ
    feedback: torch.Tensor  # (L, p, p) F = M_θ − M_Φ, so that θ₊ = θ + Φ₊ + θF (official: −α(A − I))
    dist: torch.Tensor  # (L,) ‖A − I‖_F
    finite: torch.Tensor  # (L,) bool: inputs finite (‖g‖² and tr C; without them E = θᵀg)
    scale: torch.Tensor | None = None  # (L,) s of the update pass U → sU (None: 1, no guard)
    dist_next: torch.Tensor | None = None  # (L,) bound of ‖θ₊ᵀθ₊ − I‖_F (None: not predicted)
    finite_next: torch.Tensor | None = None  # (L,) bool: θ₊, Φ₊ finite
    guarded: torch.Tensor | None = None  # (L,) int8: guards.KEPT / SCALED / RESET
    carried: tuple | None = None  # (A₊, B₊, C₊) or (A₊,) of the full step (see next_grams), where asked for

    def checks(self) -> tuple:
        """The per-layer fields ``dist … guarded``, in :class:`Checks`' order, as a plain tuple
        (what outlives the middle: a compiled step may hold it across its graph break, where
        torch 2.11's Dynamo cannot rebuild a NamedTuple made in the traced code)."""
        return tuple(self[3:9])


def mm(x: torch.Tensor, y: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ y``: a ``p × p`` product of the middle (into ``out`` if given)."""
    return torch.matmul(x, y, out=out) if out is not None else torch.matmul(x, y)


def mm_add(
    z: torch.Tensor, x: torch.Tensor, y: torch.Tensor, out: torch.Tensor | None = None, alpha: float = 1.0
) -> torch.Tensor:
    """``z + α·x @ y`` (a new tensor, or ``out``): a ``p × p`` product of the middle added to ``z``."""
    if z.dim() == x.dim() == y.dim() == 3:
        if out is not None:
            return torch.baddbmm(z, x, y, alpha=alpha, out=out)
        return torch.baddbmm(z, x, y, alpha=alpha)
    product = torch.matmul(x, y)
    return torch.add(z, product, alpha=alpha, out=out) if out is not None else torch.add(z, product, alpha=alpha)


def i_plus_d(d: torch.Tensor, x: torch.Tensor, alpha: Scalar, extra: torch.Tensor | None = None) -> torch.Tensor:
    """``(I + αD)·X (+ extra)``, as ``X + α·D·X``: the identity's part exact, only the small
    correction ``D·X`` a product (``N = I − D``: α = −1; ``A = I + D``: α = 1)."""
    z = x if extra is None else x + extra
    if isinstance(alpha, (int, float)) and z.dim() == d.dim() == x.dim() == 3:
        return torch.baddbmm(z, d, x, alpha=alpha)
    return z + alpha * mm(d, x)


def sym(m: torch.Tensor) -> torch.Tensor:
    """``sym(M) = (M + Mᵀ)/2`` of a matrix or a batch of matrices."""
    return 0.5 * (m + m.transpose(-1, -2))


def _axpy(x: torch.Tensor, y: torch.Tensor, a) -> torch.Tensor:
    """``x + a·y`` (a new tensor) in one op where ``a`` is a number."""
    return torch.add(x, y, alpha=a) if isinstance(a, (int, float)) else x + a * y


def _axpy_(x: torch.Tensor, y: torch.Tensor, a) -> torch.Tensor:
    """``x ← x + a·y`` in place (``x`` a temporary of the middle; each block it does not allocate
    is one cold buffer fewer: the middle's ops are memory-bound on a CPU)."""
    return x.add_(y, alpha=a) if isinstance(a, (int, float)) else x.add_(a * y)


def _plus_t(lay: Layout, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x + yᵀ`` per layer (a new tensor); with several p the gathered ``yᵀ`` is new already and
    takes ``x`` in place."""
    return x + lay.t(y) if lay.single else lay.t(y).add_(x)


# -- the middle's products over a layout (per group; see :mod:`.layout`) ----------------------
def _mm(lay: Layout, x, y, tx: bool = False) -> torch.Tensor:
    """``XY`` (``XᵀY`` with ``tx``) per layer."""
    if lay.products is not None:  # the backend's (one launch for every p)
        return lay.products(lay, x, y, tx=tx)
    if lay.single:
        return mm(x.transpose(-1, -2) if tx else x, y)
    out = lay.empty(x.dtype)
    for xk, yk, ok in zip(lay.pieces(x), lay.pieces(y), lay.pieces(out)):
        mm(xk.transpose(-1, -2) if tx else xk, yk, out=ok)
    return out


def _mm_add(lay: Layout, z, x, y, tx: bool = False, alpha: float = 1.0) -> torch.Tensor:
    """``Z + αXY`` (``Z + αXᵀY`` with ``tx``) per layer."""
    if lay.products is not None:
        return lay.products(lay, x, y, z=z, alpha=alpha, tx=tx)
    if lay.single:
        return mm_add(z, x.transpose(-1, -2) if tx else x, y, alpha=alpha)
    out = lay.empty(x.dtype)
    for zk, xk, yk, ok in zip(lay.pieces(z), lay.pieces(x), lay.pieces(y), lay.pieces(out)):
        mm_add(zk, xk.transpose(-1, -2) if tx else xk, yk, out=ok, alpha=alpha)
    return out


def _i_plus_d(lay: Layout, d, x, alpha: Scalar, extra=None) -> torch.Tensor:
    """``(I + αD)·X (+ extra)`` per layer as ``X + α·D·X`` (:func:`i_plus_d`); ``alpha`` a
    number or ``L`` per-layer values."""
    if lay.products is not None:
        return lay.products(lay, d, x, z=x if extra is None else x + extra, alpha=alpha)
    if lay.single:
        return i_plus_d(d, x, lay.col(alpha), extra)
    z = x if extra is None else x + extra
    if not isinstance(alpha, (int, float)):  # per-layer α
        return z + lay.col(alpha) * _mm(lay, d, x)
    return _mm_add(lay, z, d, x, alpha=alpha)


def finite_of(x: torch.Tensor) -> torch.Tensor:
    """``isfinite(x)`` in two ops (``x − x == 0``: NaN for Inf and NaN; torch's isfinite is a
    composite of four or five, and the middle runs on the host's launch budget)."""
    return (x - x) == 0


def all_finite(m: torch.Tensor, layout: Layout | None = None) -> torch.Tensor:
    """Per matrix of a ``(L, p, p)`` batch (or a block of ``layout``): every entry finite
    (``Σ 0·m == 0``: an Inf or NaN makes the sum NaN; a finite m cannot overflow it), in three ops."""
    return (layout or Layout.of(m)).sums(m * 0) == 0


def inputs_finite(g_norm: torch.Tensor, phi_sq: torch.Tensor, e: torch.Tensor, layout: Layout | None = None):
    """Per layer: g and Φ finite, from ‖g‖ (float64: no overflow for a finite float32 g), ‖Φ‖²
    and E = θᵀg: a float64 g so large that ‖g‖² overflows is still finite when E is."""
    return (finite_of(g_norm) | (torch.isinf(g_norm) & all_finite(e, layout))) & finite_of(phi_sq)


def _per_layer(x: Scalar) -> Scalar:
    """A ``(L, 1, 1)`` hyper-parameter as ``(L,)`` float64; a float stays a float."""
    return x.reshape(-1).to(torch.float64) if isinstance(x, torch.Tensor) else float(x)


def trust_scale(
    phi_norm: torch.Tensor,
    g_norm: torch.Tensor,
    lr: Scalar,
    radius: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, r)``: ``r = ‖Φ‖ + η‖g‖`` and ``s = min(1, ρ/r)`` per layer (float64), with ``s = 0``
    where ``r`` is not finite (an overflowing or non-finite input: the step is reset)."""
    r = phi_norm + _per_layer(lr) * g_norm  # r = ‖Φ‖_F + η‖g‖_F
    s = torch.clamp(radius / r, max=1.0)  # r = 0 gives inf → 1
    return torch.where(finite_of(r), s, 0.0), r


#: Devices on which a host read costs nothing (a CPU): there the guard first computes every full
#: step's distance alone and blends only when one leaves the target (the common case costs two
#: products instead of five), and the update skips masks that select nothing. Elsewhere (CUDA:
#: no host read, the step stays capturable) and under ``torch.compile`` every layer is blended
#: and every mask applied. Both give the same step, to rounding.
HOST_READ_DEVICES = ("cpu",)


def host_reads_free(device: torch.device) -> bool:
    """Whether the step may read device values on the host here (see :data:`HOST_READ_DEVICES`)."""
    return device.type in HOST_READ_DEVICES and not torch.compiler.is_compiling()


#: Where the full step's distance is bounded (``middle(uu_later=)``), first from norms alone
#: (:func:`step_bound`), its two products only where that leaves the target; measured 2–14%
#: faster per step on the CPU workloads (``benchmarks/studies/torch_knobs.py``)
_NORM_BOUND_FIRST = True

#: The blend weights the guard tries, largest first (2^(−k/2), k = 0…14), and 0.
WEIGHTS = tuple(2.0 ** (-k / 2) for k in range(15)) + (0.0,)


def store_unit(dtype: torch.dtype) -> float:
    """The rounding allowance of a parameter stored in ``dtype``: its unit roundoff plus a few
    of the compute dtype's (θ₊ is computed in float32/float64 and then rounded to ``dtype``)."""
    compute = 2.0**-53 if dtype == torch.float64 else 2.0**-24
    stored = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}.get(dtype, 0.0)
    return stored + 8.0 * compute


def storable(dist_next: torch.Tensor, p: int, dtype: torch.dtype | None) -> torch.Tensor:
    """θ₊ of distance ``dist_next`` fits ``dtype`` (its largest entry ≤ ‖θ₊‖_F ≤ √(p + √p·d)):
    a θ₊ finite in float32 can still overflow a float16 parameter."""
    if dtype is None or dtype in (torch.float32, torch.float64):  # a finite float32/float64 θ₊ fits its own dtype
        return finite_of(dist_next)
    top = torch.finfo(dtype).max
    return finite_of(dist_next) & (dist_next * p**0.5 + p < top * top)


def guard_target(limit: float | None, p: int, unit: float) -> float:
    """``limit − margin``: the largest exact distance of the computed θ₊ whose rounded, stored
    value is still within ``limit`` (see the module docstring; ``inf`` for no limit)."""
    if limit is None:
        return float("inf")
    err = unit * (p + p**0.5 * limit) ** 0.5  # ‖E‖_F ≤ u‖θ₊‖_F
    return limit - 2.0 * (1.0 + limit) ** 0.5 * err - err * err  # − 2‖θ₊‖₂‖E‖ − ‖E‖²


_powers_on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _powers(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(t, Q)`` for the positive weights of :data:`WEIGHTS` (float64, cached per device): the
    weights, and per weight the 9 coefficients ``[1, t, t²]ᵢ[1, t, t²]ⱼ`` that turn the inner
    products ``⟨Dᵢ, Dⱼ⟩`` into ``‖D₀ + tX₁ + t²X₂‖²`` (one product for every weight)."""
    if device not in _powers_on:
        with torch.inference_mode(False):  # (kept across steps: see torch_batched)
            _powers_on[device] = _weight_powers(device)
    return _powers_on[device]


def _weight_powers(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.tensor(WEIGHTS[:-1], dtype=torch.float64)
    v = torch.stack((torch.ones_like(t), t, t * t), 1)  # (k, 3)
    return t.to(device), (v[:, :, None] * v[:, None, :]).reshape(-1, 9).to(device)


class Blend(NamedTuple):
    weight: torch.Tensor  # (L,) float64 t: 1 the full step … 0 the pull-back
    newton: torch.Tensor  # (L,) bool: a reset that takes α = ½ (Newton–Schulz) instead of α
    dist: torch.Tensor  # (L,) float64 ‖θ₊ᵀθ₊ − I‖_F of the step chosen


def choose_weight(d0, x1, x2, d_newton, *, target: float, movable: torch.Tensor, layout: Layout | None = None) -> Blend:
    """The guard's rule (one for every backend): the largest t of :data:`WEIGHTS` with
    ``‖D₀ + tX₁ + t²X₂‖_F ≤ target`` where ``movable`` (the full step is finite), else 0; at 0
    the Newton–Schulz pull-back ``d_newton`` where the α pull-back ``D₀`` is beyond the target
    and farther. ``d0, x1, x2, d_newton``: ``(L, p, p)`` distance matrices (or blocks of
    ``layout``)."""
    lay = layout or Layout.of(d0)
    inner = lay.inner([d0, x1, x2])  # ⟨Dᵢ, Dⱼ⟩, i, j ∈ {0, 1, 2}, float64
    weights, coef = _powers(d0.device)
    quartic = inner.reshape(-1, 9) @ coef.T  # ‖D₀ + tX₁ + t²X₂‖² per (layer, t)
    limit2 = target * target if not isinstance(target, torch.Tensor) else (target * target).unsqueeze(1)
    fits = (quartic <= limit2) & movable.unsqueeze(1)  # (L, k); NaN compares False
    first = torch.argmax(fits.to(torch.int8), dim=1)  # the largest t that fits (argmax: the first maximum)
    weight = torch.where(fits.any(1), weights[first], 0.0)
    w = lay.col(weight.to(d0.dtype))
    chosen = torch.where(w > 0, d0 + w * x1 + (w * w) * x2, d0)  # (no 0·NaN at t = 0)
    dist = lay.norm(chosen).to(torch.float64)
    exact_fits = dist <= target  # the quartic and the direct sum agree but for rounding: re-check
    weight = torch.where(exact_fits | (weight == 0), weight, 0.0)
    dist = torch.where(exact_fits | (weight > 0), dist, inner[:, 0, 0].sqrt())
    d_ns = lay.norm(d_newton).to(torch.float64)
    newton = (weight == 0) & ~(dist <= target) & (d_ns < dist)
    return Blend(weight, newton, torch.where(newton, d_ns, dist))


def pull_back_distances(a_minus_i: torch.Tensor, alpha: Scalar, layout: Layout | None = None):
    """``(D₀, D_ns)``: ``θ₊ᵀθ₊ − I`` of the pull-back ``θ₊ = θ(I − αD)`` and of the Newton–Schulz
    step ``θ₊ = θ(I − D/2)``, exactly (``D = A − I``; both are polynomials in D). ``alpha``: a
    float or per-layer values broadcast to the blocks."""
    lay = layout or Layout.of(a_minus_i)
    d = a_minus_i
    d2 = _mm(lay, d, d)
    d3 = _mm(lay, d2, d)
    d0 = (1.0 - 2.0 * alpha) * d + (alpha * alpha - 2.0 * alpha) * d2 + (alpha * alpha) * d3
    return d0, d3.mul_(0.25).sub_(d2.mul_(0.75))  # (1 − 2α)D + (α² − 2α)D² + α²D³;  −¾D² + ¼D³


def velocity_gram(c, h, gg, beta: Scalar, lr: Scalar, layout: Layout | None = None) -> torch.Tensor:
    """``UᵀU = β²C − βη(H + Hᵀ) + η²G`` for ``U = βΦ − ηg`` from ``C = ΦᵀΦ``, ``H = Φᵀg`` (or
    its transpose: only H + Hᵀ enters), ``G = gᵀg`` (without Φ: ``c = h = None``, ``UᵀU = η²G``)."""
    w = gg * (lr * lr)  # η²G
    if c is not None:
        w = w + c * (beta * beta) - (h + (layout or Layout.of(h)).t(h)) * (beta * lr)  # + β²C − βη(H + Hᵀ)
    return w


def velocity_bound(phi_norm: torch.Tensor, g_norm: torch.Tensor, beta: Scalar, lr: Scalar, scale=None) -> torch.Tensor:
    """``(s(β‖Φ‖_F + η‖g‖_F))²`` per layer (float64): an upper bound of ``‖s²UᵀU‖_F`` for ``U = βΦ − ηg``
    (``‖UᵀU‖_F ≤ ‖U‖₂‖U‖_F ≤ ‖U‖²_F``, and the triangle inequality), from the norms the trust
    scale reads: no Gram. In training it is ~r² ≲ 1e-2 (``benchmarks/studies/guard_headroom.py``),
    far inside the guard's target."""
    u = abs(_per_layer(beta)) * phi_norm + abs(_per_layer(lr)) * g_norm  # ‖U‖_F ≤ β‖Φ‖_F + η‖g‖_F
    u = u * scale if scale is not None else u
    return u * u


def guard_codes(scale: torch.Tensor) -> torch.Tensor:
    """int8 what the guard did, from the update's total scale ``ts ∈ [0, 1]`` per layer (finite:
    :func:`trust_scale` makes it so): ``guards.KEPT`` where it is 1, ``SCALED`` where it is in
    (0, 1), ``RESET`` where it is 0 (every backend)."""
    return (scale < 1.0).to(torch.int8) + (scale <= 0.0).to(torch.int8)  # 0 / 1 / 2


def full_steps_fit(dist_full: torch.Tensor, movable: torch.Tensor, target: float) -> bool:
    """Whether every layer's full step (t = 1) is finite and within ``target`` (a host read)."""
    return bool((movable & (dist_full <= target)).all())


def step_distance(a_minus_i, m, t, w, layout: Layout | None = None) -> torch.Tensor:
    """``θ₊ᵀθ₊ − I`` of ``θ₊ = θK + sU`` (``K = I + M``, ``M = M_θ``), exactly: ``KᵀAK + KᵀT + TᵀK
    − I + s²UᵀU = D + 2 sym(M + T + DM) + sym(Mᵀ(AM + 2T)) + s²UᵀU`` with ``AM = M + DM``, ``T =
    θᵀ(sU)``, ``w = s²UᵀU`` (None: left out): two products, and no ``I`` cancelled against ``KᵀAK``
    (whose rounding would be ~u·p where the distance may be 1e-6)."""
    lay = layout or Layout.of(a_minus_i)
    dm = _mm(lay, a_minus_i, m)  # DM
    x = dm.add(m).add_(t)
    v = _mm(lay, m, dm.add_(m).add_(t, alpha=2.0), tx=True)  # V = Mᵀ(AM + 2T), AM = M + DM
    # D + 2 sym(X) + sym(V) = D + Y + Yᵀ with Y = X + V/2: one transposed read, not two (on a CPU a
    # transposed operand is read element by element; not in place: Yᵀ may be a view)
    y = x.add_(v, alpha=0.5)
    out = _plus_t(lay, y, y).add_(a_minus_i)
    return out.add_(w) if w is not None else out


def step_bound(dist, m, t, layout: Layout | None = None) -> torch.Tensor:
    """``(L,)`` float64 upper bound of ‖θ₊ᵀθ₊ − I − s²UᵀU‖_F from norms alone (no product): with
    ``dist = ‖D‖_F``, :func:`step_distance`'s terms ``D + 2 sym(M + T) + 2 sym(DM) + MᵀAM +
    2 sym(MᵀT)`` are bounded by ‖sym X‖ ≤ ‖X‖, ‖XY‖_F ≤ ‖X‖_F‖Y‖_F and ‖A‖₂ ≤ 1 + ‖D‖_F:

    ``‖D‖ + 2‖M + T‖ + 2‖D‖‖M‖ + (1 + ‖D‖)‖M‖² + 2‖M‖‖T‖``.

    Equal to the exact distance where D = 0, M = 0 and T is symmetric. Its terms are of the
    step's size and its square (in training ``r = ‖Φ‖ + η‖g‖ ≲ 0.1``,
    ``benchmarks/studies/guard_headroom.py``), well inside the guard's target, so the middle's
    two products of :func:`step_distance` run only where this leaves it."""
    lay = layout or Layout.of(m)
    d = dist.to(torch.float64)
    nm, nt, nmt = lay.norms([m, t, m + t]).to(torch.float64).unbind(0)
    # ‖D‖ + 2‖M + T‖ + ‖M‖(2‖D‖ + (1 + ‖D‖)‖M‖ + 2‖T‖)
    return torch.addcmul(d + 2.0 * nmt, nm, torch.addcmul(2.0 * (d + nt), nm, 1.0 + d))


def next_grams(d_full, a_minus_i, m, m_phi, t, w, eye, layout: Layout) -> tuple[torch.Tensor, ...]:
    """``(A₊, B₊, C₊)``, the Gram blocks of the next step, from this step's ``p × p`` blocks
    (four products instead of three passes over θ and Φ): with ``θ₊ = θK + sU``, ``K = I + M``
    (``M = M_θ``), ``Φ₊ = sU + θM_Φ``, ``T = θᵀ(sU)``, ``W = s²UᵀU`` and ``Y = T + AM_Φ``:

    * ``A₊ = I + d_full`` (``d_full = θ₊ᵀθ₊ − I``, :func:`step_distance`);
    * ``C₊ = Φ₊ᵀΦ₊ = W + M_ΦᵀT + TᵀM_Φ + M_ΦᵀAM_Φ = W + sym(M_Φᵀ(Y + T))``;
    * ``B₊ = θ₊ᵀΦ₊ = KᵀT + KᵀAM_Φ + W + TᵀM_Φ = Y + W + MᵀY + TᵀM_Φ``.

    Exact to rounding: the Grams a pass over the stored θ₊, Φ₊ would give, but for the rounding
    of storing them (what the guard's margin allows per step carried)."""
    lay = layout
    y = _i_plus_d(lay, a_minus_i, m_phi, 1.0, t)  # Y = T + AM_Φ = T + M_Φ + DM_Φ
    c_next = lay.sym(_mm(lay, m_phi, y + t, tx=True)).add_(w)  # C₊ = W + sym(M_Φᵀ(Y + T))
    b_next = _mm_add(lay, _mm_add(lay, y + w, m, y, tx=True), t, m_phi, tx=True)  # B₊ = Y + W + MᵀY + TᵀM_Φ
    return d_full + eye, b_next, c_next


def _ahead(carry: int, d_full, a_minus_i, m, m_phi, t, w, eye, lay: Layout) -> tuple[torch.Tensor, ...] | None:
    """What ``middle(carry=)`` asked for: None (0), ``(A₊,)`` (1) or ``(A₊, B₊, C₊)`` (3)."""
    if not carry:
        return None
    return next_grams(d_full, a_minus_i, m, m_phi, t, w, eye, lay) if carry == 3 else (d_full + eye,)


def middle(
    a,
    b,
    c,
    e,
    *,
    lr: Scalar,
    beta: Scalar,
    alpha: Scalar,
    g_sq: torch.Tensor | None = None,
    h: torch.Tensor | None = None,
    gg: torch.Tensor | None = None,
    uu: torch.Tensor | None = None,
    radius: float | None = None,
    limit: float | None = None,
    unit: float = 0.0,
    stored: torch.dtype | None = None,
    variant: str = "official",
    carry: int = 0,
    layout: Layout | None = None,
    blend_kernels=None,
    uu_later=None,
) -> Middle:
    """The update's ``p × p`` matrices and checks; see the module docstring.

    ``g_sq``: ``(L, p)`` or ``(L,)`` sums of g² (float64), ``h = Φᵀg`` (with Φ) and ``gg = gᵀg``,
    or ``uu = UᵀU`` itself: needed for the guard or a prediction. ``radius``: the safety radius ρ, ``None`` for no guard
    (then s = t = 1). ``limit``: ``max_distance``; with ``radius`` it sets the guard's target
    (less the rounding margin of ``unit``, :func:`store_unit`), without it only ``dist_next``
    is reported; ``stored``: the parameters' dtype, whose range θ₊ must fit. Neither given: the
    plain update, no prediction. ``variant``: ``"official"`` or ``"paper"``. The blocks are
    scratch of this step: some are scaled in place. ``carry``: 1 or 3 to get the next step's
    ``(A₊,)`` or ``(A₊, B₊, C₊)`` in ``carried`` (:func:`next_grams`) where the full step is
    the one written for every layer (with a prediction; else ``carried`` is None).
    ``layout``: the blocks' :class:`.layout.Layout` (several p in one flat buffer; default: one
    ``(L, p, p)`` batch); ``lr``, ``beta``, ``alpha``: floats or ``L`` per-layer values.
    ``blend_kernels``: where the guard blends, do it by this function's launches
    (:func:`.guard_blend.blend`, the Triton backend's) instead of torch ops: the same rule.
    ``uu_later``: instead of ``uu``/``gg``, a callable that forms the velocity block (``UᵀU``, or
    ``G = gᵀg`` without Φ; unscaled) when called. Where a host read is free and nothing is
    carried, the full step's distance is then first bounded without it (:func:`velocity_bound`),
    from norms alone (:func:`step_bound`) and, where that leaves the target, with the exact rest
    (:func:`step_distance`); the block is formed only if some layer's bound still leaves the
    target: the same decisions, and ``dist_next`` is the bound where it stayed within (an exact
    value otherwise).
    """
    lay = layout or Layout.of(a)
    p = lay.groups[0][1] if lay.single else lay.p_per_layer()  # the guard's margin and range depend on p
    eye = lay.eye(a.dtype)
    a_minus_i = a - eye  # D = A − I  (N = 2I − A = I − D: NX = X − DX)
    dist = lay.norm(a_minus_i)  # ‖θᵀθ − I‖_F
    lr_, beta_, alpha_ = (lay.col(v) for v in (lr, beta, alpha))  # per-layer values broadcast to the blocks
    predict = radius is not None or limit is not None
    host = host_reads_free(a.device)  # (a CPU: skip what a host read shows is not needed)
    scale = scaled = None  # scaled: s² where the blocks were scaled
    if not predict:
        finite = all_finite(e, lay)  # E = θᵀg finite (without a prediction: the plain check)
    else:
        g_norm = g_sq.reshape(g_sq.shape[0], -1).sum(-1).sqrt()  # ‖g‖_F (float64)
        phi_sq = lay.trace(c).to(torch.float64) if b is not None else torch.zeros_like(g_norm)
        g_finite = finite_of(g_norm)
        if host and bool(g_finite.all()):  # every ‖g‖ finite: E's own check is not needed
            finite = g_finite & finite_of(phi_sq)
        else:
            finite = inputs_finite(g_norm, phi_sq, e, lay)
        phi_norm = phi_sq.sqrt()  # ‖Φ‖_F
        if radius is not None:
            scale, _ = trust_scale(phi_norm, g_norm, lr, radius)
        if scale is not None and not (host and float(scale.min()) == 1.0):  # s = 1 everywhere: nothing to scale
            # (in place: the callers' blocks are scratch of this step)
            s = lay.col(scale.to(a.dtype))  # exactly 1.0 where the radius does not bind
            s2 = s * s
            scaled = s2
            e = e.mul_(s)  # E → sE (exact when s = 1)
            gg, uu = (m.mul_(s2) if m is not None else None for m in (gg, uu))  # G → s²G, UᵀU → s²UᵀU
            if b is not None:
                b, c = b.mul_(s), c.mul_(s2)  # B → sB, C → s²C
                h = h.mul_(s2) if h is not None else None  # H → s²H
    if b is None:
        inner = (e + lay.t(e)).mul_(0.5 * lr_)  # η sym(E)
    else:
        half_e = e * (0.5 * lr_)  # (η/2)E
        sb = lay.sym(b)  # S = sym(B)
        nb = _i_plus_d(lay, a_minus_i, b, -1.0)  # NB = B − DB (and BᵀN = (NB)ᵀ: N is symmetric)
        # η sym(E) − αBᵀN = (η/2)E + Rᵀ, R = (η/2)E − α·NB: one transposed read for both (on a CPU a
        # transposed operand is read element by element)
        inner = _plus_t(lay, half_e, _axpy(half_e, nb, -alpha_))
        inner = _axpy_(_axpy_(inner.sub_(c), sb, -(beta_ - 1.0)), b, -alpha_)  # − C − (β−1)S − αB
        inner = _mm_add(lay, inner, nb, sb)  # + NB·S
        del nb, half_e
    m_phi = _i_plus_d(lay, a_minus_i, inner, -1.0)  # M_Φ = N[…] = […] − D[…]
    pull_back = -alpha_ * a_minus_i  # F₀ = −α(A − I)
    feedback = pull_back  # F = −α(A − I)
    t = None
    if variant == "paper" or predict:
        t = e * (-lr_)  # T = θᵀ(sU) = β sB − η sE
        if b is not None:
            t = _axpy_(t, b, beta_)
    if variant == "paper":  # the θ step's velocity projected on the tangent space
        z = lay.sym(_i_plus_d(lay, a_minus_i, m_phi, 1.0, t))  # sym(T + A M_Φ), A M_Φ = M_Φ + D M_Φ
        feedback = pull_back - _i_plus_d(lay, a_minus_i, z, -1.0)  # F = −α(A − I) − N sym(T + A M_Φ)
    m_theta = m_phi + feedback  # M_θ = M_Φ + F
    if not predict:
        return Middle(m_theta, m_phi, feedback, dist, finite)

    # (per layer with several p: kept with the layout, keyed on the rule itself)
    target = guard_target(limit, p, unit) if lay.single else lay.memo((guard_target, limit, unit), p)
    d_full = None
    if uu_later is not None and host and not carry:  # bound s²UᵀU first; form it only where that leaves the target
        velocity = velocity_bound(phi_norm, g_norm, beta, lr, scale)
        bound = step_bound(dist, m_theta, t, lay) + velocity if _NORM_BOUND_FIRST else None  # no product
        if bound is None or not full_steps_fit(bound, finite, target):  # the two products without s²UᵀU
            d_full = step_distance(a_minus_i, m_theta, t, None, lay)  # θ₊ᵀθ₊ − I − s²UᵀU
            bound = lay.norm(d_full).to(torch.float64) + velocity
        if full_steps_fit(bound, finite, target):  # the exact distances fit too: the same decisions
            fits = storable(bound, p, stored)
            if radius is None:
                return Middle(m_theta, m_phi, feedback, dist, finite, None, bound, fits & all_finite(m_phi, lay))
            return Middle(m_theta, m_phi, feedback, dist, finite, scale, bound, fits, guard_codes(scale))
        formed = uu_later()  # the Gram pass's velocity block after all: UᵀU, or G = gᵀg without Φ
        formed = formed.mul_(scaled) if scaled is not None else formed  # → s²UᵀU or s²G, as the blocks
        uu, gg = (formed, gg) if b is not None else (None, formed)
    # s²UᵀU (the blocks are scaled); the blend kernels form it from its parts where no host check needs it first
    w = uu if uu is not None or (blend_kernels is not None and not host) else velocity_gram(c, h, gg, beta_, lr_, lay)
    d_full = d_full.add_(w) if d_full is not None else None  # (bounded above: now exact)
    if radius is None:  # only the prediction
        w = w if w is not None else velocity_gram(c, h, gg, beta_, lr_, lay)
        d_full = step_distance(a_minus_i, m_theta, t, w, lay) if d_full is None else d_full
        dist_next = lay.norm(d_full).to(torch.float64)
        finite_next = storable(dist_next, p, stored) & all_finite(m_phi, lay)
        ahead = _ahead(carry, d_full, a_minus_i, m_theta, m_phi, t, w, eye, lay)
        return Middle(m_theta, m_phi, feedback, dist, finite, None, dist_next, finite_next, None, ahead)

    if host:
        d_full = step_distance(a_minus_i, m_theta, t, w, lay) if d_full is None else d_full  # θ₊ᵀθ₊ − I, full step
        dist_full = lay.norm(d_full).to(torch.float64)
        # (a non-finite M_Φ makes the full step's distance non-finite: it does not fit, and the blend checks M_Φ)
        if full_steps_fit(dist_full, finite, target):  # t = 1 for every layer
            fits = storable(dist_full, p, stored)
            ahead = _ahead(carry, d_full, a_minus_i, m_theta, m_phi, t, w, eye, lay)
            return Middle(m_theta, m_phi, feedback, dist, finite, scale, dist_full, fits, guard_codes(scale), ahead)

    # the guard: D(t) = D₀ + tX₁ + t²X₂ for θ₊ = θK₀ + t(θΔ + sU)
    delta = m_theta - pull_back  # Δ = K − K₀ = M_θ − F₀
    if blend_kernels is not None:  # the products here, the rest in three launches (guard_blend.py)
        d2 = _mm(lay, a_minus_i, a_minus_i)  # D²
        y = _i_plus_d(lay, a_minus_i, delta, 1.0, t)  # Y = AΔ + T
        scale, dist_next, fits, codes = blend_kernels(
            lay,
            d=a_minus_i,
            d2=d2,
            d3=_mm(lay, d2, a_minus_i),  # D³
            z=_i_plus_d(lay, a_minus_i, y, -alpha),  # Z = K₀Y (X₁ = Z + Zᵀ)
            v=_mm(lay, delta, y.add_(t), tx=True),  # V = Δᵀ(Y + T) (X₂ = sym(V) + s²UᵀU)
            w=w,
            gg=gg,
            c=c if b is not None else None,
            h=h,
            m_phi=m_phi,
            m_theta=m_theta,
            delta=delta,
            feedback=feedback,
            movable=finite,
            scale=scale,
            stored=stored,
            alpha=alpha,
            target=target,
            lr=lr,
            beta=beta,
        )
        return Middle(m_theta, m_phi, feedback, dist, finite, scale, dist_next, fits, codes)  # scale: ts
    movable = finite & all_finite(m_phi, lay)
    d0, d_newton = pull_back_distances(a_minus_i, alpha_, lay)
    y = _i_plus_d(lay, a_minus_i, delta, 1.0, t)  # Y = AΔ + T = Δ + DΔ + T = θᵀ(θΔ + sU)
    x1 = 2.0 * lay.sym(_i_plus_d(lay, a_minus_i, y, -alpha))
    # X₁ = 2 sym(K₀Y), K₀ = I − αD;  X₂ = ΔᵀAΔ + ΔᵀT + TᵀΔ + s²UᵀU = sym(Δᵀ(Y + T)) + s²UᵀU
    # (ΔᵀAΔ symmetric, ΔᵀT + TᵀΔ = 2 sym(ΔᵀT))
    x2 = lay.sym(_mm(lay, delta, y.add_(t), tx=True)).add_(w)
    del y, t, w
    movable = movable & all_finite(x2, lay)
    blend = choose_weight(d0, x1, x2, d_newton, target=target, movable=movable, layout=lay)
    del x1, x2, d0, d_newton
    weight = lay.col(blend.weight.to(a.dtype))
    alpha_m = alpha_.to(a.dtype) if isinstance(alpha_, torch.Tensor) else torch.full_like(weight, alpha_)
    base = a_minus_i * -torch.where(lay.col(blend.newton), 0.5, alpha_m)  # F₀ = −α'D (α' = ½: Newton–Schulz)
    whole, moving = weight == 1.0, weight > 0
    m_phi = torch.where(whole, m_phi, torch.where(moving, m_phi * weight, 0.0))  # tM_Φ (a reset: Φ₊ = 0)
    m_theta = torch.where(whole, m_theta, torch.where(moving, base + delta * weight, base))  # F₀ + tΔ
    feedback = torch.where(whole, feedback, torch.where(moving, base + (feedback - pull_back) * weight, base))
    scale = scale * blend.weight  # U → tsU
    fits = storable(blend.dist, p, stored)
    return Middle(m_theta, m_phi, feedback, dist, finite, scale, blend.dist, fits, guard_codes(scale))


class Checks(NamedTuple):
    """The per-layer fields of several :class:`Middle` batches, concatenated (``None`` where
    the batches did not compute them)."""

    dist: torch.Tensor
    finite: torch.Tensor
    scale: torch.Tensor | None
    dist_next: torch.Tensor | None
    finite_next: torch.Tensor | None
    guarded: torch.Tensor | None


def join_checks(parts: list[tuple]) -> Checks:
    """The per-layer checks of several middle batches (each :meth:`Middle.checks`), concatenated."""

    def cat(k: int) -> torch.Tensor | None:
        fields = [part[k] for part in parts]
        if not fields or any(t is None for t in fields):
            return None
        return fields[0] if len(fields) == 1 else torch.cat(fields)

    return Checks(cat(0).to(torch.float64), *(cat(k) for k in range(1, 6)))


def velocity_blocks(
    grads: list[torch.Tensor], phis: list[torch.Tensor] | None, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(G, H)``: ``gᵀg`` and ``Φᵀg`` (``None`` without Φ) of layers with one p, stacked
    ``(L, p, p)`` in ``dtype``, for backends whose Gram kernels do not form them (a batched
    product per block where the layers share a shape, else one per layer)."""
    gs = [as_stiefel(g).to(dtype) for g in grads]
    fs = [as_stiefel(f).to(dtype) for f in phis] if phis is not None else None
    if all(x.shape == gs[0].shape for x in gs):  # one shape: two batched products
        g3 = torch.stack(gs)
        return g3.mT @ g3, (torch.stack(fs).mT @ g3 if fs is not None else None)  # G = gᵀg, H = Φᵀg
    gg = torch.stack([x.mT @ x for x in gs])
    return gg, (torch.stack([f.mT @ x for f, x in zip(fs, gs)]) if fs is not None else None)


def grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """``(L,)`` float64 ``‖g‖_F`` per layer (one multi-tensor op; float64 accumulation, so a
    finite float32 gradient cannot overflow it), for backends whose Gram pass does not take
    it."""
    return torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float64))


def grad_sq(grads: list[torch.Tensor]) -> torch.Tensor:
    """``(L,)`` float64 ``‖g‖²`` per layer (:func:`grad_norm` squared)."""
    return grad_norm(grads).square()


def scaled_hyper(hyper: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """The ``(L, 3)`` table ``[η, β, α]`` of an update kernel with the guard's scale folded in:
    ``[sη, sβ, α]``, so that the kernel's ``U = βΦ − ηg`` becomes ``sU`` (the table itself
    when there is no guard)."""
    if scale is None:
        return hyper
    factor = torch.ones_like(hyper)
    factor[:, :2] = scale.to(hyper.dtype).unsqueeze(1)
    return hyper * factor  # s·η, s·β, α (exact where s = 1)
