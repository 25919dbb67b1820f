"""The Gram blocks' gather into the middle's layout (``kernels/blocks.py``,
``fgd_fast/backends/gram_gather.py``) against torch indexing of the same slabs.

Integer-valued entries make every sum exact, so the kernel must agree bit for bit: the splits
summed, a symmetric block's lower tiles read as the transposes of its upper ones (tiles smaller
than p here, so that the mirror crosses tiles), ``A = H + L + Lᵀ``, the blocks absent without Φ
or without a prediction left out, in one p and in several.
"""

from __future__ import annotations

import pytest
import torch

from fgd_fast.backends.base import runs_of
from fgd_fast.backends.layout import Layout
from fgd_fast.kernels import meta
from helpers import backend_reason, device_for_tests

REASON = backend_reason("triton")
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"triton backend unavailable: {REASON}")


def _expected(slabs, splits, lay, sources, slots, *, has_phi, predict, mirror, lo, upper):
    total = slabs.view(splits, -1).sum(0)
    ps = [p for n, p in lay.groups for _ in range(n)]
    want = {k: [] for k in range(6)}
    for p, src in zip(ps, sources):
        blocks = total[src : src + slots * p * p].view(slots, p, p)
        tile = torch.arange(p, device=slabs.device) // upper
        upper_tiles = tile[:, None] <= tile[None, :]

        def sym(m, upper_tiles=upper_tiles):
            return torch.where(upper_tiles, m, m.mT) if mirror else m

        a = sym(blocks[meta.SLOT_A])
        if lo:
            a = a + (blocks[meta.SLOT_L] + blocks[meta.SLOT_L].mT)
        for k, x in enumerate([a, blocks[1], blocks[2], sym(blocks[3]), sym(blocks[4]), blocks[5]]):
            want[k].append(x.reshape(-1))
    present = [True, True, has_phi, has_phi, predict, predict and has_phi]
    return [torch.cat(want[k]) if keep else None for k, keep in enumerate(present)]


@pytest.mark.parametrize(
    "groups, mirror, lo, splits",
    [
        ([(3, 40)], True, True, 3),  # tensor cores, tf32x3: 16-row tiles, so 40 crosses three
        ([(2, 5), (1, 40), (2, 17)], True, False, 2),  # tensor cores, tf32, three p
        ([(2, 5), (1, 40)], False, False, 1),  # CUDA cores: full blocks, one split
    ],
)
@pytest.mark.parametrize("has_phi, predict", [(True, True), (False, True), (True, False)])
def test_gathered_blocks_are_the_summed_mirrored_blocks(groups, mirror, lo, splits, has_phi, predict):
    from fgd_fast.backends import gram_gather

    device = device_for_tests()
    slots = meta.TC_GRAM_SLOTS if mirror else meta.GRAM_SLOTS
    lay = Layout(groups, device)
    ps = [p for n, p in groups for _ in range(n)]
    runs = runs_of([(p, has_phi) for p in ps], [slots] * len(ps))
    sources = tuple(r.gram_at + k * r.slots * r.p * r.p for r in runs for k in range(r.end - r.first))
    per_slab = sum(slots * p * p for p in ps)
    gen = torch.Generator().manual_seed(len(ps) * 7 + splits)
    slabs = torch.randint(-50, 50, (splits * per_slab,), generator=gen).to(device, torch.float32)
    got = gram_gather.gather(
        lay, sources, slabs, splits, has_phi=has_phi, predict=predict, mirror=mirror, lo=lo, upper=16
    )
    want = _expected(
        slabs, splits, lay, sources, slots, has_phi=has_phi, predict=predict, mirror=mirror, lo=lo, upper=16
    )
    for k, (g, w) in enumerate(zip(got, want)):
        assert (g is None) == (w is None), k
        if w is not None:
            assert torch.equal(g.reshape(-1), w), k
            if lay.single:
                assert g.shape == (lay.count, ps[0], ps[0])
