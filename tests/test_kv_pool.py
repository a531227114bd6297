from __future__ import annotations

import pytest
import torch

from mmserve.engine.cache.kv_pool import KVPool, uniform_specs
from mmserve.models.layer_specs import AttentionSpec, LinearStateSpec


def make_pool(num_slots: int = 8) -> KVPool:
    return KVPool.uniform(num_slots, 2, 2, 4, torch.float16)


def t(*slots: int) -> torch.Tensor:
    return torch.tensor(slots, dtype=torch.int64)


def test_layout_is_zeroed_per_layer():
    pool = make_pool(5)
    assert len(pool.k_cache) == len(pool.v_cache) == 2
    for cache in pool.k_cache + pool.v_cache:
        assert cache.shape == (5, 2, 4) and cache.dtype == torch.float16
        assert not cache.any()
    assert pool.k_cache[0].data_ptr() != pool.k_cache[1].data_ptr() != pool.v_cache[0].data_ptr()


def test_alloc_gives_distinct_slots_with_refcount_one():
    pool = make_pool(8)
    a = pool.alloc(3)
    b = pool.alloc(5)
    assert a.dtype == torch.int64 and a.numel() == 3 and b.numel() == 5
    assert sorted(torch.cat([a, b]).tolist()) == list(range(8))
    assert pool.refcount(torch.cat([a, b])).tolist() == [1] * 8
    assert (pool.num_free, pool.num_used, pool.usage) == (0, 8, 1.0)
    pool.check_integrity()


def test_slots_freed_together_come_back_as_an_ascending_run():
    pool = make_pool(12)
    assert pool.alloc(4).tolist() == [0, 1, 2, 3]  # a fresh pool: ascending runs
    run = pool.alloc(5)
    assert run.tolist() == [4, 5, 6, 7, 8]
    pool.free(run.flip(0))  # in any order
    assert pool.alloc(5).tolist() == [4, 5, 6, 7, 8]  # the same run, ascending (read in place by the kernels)
    pool.check_integrity()


def test_alloc_zero_and_failure_allocate_nothing():
    pool = make_pool(4)
    empty = pool.alloc(0)
    assert empty.numel() == 0 and empty.dtype == torch.int64
    held = pool.alloc(3)
    assert pool.alloc(2) is None
    assert pool.num_free == 1 and pool.refcount(held).tolist() == [1, 1, 1]
    pool.check_integrity()
    assert pool.alloc(1) is not None and pool.alloc(1) is None


def test_free_returns_slots_and_they_are_reused():
    pool = make_pool(4)
    slots = pool.alloc(4)
    assert pool.free(slots[:2]) == 2
    assert pool.num_free == 2 and pool.usage == 0.5
    again = pool.alloc(2)
    assert sorted(again.tolist()) == sorted(slots[:2].tolist())
    pool.check_integrity()


def test_sharing_keeps_slot_until_last_owner_frees():
    pool = make_pool(4)
    slots = pool.alloc(2)
    pool.ref(slots)  # e.g. the prefix cache takes its own reference
    pool.ref(slots[:1])
    assert pool.refcount(slots).tolist() == [3, 2]
    assert pool.free(slots) == 0
    assert pool.free(slots) == 1  # second slot reaches 0
    assert pool.refcount(slots).tolist() == [1, 0]
    assert pool.free(slots[:1]) == 1
    assert pool.num_free == 4
    pool.check_integrity()


def test_duplicate_slots_in_one_call_count_twice():
    pool = make_pool(4)
    s = pool.alloc(1)
    pool.ref(torch.cat([s, s]))
    assert pool.refcount(s).tolist() == [3]
    assert pool.free(torch.cat([s, s, s])) == 1
    pool.check_integrity()


def test_ref_of_free_slot_and_double_free_assert_without_mutating():
    pool = make_pool(4)
    s = pool.alloc(1)
    free_slot = t(next(i for i in range(4) if i != int(s)))
    with pytest.raises(AssertionError):
        pool.ref(free_slot)
    pool.free(s)
    with pytest.raises(AssertionError):
        pool.free(s)
    with pytest.raises(AssertionError):
        pool.free(t(4))  # out of range
    pool.check_integrity()
    assert pool.num_free == 4


