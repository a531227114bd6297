"""Registry of encoder services with health state, used by the API server to dispatch media items."""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RegistryConfig:
    """Health-tracking knobs for :class:`EncoderRegistry` (immutable)."""

    failure_threshold: int = 3
    drop_after_s: float = 300.0
    probe_interval_s: float = 5.0
    probe_timeout_s: float = 2.0

    def __post_init__(self) -> None:
        if self.failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {self.failure_threshold}")
        if self.drop_after_s < 0:
            raise ValueError(f"drop_after_s must be >= 0, got {self.drop_after_s}")
        if self.probe_interval_s <= 0:
            raise ValueError(f"probe_interval_s must be > 0, got {self.probe_interval_s}")
        if self.probe_timeout_s <= 0:
            raise ValueError(f"probe_timeout_s must be > 0, got {self.probe_timeout_s}")


@dataclass
class EncoderInfo:
    """State of one encoder service; the registry hands out copies, so mutating one has no effect on it."""

    url: str
    static: bool
    healthy: bool = True
    consecutive_failures: int = 0
    unhealthy_since: float | None = None
    in_flight: int = 0
    last_seen: float = 0.0
    stats: dict = field(default_factory=dict)

    def as_json(self) -> dict:
        """Return a JSON-serialisable summary (mutates nothing)."""
        return {
            "url": self.url,
            "healthy": self.healthy,
            "static": self.static,
            "in_flight": self.in_flight,
            "consecutive_failures": self.consecutive_failures,
            "stats": copy.deepcopy(self.stats),
        }

    def snapshot(self) -> EncoderInfo:
        """Return an independent copy (mutates nothing)."""
        return copy.deepcopy(self)


def normalize_url(url: str) -> str:
    """Canonical form of an encoder URL: surrounding whitespace and trailing slashes removed."""
    return url.strip().rstrip("/")


class EncoderRegistry:
    """Thread-safe set of encoders in registration order, with failure counting, revival and TTL drop.

    Encoders come from ``--encoder-urls`` (static: marked unhealthy but never dropped) or from runtime
    registration (dropped once unhealthy for ``drop_after_s``). An explicitly unregistered URL is
    remembered so that late probe or request results cannot bring it back; only ``register`` can.
    """

    def __init__(self, cfg: RegistryConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self._cfg = cfg
        self._clock = clock
        # Handlers and the asyncio prober may run on different threads.
        self._lock = threading.Lock()
        self._encoders: dict[str, EncoderInfo] = {}
        self._unregistered: set[str] = set()

    @property
    def config(self) -> RegistryConfig:
        """The registry's configuration (mutates nothing)."""
        return self._cfg

    def add_static(self, url: str) -> None:
        """Add a static encoder (mutates: the encoder table; clears an unregistered mark for the URL).

        Re-adding a known URL only marks it static; its health state is kept.
        """
        url = normalize_url(url)
        with self._lock:
            self._unregistered.discard(url)
            info = self._encoders.get(url)
            if info is None:
                self._encoders[url] = EncoderInfo(url=url, static=True, last_seen=self._clock())
            else:
                info.static = True

    def register(self, url: str) -> EncoderInfo:
        """Register (or re-register after a restart) a runtime encoder and return a snapshot of it.

        Mutates: the encoder's entry (healthy, failures and stats reset, last_seen = now; a known encoder
        keeps its position, static flag and in-flight count) and clears any unregistered mark for the URL.
        """
        url = normalize_url(url)
        now = self._clock()
        with self._lock:
            self._unregistered.discard(url)
            info = self._encoders.get(url)
            if info is None:
                info = EncoderInfo(url=url, static=False)
                self._encoders[url] = info
            info.healthy = True
            info.consecutive_failures = 0
            info.unhealthy_since = None
            info.last_seen = now
            # A restarted encoder starts with an empty cache; stale stats would mislead.
            info.stats = {}
            return info.snapshot()

    def unregister(self, url: str) -> bool:
        """Remove an encoder and remember the removal (mutates: encoder table, unregistered set).

        Returns False if the URL was not known.
        """
        url = normalize_url(url)
        with self._lock:
            if self._encoders.pop(url, None) is None:
                return False
            self._unregistered.add(url)
            return True

    def is_unregistered(self, url: str) -> bool:
        """True if `url` was explicitly unregistered (and not registered again since)."""
        with self._lock:
            return normalize_url(url) in self._unregistered

    def record_success(self, url: str, stats: dict | None = None) -> None:
        """Record a successful probe or request (mutates: failures reset, health revived, last_seen, stats).

        Unknown, dropped or explicitly unregistered URLs are ignored.
        """
        url = normalize_url(url)
        now = self._clock()
        with self._lock:
            info = self._encoders.get(url)
            if info is None or url in self._unregistered:
                return
            info.consecutive_failures = 0
            info.healthy = True
            info.unhealthy_since = None
            info.last_seen = now
            if stats is not None:
                info.stats = copy.deepcopy(stats)

    def record_failure(self, url: str) -> None:
        """Record a failed probe or request (mutates: failure count; health once the threshold is hit).

        An encoder that is already unhealthy keeps its original ``unhealthy_since`` so the TTL is not
        pushed back by every failed probe. Unknown URLs are ignored.
        """
        url = normalize_url(url)
        now = self._clock()
        with self._lock:
            info = self._encoders.get(url)
            if info is None:
                return
            info.consecutive_failures += 1
            if info.healthy and info.consecutive_failures >= self._cfg.failure_threshold:
                info.healthy = False
                info.unhealthy_since = now

    def expire(self) -> list[str]:
        """Drop runtime encoders unhealthy for at least ``drop_after_s`` (mutates: encoder table).

        Returns the dropped URLs in registration order. Static encoders are never dropped.
        """
        now = self._clock()
        with self._lock:
            dropped = [
                url
                for url, info in self._encoders.items()
                if not info.static
                and not info.healthy
                and info.unhealthy_since is not None
                and now - info.unhealthy_since >= self._cfg.drop_after_s
            ]
            for url in dropped:
                del self._encoders[url]
            return dropped

    def healthy(self) -> list[EncoderInfo]:
        """Snapshots of the healthy encoders in registration order (mutates nothing)."""
        with self._lock:
            return [info.snapshot() for info in self._encoders.values() if info.healthy]

    def all(self) -> list[EncoderInfo]:
        """Snapshots of every known encoder in registration order (mutates nothing)."""
        with self._lock:
            return [info.snapshot() for info in self._encoders.values()]

    def get(self, url: str) -> EncoderInfo | None:
        """Snapshot of one encoder, or None if unknown (mutates nothing)."""
        url = normalize_url(url)
        with self._lock:
            info = self._encoders.get(url)
            return None if info is None else info.snapshot()

    def acquire(self, url: str) -> None:
        """Count one more request in flight to the encoder (mutates: in_flight). Unknown URLs are ignored."""
        url = normalize_url(url)
        with self._lock:
            info = self._encoders.get(url)
            if info is not None:
                info.in_flight += 1

    def release(self, url: str) -> None:
        """Count one fewer request in flight, never below 0 (mutates: in_flight). Unknown URLs are ignored."""
        url = normalize_url(url)
        with self._lock:
            info = self._encoders.get(url)
            if info is not None:
                info.in_flight = max(0, info.in_flight - 1)

    def urls_to_probe(self) -> list[str]:
        """Every known, not-unregistered URL, healthy or not, so unhealthy ones can revive (mutates nothing)."""
        with self._lock:
            return [url for url in self._encoders if url not in self._unregistered]
