"""The TF32 split behind ``precision="tf32x3"``, checked exactly on the CPU against float64.

The interpreter and the CPU have no TF32, so the arithmetic itself is tested: rounding to
TF32 (round to nearest, ties to even) against an independent float64 model, the hi/lo split,
the stacked-sum identity of the lean Gram, the Triton kernels' own rounding and split against
these bit for bit, and the torch backend's ``"tf32x3"`` path (on a CPU, fp32 sums) against the
float64 oracle.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fgd_fast
from fgd_fast.backends.tf32 import DROPPED_BITS, round_tf32, split_tf32
from helpers import device_for_tests
from test_fgd_oracle import PROBLEMS, _numpy_fp32_error, _run

LOW_BITS = (1 << DROPPED_BITS) - 1  # 0x1FFF


def _tf32_model(x: np.ndarray) -> np.ndarray:
    """float64 model of TF32 rounding: 11 significant bits (10 stored), ties to even; float32
    subnormals keep their absolute quantum 2⁻¹⁴⁹ × 2¹³."""
    x = x.astype(np.float64)
    _, e = np.frexp(x)
    quantum = np.ldexp(1.0, np.maximum(e - 11, -149 + DROPPED_BITS))
    return np.round(x / quantum) * quantum  # np.round: half to even


def _samples(gen: torch.Generator, count: int = 200_000) -> torch.Tensor:
    """float32 values over the whole exponent range, random low bits, both signs, plus exact
    ties (a TF32 number plus half its ulp, odd and even) and subnormals."""
    bits = torch.randint(-(2**31), 2**31 - 1, (count,), generator=gen, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    x = x[torch.isfinite(x)]
    exponent = torch.randint(1, 255, (4096,), generator=gen, dtype=torch.int32)
    kept = torch.randint(0, 1 << 10, (4096,), generator=gen, dtype=torch.int32)
    ties = (exponent << 23) | (kept << DROPPED_BITS) | (1 << (DROPPED_BITS - 1))  # exactly half-way
    extra = torch.tensor([0.0, -0.0, 1.0, -1.0, 3.4028235e38, -3.4028235e38, 1e-45, 1e-40, 1.17549435e-38])
    return torch.cat([x, ties.view(torch.float32), -ties.view(torch.float32), extra])


def test_round_tf32_is_round_to_nearest_even():
    x = _samples(torch.Generator().manual_seed(0))
    got = round_tf32(x)
    assert got.dtype == torch.float32
    assert int((got.view(torch.int32) & LOW_BITS).abs().max()) == 0  # a TF32 number
    expected = _tf32_model(x.numpy())
    finite = np.abs(expected) <= np.finfo(np.float32).max  # rounding past the largest float32 gives Inf
    assert not finite.all() and finite.sum() > 0.99 * len(finite)  # both cases are sampled
    np.testing.assert_array_equal(got.numpy().astype(np.float64)[finite], expected[finite])
    over = torch.from_numpy(~finite)
    assert torch.equal(got[over], torch.copysign(torch.tensor(float("inf")), x[over]))
    assert torch.equal(torch.signbit(got), torch.signbit(x))  # −0 stays −0, signs never flip


def test_round_tf32_keeps_inf_and_nan():
    """A carry out of a NaN's mantissa would otherwise give Inf or ±0 (and hide the NaN)."""
    patterns = [0x7F800000, -0x00800000, 0x7FC00000, 0x7FFFFFFF, -1, 0x7F800001, -0x007FF001]
    x = torch.tensor(patterns, dtype=torch.int32).view(torch.float32)
    got = round_tf32(x)
    assert torch.equal(got.view(torch.int32), x.view(torch.int32))


def test_round_tf32_out_and_layout():
    x = torch.randn(7, 33, generator=torch.Generator().manual_seed(1)).t()  # non-contiguous
    out = torch.empty_like(x)
    assert round_tf32(x, out=out) is out
    torch.testing.assert_close(out, round_tf32(x.contiguous()), rtol=0, atol=0)
    with pytest.raises(TypeError, match="float32"):
        round_tf32(x.double())


@pytest.mark.parametrize("scale", [1e-30, 1e-3, 1.0, 1e20])
def test_split_is_exact_to_2_pow_minus_22(scale):
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(513, 37, generator=gen) * scale).float()
    hi, lo = split_tf32(x)
    for part in (hi, lo):  # both are TF32 numbers: a TF32 product sees them unchanged
        assert int((part.view(torch.int32) & LOW_BITS).abs().max()) == 0
        torch.testing.assert_close(round_tf32(part), part, rtol=0, atol=0)
    x64, hi64, lo64 = x.double(), hi.double(), lo.double()
    assert torch.equal((x - hi).double(), x64 - hi64)  # the residual x − hi is exact in fp32
    rel = ((hi64 + lo64 - x64).abs() / x64.abs()).max().item()
    assert rel <= 2.0**-22, rel
    assert ((hi64 - x64).abs() / x64.abs()).max().item() <= 2.0**-11  # hi alone: TF32's error


