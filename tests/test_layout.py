"""Several p in one middle (``fgd_fast.backends.layout``): a flat buffer of groups ``(L_k, p_k)``
gives every block, check and decision of the per-group middles, the guard's blend included."""

from __future__ import annotations

import pytest
import torch

from fgd_fast.backends import algebra, guard_rule
from fgd_fast.backends.layout import Layout
from helpers import device_for_tests

DEV = device_for_tests()  # (on a GPU: the index tensors and segmented sums there)

GROUPS = [(3, 5), (1, 1), (2, 8), (4, 3)]  # odd sizes, a 1 × 1 block, unsorted p
EACH_P = [p for n, p in GROUPS for _ in range(n)]  # each layer's p, in layout order


def _flat(blocks: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([b.reshape(-1) for b in blocks])


def _random(gen, scale=1.0, symmetric=False):
    out = []
    for n, p in GROUPS:
        x = torch.randn((n, p, p), generator=gen, dtype=torch.float64) * scale
        out.append((0.5 * (x + x.mT) if symmetric else x).to(DEV))
    return out


def test_layout_structure_matches_each_group():
    gen = torch.Generator().manual_seed(0)
    lay = Layout(GROUPS, DEV)
    xs, ys = _random(gen), _random(gen)
    x = _flat(xs)
    assert torch.equal(lay.t(x), _flat([b.mT for b in xs]))
    assert torch.allclose(lay.norm(x), torch.cat([torch.linalg.matrix_norm(b) for b in xs]))
    assert torch.allclose(lay.trace(x), torch.cat([b.diagonal(dim1=-2, dim2=-1).sum(-1) for b in xs]))
    assert torch.allclose(lay.sums(x), torch.cat([b.sum((-2, -1)) for b in xs]))
    eyes = _flat([torch.eye(p, dtype=torch.float64, device=DEV).expand(n, p, p) for n, p in GROUPS])
    assert torch.equal(lay.eye(torch.float64), eyes)
    v = torch.arange(lay.count, dtype=torch.float64, device=DEV)
    per_layer = v.split([n for n, _ in GROUPS])
    assert torch.equal(lay.col(v) * x, _flat([b * w.view(-1, 1, 1) for b, w in zip(xs, per_layer)]))
    inner = lay.inner([x, _flat(ys)])
    per_group = torch.cat([Layout.of(a).inner([a, b]) for a, b in zip(xs, ys)])
    assert torch.allclose(inner, per_group)
    assert torch.equal(lay.layers(x, 4, 6), xs[2])  # group 2 holds layers 4 and 5
    with pytest.raises(ValueError, match="span groups"):
        lay.layers(x, 2, 5)


@pytest.mark.parametrize("groups", [GROUPS, [(4, 6)]], ids=["several-p", "one-p"])
def test_norms_of_several_blocks_are_each_layers_norms(groups):
    """``Layout.norms`` (the guard's step bound): ``(k, L)`` Frobenius norms of each layer in
    each block, for flat (several p) and ``(L, p, p)`` (one p) blocks."""
    gen = torch.Generator().manual_seed(3)
    lay = Layout(groups, DEV)
    randn = lambda n, p: torch.randn((n, p, p), generator=gen, dtype=torch.float64).to(DEV)  # noqa: E731
    per_block = [[randn(n, p) for n, p in groups] for _ in range(3)]
    got = lay.norms([_flat(b) if len(groups) > 1 else b[0] for b in per_block])  # (the layout's own blocks)
    want = torch.stack([torch.cat([torch.linalg.matrix_norm(x) for x in b]) for b in per_block])
    assert got.shape == (3, lay.count) and torch.allclose(got, want, rtol=1e-12, atol=0)


def _inputs(gen, drift=1e-3, grad=0.05):
    """Per group: A = I + small symmetric D, B, C (PSD), E, UᵀU (PSD) and ‖g‖² like a step's."""
    per = []
    for n, p in GROUPS:
        d = torch.randn((n, p, p), generator=gen, dtype=torch.float64) * drift
        a = torch.eye(p, dtype=torch.float64) + 0.5 * (d + d.mT)
        b = torch.randn((n, p, p), generator=gen, dtype=torch.float64) * grad
        f = torch.randn((n, p + 3, p), generator=gen, dtype=torch.float64) * grad
        c = f.mT @ f
        e = torch.randn((n, p, p), generator=gen, dtype=torch.float64) * grad
        u = torch.randn((n, p + 3, p), generator=gen, dtype=torch.float64) * grad
        blocks = dict(a=a, b=b, c=c, e=e, uu=u.mT @ u, g_sq=(u * u).sum((1, 2)))
        per.append({k: v.to(DEV) for k, v in blocks.items()})
    return per


FIELDS = ("m_theta", "m_phi", "feedback", "dist", "finite", "scale", "dist_next", "finite_next", "guarded")


@pytest.mark.parametrize("blend", [False, True], ids=["host-read", "blend-every-layer"])
@pytest.mark.parametrize("variant", ["official", "paper"])
@pytest.mark.parametrize("grad", [0.05, 30.0], ids=["calm", "spike"])  # a spike: the guard scales or resets
@pytest.mark.parametrize("unit", [1e-12, 0.03], ids=["fine", "coarse"])  # coarse: each p's own margin matters
def test_one_middle_over_several_p_is_the_per_group_middles(blend, variant, grad, unit, monkeypatch):
    # blend: as on a GPU, every layer blended (no host read); else the full step checked first (a read)
    monkeypatch.setattr(guard_rule, "HOST_READ_DEVICES", () if blend else (DEV.type,))
    gen = torch.Generator().manual_seed(1)
    per = _inputs(gen, grad=grad)
    count = sum(n for n, _ in GROUPS)
    lrs = torch.linspace(0.01, 0.2, count, dtype=torch.float64, device=DEV)  # per-layer η (and α below)
    alphas = torch.linspace(0.3, 0.5, count, dtype=torch.float64, device=DEV)  # per-layer α
    guard = dict(radius=4.0, limit=0.5, unit=unit, variant=variant, beta=0.9)
    mids, at = [], 0
    for blocks, (n, _) in zip(per, GROUPS):
        own = {k: v.clone() for k, v in blocks.items()}
        mids.append(algebra.middle(**own, lr=lrs[at : at + n], alpha=alphas[at : at + n], **guard, carry=3))
        at += n
    flat = {k: _flat([blk[k] for blk in per]) if k != "g_sq" else torch.cat([blk[k] for blk in per]) for k in per[0]}
    joint = algebra.middle(**flat, lr=lrs, alpha=alphas, **guard, carry=3, layout=Layout(GROUPS, DEV))
    for name in FIELDS:
        want = [getattr(m, name) for m in mids]
        got = getattr(joint, name)
        assert (got is None) == (want[0] is None), name
        if got is not None:
            want = _flat(want) if name in FIELDS[:3] else torch.cat(want)
            assert torch.allclose(got.double(), want.double(), rtol=1e-12, atol=1e-14), name
    if grad < 1 and not blend:
        assert joint.carried is not None  # every layer took its full step: the next step's Grams
    if joint.carried is not None:
        assert all(m.carried is not None for m in mids)
        for k in range(3):
            assert torch.allclose(joint.carried[k], _flat([m.carried[k] for m in mids]), rtol=1e-12, atol=1e-14)
    if grad > 1:
        assert (joint.guarded > 0).any()  # the spike made the guard bind somewhere


def test_indices_used_while_capturing_are_never_evicted(monkeypatch):
    """A captured step's replays read the layout's index tensors: those stay cached."""
    from fgd_fast.backends import layout

    monkeypatch.setattr(layout, "_indices", {})
    monkeypatch.setattr(layout, "_pinned", set())
    monkeypatch.setattr(layout, "_INDEX_CAPACITY", 2)
    monkeypatch.setattr(layout, "_capturing", lambda: True)
    captured = Layout([(1, 2), (1, 3)])
    kept = captured._index()
    monkeypatch.setattr(layout, "_capturing", lambda: False)
    for k in range(4, 8):  # more layouts than the capacity
        Layout([(1, 2), (1, k)])._index()
    assert captured._index() is kept
    assert len(layout._indices) == 3  # the pinned one and the two newest
    assert [key[0] for key in layout._indices] == [((1, 2), (1, 3)), ((1, 2), (1, 6)), ((1, 2), (1, 7))]


def test_segmented_sums_and_norms_are_the_per_group_ones(monkeypatch):
    """The one-launch segmented reductions (a GPU's) give each layer's sum and norm, as the
    per-group reductions (a CPU's) do: both run here on the same blocks."""
    from fgd_fast.backends import layout

    blocks = _random(torch.Generator().manual_seed(4))
    x = _flat(blocks)
    lay = Layout(GROUPS, DEV)
    monkeypatch.setattr(layout, "PER_GROUP_DEVICES", (DEV.type,))
    per_group = lay.sums(x), lay.norm(x)
    monkeypatch.setattr(layout, "PER_GROUP_DEVICES", ())
    segmented = lay.sums(x), lay.norm(x)
    want = torch.cat([b.sum((-2, -1)) for b in blocks])
    for got in (per_group[0], segmented[0]):
        assert got.shape == (lay.count,) and torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    assert torch.allclose(segmented[1], per_group[1], rtol=1e-12, atol=0)


def test_tiles_cover_every_layers_block_once_per_tile_size():
    """A kernel's work table: every ``tile × tile`` item of every layer's block, once, and each
    layer's row (its block's offset, its p, its first item, its item count); a table per tile."""
    lay = Layout(GROUPS, DEV)
    row = lambda k, at, p, first, items: [at, p, first, items]  # noqa: E731
    offsets = torch.tensor([0] + [p * p for p in EACH_P]).cumsum(0)[:-1]
    for tile in (2, 4):
        work, rows = lay.tiles(tile, ("test",), row)
        tiles = [-(-p // tile) for p in EACH_P]  # each layer's tiles per side
        want = [[k, i, j] for k, t in enumerate(tiles) for i in range(t) for j in range(t)]
        assert work.dtype == torch.int32 and work.tolist() == want
        assert rows[:, 0].tolist() == offsets.tolist()
        assert rows[:, 1].tolist() == EACH_P
        assert rows[:, 3].tolist() == [t * t for t in tiles]
        assert rows[:, 2].tolist() == (rows[:, 3].cumsum(0) - rows[:, 3]).tolist()


def test_per_layer_values_in_any_shape():
    """``per_layer``: a float, one value, or ``L`` values in any shape, as ``(L,)`` float64; and
    ``p_per_layer``: each layer's own p (the guard's margin and range depend on it)."""
    lay = Layout(GROUPS, DEV)
    v = torch.arange(lay.count, dtype=torch.float32, device=DEV)
    for given in (v, v.view(-1, 1, 1), v.view(1, -1)):
        got = lay.per_layer(given)
        assert got.dtype == torch.float64 and torch.equal(got, v.double())
    assert torch.equal(lay.per_layer(torch.tensor(0.5, device=DEV)), torch.full((lay.count,), 0.5, device=DEV).double())
    assert torch.equal(lay.per_layer(0.25), torch.full((lay.count,), 0.25, dtype=torch.float64, device=DEV))
    assert torch.equal(lay.per_layer(0.5), torch.full((lay.count,), 0.5, dtype=torch.float64, device=DEV))
    want = torch.tensor(EACH_P, dtype=torch.float64, device=DEV)
    assert torch.equal(lay.p_per_layer(), want)
