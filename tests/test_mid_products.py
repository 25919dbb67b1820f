"""The middle's products in one Triton launch for every p (``kernels/products.py``,
``fgd_fast/backends/mid_products.py``) against torch's batched products.

float32 blocks (float64 middles keep torch's products: Triton 3.6 cannot compile a float64
dot). Directly (``Z + α·op(X)Y`` per layer, odd p that cross tiles, ``op`` = identity or
transpose, α a number or per layer) and through the whole middle (the guard blending, both variants, with
and without Φ): the Triton backend's middle with the engine must give the torch middle's step.
"""

from __future__ import annotations

import pytest
import torch

from fgd_fast.backends import algebra, guard_rule
from fgd_fast.backends.layout import Layout
from helpers import backend_reason, device_for_tests, gram_blocks

REASON = backend_reason("triton")
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"triton backend unavailable: {REASON}")

GROUPS = {"one-p": [(3, 40)], "three-p": [(2, 5), (1, 70), (2, 17)]}


def _random_block(lay, dtype, gen):
    return (
        torch.randn(lay.numel, dtype=torch.float64, generator=gen)
        .to(lay.device, dtype)
        .reshape((lay.count, lay.groups[0][1], lay.groups[0][1]) if lay.single else (lay.numel,))
    )


@pytest.mark.parametrize("groups", list(GROUPS))
@pytest.mark.parametrize("tx", [False, True], ids=["XY", "XtY"])
def test_one_launch_computes_every_layers_product(groups, tx):
    from fgd_fast.backends import mid_products

    dtype = torch.float32  # (float64 middles keep torch's products)
    lay = Layout(GROUPS[groups], device_for_tests())
    gen = torch.Generator().manual_seed(11)
    x, y, z = (_random_block(lay, dtype, gen) for _ in range(3))
    alpha = torch.linspace(-1.0, 0.5, lay.count, dtype=torch.float64).to(lay.device)
    run = mid_products.engine("ieee")
    got_plain = run(lay, x, y, tx=tx)
    got = run(lay, x, y, z=z, alpha=alpha, tx=tx)
    tol = 1e-5
    for k, (xk, yk, zk, pk, gk) in enumerate(
        zip(lay.pieces(x), lay.pieces(y), lay.pieces(z), lay.pieces(got_plain), lay.pieces(got))
    ):
        first = sum(n for n, _ in lay.groups[:k])
        a = alpha[first : first + xk.shape[0]].to(dtype).view(-1, 1, 1)
        want = (xk.mT if tx else xk) @ yk
        assert (pk - want).abs().max() <= tol * max(1.0, float(want.abs().max()))
        assert (gk - (zk + a * want)).abs().max() <= tol * max(1.0, float(want.abs().max()))


@pytest.mark.parametrize("groups", list(GROUPS))
@pytest.mark.parametrize("variant", ["official", "paper"])
@pytest.mark.parametrize("momentum", [True, False], ids=["phi", "no-phi"])
def test_the_middle_with_the_engine_is_the_torch_middle(groups, variant, momentum, monkeypatch):
    from fgd_fast.backends import mid_products

    dtype = torch.float32
    monkeypatch.setattr(guard_rule, "HOST_READ_DEVICES", ())  # every layer blended, as on a GPU
    gen = torch.Generator().manual_seed(len(groups) + (7 if momentum else 0))
    count = sum(n for n, _ in GROUPS[groups])
    out = []
    for products in (None, mid_products.engine("ieee")):
        lay = Layout(GROUPS[groups], device_for_tests())
        lay.products = products
        blocks, g_sq = gram_blocks(lay, dtype, torch.Generator().manual_seed(gen.initial_seed()), scale=0.3, off=1e-3)
        a, e, b, c, gg, h = blocks
        if not momentum:
            b = c = h = None
        alpha = torch.linspace(0.3, 0.45, count, dtype=dtype).to(lay.device)  # per layer, as the fused backends'
        mid = algebra.middle(
            a,
            b,
            c,
            e,
            lr=0.1,
            beta=0.9,
            alpha=alpha,
            g_sq=g_sq,
            h=h,
            gg=gg,
            radius=4.0,
            limit=1e-2,
            unit=guard_rule.store_unit(dtype),
            stored=dtype,
            variant=variant,
            layout=lay,
        )
        out.append(mid)
    ref, got = out
    assert got.guarded.tolist() == ref.guarded.tolist()
    tol = 1e-5
    for name in ("m_theta", "m_phi", "feedback", "dist_next", "scale"):
        want, have = getattr(ref, name), getattr(got, name)
        assert (have - want).abs().max() <= tol * max(1.0, float(want.abs().max())), name


def test_float64_blocks_are_refused_not_silently_rounded():
    from fgd_fast.backends import mid_products

    lay = Layout(GROUPS["one-p"], device_for_tests())
    x = torch.zeros((3, 40, 40), dtype=torch.float64, device=lay.device)
    with pytest.raises(TypeError, match="float32"):
        mid_products.engine("ieee")(lay, x, x)
