"""Sliding-window rows on the CPU without a model: the radix cache's window rows (where a hit may end, tombstones,
revival, eviction), the slot allocator freeing rows behind each request's window (those kept for the prefix cache
excepted), bidirectional blocks never cut by a chunk nor cached in part, and the scheduler's integrity under
pressure."""

from __future__ import annotations

import random

import pytest
import torch

from mmserve.engine.cache.kv_pool import KVPool
from mmserve.engine.cache.radix_cache import RadixCache
from mmserve.engine.request import Request
from mmserve.engine.scheduler import Scheduler, SchedulerConfig
from mmserve.models.layer_specs import AttentionSpec
from mmserve.sampling_params import SamplingParams

W = 4  # the window: a hit must have the W - 1 = 3 window rows before it
SPECS = (AttentionSpec(1, 2, window=W), AttentionSpec(1, 2))  # one sliding layer, one full


def pools(full: int = 64, rows: int = 64) -> tuple[KVPool, KVPool]:
    return (
        KVPool(full, SPECS, torch.float32, layers=frozenset({1})),
        KVPool(rows, SPECS, torch.float32, layers=frozenset({0})),
    )


def insert(pool, window_pool, cache, tokens, held: list[bool]) -> None:
    """Insert `tokens` with window rows only where `held` says (as a request that freed the others does), then
    drop the caller's references."""
    slots = pool.alloc(len(tokens))
    rows = window_pool.alloc(len(tokens))
    freed = ~torch.tensor(held)
    window_pool.free(rows[freed])  # behind its window: the request gave them back as it went
    rows[freed] = -1
    cache.insert(tokens, slots, window_slots=rows)
    pool.free(slots)
    window_pool.free(rows[rows >= 0])


def check(pool, window_pool, cache) -> None:
    cache.check_integrity()
    pool.check_integrity()
    window_pool.check_integrity()


def test_a_hit_ends_where_the_window_before_it_is_held():
    pool, window_pool = pools()
    cache = RadixCache(pool, window_pool=window_pool, window=W)
    tokens = list(range(10, 22))  # 12 tokens; rows held for 0-2 and 6-11 (3-5 freed behind a window)
    held = [True] * 3 + [False] * 3 + [True] * 6
    pool_rows_before = window_pool.num_used
    insert(pool, window_pool, cache, tokens, held)
    assert cache.window_rows == 9 and window_pool.num_used == pool_rows_before + 9
    assert cache.match(tokens).num_tokens == 12  # rows 9, 10, 11 held
    assert cache.cached_len(tokens[:9]) == 9  # 6, 7, 8 held
    assert cache.cached_len(tokens[:8]) == 3  # 5 freed: back to the run from the start
    assert cache.cached_len(tokens[:3]) == 3
    m = cache.match(tokens[:7])
    assert m.num_tokens == 3 and m.window_slots.numel() == 3 and bool((m.window_slots >= 0).all())
    assert cache.match(tokens[:7] + [99]).num_tokens == 3
    check(pool, window_pool, cache)


def test_a_later_insert_revives_freed_window_rows():
    pool, window_pool = pools()
    cache = RadixCache(pool, window_pool=window_pool, window=W)
    tokens = list(range(30, 40))
    insert(pool, window_pool, cache, tokens, [False] * 10)  # nothing resumable but the root
    assert cache.match(tokens).num_tokens == 0 and cache.window_rows == 0
    insert(pool, window_pool, cache, tokens, [True] * 10)  # a request that held them all
    assert cache.match(tokens).num_tokens == 10 and cache.window_rows == 10
    check(pool, window_pool, cache)


def test_evict_window_frees_rows_lru_first_and_keeps_shared_full_rows():
    pool, window_pool = pools()
    cache = RadixCache(pool, window_pool=window_pool, window=W)
    shared = [1, 2, 3, 4, 5]
    insert(pool, window_pool, cache, shared + [6, 7, 8], [True] * 8)
    insert(pool, window_pool, cache, shared + [9, 10, 11], [True] * 8)
    used = window_pool.num_used
    freed = cache.evict_window(2)
    assert freed >= 2 and window_pool.num_used == used - freed
    # the least recently used leaf went whole; the other branch still resumes at its end
    assert cache.match(shared + [9, 10, 11]).num_tokens == 8
    freed = cache.evict_window(100)  # every row: the shared node keeps its full rows as a tombstone
    assert window_pool.num_used == 0 and cache.window_rows == 0
    assert cache.match(shared + [9, 10, 11]).num_tokens == 0
    check(pool, window_pool, cache)
    cache.reset()
    assert pool.num_used == 0


