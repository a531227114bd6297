"""Encoder registry: health tracking, revival, TTL drop, unregistration, in-flight accounting."""

from __future__ import annotations

import pytest

from mmserve.dispatch.registry import EncoderRegistry, RegistryConfig

A = "http://127.0.0.1:9001"
B = "http://127.0.0.1:9002"
C = "http://127.0.0.1:9003"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def reg(clock: FakeClock) -> EncoderRegistry:
    return EncoderRegistry(RegistryConfig(failure_threshold=3, drop_after_s=300.0), clock=clock)


def test_three_strikes_mark_unhealthy(reg: EncoderRegistry, clock: FakeClock) -> None:
    reg.register(A)
    reg.record_failure(A)
    reg.record_failure(A)
    assert reg.get(A).healthy
    clock.now += 1
    reg.record_failure(A)
    info = reg.get(A)
    assert not info.healthy
    assert info.unhealthy_since == clock.now
    assert reg.healthy() == []


def test_success_resets_failure_count(reg: EncoderRegistry) -> None:
    reg.register(A)
    reg.record_failure(A)
    reg.record_failure(A)
    reg.record_success(A)
    assert reg.get(A).consecutive_failures == 0
    reg.record_failure(A)
    reg.record_failure(A)
    assert reg.get(A).healthy


def test_revival_after_success(reg: EncoderRegistry, clock: FakeClock) -> None:
    reg.add_static(A)
    for _ in range(3):
        reg.record_failure(A)
    assert not reg.get(A).healthy
    assert reg.urls_to_probe() == [A]
    clock.now += 10
    reg.record_success(A, stats={"hits": 5})
    info = reg.get(A)
    assert info.healthy and info.consecutive_failures == 0 and info.unhealthy_since is None
    assert info.last_seen == clock.now
    assert info.stats == {"hits": 5}


def test_ttl_drops_runtime_encoder_only_after_deadline(reg: EncoderRegistry, clock: FakeClock) -> None:
    reg.register(A)
    for _ in range(3):
        reg.record_failure(A)
    clock.now += 299.0
    reg.record_failure(A)  # further failures must not push the deadline back
    assert reg.expire() == []
    assert reg.get(A) is not None
    clock.now += 1.0
    assert reg.expire() == [A]
    assert reg.get(A) is None
    assert reg.urls_to_probe() == []
    reg.record_success(A)  # a late success does not resurrect a dropped encoder
    assert reg.get(A) is None


def test_static_encoder_never_dropped(reg: EncoderRegistry, clock: FakeClock) -> None:
    reg.add_static(A)
    for _ in range(3):
        reg.record_failure(A)
    clock.now += 10_000.0
    assert reg.expire() == []
    info = reg.get(A)
    assert info is not None and not info.healthy and info.static


def test_unregister_is_never_revived_until_registered_again(reg: EncoderRegistry) -> None:
    reg.register(A)
    reg.register(B)
    assert reg.unregister(A + "/")
    assert not reg.unregister(A)
    assert not reg.unregister(C)
    reg.record_success(A)
    assert reg.get(A) is None
    assert A not in reg.urls_to_probe()
    assert [e.url for e in reg.healthy()] == [B]
    reg.register(A)
    assert reg.get(A).healthy
    assert reg.urls_to_probe() == [B, A]


def test_reregistration_resets_state(reg: EncoderRegistry, clock: FakeClock) -> None:
    reg.register(A)
    reg.record_success(A, stats={"entries": 3})
    for _ in range(4):
        reg.record_failure(A)
    assert not reg.get(A).healthy
    clock.now += 5
    info = reg.register(A)
    assert info.healthy and info.consecutive_failures == 0 and info.unhealthy_since is None
    assert info.stats == {} and info.last_seen == clock.now and not info.static
    assert len(reg.all()) == 1


def test_acquire_release_counts(reg: EncoderRegistry) -> None:
    reg.register(A)
    reg.acquire(A)
    reg.acquire(A)
    reg.release(A)
    assert reg.get(A).in_flight == 1
    reg.release(A)
    reg.release(A)
    assert reg.get(A).in_flight == 0
    reg.acquire(C)  # unknown: ignored
    assert reg.get(C) is None


def test_healthy_order_and_url_normalisation(reg: EncoderRegistry) -> None:
    reg.add_static(B + "/")
    reg.register(A)
    reg.register(C)
    reg.register(B)  # known URL keeps its position
    for _ in range(3):
        reg.record_failure(A)
    assert [e.url for e in reg.healthy()] == [B, C]
    assert [e.url for e in reg.all()] == [B, A, C]
    assert reg.get(B).static


def test_snapshots_are_detached_and_json(reg: EncoderRegistry) -> None:
    reg.register(A)
    snap = reg.get(A)
    snap.in_flight = 99
    snap.stats["x"] = 1
    assert reg.get(A).in_flight == 0 and reg.get(A).stats == {}
    assert reg.get(A).as_json() == {
        "url": A,
        "healthy": True,
        "static": False,
        "in_flight": 0,
        "consecutive_failures": 0,
        "stats": {},
    }


def test_config_validation() -> None:
    with pytest.raises(ValueError):
        RegistryConfig(failure_threshold=0)
