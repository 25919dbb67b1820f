"""TF32 rounding and the hi/lo split behind the Triton backend's ``precision="tf32x3"`` (one
concern: the arithmetic; the kernels' own rounding is compared with it bit for bit in the tests;
the torch backend computes A in IEEE fp32 instead, see ``torch_bucket``).

TF32 keeps float32's sign and 8-bit exponent and 10 of its 23 mantissa bits. Tensor cores
take fp32 operands as TF32, so a plain TF32 product has ~2⁻¹¹ relative input error, far above
fp32's 2⁻²⁴. Splitting ``x = hi + lo`` with

    hi = tf32(x),   lo = tf32(x − hi)

and multiplying the parts recovers near-fp32 accuracy from TF32 products (3×TF32):
``xᵀy ≈ hiₓᵀhi_y + hiₓᵀlo_y + loₓᵀhi_y``.

**Why the split survives the library's own conversion.** ``hi`` and ``lo`` are computed here,
in fp32, with their low 13 mantissa bits zero: they are TF32 numbers stored in fp32. Whatever
a TF32 matmul does to convert its fp32 inputs (round to nearest, or drop the low bits), it
leaves a TF32 number unchanged, so the products see exactly ``hi`` and ``lo``; and ``x − hi`` is
exact in fp32 (Sterbenz: ``hi`` is within half a TF32 ulp of ``x``).

**What error remains.** ``lo`` is ``x − hi`` rounded to TF32, so ``hi + lo`` reproduces ``x`` to
a relative ~2⁻²² (the low 13 bits of ``x − hi`` are dropped: |x − hi| ≤ 2⁻¹¹|x|, rounded to 11
significant bits). The product drops ``loₓᵀlo_y`` (~2⁻²² relative per term) and the rounding
of ``lo``: ~2⁻²¹ relative per product against fp32's 2⁻²⁴, with fp32 accumulation either way.

FGD's feedback drives the *computed* ``A = θᵀθ`` to ``I``, so only ``A`` needs this accuracy
("lean" 3×TF32): with ``H = hiᵀhi`` and ``L = hiᵀlo``, ``A ≈ H + L + Lᵀ`` (``loᵀhi = Lᵀ``), one
extra product instead of two. ``B = θᵀΦ``, ``C = ΦᵀΦ``, ``E = θᵀg`` and the update products
``θ M`` stay single TF32: their errors enter the step scaled by ‖Φ‖, ‖Φ‖² and η‖g‖, not the
distance to the manifold.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["round_tf32", "split_tf32", "DROPPED_BITS", "emulated_tf32_middle"]

DROPPED_BITS = 13  # float32 mantissa bits that TF32 does not keep (23 − 10)
_HALF = (1 << (DROPPED_BITS - 1)) - 1  # 0x0FFF: just under half of the dropped range
_KEEP = ~((1 << DROPPED_BITS) - 1)  # ...1110_0000_0000_0000: clears the dropped bits
_EXPONENT = 0x7F800000  # the exponent field of float32; all ones for Inf and NaN


def round_tf32(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` (float32) rounded to TF32, round to nearest, ties to even, returned as float32.

    Integer arithmetic on the bit pattern: adding ``0x0FFF`` plus the lowest kept bit and
    clearing the 13 dropped bits rounds the magnitude to nearest with ties to even (the sign
    bit is untouched: the carry can only run into the exponent, which is the correct
    rounding up to the next binade or to Inf). Inf and NaN are returned as they are (a carry
    out of a NaN's mantissa would otherwise turn it into Inf or ±0). ``out`` (float32, the
    shape of ``x``) receives the result; it may be ``x`` itself.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"round_tf32 needs float32, got {x.dtype}")
    bits = x.view(torch.int32)
    lsb = torch.bitwise_right_shift(bits, DROPPED_BITS).bitwise_and_(1)  # lowest kept bit: ties to even
    rounded = lsb.add_(_HALF).add_(bits).bitwise_and_(_KEEP)  # (bits + 0x0FFF + lsb) & ~0x1FFF
    special = bits.bitwise_and(_EXPONENT) == _EXPONENT  # Inf / NaN: keep the bits
    rounded = torch.where(special, bits, rounded).view(torch.float32)
    if out is None:
        return rounded
    return out.copy_(rounded)


def split_tf32(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hi, lo)`` with ``hi = tf32(x)``, ``lo = tf32(x − hi)``: both TF32 numbers in float32,
    ``hi + lo = x`` to ~2⁻²² relative (``x − hi`` itself is exact)."""
    hi = round_tf32(x)
    lo = round_tf32(x - hi)
    return hi, lo


def _tf32(x: torch.Tensor) -> torch.Tensor:
    return round_tf32(x.contiguous()) if x.dtype == torch.float32 else x


@contextmanager
def emulated_tf32_middle(form: str = "lean") -> Iterator[None]:
    """Inside, every ``p × p`` product of the middle (:mod:`.block_products`' ``mm``, ``mm_add``,
    ``i_plus_d``) takes float32 inputs rounded to TF32 and sums in fp32, as TF32 tensor cores
    do, on any device: a CPU check of a middle run at ``precision="tf32"``. ``form="naive"``
    computes ``(I + αD)·X`` as one product of the rounded ``I + αD`` (what the middle did
    before its ``X ∓ D·X`` forms), to show what those forms save."""
    from . import block_products

    saved = block_products.mm, block_products.mm_add, block_products.i_plus_d

    def mm(x, y, out=None):
        product = torch.matmul(_tf32(x), _tf32(y))
        return product if out is None else out.copy_(product)

    def mm_add(z, x, y, out=None, alpha=1.0):
        total = z + alpha * mm(x, y)
        return total if out is None else out.copy_(total)

    def i_plus_d(d, x, alpha, extra=None):
        if form == "naive":
            eye = torch.eye(d.shape[-1], dtype=d.dtype, device=d.device)
            out = mm(eye + alpha * d, x)
        else:
            out = x + alpha * mm(d, x)
        return out if extra is None else out + extra

    if form not in ("lean", "naive"):
        raise ValueError(f"form={form!r}: 'lean' or 'naive'")
    block_products.mm, block_products.mm_add, block_products.i_plus_d = mm, mm_add, i_plus_d
    try:
        yield
    finally:
        block_products.mm, block_products.mm_add, block_products.i_plus_d = saved