@pytest.mark.parametrize(("n", "p"), [(1, 1), (37, 5), (300, 41), (1025, 64)])
def test_stacked_lean_gram_identity(n, p):
    """One product over K′ = 3n of stacked parts, [hi; hi; lo]ᵀ[hi; lo; hi], is hiᵀhi + L + Lᵀ
    with L = hiᵀlo; the lean A = H + L + Lᵀ is θᵀθ to ~2⁻²¹ relative per term (the dropped
    loᵀlo and the rounding of lo), where plain TF32 (hiᵀhi) is off by ~2⁻¹¹."""
    theta = torch.linalg.qr(torch.randn(n, p, generator=torch.Generator().manual_seed(n), dtype=torch.float64))[0]
    theta = theta.float()
    hi, lo = split_tf32(theta)
    # the identity, in float64 (the parts' products are exact there): K′ = 3n stacking
    left = torch.cat([hi, hi, lo]).double()
    right = torch.cat([hi, lo, hi]).double()
    h64, l64 = hi.double().T @ hi.double(), hi.double().T @ lo.double()
    torch.testing.assert_close(left.T @ right, h64 + l64 + l64.T, rtol=1e-15, atol=1e-15)
    # the lean Gram's sums in fp32 (the Triton kernels' order): hiᵀ[hi | lo] in one product, A = H + (L + Lᵀ)
    both = hi.T @ torch.cat([hi, lo], dim=1)
    a = both[:, :p] + (both[:, p:] + both[:, p:].T)
    exact = theta.double().T @ theta.double()
    scale = theta.double().abs().T @ theta.double().abs()  # Σ|θ||θ| per entry
    lean_err = ((h64 + l64 + l64.T - exact).abs() / scale).max().item()
    assert lean_err <= 2.0**-20, lean_err
    fp32_err = ((a.double() - exact).abs() / scale).max().item()
    assert fp32_err <= 2.0**-20 + n * 2.0**-24, fp32_err  # plus fp32 accumulation
    if n >= 37:  # enough terms that plain TF32 shows its 2⁻¹¹-level error
        tf32_err = ((h64 - exact).abs() / scale).max().item()
        assert tf32_err > 50 * lean_err, (tf32_err, lean_err)


def _fp32_tolerance(problem: str, steps: int) -> float:
    """4× what plain float32 arithmetic loses on the same data, plus 4 ulps of 1: the
    ``"ieee"`` bound of test_fgd_oracle with 2 more ulps for the split A (its ~2⁻²¹ error per
    term is a few fp32 roundings). Measured on the CPU: 0.5–1.9× the plain float32 error, as
    for ``"ieee"``."""
    return 4 * _numpy_fp32_error(problem, steps) + 4 * 2.0**-23


@pytest.mark.parametrize("problem", sorted(PROBLEMS))
def test_torch_tf32x3_matches_oracle(problem):
    """On a CPU the torch backend's ``"tf32x3"`` path computes in fp32: A in IEEE fp32 (as on a
    GPU, where cuBLAS's truncating tensor-core adds rule out the split), everything else as
    ``"ieee"``. Within the float32 bound of the oracle test; on a GPU (TF32 in B, C, E and the
    update) see test_torch_tf32x3_on_gpu."""
    if device_for_tests().type != "cpu":
        pytest.skip("TF32 products on a GPU differ from fp32 by ~1e-3 relative: test_torch_tf32x3_on_gpu")
    steps = 25
    params, _, ow, _ = _run(problem, "torch", torch.float32, steps=steps, precision="tf32x3")
    err = max(float(np.abs(p.detach().double().cpu().numpy() - w).max()) for p, w in zip(params, ow))
    assert err <= _fp32_tolerance(problem, steps), err


def test_precision_on_cpu_computes_in_fp32():
    """A CPU has no TF32: ``"tf32"`` gives the ``"ieee"`` numbers bit for bit; ``"tf32x3"``
    only changes A (split), so it stays within fp32 rounding of them."""
    gen = torch.Generator().manual_seed(3)
    w0 = fgd_fast.orthogonalize_(torch.randn(24, 6, 3, 3, generator=gen))
    grads = [torch.randn(24, 6, 3, 3, generator=gen) * 0.1 for _ in range(5)]
    out = {}
    for precision in ("ieee", "tf32", "tf32x3"):
        w = torch.nn.Parameter(w0.clone())
        opt = fgd_fast.FGD([dict(params=[w], orthogonal=True)], lr=0.05, backend="torch", precision=precision)
        for g in grads:
            w.grad = g
            opt.step()
        out[precision] = w.detach()
    assert torch.equal(out["tf32"], out["ieee"])
    torch.testing.assert_close(out["tf32x3"], out["ieee"], rtol=0, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="TF32 tensor cores need a CUDA GPU")
