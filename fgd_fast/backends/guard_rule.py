"""The step guard's numbers, the same in every backend (reference included): the trust scale,
the target and its rounding margin, the exact distance after a step, and the blend weight.

:func:`.algebra.middle` applies them to a batch of layers; this module holds the rule.

**The guard** (``guard=``). Its one rule, the same in every backend (reference included):
the step written is the one of largest weight ``t ∈ [0, 1]`` whose distance after the step,
``‖θ₊ᵀθ₊ − I‖_F``, computed exactly (to rounding) before anything is written, is within the
target ``limit − margin``.

* Inputs. With ``r = ‖Φ‖_F + η‖g‖_F`` (``‖Φ‖² = tr C``, ``‖g‖²`` from the backend in
  float64), Φ and g are scaled by ``s = min(1, ρ/r)`` (``s = 0``, a reset, where r overflows or
  s is below the blocks' dtype's smallest normal number, :data:`MIN_TRUST_SCALE` for float32,
  which those blocks cannot carry). ρ is a
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
  bfloat16 layer). Where it takes all of the limit (bfloat16 from p = 2,328 at the default 0.5)
  no step could be stored: a guarded step refuses such a parameter (:func:`fgd_fast.guards.check_guard_room`).

The finite checks are here too: a step is movable only where its inputs and its ``M_Φ`` are
finite, and the guard resets the rest.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .block_products import Scalar, block_mm, plus_t
from .layout import Layout

__all__ = [
    "finite_of",
    "all_finite",
    "inputs_finite",
    "per_layer",
    "trust_scale",
    "MIN_TRUST_SCALE",
    "HOST_READ_DEVICES",
    "host_reads_free",
    "WEIGHTS",
    "store_unit",
    "storable",
    "guard_target",
    "with_write_rounding",
    "TF32_UNIT",
    "Blend",
    "choose_weight",
    "pull_back_distances",
    "velocity_gram",
    "velocity_bound",
    "guard_codes",
    "full_steps_fit",
    "step_distance",
    "step_bound",
]


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


def per_layer(x: Scalar) -> Scalar:
    """A ``(L, 1, 1)`` hyper-parameter as ``(L,)`` float64; a float stays a float."""
    return x.reshape(-1).to(torch.float64) if isinstance(x, torch.Tensor) else float(x)


#: The smallest trust scale s the guard scales a step by: float32's smallest normal number. Below
#: it the layer is reset, as for a non-finite input: the middle applies s to float32 blocks (sE,
#: sB, s·(sG), …), where a subnormal s keeps a few bits and one below 1.4e-45 is 0, so the step
#: the guard predicted was not the one written with the exact sη (θ stored 8.5 from the manifold).
#: With the default ρ = 4 a reset needs ‖Φ‖ + η‖g‖ > 3.4e38.
MIN_TRUST_SCALE = 2.0**-126


def trust_scale(
    phi_norm: torch.Tensor,
    g_norm: torch.Tensor,
    lr: Scalar,
    radius: float,
    floor: float = MIN_TRUST_SCALE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, r)``: ``r = ‖Φ‖ + η‖g‖`` and ``s = min(1, ρ/r)`` per layer (float64), with ``s = 0``
    where ``r`` is not finite (an overflowing or non-finite input: the step is reset) or where s
    is below ``floor``, the smallest normal number of the blocks' dtype (:data:`MIN_TRUST_SCALE`
    for float32 blocks: an input too large for them to scale it is reset too)."""
    r = phi_norm + per_layer(lr) * g_norm  # r = ‖Φ‖_F + η‖g‖_F
    s = torch.clamp(radius / r, max=1.0)  # r = 0 gives inf → 1
    # (s ≥ floor is false for r = ∞, where s = 0, and for a NaN r: the finite check in one op)
    return torch.where(s >= floor, s, 0.0), r


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


WEIGHTS = tuple(2.0 ** (-k / 2) for k in range(15)) + (0.0,)


#: The unit roundoff of a TF32 operand (10 explicit mantissa bits): an update pass whose θM_θ
#: product takes TF32 operands (cuBLAS at a TF32 precision, Triton's single-pass "tf32")
TF32_UNIT = 2.0**-11


