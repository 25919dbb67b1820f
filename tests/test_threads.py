"""Two optimizers stepping at once in two threads (a review of the process-wide state): the fp32
matmul precision a step switches is the most precise any open region wants and is put back as
the user set it when the last closes, the backends' caches take concurrent lookups and
insertions and build their tables outside their lock (ranks as threads meet in collectives
there), and a layout's memo stays bounded when a search changes the values it is keyed on."""

from __future__ import annotations

import sys
import threading

import pytest
import torch

import fgd_fast
from fgd_fast.backends import base, layout
from fgd_fast.backends.layout import Layout


@pytest.fixture
def user_precision():
    before = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(before)


def test_overlapping_regions_get_at_least_their_precision_and_the_last_restores_the_users(user_precision):
    """A review: two steps in two threads each saved the process-wide precision, set their own
    and restored what they had saved, so the second restored the first's temporary "high" and
    TF32 stayed on for the rest of the process (10 of 15 rounds). Now every thread's open regions
    are counted: the setting is the most precise one wanted (a TF32 region overlapping an IEEE
    one runs IEEE, never the reverse), and the last region to close restores the user's. No
    region waits for another (ranks as threads meet in collectives inside theirs)."""
    torch.set_float32_matmul_precision("medium")
    step = threading.Barrier(2, timeout=10)
    seen: dict = {}

    def fast():  # TF32 allowed
        with base.fp32_matmuls("tf32x3"):
            seen["fast alone"] = torch.get_float32_matmul_precision()
            step.wait()  # 1: the other opens its IEEE region
            step.wait()  # 2: it is open
            seen["fast beside ieee"] = torch.get_float32_matmul_precision()
            step.wait()  # 3: it closes
            step.wait()  # 4: it is closed
            seen["fast after ieee"] = torch.get_float32_matmul_precision()

    def exact():  # IEEE
        step.wait()  # 1
        with base.fp32_matmuls("ieee"):
            seen["ieee beside fast"] = torch.get_float32_matmul_precision()
            step.wait()  # 2
            step.wait()  # 3
        step.wait()  # 4

    def exact_first():  # an IEEE region open when a TF32 one enters beside it
        with base.fp32_matmuls("ieee"):
            step.wait()  # 1: the other enters its TF32 region
            step.wait()  # 2: it is open
            seen["ieee when fast entered"] = torch.get_float32_matmul_precision()
            step.wait()  # 3: it closes
            step.wait()  # 4: it is closed
            seen["ieee after fast"] = torch.get_float32_matmul_precision()

    def fast_second():
        step.wait()  # 1
        with base.fp32_matmuls("tf32x3"):
            step.wait()  # 2
            step.wait()  # 3
        step.wait()  # 4

    for pair in ((fast, exact), (exact_first, fast_second)):
        threads = [threading.Thread(target=f, daemon=True) for f in pair]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert not any(t.is_alive() for t in threads)
        assert torch.get_float32_matmul_precision() == "medium"
    assert seen == {
        "fast alone": "high",
        "ieee beside fast": "highest",
        "fast beside ieee": "highest",
        "fast after ieee": "high",
        "ieee when fast entered": "highest",
        "ieee after fast": "highest",
    }


def test_a_setting_that_is_already_the_steps_is_not_written(user_precision, monkeypatch):
    """Other threads' matmuls see no change where the user's setting is the step's already, and
    a region nested in another (the IEEE Gram inside a TF32 step) sets and restores it."""
    torch.set_float32_matmul_precision("highest")
    calls = []
    real = torch.set_float32_matmul_precision
    monkeypatch.setattr(torch, "set_float32_matmul_precision", lambda v: (calls.append(v), real(v)))
    with base.fp32_matmuls("ieee"):
        pass
    assert calls == []
    with base.fp32_matmuls("tf32x3"):
        with base.full_precision():
            assert torch.get_float32_matmul_precision() == "highest"
        assert torch.get_float32_matmul_precision() == "high"
    assert calls == ["high", "highest", "high", "highest"]


