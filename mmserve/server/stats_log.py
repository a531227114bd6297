"""vLLM's periodic one-line stats log, on logger `mmserve.stats`:

    Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 96.0 tokens/s, Running: 4 reqs,
    Waiting: 0 reqs, KV cache usage: 12.5%, Prefix cache hit rate: 48.0%, Embedding cache hit rate: 50.0%

(one line). Every `--log-stats-interval` seconds the logger reads the server's metrics (after copying the
engine's latest StatsMsg into them), so the line and /metrics never disagree. Throughputs and hit rates are
over the interval; a hit rate keeps its last value through an interval without lookups, as vLLM's sliding
window does. The embedding cache hit rate (the engine's local encoder's) appears once that cache was used.

A line is logged when something happened in its interval (tokens processed, requests running or waiting),
and once more after activity stops, so an idle server stays quiet after one idle line.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from mmserve.server.metrics import ServerMetrics
from mmserve.transport.messages import StatsMsg

logger = logging.getLogger("mmserve.stats")

# Running totals the line is computed from: sample names in ServerMetrics' registry, without the prefix.
TOTALS = (
    "prompt_tokens_total",
    "generation_tokens_total",
    "prefix_cache_queries_total",
    "prefix_cache_hits_total",
    "mm_cache_queries_total",
    "mm_cache_hits_total",
)


class StatsLogger:
    """Builds one line per interval from `metrics`. `clock` (monotonic seconds) is injectable for tests.
    Not thread-safe: call from one thread (the server's event loop)."""

    def __init__(
        self, metrics: ServerMetrics, interval_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.metrics = metrics
        self.interval_s = interval_s
        self.clock = clock
        self._last_time = clock()
        self._last = metrics.values(*TOTALS)
        self._was_active = True  # the first interval is logged even when idle: one line says we are up
        self._prefix_hit_rate = 0.0
        self._mm_hit_rate = 0.0

    def line(self, stats: StatsMsg | None) -> str | None:
        """End the current interval: the line for it, or None when it and the one before were idle.
        `stats` is the engine's latest StatsMsg (None before the first)."""
        now = self.clock()
        self.metrics.update_engine(stats)
        totals = self.metrics.values(*TOTALS)
        delta = {name: totals[name] - self._last[name] for name in TOTALS}
        elapsed = max(now - self._last_time, 1e-9)
        self._last, self._last_time = totals, now
        running = stats.num_running if stats is not None else 0
        waiting = stats.num_waiting if stats is not None else 0
        kv_usage = stats.kv_cache_usage if stats is not None else 0.0
        if delta["prefix_cache_queries_total"] > 0:
            self._prefix_hit_rate = delta["prefix_cache_hits_total"] / delta["prefix_cache_queries_total"]
        if delta["mm_cache_queries_total"] > 0:
            self._mm_hit_rate = delta["mm_cache_hits_total"] / delta["mm_cache_queries_total"]
        active = bool(delta["prompt_tokens_total"] or delta["generation_tokens_total"] or running or waiting)
        if not (active or self._was_active):
            return None
        self._was_active = active
        text = (
            f"Avg prompt throughput: {delta['prompt_tokens_total'] / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {delta['generation_tokens_total'] / elapsed:.1f} tokens/s, "
            f"Running: {running} reqs, Waiting: {waiting} reqs, KV cache usage: {kv_usage * 100:.1f}%, "
            f"Prefix cache hit rate: {self._prefix_hit_rate * 100:.1f}%"
        )
        if totals["mm_cache_queries_total"] > 0:
            text += f", Embedding cache hit rate: {self._mm_hit_rate * 100:.1f}%"
        return text

    def log(self, stats: StatsMsg | None) -> str | None:
        """`line`, logged at INFO when there is one."""
        text = self.line(stats)
        if text is not None:
            logger.info("%s", text)
        return text

    async def run(self, latest_stats: Callable[[], StatsMsg | None]) -> None:
        """Log every `interval_s` until cancelled; `latest_stats` returns the engine's latest StatsMsg."""
        while True:
            await asyncio.sleep(self.interval_s)
            self.log(latest_stats())


def start_stats_log(
    metrics: ServerMetrics, interval_s: float, latest_stats: Callable[[], StatsMsg | None]
) -> asyncio.Task | None:
    """The stats log as a task on the running loop (the caller cancels it at shutdown); None when
    `interval_s` is 0 (off)."""
    if interval_s <= 0:
        return None
    return asyncio.create_task(StatsLogger(metrics, interval_s).run(latest_stats))
