"""The device-table cache of the fused backends: bounded, and safe under CUDA graph capture."""

from __future__ import annotations

import torch

from fgd_fast.backends import base


def test_cache_keeps_at_most_capacity_entries_least_recent_out():
    cache = base.TableCache(capacity=3)
    for k in range(5):
        cache.get_or(k, lambda k=k: torch.tensor([k]))
    assert list(cache) == [2, 3, 4]
    cache.get_or(2, lambda: torch.tensor([-1]))  # a hit: not rebuilt, now most recent
    assert int(cache[2]) == 2 and list(cache) == [3, 4, 2]


def test_every_build_is_counted_and_a_hit_is_not():
    """``TableCache.builds`` (the training comparison's tables built per step) counts misses only."""
    cache = base.TableCache(capacity=2)
    before = base.TableCache.builds
    for k in (0, 1, 0, 1, 2):
        cache.get_or(k, lambda k=k: torch.tensor([k]))
    assert base.TableCache.builds - before == 3


def test_tables_used_during_graph_capture_are_never_evicted(monkeypatch):
    """A captured graph reads its tables at every replay: they must outlive any eviction."""
    cache = base.TableCache(capacity=2)
    monkeypatch.setattr(base, "_capturing", lambda: True)
    captured = cache.get_or("graph", lambda: torch.tensor([7]))
    monkeypatch.setattr(base, "_capturing", lambda: False)
    for k in range(10):
        cache.get_or(k, lambda k=k: torch.tensor([k]))
    assert cache["graph"] is captured
    assert list(cache) == ["graph", 8, 9]


def test_inverse_permutation_goes_through_the_cache(monkeypatch):
    monkeypatch.setattr(base, "_permutations", base.TableCache(capacity=2))
    parts = [torch.tensor([10.0, 30.0]), torch.tensor([20.0])]
    out = base.in_input_order(parts, [0, 2, 1], torch.device("cpu"))
    assert out.tolist() == [10.0, 20.0, 30.0]
    assert ((0, 2, 1), torch.device("cpu")) in base._permutations
