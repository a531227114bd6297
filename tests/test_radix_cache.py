from __future__ import annotations

import random

import pytest
import torch

from mmserve.engine.cache.kv_pool import KVPool
from mmserve.engine.cache.radix_cache import NoPrefixCache, PrefixCache, RadixCache

PAD = 2**62


def make(num_slots: int = 64) -> tuple[KVPool, RadixCache]:
    pool = KVPool.uniform(num_slots, 1, 1, 2, torch.float32)
    return pool, RadixCache(pool)


def check(pool: KVPool, cache: RadixCache) -> None:
    cache.check_integrity()
    pool.check_integrity()


def request_insert(pool: KVPool, cache: RadixCache, tokens: list[int]) -> torch.Tensor:
    """Allocate fresh slots for `tokens`, insert them, then drop the request's own references (as a
    finished request does). Returns the slots the tree now maps `tokens` to."""
    slots = pool.alloc(len(tokens))
    assert slots is not None
    cache.insert(tokens, slots)
    pool.free(slots)
    return cache.match(tokens).slots


def tree_contents(cache: RadixCache) -> dict[tuple[int, ...], int]:
    """Every stored prefix -> slot of its last token, read without touching LRU state."""
    out: dict[tuple[int, ...], int] = {}
    stack = [((), cache._root)]
    while stack:
        prefix, node = stack.pop()
        for child in node.children.values():
            p = prefix
            for tok, slot in zip(child.key, child.slots.tolist(), strict=True):
                p = p + (tok,)
                out[p] = slot
            stack.append((p, child))
    return out


def test_match_on_empty_tree():
    pool, cache = make()
    m = cache.match([1, 2, 3])
    assert m.num_tokens == 0 and m.slots.dtype == torch.int64
    cache.lock(m.handle)
    assert cache.evict(10) == 0
    cache.unlock(m.handle)
    assert cache.match([]).num_tokens == 0
    check(pool, cache)


def test_insert_then_match_full_partial_and_diverging():
    pool, cache = make()
    slots = pool.alloc(5)
    assert cache.insert([1, 2, 3, 4, 5], slots) == 0
    assert cache.total_tokens == 5 and cache.evictable_tokens == 5
    assert pool.refcount(slots).tolist() == [2] * 5  # request + tree
    assert torch.equal(cache.match([1, 2, 3, 4, 5]).slots, slots)
    assert torch.equal(cache.match([1, 2, 3, 4, 5, 6, 7]).slots, slots)
    assert torch.equal(cache.match([1, 2, 9]).slots, slots[:2])  # ends inside the edge: split
    assert len(cache._root.children[1].key) == 2
    assert torch.equal(cache.match([1, 2, 3]).slots, slots[:3])
    assert cache.match([7, 1, 2]).num_tokens == 0
    assert cache.total_tokens == 5
    check(pool, cache)


def test_insert_of_present_prefix_takes_no_extra_refs():
    pool, cache = make()
    first = pool.alloc(4)
    cache.insert([1, 2, 3, 4], first)
    dup = pool.alloc(6)
    assert cache.insert([1, 2, 3, 4, 5, 6], dup) == 4
    assert pool.refcount(first).tolist() == [2] * 4
    assert pool.refcount(dup).tolist() == [1, 1, 1, 1, 2, 2]
    assert cache.insert([1, 2], pool.alloc(2)) == 2  # fully present: nothing new
    assert cache.total_tokens == 6
    assert torch.equal(cache.match([1, 2, 3, 4, 5, 6]).slots, torch.cat([first, dup[4:]]))
    # The request frees its own references: duplicates go back to the pool, the tree's stay.
    assert pool.free(dup) == 4
    assert pool.free(first) == 0
    check(pool, cache)


def test_same_text_different_image_pad_values():
    pool, cache = make()
    text = [10, 11]
    a = text + [PAD + 5] * 3 + [12]
    b = text + [PAD + 9] * 3 + [12]
    a_slots = request_insert(pool, cache, a)
    assert cache.insert(b, pool.alloc(len(b))) == 2
    m = cache.match(text + [PAD + 5, PAD + 9])
    assert m.num_tokens == 3 and torch.equal(m.slots, a_slots[:3])
    assert cache.match(text + [PAD + 9] * 3 + [13]).num_tokens == 5
    assert cache.match(text + [2**63 - 1]).num_tokens == 2
    check(pool, cache)


