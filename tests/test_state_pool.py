"""The state pool (linear-attention layers' per-request state) and the prefix cache's state checkpoints: CPU unit
tests of the managers, no model."""

from __future__ import annotations

import pytest
import torch

from mmserve.engine.cache.kv_pool import KVPool
from mmserve.engine.cache.radix_cache import RadixCache
from mmserve.engine.cache.state_pool import StatePool, state_bytes
from mmserve.models.layer_specs import LinearStateSpec

SPEC = LinearStateSpec((12, 4), (2, 3, 5), "Qwen3_5GatedDeltaNet")
SPECS = {0: SPEC, 2: SPEC}


def test_slots_views_and_bytes_in_the_dtypes_transformers_keeps():
    pool = StatePool(3, SPECS, torch.bfloat16)
    assert pool.conv[0].shape == (3, 12, 4) and pool.conv[0].dtype == torch.bfloat16
    assert pool.recurrent[2].shape == (3, 2, 3, 5) and pool.recurrent[2].dtype == torch.float32  # fp32 in bf16
    assert pool.slot_bytes == state_bytes(SPECS, torch.bfloat16) == 2 * (12 * 4 * 2 + 2 * 3 * 5 * 4)
    for layer, value in ((0, 1.0), (2, 2.0)):  # every view its own part of the one allocation
        pool.conv[layer].fill_(value)
        pool.recurrent[layer].fill_(-value)
    assert float(pool.conv[0].float().sum()) == 3 * 48 and float(pool.recurrent[2].mean()) == -2.0
    assert StatePool.from_budget(pool.slot_bytes * 5 + 1, SPECS, torch.bfloat16).num_slots == 5
    with pytest.raises(ValueError, match="state-cache-mb"):
        StatePool.from_budget(pool.slot_bytes - 1, SPECS, torch.bfloat16)


def test_alloc_free_copy_gather_scatter():
    pool = StatePool(2, SPECS, torch.float32)
    a, b = pool.alloc(), pool.alloc()
    assert (a, b) == (0, 1) and pool.alloc() is None and pool.num_free == 0
    for layer in SPECS:
        pool.conv[layer][a].copy_(torch.randn(12, 4))
        pool.recurrent[layer][a].copy_(torch.randn(2, 3, 5))
    pool.copy_(a, b)
    assert all(torch.equal(pool.conv[k][a], pool.conv[k][b]) for k in SPECS)
    other = StatePool(4, SPECS, torch.float32)
    data = pool.gather(a)
    assert data.dtype == torch.uint8 and data.numel() == pool.slot_bytes
    other.scatter(3, data)
    assert all(torch.equal(other.recurrent[k][3], pool.recurrent[k][a]) for k in SPECS)
    with pytest.raises(ValueError, match="bytes"):
        other.scatter(3, data[:-1])
    pool.free(a)
    pool.check_integrity()
    with pytest.raises(AssertionError):
        pool.free(a)  # twice
    pool._free.append(b)  # corruption: a slot in use on the free list
    with pytest.raises(AssertionError):
        pool.check_integrity()


def make_tree(states: int = 8) -> tuple[KVPool, StatePool, RadixCache]:
    kv = KVPool.uniform(64, 1, 1, 2, torch.float32)
    pool = StatePool(states, SPECS, torch.float32)
    return kv, pool, RadixCache(kv, pool)


def put(kv, pool, cache, tokens: list[int]) -> int:
    """A finished request leaving `tokens` with its state (as the scheduler donates it)."""
    slots = kv.alloc(len(tokens))
    state = pool.alloc()
    cache.insert(tokens, slots, state)
    kv.free(slots)
    return state


def check(kv, pool, cache) -> None:
    cache.check_integrity()
    kv.check_integrity()
    pool.check_integrity()
    assert pool.num_used == cache.num_states


def test_match_ends_at_the_deepest_checkpoint_and_splits_keep_states_below():
    kv, pool, cache = make_tree()
    s10 = put(kv, pool, cache, list(range(10)))
    m = cache.match(list(range(8)))  # inside the edge: no state at 8, the empty state (root)
    assert m.num_tokens == 0 and m.state is None
    s4 = put(kv, pool, cache, list(range(4)))  # splits the edge at 4: the upper node gets the new state
    m = cache.match(list(range(8)))
    assert m.num_tokens == 4 and m.state == s4
    m = cache.match(list(range(12)))
    assert m.num_tokens == 10 and m.state == s10
    assert cache.cached_len(list(range(9))) == 4 and cache.cached_len([7]) == 0
    # the same prefix again: the tree keeps its own state and frees the newcomer
    before = pool.num_used
    put(kv, pool, cache, list(range(10)))
    assert pool.num_used == before
    check(kv, pool, cache)


def test_evicting_a_leaf_frees_its_state_and_trims_tombstone_parents():
    kv, pool, cache = make_tree()
    put(kv, pool, cache, [1, 2, 3, 4, 5, 6])
    put(kv, pool, cache, [1, 2, 3, 9, 9])  # splits at 3: the node [1, 2, 3] is a tombstone
    assert cache.num_states == 2
    assert cache.evict(1) >= 3  # the least recently used leaf
    assert cache.num_states == 1
    cache.evict(100)  # the other leaf goes, and the tombstone above it with it
    assert cache.total_tokens == 0 and cache.num_states == 0 and kv.num_used == 0
    check(kv, pool, cache)


def test_evict_states_takes_locked_states_and_the_tombstone_leaf_goes_with_its_last_lock():
    kv, pool, cache = make_tree()
    put(kv, pool, cache, [5, 6, 7])
    m = cache.match([5, 6, 7, 8])
    cache.lock(m.handle)  # a running request resumed from it (its own copy of the state)
    assert cache.evict_states(1) == 1 and cache.num_states == 0
    assert cache.total_tokens == 3  # locked: the tombstone leaf stays while the request runs
    check(kv, pool, cache)
    cache.unlock(m.handle)
    assert cache.total_tokens == 0 and kv.num_used == 0
    check(kv, pool, cache)


def test_reset_frees_every_state_and_integrity_catches_corruption():
    kv, pool, cache = make_tree()
    put(kv, pool, cache, [1, 2])
    put(kv, pool, cache, [1, 2, 3, 4])
    cache.reset()
    assert pool.num_used == 0 and kv.num_used == 0
    state = put(kv, pool, cache, [1, 2])
    leaf = next(iter(cache._stateful))
    leaf.state = None  # corruption: an unlocked tombstone leaf (and a state nobody owns)
    cache._stateful.clear()
    with pytest.raises(AssertionError, match="tombstone"):
        cache.check_integrity()
    leaf.state = state
    cache._stateful[leaf] = None
    pool.free(state)  # corruption: the tree holds a free slot
    with pytest.raises(AssertionError, match="free state"):
        cache.check_integrity()
