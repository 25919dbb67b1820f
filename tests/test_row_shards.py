"""The backend contract for row shards (``prepare(..., reduce=, shapes=)``), in one process.

R threads stand in for R ranks: each calls the backend on its rows of every θ, and their
``reduce`` sums the ranks' lists in a fixed order behind a barrier (as one all-reduce would).
Every rank's rows of θ₊ and Φ₊, its distances and finite flags must match the backend on
the whole matrices. This reaches what the multi-process tests do not: p ≥ 64 (the torch
backend's block-half Grams), float32, several layers per bucket, shards with no rows, and the
GPU's stacked operands when a GPU is present.
"""

from __future__ import annotations

import threading

import pytest
import torch

from fgd_fast._matrix import as_stiefel, from_stiefel, stiefel_shape
from fgd_fast.backends import resolve_backend, torch_batched, torch_bucket
from fgd_fast.manifold import orthogonalize_
from helpers import device_for_tests

ROW_SHARD_BACKENDS = ["torch"]


def _row_dim(shape) -> int:
    """The dimension whose slabs are sets of θ's rows: 1 when θ = W2ᵀ, else 0."""
    return 1 if stiefel_shape(shape).transposed else 0


def _split(t: torch.Tensor, ranks: int) -> list[torch.Tensor]:
    """Uneven slabs (the last ones possibly empty), as FSDP2 chunks a dimension."""
    dim = _row_dim(t.shape)
    size = -(-t.shape[dim] // ranks)
    return [
        t.narrow(dim, min(r * size, t.shape[dim]), max(0, min(size, t.shape[dim] - r * size))).clone()
        for r in range(ranks)
    ]


def _run_ranks(prepare, ranks, params, grads, bufs, fresh, kw, reduces=1, steps=1):
    barrier = threading.Barrier(ranks)
    lists: dict[int, list[torch.Tensor]] = {}
    calls = [0] * ranks
    out: dict[int, tuple] = {}
    errors: list[BaseException] = []

    def reduce_for(rank):
        def reduce(tensors):
            calls[rank] += 1
            lists[rank] = tensors
            barrier.wait()
            if rank == 0:
                sums = [sum(lists[r][i] for r in range(ranks)) for i in range(len(tensors))]
                lists["sum"] = sums
            barrier.wait()
            for t, s in zip(tensors, lists["sum"]):
                t.copy_(s)
            barrier.wait()

        return reduce

    def rank_main(rank):
        try:
            p = [_split(t, ranks)[rank] for t in params]
            g = [_split(t, ranks)[rank] for t in grads]
            b = [_split(t, ranks)[rank] if t is not None else None for t in bufs]
            for step in range(steps):  # (later steps read Φ where there is one)
                now = fresh if step == 0 else [t is None for t in b]
                plan = prepare(p, g, b, now, **kw, reduce=reduce_for(rank), shapes=[t.shape for t in params])
                plan.apply()
            out[rank] = (p, b, plan.dist, plan.finite)
        except BaseException as exc:  # noqa: BLE001 (reported by the test)
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert calls == [reduces * steps] * ranks  # one reduce per prepare (unless told), on every rank
    return out


def _assert_rows_are_the_whole_step(out, plan, whole, ranks, layers, with_phi, tol) -> None:
    """Every rank's distances and finite flags as the others' and as the whole matrices'
    ``plan``'s, and its rows of θ₊ (and Φ₊) of ``layers`` those of the whole matrices' step
    ``whole``."""
    for rank, (p, b, dist, finite) in out.items():
        assert torch.equal(dist, out[0][2]) and torch.equal(finite, out[0][3])  # the same on every rank
        torch.testing.assert_close(dist, plan.dist, rtol=0, atol=tol)
        assert finite.tolist() == plan.finite.tolist()
        for i in layers:
            torch.testing.assert_close(p[i], _split(whole[0][i], ranks)[rank], rtol=0, atol=tol)
            if with_phi:
                torch.testing.assert_close(b[i], _split(whole[1][i], ranks)[rank], rtol=0, atol=tol)


def _problem(shapes, dtype, seed, with_phi, device):
    gen = torch.Generator().manual_seed(seed)
    params = [orthogonalize_(torch.randn(s, generator=gen, dtype=torch.float64)).to(dtype) for s in shapes]
    grads = [0.01 * torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes]
    bufs = []
    for theta, s in zip(params, shapes):
        if not with_phi:
            bufs.append(None)
            continue
        th = as_stiefel(theta).to(torch.float64)
        raw = 1e-3 * torch.randn(th.shape, generator=gen, dtype=torch.float64)
        bufs.append(from_stiefel(raw - th @ (th.t() @ raw), s).to(dtype))  # roughly tangent
    move = lambda ts: [t.to(device) if t is not None else None for t in ts]  # noqa: E731
    return move(params), move(grads), move(bufs)


@pytest.mark.parametrize("backend", ROW_SHARD_BACKENDS)
@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
@pytest.mark.parametrize("with_phi", [True, False], ids=["phi", "first-step"])
@pytest.mark.parametrize("halves", [False, True], ids=["one-product", "halves"])
@pytest.mark.parametrize("bad", [float("nan"), -float("inf")], ids=["nan", "minus-inf"])  # (a max alone misses −Inf)
def test_row_shards_match_whole_matrices(backend, ranks, dtype, tol, with_phi, halves, bad, monkeypatch):
    device = device_for_tests()
    _, prepare = resolve_backend(backend, device)
    assert getattr(prepare, "row_shards", False)
    if halves:  # the torch backend's symmetric Grams as block halves from p = 64 on (the default: from 160)
        monkeypatch.setattr(torch_bucket, "_HALVES_FROM", 64)
    # θ = W2ᵀ conv (p = 70: block halves where asked for), two equal layers in one bucket, θ = W2
    # with 2 rows (empty shards on 3 ranks), and a Linear
    shapes = [(70, 9, 3, 3), (70, 9, 3, 3), (2, 1), (5, 7), (19, 4, 1, 1)]
    params, grads, bufs = _problem(shapes, dtype, seed=ranks, with_phi=with_phi, device=device)
    grads[3][0, 0] = bad  # reported as not finite by every rank (no prediction: the check's own pass over g)
    fresh = [not with_phi] * len(shapes)
    kw = dict(lr=[0.1] * 5, momentum=[0.9] * 5, feedback=[0.4] * 5, check_finite=True)

    whole = [t.clone() for t in params], [t.clone() if t is not None else None for t in bufs]
    plan = prepare(whole[0], [g.clone() for g in grads], whole[1], fresh, **kw)
    plan.apply()
    out = _run_ranks(prepare, ranks, params, grads, bufs, fresh, kw)
    assert plan.finite.tolist() == [True, True, True, False, True]
    # (layer 3's NaN spreads through its θ₊; only the flag matters there)
    _assert_rows_are_the_whole_step(out, plan, whole, ranks, (0, 1, 2, 4), with_phi, tol)


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("with_phi", [True, False], ids=["phi", "first-step"])
def test_a_gradient_past_the_float32_gram_range_is_scaled_as_on_whole_matrices(ranks, with_phi):
    """A finite float32 gradient so large (‖g‖ ~ 1e22) that its Gram gᵀg overflows float32, with
    the guard on: on whole matrices the guard scales the step, (sU)ᵀ(sU) formed again from sU.
    Row shards do the same: each rank forms its rows' part and the ranks sum it (a second
    ``reduce``, on every rank alike); every rank's rows equal the whole matrices' step (a rank's
    own part alone, or none, made other distances or a reset)."""
    _, prepare = resolve_backend("torch", torch.device("cpu"))  # (the host read that asks for the sum: a CPU)
    shapes = [(70, 9, 3, 3), (5, 7), (19, 4, 1, 1)]
    params, grads, bufs = _problem(shapes, torch.float32, seed=ranks, with_phi=with_phi, device="cpu")
    grads[1].mul_(1e22)  # finite; ‖g‖² ~ 1e44 is not a float32
    fresh = [not with_phi] * len(shapes)
    kw = dict(lr=[0.1] * 3, momentum=[0.9] * 3, feedback=[0.4] * 3, check_finite=True, trust_radius=1.0)
    kw.update(max_distance=1e-3)
    whole = [t.clone() for t in params], [t.clone() if t is not None else None for t in bufs]
    plan = prepare(whole[0], [g.clone() for g in grads], whole[1], fresh, **kw)
    assert plan.guarded.tolist() == [0, 1, 0]  # the huge layer scaled, not reset
    plan.apply()
    out = _run_ranks(prepare, ranks, params, grads, bufs, fresh, kw, reduces=2)
    assert plan.finite.tolist() == [True] * 3
    _assert_rows_are_the_whole_step(out, plan, whole, ranks, range(3), with_phi, 2e-5)


def test_row_shards_carry_no_grams_between_steps():
    """``gram_refresh`` > 1 carries Gram blocks from one step to the next (:mod:`.carry`) for whole
    matrices only: a row shard's blocks are partial sums, summed over the ranks every step (a
    carried A, already summed, summed again came back doubled). Three steps of each rank on its
    own shards equal three steps on the whole matrices, which carry."""
    _, prepare = resolve_backend("torch", torch.device("cpu"))  # (Grams are carried on a CPU)
    shapes = [(70, 9, 3, 3), (30, 5)]
    params, grads, bufs = _problem(shapes, torch.float64, seed=0, with_phi=True, device="cpu")
    kw = dict(lr=[0.1] * 2, momentum=[0.9] * 2, feedback=[0.4] * 2, check_finite=True, trust_radius=1.0)
    kw.update(max_distance=0.5, gram_refresh=4)
    whole = [t.clone() for t in params], [t.clone() for t in bufs]
    for _ in range(3):
        plan = prepare(whole[0], grads, whole[1], [False] * 2, **kw)
        plan.apply()
    out = _run_ranks(prepare, 2, params, grads, bufs, [False] * 2, kw, steps=3)
    _assert_rows_are_the_whole_step(out, plan, whole, 2, range(2), True, 1e-12)


def test_row_shards_cut_the_middle_by_the_whole_matrices_sizes(monkeypatch):
    """With a GPU's middle budget (the step's constrained elements: here 3 layers of p = 3 per
    middle chunk), the chunks are cut from the whole matrices' sizes (``shapes``), so every rank
    makes the same groups and sums the same blocks in the same order; cut from its own rows
    (24 and 23 of 47), the two ranks grouped the 8 layers by 2 and by 1 and their sums did not
    line up."""
    monkeypatch.setattr(torch_batched, "_CPU_MIDDLE_FLOOR", 0)
    _, prepare = resolve_backend("torch", torch.device("cpu"))
    shapes = [(47, 3)] * 8
    params, grads, bufs = _problem(shapes, torch.float64, seed=1, with_phi=True, device="cpu")
    kw = dict(lr=[0.1] * 8, momentum=[0.9] * 8, feedback=[0.4] * 8, check_finite=True)
    whole = [t.clone() for t in params], [t.clone() for t in bufs]
    plan = prepare(whole[0], grads, whole[1], [False] * 8, **kw)
    plan.apply()
    out = _run_ranks(prepare, 2, params, grads, bufs, [False] * 8, kw)
    _assert_rows_are_the_whole_step(out, plan, whole, 2, range(8), True, 1e-12)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(
    "bucket_bytes, count",
    [(None, 1), (1, 4), (500, 3), (1000, 2)],
    ids=["one-call", "a-call-per-chunk", "two-chunks-a-call", "a-chunk-left-for-the-end"],
)
def test_overlapped_sums_send_each_block_once(bucket_bytes, count, asynchronous):
    """``OverlappedSums`` with a reducer standing in for two equal ranks (each sum doubles): every
    block, symmetric ones as upper triangles mirrored back, and the extra tensors are summed
    exactly once, whatever the bucket size (a bucket counts only what is pending: the bytes
    already sent do not make every later chunk a call of its own); a reducer that sums only when
    its returned ``wait`` is called (an asynchronous collective) is waited for; and a step with
    nothing to sum still makes its call (every rank makes the same calls)."""
    from fgd_fast.backends.gram_sums import OverlappedSums

    calls = []

    def reduce(tensors):
        calls.append(len(tensors))

        def wait():
            for t in tensors:
                t.mul_(2.0)

        if asynchronous:
            return wait
        wait()

    if bucket_bytes is not None:
        reduce.bucket_bytes = bucket_bytes
    gen = torch.Generator().manual_seed(0)
    chunks = []
    for p in (3, 5, 4):
        a = torch.randn(2, p, p, generator=gen, dtype=torch.float64)
        chunks.append([a + a.mT, torch.randn(2, p, p, generator=gen, dtype=torch.float64)])  # [A (symmetric), E]
    want = [[2.0 * b for b in blocks] for blocks in chunks]
    extra = torch.arange(3.0)
    sums = OverlappedSums(reduce)
    for blocks in chunks:
        sums.add(blocks, (0,))
    sums.finish([extra])
    for got, expected in zip(chunks, want):
        for b, w in zip(got, expected):
            assert torch.equal(b, w)
    assert torch.equal(extra, 2.0 * torch.arange(3.0)) and len(calls) == count  # (the extra with the last blocks)
    calls.clear()
    OverlappedSums(reduce).finish([])
    assert calls == [0]


@pytest.mark.parametrize("guard", [True, False], ids=["guard", "no-guard"])
@pytest.mark.parametrize("with_phi", [True, False], ids=["phi", "first-step"])
def test_every_symmetric_gram_block_is_sent_as_its_upper_triangle(with_phi, guard):
    """What a row-sharded torch step sums over the ranks: each layer's symmetric blocks (A, C with
    Φ, the guard's velocity Gram UᵀU or gᵀg with a prediction) as p(p+1)/2 numbers, the others (E,
    B) whole (a velocity Gram left out of the symmetric slots was sent whole: the same sums, more
    bytes)."""
    _, prepare = resolve_backend("torch", torch.device("cpu"))
    p, layers = 5, 2
    params, grads, bufs = _problem([(11, p)] * layers, torch.float64, seed=0, with_phi=with_phi, device="cpu")
    sent = []
    kw = dict(lr=[0.1] * layers, momentum=[0.9] * layers, feedback=[0.4] * layers, check_finite=True)
    if guard:
        kw.update(trust_radius=1.0, max_distance=0.5)
    fresh = [not with_phi] * layers
    plan = prepare(
        params, grads, bufs, fresh, **kw, reduce=lambda ts: sent.extend(ts), shapes=[t.shape for t in params]
    )
    plan.apply()
    shapes = [tuple(t.shape) for t in sent]
    triangles = (2 if with_phi else 1) + (1 if guard else 0)
    assert shapes.count((layers, p * (p + 1) // 2)) == triangles, shapes
    assert shapes.count((layers, p, p)) == (2 if with_phi else 1), shapes  # E (and B)
