"""Gram blocks carried between steps (``FGD(gram_refresh=k)``, the torch backend on a CPU).

A carried step takes ``A = θᵀθ``, ``B = θᵀΦ``, ``C = ΦᵀΦ`` from the last step's ``p × p``
blocks instead of the parameters (``fgd_fast.backends.carry``). In float64 that is the same
step to rounding, whatever the guard did, whatever was written between steps (as long as the
tensors' version counters see it), and after a step that failed; in float32 FGD settles as
close to the manifold as with fresh Grams.
"""

from __future__ import annotations

import contextlib
import copy
import statistics

import pytest
import torch

import fgd_fast
from benchmarks.opcount import OpCounter
from fgd_fast.backends import carry

# every layer n ≥ 2p: A, B and C carried; with a square layer and one of n < 2p: A only
WIDE = [(16, 8, 3, 3), (16, 8, 3, 3), (64, 16), (8, 4, 3, 3)]
MIXED = WIDE[:2] + [(12, 12), (64, 16), (20, 3, 3, 3)]


def _params(dtype=torch.float64, seed=1, shapes=WIDE):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(fgd_fast.orthogonalize_(torch.randn(s, generator=gen, dtype=dtype))) for s in shapes]


def _run(refresh, steps=12, *, lr=0.05, between=None, dtype=torch.float64, shapes=WIDE, **options):
    """θ after ``steps`` FGD steps on fixed random unit-norm gradients; ``between(k, params,
    opt)`` runs before step k (it may write)."""
    carry.forget()
    params = _params(dtype, shapes=shapes)
    opt = fgd_fast.FGD([dict(params=params, orthogonal=True)], lr=lr, backend="torch", gram_refresh=refresh, **options)
    gen = torch.Generator().manual_seed(2)
    for k in range(steps):
        for p in params:
            g = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            p.grad = (g / g.norm()).to(dtype)
        if between is not None:
            between(k, params, opt)
        try:
            opt.step()
        except FloatingPointError:
            pass
    return [p.detach().clone() for p in params], opt


def _close(a, b, tol=1e-11):
    worst = max((x - y).abs().max().item() for x, y in zip(a, b))
    assert worst < tol, worst


def _carried():
    return sorted((e.age, len(e.blocks)) for e in carry._store.values())


@pytest.mark.parametrize("momentum", [0.9, 0.0])
@pytest.mark.parametrize("variant", ["official", "paper"])
@pytest.mark.parametrize("lr", [0.05, 3.0])  # 3.0: the guard scales or resets steps
@pytest.mark.parametrize("shapes", [WIDE, MIXED], ids=["A-B-C", "A"])
def test_carried_grams_give_the_step_of_fresh_ones(momentum, variant, lr, shapes):
    fresh, _ = _run(1, momentum=momentum, variant=variant, lr=lr, shapes=shapes)
    with pytest.warns(RuntimeWarning) if lr > 1 else contextlib.nullcontext():
        carried, _ = _run(4, momentum=momentum, variant=variant, lr=lr, shapes=shapes)
    _close(fresh, carried)
    if lr < 1:  # the guard never bound: the blocks were carried, up to 3 steps old (B, C with Φ, every n ≥ 2p)
        blocks = 3 if momentum > 0 and shapes is WIDE else 1
        assert _carried() == [(3, blocks)]


def test_grams_are_read_again_every_refresh_steps():
    """The Gram products of each step: fewer on a carried one, all of them every ``refresh``."""
    carry.forget()
    params = _params()
    opt = fgd_fast.FGD([dict(params=params, orthogonal=True)], lr=0.05, backend="torch", gram_refresh=3)
    gen = torch.Generator().manual_seed(2)
    counts = []
    for _ in range(8):
        for p in params:
            g = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            p.grad = g / g.norm()
        with OpCounter() as count:
            opt.step()
        counts.append(count.ops["aten.bmm"])
    full, carried = counts[3], counts[1]
    assert carried < full
    # step 0 (no Φ yet: fewer Grams) and steps 3 and 6 read them, the others carry
    assert counts[1:] == [carried, carried, full, carried, carried, full, carried]


@torch.no_grad()
def _writes(k, params, opt):
    if k == 3:
        params[0].mul_(1.01)  # an in-place write autograd sees
    if k == 5:
        fgd_fast.orthogonalize_(params[3])
    if k == 7:
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # new momentum buffers: Φ read again
    if k == 9:
        opt.state[params[1]]["momentum_buffer"].mul_(0.5)


def test_writes_between_steps_are_seen():
    fresh, _ = _run(1, between=_writes)
    carried, _ = _run(4, between=_writes)
    _close(fresh, carried)


def _data_write(k, params, opt):
    if k == 3:
        params[0].data.mul_(1.01)  # invisible to the version counter
        carry.forget()


def _new_data(k, params, opt):
    if k == 3:  # (torch's vector_to_parameters assigns p.data: same counter, new memory)
        torch.nn.utils.vector_to_parameters(params[0].detach().flatten() * 1.01, [params[0]])