def test_a_split_keeps_window_rows_with_their_tokens():
    pool, window_pool = pools()
    cache = RadixCache(pool, window_pool=window_pool, window=W)
    insert(pool, window_pool, cache, list(range(8)), [True] * 8)
    m = cache.match([0, 1, 2, 3, 4, 99])  # splits the edge after 5 tokens
    assert m.num_tokens == 5 and (m.window_slots >= 0).all()
    check(pool, window_pool, cache)


# -- the scheduler over both pools -------------------------------------------------------------------------
def scheduler(full=256, rows=64, budget=7, window=W) -> Scheduler:
    pool = KVPool(full, SPECS, torch.float32, layers=frozenset({1}))
    window_pool = KVPool(rows, SPECS, torch.float32, layers=frozenset({0}))
    cache = RadixCache(pool, window_pool=window_pool, window=window)
    cfg = SchedulerConfig(budget, 8, max_model_len=1000)
    return Scheduler(cfg, pool, cache, window_pool=window_pool, window=window)


def request(rid: str, prompt: list[int], max_tokens: int, blocks=()) -> Request:
    return Request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens), blocks=list(blocks))


def run(sched: Scheduler, steps: int = 400, on_step=None) -> list[list[tuple[str, int, int]]]:
    """Schedule, pretend to run (finish_step, cache_prompt, sample) until idle; returns every step's chunks."""
    history = []
    for _ in range(steps):
        if not sched.has_work:
            break
        chunks = sched.schedule()
        history.append([(c.request.request_id, c.start, c.end) for c in chunks])
        sched.finish_step(chunks)
        for c in chunks:
            if c.start < c.request.prompt_len <= c.end:
                sched.cache_prompt(c.request)
            if c.samples:
                c.request.append_output(7)
                if len(c.request.output_ids) >= c.request.params.max_tokens:
                    sched.finish(c.request, "length")
        if on_step is not None:
            on_step(sched)
        sched.check_integrity()
    assert not sched.has_work
    return history


def test_a_chunk_never_ends_inside_a_block_and_may_take_one_past_the_budget():
    sched = scheduler(budget=7)
    prompt = list(range(100, 140))
    blocks = [(5, 17), (20, 23)]  # a 12-token block: longer than the budget
    sched.add(request("a", prompt, 3, blocks))
    ends = [end for step in run(sched) for _, _, end in step]
    assert all(not (a < end < b) for a, b in blocks for end in ends)
    assert 17 in ends and 5 in ends  # stopped before the block, then took it whole (12 > 7)


def test_window_rows_behind_the_window_are_freed_but_those_kept_for_the_cache():
    sched = scheduler(full=512, rows=64, budget=8)
    prompt = list(range(1000, 1100))  # 100 tokens, no items: kept rows only before the last prompt token
    held: list[int] = []
    sched.add(request("a", prompt, 20))
    run(sched, on_step=lambda s: held.extend(int((r.window_buffer >= 0).sum()) for r in s.running))
    # a running request holds its window, a chunk and the W - 1 rows kept before its last prompt token
    assert max(held) <= (W - 1) + 8 + (W - 1)
    # the repeat resumes at the prompt's last token but one: the rows before it were kept for it
    assert sched.prefix_cache.cached_len(prompt[:99]) == 99


def test_only_whole_blocks_enter_the_prefix_cache():
    req = request("a", list(range(200, 230)), 2, [(10, 20)])
    assert req.safe_prefix(15) == 10 and req.safe_prefix(20) == 20 and req.safe_prefix(9) == 9
    assert req.chunk_end(8, 12) == 10 and req.chunk_end(10, 12) == 20 and req.chunk_end(12, 14) == 20


@pytest.mark.parametrize("seed", range(4))
def test_random_workload_with_blocks_under_pressure_leaks_nothing(seed):
    rng = random.Random(seed)
    sched = scheduler(full=160, rows=48, budget=rng.choice([1, 5, 9]))
    prompts = []
    for i in range(10):
        n = rng.randint(8, 40)
        start = rng.randint(0, 5)
        blocks = [(start, start + rng.randint(1, 6))] if rng.random() < 0.7 else []
        prompt = [rng.randint(1, 4) for _ in range(n)]  # few distinct ids: many shared prefixes
        prompts.append(prompt)
        sched.add(request(f"r{i}", prompt, rng.randint(1, 12), blocks))
    run(sched, steps=2000)
    sched.prefix_cache.reset()
    assert sched.pool.num_used == 0 and sched.window_pool.num_used == 0
