"""The middle's product helpers (``fgd_fast.backends.block_products``) against their formulas,
in every form they take: batched and plain matrices, with and without ``out``, any α, a number
or per-layer tensor; the middle calls only some of these forms today, and a helper that
ignored an argument in another (found by a mutation review) would pass its tests."""

from __future__ import annotations

import pytest
import torch

from fgd_fast.backends import block_products as bp
from fgd_fast.backends.layout import Layout

GEN = torch.Generator().manual_seed(6)


def _randn(*shape):
    return torch.randn(shape, generator=GEN, dtype=torch.float64)


def _close(got, want):
    assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("batch", [(3,), ()], ids=["batched", "matrix"])
@pytest.mark.parametrize("alpha", [1.0, -0.5])
def test_mm_add_is_z_plus_alpha_xy_with_and_without_out(batch, alpha):
    z, x, y = _randn(*batch, 4, 4), _randn(*batch, 4, 4), _randn(*batch, 4, 4)
    want = z + alpha * (x @ y)
    _close(bp.mm_add(z, x, y, alpha=alpha), want)
    out = torch.empty_like(z)
    assert bp.mm_add(z, x, y, out=out, alpha=alpha) is out
    _close(out, want)
    _close(bp.mm(x, y), x @ y)


@pytest.mark.parametrize("batch", [(3,), ()], ids=["batched", "matrix"])
@pytest.mark.parametrize("alpha", [-1.0, 0.25, "tensor"])
@pytest.mark.parametrize("extra", [False, True])
def test_i_plus_d_is_x_plus_alpha_dx_plus_extra(batch, alpha, extra):
    d, x, e = _randn(*batch, 5, 5), _randn(*batch, 5, 5), _randn(*batch, 5, 5)
    if alpha == "tensor":  # per-layer α, broadcast against the blocks
        alpha = _randn(*batch, 1, 1)
    want = x + alpha * (d @ x) + (e if extra else 0.0)
    _close(bp.i_plus_d(d, x, alpha, e if extra else None), want)


def test_the_elementwise_helpers():
    x, y, a = _randn(3, 4, 4), _randn(3, 4, 4), _randn(3, 1, 1)
    _close(bp.sym(x), 0.5 * (x + x.mT))
    for coef in (-0.5, a):
        _close(bp.axpy(x, y, coef), x + coef * y)
        held = x.clone()
        assert bp.axpy_(held, y, coef) is held  # in place
        _close(held, x + coef * y)


@pytest.mark.parametrize("groups", [[(3, 4)], [(2, 4), (1, 1), (3, 6)]], ids=["one-p", "several-p"])
def test_block_forms_are_each_layers_products(groups):
    lay = Layout(groups)

    def joined(layers):  # the layout's block of per-group (n, p, p) layers
        return layers[0] if lay.single else torch.cat([m.reshape(-1) for m in layers])

    def block():
        layers = [_randn(n, p, p) for n, p in groups]
        return joined(layers), layers

    (x, xs), (y, ys), (z, zs), (d, ds) = block(), block(), block(), block()
    alpha = torch.linspace(-1.0, 1.0, lay.count, dtype=torch.float64)
    alphas = alpha.split([n for n, _ in groups])
    _close(bp.plus_t(lay, x, y), joined([a + b.mT for a, b in zip(xs, ys)]))
    for tx in (False, True):
        _close(bp.block_mm(lay, x, y, tx=tx), joined([(a.mT if tx else a) @ b for a, b in zip(xs, ys)]))
        for coef in (1.0, -0.5):
            want = joined([c + coef * ((a.mT if tx else a) @ b) for a, b, c in zip(xs, ys, zs)])
            _close(bp.block_mm_add(lay, z, x, y, tx=tx, alpha=coef), want)
    for extra in (None, z):
        plus = zs if extra is not None else [0.0] * len(groups)
        _close(bp.block_i_plus_d(lay, d, x, -1.0, extra), joined([b - a @ b + e for a, b, e in zip(ds, xs, plus)]))
        want = joined([b + k.view(-1, 1, 1) * (a @ b) + e for a, b, k, e in zip(ds, xs, alphas, plus)])
        _close(bp.block_i_plus_d(lay, d, x, alpha, extra), want)
