"""The middle at TF32: its products with N = I − D and A = I + D are written X ∓ D·X, so TF32's
input rounding (emulated: fgd_fast.backends.tf32.emulated_tf32_middle) touches only the small
correction D·X and the second-order terms, and FGD settles where the fp32 middle does."""

from __future__ import annotations

import pytest
import torch

from benchmarks.studies.tf32_middle import settled_distance
from fgd_fast.backends import algebra, block_products
from fgd_fast.backends.tf32 import emulated_tf32_middle

TF32_UNIT = 2.0**-11  # TF32's unit roundoff (10 stored mantissa bits)


def _blocks(p: int, count: int, gen: torch.Generator, d_scale: float):
    """Gram blocks of ``count`` layers: A = I + D (‖D‖ ~ d_scale), B, C, E of a small velocity."""
    x = torch.randn(count, p, p, generator=gen, dtype=torch.float64)
    a = torch.eye(p, dtype=torch.float64) + d_scale * (x + x.mT) / 2
    b = 1e-2 * torch.randn(count, p, p, generator=gen, dtype=torch.float64)
    y = 1e-2 * torch.randn(count, p, p, generator=gen, dtype=torch.float64)
    c = y @ y.mT
    e = 1e-1 * torch.randn(count, p, p, generator=gen, dtype=torch.float64)
    return a, b, c, e


def _m_phi(blocks, dtype):
    a, b, c, e = (t.to(dtype) for t in blocks)
    return algebra.middle(a, b, c, e, lr=0.1, beta=0.9, alpha=0.4).m_phi.to(torch.float64)


@pytest.mark.parametrize("p", [7, 32])
def test_n_products_keep_the_identity_exact_at_tf32(p):
    """M_Φ = N[…] with ‖D‖ ~ 1e-3: at TF32 in the X − D·X form its error is a few units of
    2⁻¹¹ of the small terms (D·[…] and the second-order NBS); rounding N = I − D as a whole
    (the old form) loses D·[…] itself — the test fails if the middle goes back to it."""
    gen = torch.Generator().manual_seed(p)
    blocks = _blocks(p, 3, gen, d_scale=1e-3)
    exact = _m_phi(blocks, torch.float64)
    fp32 = (_m_phi(blocks, torch.float32) - exact).abs().max().item()
    with emulated_tf32_middle():
        lean = (_m_phi(blocks, torch.float32) - exact).abs().max().item()
    with emulated_tf32_middle("naive"):
        naive = (_m_phi(blocks, torch.float32) - exact).abs().max().item()
    scale = exact.abs().max().item()
    a, b = blocks[0], blocks[1]
    second = ((2 * torch.eye(p, dtype=a.dtype) - a) @ b @ ((b + b.mT) / 2)).abs().max().item()  # NBS
    assert fp32 < 1e-6 * scale
    # TF32 rounds only D·X (‖D‖ ~1e-3) and the second-order NBS: a few units of 2⁻¹¹ of those
    assert lean < 4 * TF32_UNIT * (second + 1e-3 * scale) + 4 * fp32, (lean, second, scale)
    assert naive > 10 * lean, (naive, lean)


def test_emulation_rounds_the_products_and_restores_them():
    x = torch.randn(4, 5, 5, generator=torch.Generator().manual_seed(0))
    with emulated_tf32_middle():
        rounded = block_products.mm(x, x)
    assert not torch.equal(rounded, x @ x) and block_products.mm is not None
    assert torch.equal(block_products.mm(x, x), torch.matmul(x, x))  # restored
    with pytest.raises(ValueError, match="lean"), emulated_tf32_middle("fast"):
        pass


@pytest.mark.parametrize("form", ["lean", "naive"])
def test_emulated_products_keep_their_contract(form):
    """Inside the emulation, ``mm_add`` is still ``Z + αXY`` (into ``out``) and ``i_plus_d``
    still ``X + αDX + extra``, to TF32's rounding of the product (one ignored α or ``extra``
    passed the accuracy studies)."""
    gen = torch.Generator().manual_seed(1)
    z, x, y, d = (torch.randn(3, 6, 6, generator=gen) for _ in range(4))
    d = d * 1e-2
    close = lambda got, want: torch.allclose(got, want, rtol=0, atol=2e-2)  # noqa: E731  (TF32 inputs: ~2⁻¹¹ each)
    with emulated_tf32_middle(form):
        out = torch.empty_like(z)
        assert close(block_products.mm_add(z, x, y, alpha=-0.5), z - 0.5 * (x @ y))
        assert block_products.mm_add(z, x, y, out=out, alpha=2.0) is out and close(out, z + 2.0 * (x @ y))
        assert close(block_products.i_plus_d(d, x, -1.0), x - d @ x)
        assert close(block_products.i_plus_d(d, x, 1.0, extra=y), x + d @ x + y)
        assert not torch.equal(block_products.mm(x, y), x @ y)  # the products are rounded


@pytest.mark.parametrize("lr", [1e-2, 1e-4])
def test_a_tf32_middle_settles_where_the_fp32_middle_does(lr):
    """600 steps of unit-norm random gradients (1e-2: the O(η²) drift sets the distance; 1e-4:
    fp32's rounding floor): the largest ‖θᵀθ − I‖_F with every middle product at TF32 is within
    1.2× of the fp32 middle's (the workload shapes: benchmarks/studies/tf32_middle.py)."""
    shapes = [(8, 8, 3, 3), (16, 16, 3, 3), (24, 40)]
    fp32, tf32 = (settled_distance(shapes, 600, form, lr) for form in (None, "lean"))
    assert tf32 <= 1.2 * fp32, (tf32, fp32)
