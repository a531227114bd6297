"""Byte-budgeted LRU of item embeddings (tensors, or objects with `nbytes`), keyed by content hash, with single-flight computation.

Thread-safe: the encoder's HTTP handlers and its batching worker share one cache. `get_or_compute` makes
concurrent callers for the same key wait for one computation instead of running it again (NOTE: the waiter
blocks on an Event, never while holding the cache lock).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch


def tensor_nbytes(value) -> int:
    """Bytes held by a cached value: a tensor, or any object with an `nbytes` attribute."""
    return int(value.nbytes)


@dataclass
class CacheStats:
    queries: int = 0
    hits: int = 0
    evictions: int = 0
    refused: int = 0  # entries larger than the whole budget

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class _Flight:
    """One in-progress computation that other callers can wait on."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: torch.Tensor | None = None
        self.error: BaseException | None = None


class EmbeddingCache:
    """LRU over `bytes` keys with a budget of `capacity_mb` megabytes (MiB) of tensor data."""

    def __init__(self, capacity_mb: float) -> None:
        self.capacity_bytes = int(capacity_mb * 1024 * 1024)
        self.used_bytes = 0
        self.stats = CacheStats()
        self._entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._flights: dict[bytes, _Flight] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._entries

    def get(self, key: bytes) -> torch.Tensor | None:
        """Look up `key` (counts a query; a hit refreshes its recency)."""
        with self._lock:
            return self._get_locked(key)

    def _get_locked(self, key: bytes) -> torch.Tensor | None:
        self.stats.queries += 1
        value = self._entries.get(key)
        if value is not None:
            self.stats.hits += 1
            self._entries.move_to_end(key)
        return value

    def put(self, key: bytes, value: torch.Tensor) -> bool:
        """Insert, evicting least recently used entries to fit. Returns False (and stores nothing,
        evicts nothing) if the value alone exceeds the budget."""
        with self._lock:
            return self._put_locked(key, value)

    def _put_locked(self, key: bytes, value: torch.Tensor) -> bool:
        size = tensor_nbytes(value)
        if size > self.capacity_bytes:
            self.stats.refused += 1
            return False
        old = self._entries.pop(key, None)
        if old is not None:
            self.used_bytes -= tensor_nbytes(old)
        while self.used_bytes + size > self.capacity_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.used_bytes -= tensor_nbytes(evicted)
            self.stats.evictions += 1
        self._entries[key] = value
        self.used_bytes += size
        return True

    def get_or_compute(
        self, key: bytes, compute: Callable[[], torch.Tensor], timeout_s: float = 300.0
    ) -> torch.Tensor:
        """The cached value for `key`, computing it at most once across concurrent callers.

        If the leader's computation raises, every waiter gets the same exception and nothing is cached.
        Raises TimeoutError if a waiter's leader takes longer than `timeout_s`.
        """
        with self._lock:
            value = self._get_locked(key)
            if value is not None:
                return value
            flight = self._flights.get(key)
            leader = flight is None
            if leader:
                flight = self._flights[key] = _Flight()
        if not leader:
            if not flight.done.wait(timeout_s):
                raise TimeoutError(f"embedding computation for {key.hex()} did not finish in {timeout_s}s")
            if flight.error is not None:
                raise flight.error
            return flight.value
        try:
            flight.value = compute()
        except BaseException as e:
            flight.error = e
            raise
        finally:
            with self._lock:
                if flight.error is None:
                    self._put_locked(key, flight.value)
                del self._flights[key]
            flight.done.set()
        return flight.value

    def check_integrity(self) -> None:
        with self._lock:
            total = sum(tensor_nbytes(v) for v in self._entries.values())
            assert total == self.used_bytes, (total, self.used_bytes)
            assert self.used_bytes <= self.capacity_bytes
            assert self.stats.hits <= self.stats.queries