def test_lock_prevents_eviction_and_unlock_restores_it():
    pool, cache = make()
    request_insert(pool, cache, [1, 2, 3, 4])
    request_insert(pool, cache, [1, 2, 5, 6])
    m = cache.match([1, 2, 3, 4])
    cache.lock(m.handle)
    assert cache.evictable_tokens == 2  # [5, 6]; the locked path is [1, 2] + [3, 4]
    assert cache.evict(100) == 2
    assert cache.match([1, 2, 3, 4]).num_tokens == 4 and cache.match([1, 2, 5]).num_tokens == 2
    cache.lock(m.handle)
    cache.unlock(m.handle)
    assert cache.evict(100) == 0
    cache.unlock(m.handle)
    assert cache.evictable_tokens == 4
    assert cache.evict(3) == 4  # [3, 4] then [1, 2]: a parent becomes a leaf once its last child goes
    assert cache.total_tokens == 0 and pool.num_free == pool.num_slots
    check(pool, cache)


def test_lock_survives_split_of_the_locked_edge():
    pool, cache = make()
    request_insert(pool, cache, [1, 2, 3, 4])
    m = cache.match([1, 2, 3, 4])
    cache.lock(m.handle)
    cache.match([1, 2, 9])  # splits the locked edge
    check(pool, cache)
    assert cache.evictable_tokens == 0 and cache.evict(10) == 0
    cache.unlock(m.handle)
    assert cache.evictable_tokens == 4
    check(pool, cache)


def test_eviction_is_lru_and_counts_tokens():
    pool, cache = make()
    for first in (1, 2, 3):
        request_insert(pool, cache, [first] * 3)
    cache.match([1, 1, 1])  # recency order now: 2, 3, 1
    assert cache.evict(1) == 3
    assert cache.match([2]).num_tokens == 0
    cache.match([3, 3, 3])  # recency order now: 1, 3
    assert cache.evict(2) == 3
    assert cache.match([1]).num_tokens == 0 and cache.match([3, 3, 3]).num_tokens == 3
    request_insert(pool, cache, [4, 4, 4])
    # A partial match refreshes only the matched part: the split-off tail [3, 3] keeps its old time.
    cache.match([3])
    assert cache.evict(1) == 2
    assert cache.match([3, 3]).num_tokens == 1 and cache.match([4, 4, 4]).num_tokens == 3
    assert cache.total_tokens == 4
    assert cache.evict(100) == 4 and cache.evict(100) == 0
    check(pool, cache)


def test_evicted_slots_return_to_pool_only_after_requests_free():
    pool, cache = make(8)
    slots = pool.alloc(4)
    cache.insert([1, 2, 3, 4], slots)
    assert cache.evict(4) == 4 and cache.total_tokens == 0
    assert pool.num_free == 4  # the request still holds them
    assert pool.refcount(slots).tolist() == [1] * 4
    pool.free(slots)
    assert pool.num_free == 8
    check(pool, cache)


def test_reset_frees_everything():
    pool, cache = make(16)
    request_insert(pool, cache, [1, 2, 3])
    request_insert(pool, cache, [1, 4])
    m = cache.match([1, 2])
    cache.lock(m.handle)
    with pytest.raises(AssertionError):
        cache.reset()
    cache.unlock(m.handle)
    cache.reset()
    assert cache.total_tokens == cache.evictable_tokens == 0
    assert pool.num_free == 16 and cache.match([1, 2, 3]).num_tokens == 0
    check(pool, cache)


def test_check_integrity_detects_corruption():
    pool, cache = make()
    request_insert(pool, cache, [1, 2, 3])
    cache._total_tokens += 1
    with pytest.raises(AssertionError):
        cache.check_integrity()
    cache._total_tokens -= 1
    cache._root.children[1].lock_ref = 1  # locked child under an unlocked root
    with pytest.raises(AssertionError):
        cache.check_integrity()
    cache._root.children[1].lock_ref = 0
    pool.free(cache.match([1]).slots)  # someone drops the tree's own reference
    with pytest.raises(AssertionError, match="refcount 0"):
        cache.check_integrity()