def test_two_optimizers_in_two_threads_step_as_they_do_one_after_another(user_precision):
    """End to end, the review's case: two models' torch-backend steps interleaved in two threads
    give the sequential run's weights, and the user's precision is as set afterwards."""
    torch.set_float32_matmul_precision("high")
    gen = torch.Generator().manual_seed(0)
    shapes = {0: [(96, 24), (40, 8)], 1: [(64, 16), (33, 5), (33, 5)]}
    starts = {k: [fgd_fast.orthogonalize_(torch.randn(s, generator=gen)) for s in v] for k, v in shapes.items()}
    grads = {k: [[torch.randn(s, generator=gen) * 0.05 for s in v] for _ in range(8)] for k, v in shapes.items()}

    def run(k, out, barrier=None):
        params = [torch.nn.Parameter(w.clone()) for w in starts[k]]
        opt = fgd_fast.FGD([dict(params=params, orthogonal=True)], lr=0.1, backend="torch", precision="ieee")
        if barrier is not None:
            barrier.wait(10)
        for step in grads[k]:
            for p, g in zip(params, step):
                p.grad = g.clone()
            opt.step()
        out[k] = [p.detach().clone() for p in params]

    alone: dict = {}
    run(0, alone)
    run(1, alone)
    for _ in range(3):
        together: dict = {}
        barrier = threading.Barrier(2)
        threads = [threading.Thread(target=run, args=(k, together, barrier), daemon=True) for k in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a thread hung"
        assert sorted(together) == [0, 1]
        for k in (0, 1):
            assert all(torch.equal(a, b) for a, b in zip(together[k], alone[k])), k
        assert torch.get_float32_matmul_precision() == "high"


def test_the_caches_take_lookups_and_insertions_from_many_threads(monkeypatch):
    """A review: ``TableCache.get_or`` and the layout index iterated their dicts while another
    thread inserted ("OrderedDict mutated during iteration", a KeyError; 23 errors in 5 trials of
    8 threads at a 1 µs switch interval). Now behind one lock."""
    monkeypatch.setattr(layout, "_indices", {})
    monkeypatch.setattr(layout, "_pinned", set())
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    errors: list[str] = []

    def tables(cache, tid):
        try:
            for i in range(2000):
                cache.get_or((tid, i), lambda i=i: i)
        except Exception as error:  # noqa: BLE001 (collected: a thread's exception is otherwise lost)
            errors.append(repr(error))

    def layouts(tid):
        try:
            for i in range(300):
                Layout([(1, 2 + (i % 40)), (1, 3 + tid)]).eye(torch.float32)
        except Exception as error:  # noqa: BLE001
            errors.append(repr(error))

    try:
        for _ in range(3):
            cache = base.TableCache(capacity=64)
            threads = [threading.Thread(target=tables, args=(cache, t), daemon=True) for t in range(4)]
            threads += [threading.Thread(target=layouts, args=(t,), daemon=True) for t in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert not any(t.is_alive() for t in threads), "a thread hung"
            assert len(cache) <= 64
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors[:3]


def test_a_layouts_memo_keeps_its_newest_entries_and_those_a_capture_used(monkeypatch):
    """A review: the memo (e.g. the guard's target per layer, keyed on ``max_distance``) grew by
    one entry per value a search tried (20,000 trials: 20,000 entries). Now the least recently
    used go beyond ``_MEMO_CAPACITY``; an entry used while a CUDA graph was captured stays."""
    monkeypatch.setattr(layout, "_indices", {})
    monkeypatch.setattr(layout, "_pinned", set())
    monkeypatch.setattr(layout, "_MEMO_CAPACITY", 3)
    lay = Layout([(1, 2), (1, 3)])
    monkeypatch.setattr(layout, "_capturing", lambda: True)
    captured = lay.cached(("graph",), lambda: torch.zeros(2))
    monkeypatch.setattr(layout, "_capturing", lambda: False)
    for k in range(10):
        lay.cached(("value", k), lambda k=k: torch.full((2,), float(k)))
    lay.cached(("value", 8), lambda: pytest.fail("a hit is not rebuilt"))
    memo = lay._index().memo
    assert list(memo) == [("graph",), ("value", 7), ("value", 9), ("value", 8)]
    assert memo[("graph",)] is captured


def test_a_table_is_built_outside_the_caches_lock(monkeypatch):
    """A diff review: ``TableCache.get_or`` held the lock while it built a table, and the owner
    sharding's table is built by an all-gather; with ranks as threads of one process, rank 0 held
    the lock inside the collective while rank 1 waited for the lock (a hang). Two builds that
    wait for each other, as the ranks' collective does, now both finish; so do a layout's."""
    monkeypatch.setattr(layout, "_indices", {})
    monkeypatch.setattr(layout, "_pinned", set())
    cache = base.TableCache(capacity=8)
    meet = threading.Barrier(2, timeout=5)
    done: list = []

    def rank(r):
        try:
            done.append(cache.get_or(("table", r), lambda: (meet.wait(), r)[1]))
            lay = Layout([(1, 2), (1, 5)])
            done.append(lay.cached(("memo", r), lambda: (meet.wait(), r)[1]))
        except threading.BrokenBarrierError as error:
            done.append(error)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert sorted(done) == [0, 0, 1, 1], done


def test_a_region_entered_after_the_apis_were_mixed_opens_and_closes(user_precision):
    """A diff review: a region entered after the per-backend switches were set unlike the legacy
    setting (torch then raises reading the legacy one) raised after it was counted, so the count
    never came back to zero and the user's setting was never put back."""
    from fgd_fast.backends import shared_state

    torch.set_float32_matmul_precision("highest")
    with base.fp32_matmuls("tf32x3"):
        torch.backends.cuda.matmul.fp32_precision = "tf32"  # (mixed: the legacy getter raises now)
        torch.backends.mkldnn.matmul.fp32_precision = "ieee"
        with base.full_precision():
            assert torch.backends.cuda.matmul.fp32_precision in ("ieee", "none")
    assert shared_state._REGIONS.open == {"ieee": 0, "tf32": 0}
    assert torch.get_float32_matmul_precision() == "highest"
