"""Scheduler on the CPU without a model: budgets, chunking, retraction, aborts, no leaks."""

from __future__ import annotations

import random

import pytest
import torch

from mmserve.engine.cache.kv_pool import KVPool
from mmserve.engine.cache.radix_cache import NoPrefixCache, RadixCache
from mmserve.engine.request import Request, RequestStatus
from mmserve.engine.scheduler import Scheduler, SchedulerConfig
from mmserve.sampling_params import SamplingParams


def make(num_slots=64, budget=16, max_seqs=8, prefix=True) -> Scheduler:
    pool = KVPool.uniform(num_slots, 1, 1, 2, torch.float32)
    cache = RadixCache(pool) if prefix else NoPrefixCache()
    return Scheduler(SchedulerConfig(budget, max_seqs, max_model_len=1000), pool, cache)


def request(rid: str, prompt: list[int], max_tokens: int) -> Request:
    return Request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens))


def fake_step(sched: Scheduler, next_token=lambda req: 7) -> list[Request]:
    """Schedule, pretend to run, sample a token for every finished chunk; finish at max_tokens."""
    chunks = sched.schedule()
    assert sum(c.num_tokens for c in chunks) <= sched.cfg.max_num_batched_tokens
    assert len(sched.running) <= sched.cfg.max_num_seqs
    done = []
    for c in chunks:
        assert c.request.status == RequestStatus.RUNNING
        if c.start < c.request.prompt_len <= c.end:  # as the engine does after the forward
            sched.cache_prompt(c.request)
        if c.samples:
            c.request.append_output(next_token(c.request))
            if len(c.request.output_ids) >= c.request.params.max_tokens:
                sched.finish(c.request, "length")
                done.append(c.request)
    sched.check_integrity()
    return done


def test_chunked_prefill_respects_budget_and_prefers_prefill():
    sched = make(budget=5)
    sched.add(request("a", list(range(12)), 3))
    sizes = []
    while sched.has_work:
        chunks = sched.schedule()
        sizes.append([c.num_tokens for c in chunks])
        for c in chunks:
            if c.samples:
                c.request.append_output(1)
                if len(c.request.output_ids) == 3:
                    sched.finish(c.request, "length")
    assert sizes == [[5], [5], [2], [1], [1]]


def is_run(slots: list[int]) -> bool:
    return slots == list(range(slots[0], slots[0] + len(slots)))


def test_decode_tokens_take_runs_of_slots_ending_at_multiples_of_16():
    sched = make(num_slots=256, budget=64, max_seqs=4)
    a, b = request("a", list(range(10)), 40), request("b", list(range(100, 110)), 40)
    sched.add(a)
    sched.add(b)
    for _ in range(30):  # both decode in every step: one slot a step each would interleave them
        fake_step(sched)
    for req in (a, b):  # what the decode attention reads in place
        slots = req.slots.tolist()
        assert is_run(slots[10:16]) and is_run(slots[16:32]), slots
    while sched.has_work:
        fake_step(sched)  # finishing gives the unused rest of a run back (check_integrity counts every slot)
    assert not a.decode_run and not b.decode_run


def test_unused_decode_runs_are_given_back_before_anyone_is_retracted():
    sched = make(num_slots=48, budget=64, max_seqs=4, prefix=False)
    a = request("a", list(range(10)), 30)  # 40 slots at most, held 16 at a time
    sched.add(a)
    for _ in range(8):
        fake_step(sched)
    assert a.decode_run  # the rest of its run, not computed yet
    b = request("b", list(range(100, 110)), 10)  # 20 slots: both fit, if a's run is not held against b
    sched.add(b)
    for _ in range(60):
        if not sched.has_work:
            break
        fake_step(sched)
    assert len(a.output_ids) == 30 and len(b.output_ids) == 10
    assert sched.stats.retractions == 0
    assert sched.pool.num_used == 0


def test_prefix_hit_skips_cached_tokens():
    sched = make()
    a = request("a", [1, 2, 3, 4, 5, 6], 2)
    sched.add(a)
    while sched.has_work:
        fake_step(sched)
    b = request("b", [1, 2, 3, 4, 9], 2)
    sched.add(b)
    chunks = sched.schedule()
    assert (chunks[0].start, chunks[0].end) == (4, 5)
    assert b.num_cached_tokens == 4


def test_max_num_seqs_caps_running():
    sched = make(budget=100, max_seqs=2)
    for i in range(4):
        sched.add(request(f"r{i}", [i, i + 1, i + 2], 4))
    sched.schedule()
    assert len(sched.running) == 2 and len(sched.waiting) == 2