def test_no_prefix_cache():
    pool = KVPool.uniform(4, 1, 1, 2, torch.float32)
    cache: PrefixCache = NoPrefixCache()
    slots = pool.alloc(3)
    assert cache.insert([1, 2, 3], slots) == 0
    m = cache.match([1, 2, 3])
    assert m.num_tokens == 0
    cache.lock(m.handle)
    cache.unlock(m.handle)
    assert cache.evict(10) == 0 and cache.total_tokens == cache.evictable_tokens == 0
    assert pool.refcount(slots).tolist() == [1, 1, 1]
    cache.reset()
    cache.check_integrity()


def test_randomized_against_reference_model():
    rng = random.Random(1234)
    pool, cache = make(32)
    ref: dict[tuple[int, ...], int] = {}  # stored prefix -> slot of its last token
    locks: list[tuple[object, tuple[int, ...]]] = []
    alphabet = [1, 2, 3, PAD + 5, PAD + 9, 2**63 - 1]

    def random_seq() -> list[int]:
        return [rng.choice(alphabet[: rng.choice([2, 6])]) for _ in range(rng.randint(1, 10))]

    def expected_match(seq: list[int]) -> list[int]:
        out = []
        while len(out) < len(seq) and tuple(seq[: len(out) + 1]) in ref:
            out.append(ref[tuple(seq[: len(out) + 1])])
        return out

    def locked_prefixes() -> set[tuple[int, ...]]:
        return {p[:i] for _, p in locks for i in range(1, len(p) + 1)}

    for _ in range(300):
        op = rng.random()
        seq = random_seq()
        if op < 0.4:  # a request: reuse the cached prefix, allocate the rest, insert, finish
            m = cache.match(seq)
            assert m.slots.tolist() == expected_match(seq)
            cache.lock(m.handle)  # held while the request runs, so eviction below cannot take it
            use_match = rng.random() < 0.7  # otherwise the request recomputes its prefix into new slots
            if use_match:
                pool.ref(m.slots)
            n_new = len(seq) - (m.num_tokens if use_match else 0)
            new = pool.alloc(n_new)
            if new is None:
                cache.evict(n_new - pool.num_free)
                assert tree_contents(cache).items() <= ref.items()
                ref = tree_contents(cache)
                new = pool.alloc(n_new)
            own = torch.cat([m.slots, new]) if use_match and new is not None else new
            if new is not None:
                assert cache.insert(seq, own) == m.num_tokens
                for i, slot in enumerate(own.tolist()):
                    ref.setdefault(tuple(seq[: i + 1]), slot)
                pool.free(own)
            elif use_match:
                pool.free(m.slots)
            cache.unlock(m.handle)
        elif op < 0.6:
            m = cache.match(seq)
            assert m.slots.tolist() == expected_match(seq)
            cache.lock(m.handle)
            locks.append((m.handle, tuple(seq[: m.num_tokens])))
        elif op < 0.75 and locks:
            cache.unlock(locks.pop(rng.randrange(len(locks)))[0])
        else:
            evictable = len(ref) - len(locked_prefixes())
            assert cache.evictable_tokens == evictable
            want = rng.randint(1, 12)
            removed = cache.evict(want)
            after = tree_contents(cache)
            assert after.items() <= ref.items()
            assert removed == len(ref) - len(after)
            assert removed >= min(want, evictable)
            assert locked_prefixes() <= after.keys()
            ref = after
        check(pool, cache)
        assert tree_contents(cache) == ref
        assert cache.total_tokens == len(ref)
        assert cache.evictable_tokens == len(ref) - len(locked_prefixes())
        # No request is live between operations: the tree holds the only reference to each used slot.
        assert pool.num_used == len(ref)
        if ref:
            assert set(pool.refcount(torch.tensor(list(ref.values()))).tolist()) == {1}
    for handle, _ in locks:
        cache.unlock(handle)
    cache.reset()
    check(pool, cache)
    assert pool.num_free == pool.num_slots
