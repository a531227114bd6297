"""Routing policies that pick an encoder for each media item of a request."""

from __future__ import annotations

import hashlib
import math
import threading
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Protocol

from mmserve.dispatch.registry import EncoderInfo

DEFAULT_POLICY = "cache_affinity"


class RoutingPolicy(Protocol):
    """Chooses one encoder among non-empty ``candidates`` for an item identified by ``routing_key``.

    ``planned`` maps url -> items already assigned to that encoder within the request being planned.
    """

    def choose(
        self, routing_key: bytes, candidates: list[EncoderInfo], planned: dict[str, int]
    ) -> EncoderInfo:
        """Return the chosen candidate (may mutate only the policy's own internal state)."""
        ...


def _load(info: EncoderInfo, planned: Mapping[str, int]) -> int:
    return info.in_flight + planned.get(info.url, 0)


def rendezvous_score(routing_key: bytes, url: str) -> int:
    """Highest-random-weight score of ``url`` for ``routing_key``; stable across processes."""
    h = hashlib.blake2b(digest_size=8)
    # Length prefix so that (key, url) pairs cannot collide by shifting bytes between the two parts.
    h.update(len(routing_key).to_bytes(8, "little"))
    h.update(routing_key)
    h.update(url.encode())
    return int.from_bytes(h.digest(), "little")


class CacheAffinityPolicy:
    """Rendezvous hashing with bounded load, so repeated media hit the encoder that has them cached."""

    def __init__(self, load_factor: float = 1.25) -> None:
        if not (load_factor > 0 and math.isfinite(load_factor)):
            raise ValueError(f"load_factor must be a finite number > 0, got {load_factor}")
        self.load_factor = load_factor

    def ranked(self, routing_key: bytes, candidates: list[EncoderInfo]) -> list[EncoderInfo]:
        """Candidates in rendezvous order for ``routing_key``, best first (mutates nothing)."""
        return sorted(candidates, key=lambda e: (-rendezvous_score(routing_key, e.url), e.url))

    def choose(
        self, routing_key: bytes, candidates: list[EncoderInfo], planned: dict[str, int]
    ) -> EncoderInfo:
        """Highest-ranked encoder that stays within the load bound after taking the item (mutates nothing)."""
        ranked = self.ranked(routing_key, candidates)
        total = sum(_load(e, planned) for e in candidates)
        bound = math.ceil(self.load_factor * (total + 1) / len(candidates))
        for info in ranked:
            if _load(info, planned) + 1 <= bound:
                return info
        # Only reachable with load_factor < 1; min() keeps rendezvous order among ties.
        return min(ranked, key=lambda e: _load(e, planned))


class RoundRobinPolicy:
    """Cycles through the candidates with a counter that survives changes in the candidate list."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 0

    def choose(
        self, routing_key: bytes, candidates: list[EncoderInfo], planned: dict[str, int]
    ) -> EncoderInfo:
        """Return the next candidate in turn (mutates: the internal counter)."""
        with self._lock:
            index = self._next % len(candidates)
            self._next += 1
        return candidates[index]


class LeastLoadedPolicy:
    """Picks the encoder with the fewest in-flight plus planned items; ties go to the earlier candidate."""

    def choose(
        self, routing_key: bytes, candidates: list[EncoderInfo], planned: dict[str, int]
    ) -> EncoderInfo:
        """Return the least-loaded candidate (mutates nothing)."""
        return min(candidates, key=lambda e: _load(e, planned))


_POLICIES: Mapping[str, Callable[..., RoutingPolicy]] = MappingProxyType(
    {
        "cache_affinity": CacheAffinityPolicy,
        "round_robin": RoundRobinPolicy,
        "least_loaded": LeastLoadedPolicy,
    }
)


def policy_names() -> list[str]:
    """Names accepted by :func:`make_policy` (mutates nothing)."""
    return list(_POLICIES)


def make_policy(name: str = DEFAULT_POLICY, **kw: object) -> RoutingPolicy:
    """Build a policy by name, passing ``kw`` to its constructor; unknown names raise ValueError."""
    factory = _POLICIES.get(name)
    if factory is None:
        raise ValueError(f"unknown routing policy {name!r}; known policies: {', '.join(_POLICIES)}")
    return factory(**kw)


def plan(policy: RoutingPolicy, keys: list[bytes], candidates: list[EncoderInfo]) -> dict[str, list[int]]:
    """Assign item i (routing key ``keys[i]``) to an encoder; returns url -> ascending item indices.

    Each choice sees the items already planned for this request, so one request's items can spread.
    Mutates only the policy's internal state (e.g. the round-robin counter).
    """
    if keys and not candidates:
        raise ValueError("cannot plan items without candidate encoders")
    planned: dict[str, int] = {}
    assignment: dict[str, list[int]] = {}
    for index, key in enumerate(keys):
        url = policy.choose(key, candidates, planned).url
        planned[url] = planned.get(url, 0) + 1
        assignment.setdefault(url, []).append(index)
    return assignment