def test_bytes_per_token_and_from_budget():
    specs = uniform_specs(3, 2, 8)
    per = KVPool.bytes_per_token(specs, torch.bfloat16)
    assert per == 2 * 3 * 2 * 8 * 2
    pool = KVPool.from_budget(per * 10 + per - 1, specs, torch.bfloat16)
    assert pool.num_slots == 10 and pool.k_cache[2].shape == (10, 2, 8)
    assert KVPool.from_budget(per, specs, torch.bfloat16).num_slots == 1
    assert KVPool.bytes_per_token(uniform_specs(1, 1, 1), torch.float32) == 8
    with pytest.raises(ValueError):
        KVPool.from_budget(per - 1, specs, torch.bfloat16)


# A hybrid stack: linear-state layers hold no rows; two attention shapes give two groups; a shared layer aliases.
HYBRID = (
    LinearStateSpec((24, 4), (2, 4, 4), "Qwen3_5GatedDeltaNet"),
    AttentionSpec(2, 8),
    LinearStateSpec((24, 4), (2, 4, 4), "Qwen3_5GatedDeltaNet"),
    AttentionSpec(1, 16),
    AttentionSpec(2, 8),
    AttentionSpec(2, 8, kv_source=1),
)


def test_rows_only_for_layers_that_have_kv_one_view_per_shape():
    pool = KVPool(5, HYBRID, torch.float32)
    assert pool.k_cache[0] is None and pool.v_cache[2] is None
    assert pool.k_cache[1].shape == (5, 2, 8) and pool.k_cache[3].shape == (5, 1, 16)
    assert pool.k_cache[5] is pool.k_cache[1] and pool.v_cache[5] is pool.v_cache[1]  # KV sharing: no rows
    assert [g.layers for g in pool.groups] == [(1, 4), (3,)]
    per = KVPool.bytes_per_token(HYBRID, torch.float32)
    assert per == (2 * 2 * 2 * 8 + 2 * 1 * 16) * 4 == pool.token_bytes
    # the views are disjoint parts of the one allocation
    for layer, value in ((1, 1.0), (3, 2.0), (4, 3.0)):
        pool.k_cache[layer].fill_(value)
        pool.v_cache[layer].fill_(-value)
    assert float(pool.k_cache[1].sum()) == 5 * 16 and float(pool.v_cache[4].mean()) == -3.0
    assert pool.buffer.numel() * 4 >= 5 * per


def test_gather_and_scatter_move_every_plane_of_the_slots():
    src, dst = KVPool(6, HYBRID, torch.bfloat16), KVPool(6, HYBRID, torch.bfloat16)
    for layer in (1, 3, 4):
        src.k_cache[layer].copy_(torch.randn(src.k_cache[layer].shape))
        src.v_cache[layer].copy_(torch.randn(src.v_cache[layer].shape))
    data = src.gather(torch.tensor([4, 1]))
    assert data.dtype == torch.uint8 and data.numel() == 2 * src.token_bytes
    dst.scatter(torch.tensor([0, 5]), data)
    for layer in (1, 3, 4):
        assert torch.equal(dst.k_cache[layer][[0, 5]], src.k_cache[layer][[4, 1]])
        assert torch.equal(dst.v_cache[layer][[0, 5]], src.v_cache[layer][[4, 1]])
    assert not dst.k_cache[1][1:5].any()
    with pytest.raises(ValueError, match="bytes"):
        dst.scatter(torch.tensor([0]), data)
    offsets = [offset for offset, _ in src.planes()]
    assert offsets == sorted(offsets) and len(offsets) == 2 * 3


@pytest.mark.parametrize("corruption", ["duplicate_free", "free_with_ref", "leaked", "negative"])
def test_check_integrity_detects_corruption(corruption):
    pool = make_pool(4)
    slots = pool.alloc(2)
    pool.check_integrity()
    if corruption == "duplicate_free":
        pool._free.append(pool._free[0])
    elif corruption == "free_with_ref":
        pool._refcount[pool._free[0]] = 1
    elif corruption == "leaked":  # refcount 0 but not on the free list
        pool._refcount[slots[0]] = 0
    else:
        pool._refcount[slots[0]] = -1
    with pytest.raises(AssertionError):
        pool.check_integrity()
