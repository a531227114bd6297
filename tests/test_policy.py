"""Routing policies: rendezvous affinity with bounded load, round robin, least loaded, planning."""

from __future__ import annotations

import pytest

from mmserve.dispatch.policy import (
    CacheAffinityPolicy,
    LeastLoadedPolicy,
    RoundRobinPolicy,
    make_policy,
    plan,
)
from mmserve.dispatch.registry import EncoderInfo


def encoders(n: int, in_flight: list[int] | None = None) -> list[EncoderInfo]:
    loads = in_flight or [0] * n
    return [
        EncoderInfo(url=f"http://127.0.0.1:{9001 + i}", static=True, in_flight=loads[i]) for i in range(n)
    ]


def keys(n: int) -> list[bytes]:
    return [f"image-{i}".encode() for i in range(n)]


def test_same_key_same_encoder() -> None:
    policy = make_policy("cache_affinity")
    cands = encoders(4)
    first = policy.choose(b"some-image-hash", cands, {}).url
    assert all(policy.choose(b"some-image-hash", cands, {}).url == first for _ in range(20))
    assert CacheAffinityPolicy().choose(b"some-image-hash", list(reversed(cands)), {}).url == first


def test_keys_spread_evenly() -> None:
    policy = CacheAffinityPolicy()
    cands = encoders(4)
    counts: dict[str, int] = {}
    for key in keys(2000):
        url = policy.choose(key, cands, {}).url
        counts[url] = counts.get(url, 0) + 1
    assert len(counts) == 4
    assert all(0.15 * 2000 <= c <= 0.35 * 2000 for c in counts.values()), counts


def test_removing_encoder_moves_only_its_keys() -> None:
    policy = CacheAffinityPolicy()
    cands = encoders(4)
    removed = cands[2].url
    before = {key: policy.choose(key, cands, {}).url for key in keys(2000)}
    remaining = [e for e in cands if e.url != removed]
    after = {key: policy.choose(key, remaining, {}).url for key in keys(2000)}
    moved = [key for key in before if before[key] != after[key]]
    assert moved and all(before[key] == removed for key in moved)
    assert all(after[key] == before[key] for key in before if before[key] != removed)


def test_bounded_load_avoids_overloaded_encoder() -> None:
    policy = CacheAffinityPolicy()
    cands = encoders(4, in_flight=[1000, 0, 0, 0])
    hot = cands[0].url
    assert any(policy.choose(key, encoders(4), {}).url == hot for key in keys(100))
    assert all(policy.choose(key, cands, {}).url != hot for key in keys(500))


def test_bounded_load_spreads_one_request() -> None:
    assignment = plan(CacheAffinityPolicy(), [b"same"] * 8, encoders(4))
    assert max(len(items) for items in assignment.values()) <= 3
    assert sorted(i for items in assignment.values() for i in items) == list(range(8))


def test_round_robin_cycles() -> None:
    policy = make_policy("round_robin")
    cands = encoders(3)
    picks = [policy.choose(b"k", cands, {}).url for _ in range(6)]
    assert picks == [e.url for e in cands] * 2
    assert policy.choose(b"k", cands[:2], {}).url in {cands[0].url, cands[1].url}


def test_least_loaded_picks_min() -> None:
    policy = LeastLoadedPolicy()
    cands = encoders(3, in_flight=[2, 1, 1])
    assert policy.choose(b"k", cands, {}).url == cands[1].url
    assert policy.choose(b"k", cands, {cands[1].url: 1}).url == cands[2].url
    assert make_policy("least_loaded").choose(b"k", encoders(3), {}).url == cands[0].url


def test_plan_round_robin() -> None:
    cands = encoders(2)
    assert plan(RoundRobinPolicy(), keys(4), cands) == {cands[0].url: [0, 2], cands[1].url: [1, 3]}
    assert plan(RoundRobinPolicy(), [], cands) == {}


def test_unknown_policy_name() -> None:
    with pytest.raises(ValueError, match="cache_affinity"):
        make_policy("random")