def test_torch_tf32x3_on_gpu():
    """On a GPU, lean 3×TF32 settles within 1.5× of IEEE fp32's distance after 200 steps (CPU
    emulation: 2.9e-6 vs 2.2e-6 on 2880×320), where plain TF32 settles ~1e-3 off."""
    gen = torch.Generator().manual_seed(4)
    w0 = fgd_fast.orthogonalize_(torch.randn(320, 2880, generator=gen)).cuda()
    grads = [(g / g.norm()).cuda() for g in (torch.randn(320, 2880, generator=gen) for _ in range(8))]
    dist = {}
    for precision in ("ieee", "tf32x3", "tf32"):
        w = torch.nn.Parameter(w0.clone())
        opt = fgd_fast.FGD([dict(params=[w], orthogonal=True)], lr=5e-4, backend="torch", precision=precision)
        for k in range(200):
            w.grad = grads[k % 8]
            opt.step()
        dist[precision] = fgd_fast.stiefel_distance(w)
    assert dist["tf32x3"] <= 1.5 * dist["ieee"] + 1e-6, dist
    assert dist["tf32"] > 10 * dist["tf32x3"], dist  # the products really ran in TF32


@pytest.mark.parametrize("default", ["ieee", "tf32x3"])
def test_default_precision_is_one_setting(monkeypatch, default):
    """The default precision is ``fgd_fast.backends.DEFAULT_PRECISION`` (set by the GPU
    measurements): changing that one line changes it for the backends that honour precision,
    in ``FGD`` and in ``fgd()`` alike, while "reference" and "cuda" keep IEEE fp32 and still
    construct."""
    import fgd_fast.backends as backends

    monkeypatch.setattr(backends, "DEFAULT_PRECISION", default)
    param = torch.nn.Parameter(torch.eye(3))
    for backend in ("auto", "torch", "triton"):
        assert fgd_fast.FGD([param], lr=0.1, backend=backend).precision == default
        assert backends.checked_precision(None, backend) == default  # (what fgd() takes)
    for backend in ("reference", "cuda"):
        assert fgd_fast.FGD([param], lr=0.1, backend=backend).precision == "ieee"


def test_default_precision_is_tf32x3_as_measured_on_a_gpu():
    """The H200 report (benchmarks/results/gpu-h200-2026-11-26-first.md) measured "tf32x3"
    within 1.5× of the reference form's distance on every workload; on a CPU it is "ieee"."""
    from fgd_fast.backends import DEFAULT_PRECISION

    assert DEFAULT_PRECISION == "tf32x3"
    assert fgd_fast.FGD([torch.nn.Parameter(torch.eye(3))], lr=0.1).precision == "tf32x3"


def test_the_kernels_rounding_and_split_are_split_tf32_bit_for_bit():
    """The tensor-core kernels' TF32 rounding (``tc_step._tf32``, what the split pass writes into
    hi and lo) is ``round_tf32`` and their split is ``split_tf32``, bit for bit, on random values
    of every scale and on the edges: ties to even both ways, the carry into the next binade and
    to Inf, subnormals, ±0, ±Inf and NaN."""
    from helpers import backend_reason

    device = device_for_tests()
    reason = backend_reason("triton", str(device))
    if reason:
        pytest.skip(f"triton backend unavailable: {reason}")
    import tf32_kernel

    gen = torch.Generator().manual_seed(0)
    rand = torch.randn(3000, generator=gen) * torch.logspace(-40, 38, 3000).to(torch.float32)
    ties = [0x3F801000, 0x3F803000, 0x3F800FFF, 0x3F801001, 0x3FFFF000, 0x7F7FF000, 0x00001000, 0x00003000]
    edges = torch.tensor(ties + [0x00000001, 0x007FFFFF, 0x80000000, 0, 0x7F800000, 0xFF800000, 0x7FC00001])
    special = edges.to(torch.int32).view(torch.float32)
    x = torch.cat([rand, special, -special]).to(device)
    hi, lo = torch.empty_like(x), torch.empty_like(x)
    tf32_kernel.split_kernel[((x.numel() + 255) // 256,)](x, hi, lo, x.numel(), BLOCK=256)  # (12 programs)
    want_hi, want_lo = split_tf32(x.cpu())
    for got, want in ((hi.cpu(), want_hi), (lo.cpu(), want_lo)):
        nan = torch.isnan(want)
        assert torch.equal(torch.isnan(got), nan)
        assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))