def test_new_memory_assigned_through_data_is_seen():
    """A review: ``p.data = other`` (``vector_to_parameters``) kept the version counter, and a
    carried step used the old θ's Grams (θ stored 2.9 off where a fresh step refused it)."""
    fresh, _ = _run(1, between=_new_data)
    carried, _ = _run(4, between=_new_data)
    _close(fresh, carried)


def test_forget_after_a_write_through_data():
    fresh, _ = _run(1, between=_data_write)
    carried, _ = _run(4, between=_data_write)
    _close(fresh, carried)


def test_an_unseen_write_through_data_is_named_in_the_error():
    """A new user's review: after ``p.data.copy_(another orthonormal θ)``, carried steps measured
    the old θ's Grams, moved the new θ off the manifold, and the refresh refused it, advising a
    projection; the message now names the write and carry.forget()."""
    carry.forget()
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(fgd_fast.orthogonalize_(torch.randn(64, 16, generator=gen)))
    opt = fgd_fast.FGD([dict(params=[p], orthogonal=True)], lr=0.1, backend="torch", gram_refresh=4)
    with pytest.raises(ValueError, match=r"through param\.data .*carry\.forget\(\)"):
        for k in range(8):
            p.grad = torch.randn(p.shape, generator=gen) * 0.1
            if k == 2:  # a carried step follows (step 0 read the Grams)
                p.data.copy_(fgd_fast.orthogonalize_(torch.randn(p.shape, generator=gen)))
            opt.step()
    carry.forget()
    with pytest.raises(ValueError, match="from the Stiefel manifold") as info:  # without carrying: no such words
        q = torch.nn.Parameter(2 * torch.eye(3))
        q.grad = torch.zeros(3, 3)
        fgd_fast.FGD([dict(params=[q], orthogonal=True)], lr=0.1, backend="torch").step()
    assert "carry" not in str(info.value)


def _failing(k, params, opt):
    if k == 5:  # a carried step (steps 0 and 4 read the Grams)
        params[0].grad[0, 0, 0, 0] = float("nan")  # check_finite raises before anything is written


def test_a_failed_step_leaves_no_stale_blocks():
    fresh, _ = _run(1, between=_failing)
    carried, _ = _run(4, between=_failing)
    _close(fresh, carried)


@pytest.mark.parametrize(
    "options",
    [
        dict(dtype=torch.bfloat16),  # a 16-bit θ: its rounding is too coarse to carry
        dict(guard=False, check_finite=False, check_manifold=False),  # no prediction: no step distance
    ],
    ids=["bfloat16", "no-prediction"],
)
def test_nothing_is_carried_where_it_would_not_be_exact(options):
    _run(4, steps=3, **options)
    assert carry._store == {}


def test_a_copy_continues_equal_to_rounding():
    params = _params()
    opt = fgd_fast.FGD([dict(params=params, orthogonal=True)], lr=0.05, backend="torch", gram_refresh=4)
    clone = [torch.nn.Parameter(p.detach().clone()) for p in params]
    twin = fgd_fast.FGD([dict(params=clone, orthogonal=True)], lr=0.05, backend="torch", gram_refresh=4)
    gen = torch.Generator().manual_seed(2)
    for k in range(8):
        grads = [g / g.norm() for g in (torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in params)]
        for ps, o in ((params, opt), (clone, twin)):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
            o.step()
        if k == 2:
            twin.load_state_dict(copy.deepcopy(opt.state_dict()))  # the twin reads its Grams afresh from here
    _close(params, clone)


@pytest.mark.parametrize("value, error", [(0, ValueError), (2.5, TypeError), (True, TypeError)])
def test_gram_refresh_is_validated(value, error):
    with pytest.raises(error, match="gram_refresh"):
        fgd_fast.FGD(_params(), lr=0.1, gram_refresh=value)


def _settled(refresh, lr, steps=600):
    """The largest ‖θᵀθ − I‖_F over the layers, averaged over the last tenth of the steps
    (float32, unit-norm gradients)."""
    carry.forget()
    gen = torch.Generator().manual_seed(0)
    shapes = [(48, 16, 3, 3)] * 3 + [(64, 32, 3, 3)] * 2
    params = [torch.nn.Parameter(fgd_fast.orthogonalize_(torch.randn(s, generator=gen))) for s in shapes]
    opt = fgd_fast.FGD([dict(params=params, orthogonal=True)], lr=lr, backend="torch", gram_refresh=refresh)
    tail = []
    for k in range(steps):
        for p in params:
            g = torch.randn(p.shape, generator=gen)
            p.grad = g / g.norm()
        opt.step()
        if k >= steps - steps // 10:
            tail.append(max(fgd_fast.stiefel_distance(p) for p in params))
    return statistics.fmean(tail)


@pytest.mark.parametrize("lr", [1e-2, 1e-4])  # 1e-2: the O(η²) drift sets the distance; 1e-4: fp32's rounding
def test_float32_settles_as_close_with_carried_grams(lr):
    fresh, carried = _settled(1, lr), _settled(4, lr)  # (measured 1.00× and 1.14×; 8 steps: 1.25× at 1e-4)
    assert carried <= 1.2 * fresh, (carried, fresh)