def store_unit(dtype: torch.dtype, tf32_grams: bool = False) -> float:
    """The rounding allowance of a parameter stored in ``dtype``: its unit roundoff plus a few
    of the compute dtype's (θ₊ is computed in float32/float64 and then rounded to ``dtype``).
    ``tf32_grams``: the step reads θᵀθ and the guard's blocks from single TF32 passes (a GPU's
    ``precision="tf32"``), which measure the distance only to ~:data:`TF32_UNIT`: that much more
    room, else the guard stored θ past ``max_distance`` by 2.5e-4 and the next step's check read a θ
    within it as beyond."""
    compute = 2.0**-53 if dtype == torch.float64 else 2.0**-24
    stored = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}.get(dtype, 0.0)
    tf32 = TF32_UNIT if tf32_grams and dtype != torch.float64 else 0.0
    return stored + 8.0 * compute + tf32


def storable(dist_next: torch.Tensor, p: int, dtype: torch.dtype | None) -> torch.Tensor:
    """θ₊ of distance ``dist_next`` fits ``dtype`` (its largest entry ≤ ‖θ₊‖_F ≤ √(p + √p·d)):
    a θ₊ finite in float32 can still overflow a float16 parameter."""
    if dtype is None or dtype in (torch.float32, torch.float64):  # a finite float32/float64 θ₊ fits its own dtype
        return finite_of(dist_next)
    top = torch.finfo(dtype).max
    return finite_of(dist_next) & (dist_next * p**0.5 + p < top * top)


def with_write_rounding(
    dist_next, m_norm, u_norm, p, unit: float, limit: float | None, operand_unit: float = 0.0
) -> torch.Tensor:
    """``dist_next`` (the exact distance of the unguarded full step ``θ₊ = θ + θM_θ + U``), or
    where it matters, that plus what rounding the write can add. The exact distance can be tiny
    while the terms are huge and cancel (a gradient normal to the manifold, g = θS: a 1 × 1 layer
    with ‖ηg‖ = 7e8 in float32 was stored 110 off). The write's error in a dtype of unit
    roundoff ``u`` is ``‖E‖_F ≤ u(3(√p + ‖M_θ‖_F + ‖U‖_F) + p^1.5‖M_θ‖_F) + 2u_o√p‖M_θ‖_F``:
    sums of three terms, the product θM_θ's accumulation over p terms (``γ_p‖θ‖_F‖M_θ‖_F``), and
    its operands' rounding to ``operand_unit`` u_o (0 for exact fp32 operands, :data:`TF32_UNIT`
    for TF32 ones: ``2u_o‖|θ||M_θ|‖_F``). That moves the distance by at most
    ``2‖θ₊‖₂‖E‖ + ‖E‖²`` with ``‖θ₊‖₂² ≤ 1 + dist``. The value changes only where that reaches
    past ``limit`` (so the check refuses the step; elsewhere it is what the step reports)."""
    if limit is None:
        return dist_next
    err = unit * (3.0 * (p**0.5 + m_norm + u_norm) + p**1.5 * m_norm) + 2.0 * operand_unit * p**0.5 * m_norm
    bound = dist_next + 2.0 * (1.0 + dist_next).sqrt() * err + err * err
    return torch.where(bound > limit, bound, dist_next)


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
    d2 = block_mm(lay, d, d)
    d3 = block_mm(lay, d2, d)
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
    u = abs(per_layer(beta)) * phi_norm + abs(per_layer(lr)) * g_norm  # ‖U‖_F ≤ β‖Φ‖_F + η‖g‖_F
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
    dm = block_mm(lay, a_minus_i, m)  # DM
    x = dm.add(m).add_(t)
    v = block_mm(lay, m, dm.add_(m).add_(t, alpha=2.0), tx=True)  # V = Mᵀ(AM + 2T), AM = M + DM
    # D + 2 sym(X) + sym(V) = D + Y + Yᵀ with Y = X + V/2: one transposed read, not two (on a CPU a
    # transposed operand is read element by element; not in place: Yᵀ may be a view)
    y = x.add_(v, alpha=0.5)
    out = plus_t(lay, y, y).add_(a_minus_i)
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