def test_never_fitting_request_is_refused():
    sched = make(num_slots=10)
    with pytest.raises(ValueError, match="KV cache capacity"):
        sched.add(request("big", list(range(8)), 5))
    with pytest.raises(ValueError, match="context"):
        make(num_slots=5000).add(request("long", list(range(1000)), 1))


@pytest.mark.parametrize("seed", range(5))
def test_random_workload_under_pressure_finishes_everything_without_leaks(seed):
    rng = random.Random(seed)
    sched = make(num_slots=40, budget=rng.choice([1, 3, 8, 32]), max_seqs=rng.choice([2, 4, 8]))
    expected = {}
    for i in range(12):
        prompt = [rng.randrange(4) for _ in range(rng.randrange(1, 20))]  # shared prefixes happen
        req = request(f"r{i}", prompt, rng.randrange(1, 12))
        sched.add(req)
        expected[req.request_id] = req
    aborted = set()
    for step in range(2000):
        if not sched.has_work:
            break
        fake_step(sched, next_token=lambda r: len(r.token_ids) % 5)
        if step % 37 == 5 and sched.running:
            victim = rng.choice(sched.running)
            sched.finish(victim, "abort")
            aborted.add(victim.request_id)
    assert not sched.has_work
    for rid, req in expected.items():
        assert req.finished
        if rid not in aborted:
            assert len(req.output_ids) == req.params.max_tokens
    sched.prefix_cache.reset()
    assert sched.pool.num_used == 0
    sched.pool.check_integrity()


def test_decode_pressure_retracts_newest_and_recomputes():
    sched = make(num_slots=12, budget=32, prefix=False)
    a, b = request("a", [1, 2, 3, 4, 5], 6), request("b", [6, 7, 8, 9, 10], 6)
    sched.add(a)
    sched.add(b)
    while sched.has_work:
        fake_step(sched)
    assert sched.stats.retractions > 0 and b.num_retractions > 0 and a.num_retractions == 0
    assert len(a.output_ids) == len(b.output_ids) == 6
    assert sched.pool.num_used == 0


def test_finished_prompt_is_shared_while_its_request_still_runs():
    sched = make(budget=64)
    a = request("a", [1, 2, 3, 4, 5, 6, 7, 8], 20)
    sched.add(a)
    fake_step(sched)  # a's prompt is computed and cached; a keeps decoding
    assert a.status == RequestStatus.RUNNING
    b = request("b", [1, 2, 3, 4, 5, 6, 7, 9], 2)
    sched.add(b)
    fake_step(sched)
    assert b.num_cached_tokens == 7
    while sched.has_work:
        fake_step(sched)
    sched.prefix_cache.reset()
    assert sched.pool.num_used == 0


def test_a_prefix_hit_is_not_queued_behind_a_long_miss():
    sched = make(num_slots=400, budget=16)
    warm = request("warm", list(range(40)), 1)
    sched.add(warm)
    while sched.has_work:
        fake_step(sched)
    miss = request("miss", [100 + i for i in range(200)], 2)  # 13 steps of prefill at 16 tokens
    sched.add(miss)
    fake_step(sched)
    hit = request("hit", list(range(40)) + [7], 2)  # all but its last token cached
    sched.add(hit)
    chunks = {c.request.request_id: c for c in sched.schedule()}
    assert chunks["hit"].samples  # its first token comes from this very step...
    assert chunks["miss"].num_tokens == 16 - chunks["hit"].num_tokens  # ...and the miss keeps the rest


def test_shortest_first_never_starves_a_long_prefill():
    sched = make(num_slots=2000, budget=8, max_seqs=64)
    long = request("long", [500 + i for i in range(64)], 1)
    sched.add(long)
    got_tokens_at = []
    for step in range(40):  # a fresh 8-token request arrives every step: shortest first would always win
        sched.add(request(f"short{step}", [1000 + 8 * step + i for i in range(8)], 1))
        chunks = sched.schedule()
        if any(c.request is long for c in chunks):
            got_tokens_at.append(step)
        for c in chunks:
            if c.start < c.request.prompt_len <= c.end:
                sched.cache_prompt(c.request)
            if c.samples:
                c.request.append_output(7)
                sched.finish(c.request, "length")
    from mmserve.engine.scheduler import STARVATION_STEPS

    assert got_tokens_at and got_tokens_at[0] <= STARVATION_STEPS
    assert all(b - a <= STARVATION_STEPS + 1 for a, b in zip(got_tokens_at, got_tokens_at[1:], strict=False))
    assert long.finished
