from __future__ import annotations

import threading
import time

import pytest
import torch

from mmserve.multimodal.cache import EmbeddingCache

MB = 1024 * 1024


def block(mb: float, fill: float = 0.0) -> torch.Tensor:
    return torch.full((int(mb * MB) // 4,), fill, dtype=torch.float32)


def test_budget_and_lru_eviction_order():
    cache = EmbeddingCache(capacity_mb=3)
    for key in (b"a", b"b", b"c"):
        assert cache.put(key, block(1))
    assert cache.used_bytes == 3 * MB
    assert cache.get(b"a") is not None  # a becomes most recent: order b, c, a
    cache.put(b"d", block(1))  # evicts b
    assert b"b" not in cache and b"a" in cache and b"c" in cache and b"d" in cache
    cache.put(b"e", block(2))  # evicts c then a
    assert list(cache._entries) == [b"d", b"e"]
    assert cache.stats.evictions == 3
    cache.check_integrity()


def test_oversize_entry_refused_without_evicting():
    cache = EmbeddingCache(capacity_mb=2)
    cache.put(b"a", block(1))
    assert not cache.put(b"huge", block(3))
    assert b"a" in cache and b"huge" not in cache
    assert cache.stats.refused == 1 and cache.stats.evictions == 0
    cache.check_integrity()


def test_replacing_a_key_keeps_accounting_exact():
    cache = EmbeddingCache(capacity_mb=2)
    cache.put(b"a", block(1))
    cache.put(b"a", block(0.5))
    assert cache.used_bytes == MB // 2
    cache.check_integrity()


def test_hit_miss_counters():
    cache = EmbeddingCache(capacity_mb=1)
    assert cache.get(b"x") is None
    cache.put(b"x", block(0.1))
    assert cache.get(b"x") is not None
    assert (cache.stats.queries, cache.stats.hits) == (2, 1)
    assert cache.stats.hit_rate == 0.5


def test_single_flight_computes_once_for_concurrent_callers():
    cache = EmbeddingCache(capacity_mb=1)
    calls = []
    gate = threading.Event()

    def compute():
        calls.append(1)
        gate.wait(5)
        return block(0.01, fill=7.0)

    results = []
    threads = [
        threading.Thread(target=lambda: results.append(cache.get_or_compute(b"k", compute))) for _ in range(8)
    ]
    for t in threads:
        t.start()
    time.sleep(0.1)
    gate.set()
    for t in threads:
        t.join(5)
    assert len(calls) == 1
    assert len(results) == 8 and all(torch.equal(r, results[0]) for r in results)
    assert cache.get_or_compute(b"k", compute) is not None and len(calls) == 1


def test_single_flight_error_propagates_and_is_not_cached():
    cache = EmbeddingCache(capacity_mb=1)

    def boom():
        raise RuntimeError("tower failed")

    with pytest.raises(RuntimeError, match="tower failed"):
        cache.get_or_compute(b"k", boom)
    assert b"k" not in cache
    assert torch.equal(cache.get_or_compute(b"k", lambda: block(0.01, 1.0)), block(0.01, 1.0))
    cache.check_integrity()