def test_blocks_of_freed_tensors_are_dropped():
    """A dropped model's carried blocks go at the next step of any model (no memory held)."""
    import gc

    _run(4, steps=3)  # leaves an entry, its tensors freed with the function's locals
    gc.collect()
    assert len(carry._store) == 1
    params = _params()
    opt = fgd_fast.FGD([dict(params=params, orthogonal=True)], lr=0.05, backend="torch", gram_refresh=4)
    for p in params:
        p.grad = torch.randn(p.shape, dtype=p.dtype) * 0.01
    opt.step()
    assert len(carry._store) == 1 and all(r() is not None for e in carry._store.values() for r in e.refs)


def test_an_entry_is_taken_only_for_the_tensors_it_was_made_from():
    """The key holds the tensors' ids, which Python reuses once a tensor is freed: an entry found
    under its key is still refused for other tensor objects, even at the same version counts."""
    carry.forget()
    made, other = torch.zeros(4, 2, dtype=torch.float64), torch.zeros(4, 2, dtype=torch.float64)
    assert made._version == other._version
    blocks = (torch.eye(2, dtype=torch.float64)[None],)
    # (take removes the entry either way: each try keeps it again first)
    for tensors, taken in (([other], False), ([made, other], False), ([made], True)):  # (2: another count)
        carry.keep(("key",), blocks, [made], age=0)
        assert (carry.take(("key",), tensors, refresh=4) is not None) == taken
    carry.forget()


def test_the_store_keeps_a_few_entries_the_oldest_going_first():
    """Many models stepping with carried Grams (all alive) hold the blocks of the latest few only."""
    carry.forget()
    models = []
    for seed in range(carry._CAPACITY + 3):
        params = _params(seed=seed)
        opt = fgd_fast.FGD([dict(params=params, orthogonal=True)], lr=0.05, backend="torch", gram_refresh=4)
        for p in params:
            p.grad = torch.randn(p.shape, dtype=p.dtype) * 0.01
        opt.step()
        models.append((params, opt))  # (the entries hold the momentum buffers too: the optimizers stay alive)
    assert len(carry._store) == carry._CAPACITY
    kept = {id(r()) for e in carry._store.values() for r in e.refs}
    assert not kept & {id(p) for p in models[0][0]} and {id(p) for p in models[-1][0]} <= kept
    carry.forget()


@pytest.mark.parametrize("refresh", [1, 4])
def test_the_guard_is_told_each_groups_stored_dtype_and_carried_rounding(refresh, monkeypatch):
    """Each middle call of the torch backend serves one stored dtype (a float32 and a bfloat16
    layer of one shape are not one group: each θ₊ must fit its own dtype's rounding) and its
    guard's rounding unit is the stored dtype's, times the steps its carried Grams may lag the
    stored θ (``refresh``: one rounding per step carried)."""
    from fgd_fast.backends import torch_groups
    from fgd_fast.backends.guard_rule import store_unit

    told = []

    def middle(*args, **kwargs):
        told.append((kwargs["stored"], kwargs["unit"], kwargs["carry"], kwargs["layout"].count))
        return real(*args, **kwargs)

    real = torch_groups.middle
    monkeypatch.setattr(torch_groups, "middle", middle)
    carry.forget()
    gen = torch.Generator().manual_seed(3)
    params = [
        torch.nn.Parameter(fgd_fast.orthogonalize_(torch.randn(32, 8, generator=gen)).to(dtype))
        for dtype in (torch.float32, torch.bfloat16, torch.float32)
    ]
    opt = fgd_fast.FGD([dict(params=params, orthogonal=True)], lr=0.05, backend="torch", gram_refresh=refresh)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()
    assert {(stored, count) for stored, _, _, count in told} == {(torch.float32, 2), (torch.bfloat16, 1)}
    for stored, unit, carried, _ in told:
        assert unit == store_unit(stored) * (refresh if carried else 1)
    assert any(carried for stored, _, carried, _ in told if stored == torch.float32) == (refresh > 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_gradient_in_the_normal_space_never_resets_a_carried_step(dtype):
    """g = θS (S symmetric: an L2 penalty's direction) has no tangent part, so Φ₊ ≈ 0 and a
    carried C₊ = Φ₊ᵀΦ₊, a difference of blocks, may have a trace that rounds below 0. Its square
    root was NaN and the guard reset the step (a review planted the clamp's removal: 32 of 40
    such runs reset); with the clamp, none does."""
    resets = 0
    for seed in range(10):
        gen = torch.Generator().manual_seed(seed)
        p = torch.nn.Parameter(fgd_fast.orthogonalize_(torch.randn(64, 16, generator=gen, dtype=dtype)))
        opt = fgd_fast.FGD([dict(params=[p], orthogonal=True)], lr=0.1, backend="torch", gram_refresh=4)
        for _ in range(4):
            s = torch.randn(16, 16, generator=gen, dtype=dtype)
            p.grad = p.detach() @ (s + s.mT)
            opt.step()
        resets += opt.guard_stats()[0]["reset"]
    carry.forget()
    assert resets == 0
