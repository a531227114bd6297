"""What the router records about each routed request: the `x-mmserve-route` header, one INFO log line, and
Prometheus metrics (`mmserve_router:` prefix) in a registry of its own per app."""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from mmserve.disagg.router_registry import ServerRegistry

logger = logging.getLogger("mmserve.router")
ROUTE_HEADER = "x-mmserve-route"
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_UNSAFE = re.compile(r"[^\x21-\x3a\x3c-\x7e]")  # printable ASCII but ';' (the header's separator) and space


@dataclass
class RouteNote:
    """The path of one request, filled in as the relay learns it (servers per attempt, then the handoff)."""

    backend: str
    started: float = field(default_factory=time.perf_counter)
    prefill: str = ""
    decode: str = ""
    room: str = ""
    attempts: int = 0
    kv_bytes: int | None = None
    transfer_s: float | None = None
    encoded_by: str | None = None
    first_byte_s: float | None = None  # since `started`
    status: int = 0

    def header(self) -> str:
        """`prefill=URL; decode=URL; backend=zmq; room=R; attempts=N; kv_bytes=B; kv_transfer_ms=T; encoded_by=E`;
        the handoff fields only once the prefill server answered."""
        parts = [
            f"prefill={self.prefill}",
            f"decode={self.decode}",
            f"backend={self.backend}",
            f"room={self.room}",
            f"attempts={self.attempts}",
        ]
        if self.kv_bytes is not None:
            parts.append(f"kv_bytes={self.kv_bytes}")
        if self.transfer_s is not None:
            parts.append(f"kv_transfer_ms={self.transfer_s * 1e3:.2f}")
        if self.encoded_by is not None:
            parts.append(f"encoded_by={_UNSAFE.sub('_', self.encoded_by)[:100]}")
        return "; ".join(parts)

    def read_handoff(self, body: object) -> None:
        """Take kv_bytes, transfer time and encoded_by from a prefill server's kv_handoff answer (leniently: a
        field missing or malformed is left out of the header)."""
        if not isinstance(body, dict):
            return
        kv = body.get("kv_transfer") if isinstance(body.get("kv_transfer"), dict) else {}
        extra = body.get("mmserve") if isinstance(body.get("mmserve"), dict) else {}
        if isinstance(kv.get("kv_bytes"), int):
            self.kv_bytes = kv["kv_bytes"]
        if isinstance(kv.get("transfer_s"), int | float):
            self.transfer_s = float(kv["transfer_s"])
        if extra.get("encoded_by") is not None:
            self.encoded_by = str(extra["encoded_by"])

    def mark_first_byte(self) -> None:
        if self.first_byte_s is None:
            self.first_byte_s = time.perf_counter() - self.started


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "mmserve_router:requests",
            "Routed requests by servers and final HTTP status",
            ["prefill", "decode", "status"],
            registry=r,
        )
        self.kv_bytes = Counter(
            "mmserve_router:kv_transfer_bytes", "KV bytes handed from prefill to decode", registry=r
        )
        self.kv_seconds = Histogram(
            "mmserve_router:kv_transfer_seconds",
            "KV handoff time (prefill's report)",
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self.ttfb = Histogram(
            "mmserve_router:time_to_first_byte_seconds",
            "Request arrival to the first byte of the answer",
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self.retries = Counter(
            "mmserve_router:retries", "Requests tried again in a new room, by reason", ["reason"], registry=r
        )
        self.in_flight = Gauge(
            "mmserve_router:in_flight_requests",
            "Requests open on each server",
            ["server", "role"],
            registry=r,
        )
        self.healthy = Gauge(
            "mmserve_router:server_healthy", "1 when the server is selectable", ["server", "role"], registry=r
        )

    def finish(self, note: RouteNote) -> None:
        """Count and log a request once its answer is complete (or broken off)."""
        self.requests.labels(note.prefill, note.decode, str(note.status)).inc()
        if note.kv_bytes is not None:
            self.kv_bytes.inc(note.kv_bytes)
        if note.transfer_s is not None:
            self.kv_seconds.observe(note.transfer_s)
        if note.first_byte_s is not None:
            self.ttfb.observe(note.first_byte_s)
        total_ms = (time.perf_counter() - note.started) * 1e3
        ttfb_ms = f"{note.first_byte_s * 1e3:.1f}" if note.first_byte_s is not None else "-"
        logger.info("%s status=%s ttfb_ms=%s total_ms=%.1f", note.header(), note.status, ttfb_ms, total_ms)

    def render(self, servers: ServerRegistry) -> bytes:
        # Per-server gauges are rebuilt at each scrape, so unregistered servers disappear.
        self.in_flight.clear()
        self.healthy.clear()
        for s in servers.all():
            self.in_flight.labels(s.url, s.role).set(s.in_flight)
            self.healthy.labels(s.url, s.role).set(1 if s.selectable else 0)
        return generate_latest(self.registry)
