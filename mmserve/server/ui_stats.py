"""What the dashboard shows (`GET /ui/api/stats`): the engine's and the encoders' state now, and a short history.

History: `StatsHistory` samples the server's own metrics every `SAMPLE_INTERVAL_S` into a ring of `HISTORY_S`
(counters, latency histogram buckets, running / waiting requests, KV usage). Sampling starts with the first
request to a UI route (a task on the server's event loop) and stops with the server. Rates are differences of
counters between samples; latency percentiles come from the difference of histogram buckets over a window,
interpolated inside a bucket as Prometheus' `histogram_quantile` does (so they are as fine as the buckets of
mmserve.server.metrics).

Encoders: the registry's view (health, strikes, requests in flight from this server, the probe's cache
counters), plus each encoder's own /metrics (pending jobs, batches, items per batch, mean tower time), fetched
at most every `ENCODER_METRICS_MAX_AGE_S`, each fetch bounded by `ENCODER_METRICS_TIMEOUT_S`.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from mmserve.server.app_state import AppState
from mmserve.server.metrics import PREFIX

SAMPLE_INTERVAL_S = 2.0
HISTORY_S = 300.0
LATENCY_WINDOW_S = 30.0  # each chart point's percentiles: the requests that finished in the 30 s before it
SUMMARY_WINDOWS_S = (60.0, 300.0)  # the percentile table: the last minute and the last five
ENCODER_METRICS_TIMEOUT_S = 1.0
ENCODER_METRICS_MAX_AGE_S = 2.0
HISTOGRAMS = {
    "ttft": "time_to_first_token_seconds",
    "itl": "inter_token_latency_seconds",
    "e2e": "e2e_request_latency_seconds",
}
COUNTERS = ("prompt_tokens_total", "generation_tokens_total", "request_success_total", "request_errors_total")
Buckets = list[tuple[float, float]]  # (upper bound `le`, cumulative count), ascending, ending with +Inf


@dataclass(frozen=True)
class Sample:
    t: float  # time.monotonic()
    counters: dict[str, float]
    buckets: dict[str, Buckets]  # HISTOGRAMS key -> buckets
    running: int
    waiting: int
    kv_usage: float  # 0..1


def histogram_buckets(state: AppState, name: str) -> Buckets:
    """The cumulative buckets of one of the server's histograms (summed over label values)."""
    wanted, out = PREFIX + name, {}
    for family in state.metrics.registry.collect():
        if family.name == wanted:
            for s in family.samples:
                if s.name.endswith("_bucket"):
                    le = float(s.labels["le"])
                    out[le] = out.get(le, 0.0) + s.value
    return sorted(out.items())


def quantile(q: float, now: Buckets, then: Buckets | None) -> float | None:
    """The q-quantile of the observations between two readings of a histogram (`then` None: since start);
    None when there were none."""
    before = dict(then or ())
    delta = [(le, count - before.get(le, 0.0)) for le, count in now]
    total = delta[-1][1] if delta else 0.0
    if total <= 0:
        return None
    rank = q * total
    prev_le, prev_count = 0.0, 0.0
    for le, count in delta:
        if count >= rank:
            if math.isinf(le):  # above the largest bound: report that bound, as histogram_quantile does
                return prev_le
            if count == prev_count:
                return le
            return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
        prev_le, prev_count = le, count
    return prev_le


def _per_s(before: Sample, after: Sample, counter: str) -> float:
    return round((after.counters[counter] - before.counters[counter]) / max(after.t - before.t, 1e-6), 2)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 2)


class StatsHistory:
    """A ring of `Sample`s of one server, the oldest dropped first (bounded: HISTORY_S / SAMPLE_INTERVAL_S)."""

    def __init__(self, state: AppState, interval_s: float = SAMPLE_INTERVAL_S, history_s: float = HISTORY_S):
        self.state, self.interval_s = state, interval_s
        self.samples: deque[Sample] = deque(maxlen=int(history_s / interval_s) + 1)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Start sampling on the running event loop; later calls do nothing."""
        if self._task is None:
            self.sample()
            self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.sample()

    def sample(self) -> Sample:
        stats = self.state.client.stats
        s = Sample(
            time.monotonic(),
            self.state.metrics.values(*COUNTERS),
            {key: histogram_buckets(self.state, name) for key, name in HISTOGRAMS.items()},
            stats.num_running if stats else 0,
            stats.num_waiting if stats else 0,
            stats.kv_cache_usage if stats else 0.0,
        )
        self.samples.append(s)
        return s

    def _at_or_before(self, t: float) -> Sample | None:
        """The newest sample taken at or before `t` (None: the ring starts later)."""
        best = None
        for s in self.samples:
            if s.t > t:
                break
            best = s
        return best

    def series(self) -> dict[str, list]:
        """Chart data: per sample, seconds before the newest sample, rates since the sample before, gauges,
        and TTFT / E2E percentiles (ms) of the LATENCY_WINDOW_S before it (None: no request finished)."""
        samples = list(self.samples)
        out: dict[str, list] = {
            k: [] for k in ("t", "gen_tps", "prompt_tps", "running", "waiting", "kv_usage")
        }
        for key in ("ttft", "e2e"):
            out[f"{key}_p50"], out[f"{key}_p90"] = [], []
        if len(samples) < 2:
            return out
        newest = samples[-1].t
        for prev, s in zip(samples, samples[1:], strict=False):
            out["t"].append(round(s.t - newest, 1))
            out["gen_tps"].append(_per_s(prev, s, "generation_tokens_total"))
            out["prompt_tps"].append(_per_s(prev, s, "prompt_tokens_total"))
            out["running"].append(s.running)
            out["waiting"].append(s.waiting)
            out["kv_usage"].append(round(100 * s.kv_usage, 2))
            then = self._at_or_before(s.t - LATENCY_WINDOW_S) or samples[0]
            for key in ("ttft", "e2e"):
                out[f"{key}_p50"].append(_ms(quantile(0.5, s.buckets[key], then.buckets[key])))
                out[f"{key}_p90"].append(_ms(quantile(0.9, s.buckets[key], then.buckets[key])))
        return out

    def latency(self) -> dict[str, Any]:
        """TTFT / ITL / E2E p50, p90, p99 (ms) over each of SUMMARY_WINDOWS_S (or the history there is),
        with the number of observations behind them."""
        if not self.samples:
            return {}
        newest = self.samples[-1]
        out = {}
        for window in SUMMARY_WINDOWS_S:
            then = self._at_or_before(newest.t - window) or self.samples[0]
            row: dict[str, Any] = {"covered_s": round(newest.t - then.t, 1)}
            for key in HISTOGRAMS:
                now_b, then_b = newest.buckets[key], then.buckets[key]
                count = (now_b[-1][1] - then_b[-1][1]) if now_b and then_b else 0
                row[key] = {
                    "count": int(count),
                    **{f"p{int(100 * q)}": _ms(quantile(q, now_b, then_b)) for q in (0.5, 0.9, 0.99)},
                }
            out[f"{int(window)}s"] = row
        return out


def _encoder_metrics(text: str) -> dict[str, float]:
    """An encoder's Prometheus text as sample name -> value (summed over label values)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def _mean_ms(m: dict[str, float], name: str) -> float | None:
    count = m.get(f"mmserve:encoder_{name}_seconds_count", 0.0)
    return _ms(m[f"mmserve:encoder_{name}_seconds_sum"] / count) if count else None


class EncoderMetrics:
    """Each registered encoder's own /metrics, cached for ENCODER_METRICS_MAX_AGE_S."""

    def __init__(self) -> None:
        self._fetched_at = -math.inf
        self._by_url: dict[str, dict[str, float] | None] = {}
        self._lock = asyncio.Lock()

    async def get(self, urls: list[str]) -> dict[str, dict[str, float] | None]:
        """url -> its metrics (None: it did not answer in time)."""
        if not urls:
            return {}
        async with self._lock:  # concurrent dashboards share one round of fetches
            if time.monotonic() - self._fetched_at >= ENCODER_METRICS_MAX_AGE_S or set(urls) - set(
                self._by_url
            ):
                async with httpx.AsyncClient(timeout=ENCODER_METRICS_TIMEOUT_S) as http:
                    texts = await asyncio.gather(*(self._fetch(http, u) for u in urls))
                self._by_url = dict(zip(urls, texts, strict=True))
                self._fetched_at = time.monotonic()
            return {u: self._by_url.get(u) for u in urls}

    @staticmethod
    async def _fetch(http: httpx.AsyncClient, url: str) -> dict[str, float] | None:
        try:
            r = await http.get(url + "/metrics")
            r.raise_for_status()
            return _encoder_metrics(r.text)
        except (httpx.HTTPError, ValueError):
            return None


def encoder_row(info: dict[str, Any], m: dict[str, float] | None) -> dict[str, Any]:
    """One encoder for the dashboard: the registry's `as_json()` and its own metrics (None: unreachable)."""
    probe_cache = info.get("stats") or {}  # the last health probe's cache counters
    row = {
        "url": info["url"],
        "healthy": info["healthy"],
        "static": info["static"],
        "strikes": info["consecutive_failures"],
        "in_flight": info["in_flight"],
        "metrics_reachable": m is not None,
        "cache_queries": probe_cache.get("queries", 0),
        "cache_hits": probe_cache.get("hits", 0),
        "cache_bytes": probe_cache.get("bytes", 0),
    }
    if m is not None:
        row.update(
            pending=int(m.get("mmserve:encoder_pending_jobs", 0)),
            batches=int(m.get("mmserve:encoder_batches", 0)),
            items_per_batch=round(m.get("mmserve:encoder_items_per_batch", 0.0), 2),
            cache_queries=int(m.get("mmserve:encoder_cache_queries", 0)),
            cache_hits=int(m.get("mmserve:encoder_cache_hits", 0)),
            cache_bytes=int(m.get("mmserve:encoder_cache_bytes", 0)),
            rejected=int(m.get("mmserve:encoder_rejected_jobs_total", 0)),
            forward_ms=_mean_ms(m, "forward"),
            queue_wait_ms=_mean_ms(m, "queue_wait"),
            transfer_ms=_mean_ms(m, "transfer"),
        )
    queries = row["cache_queries"]
    row["cache_hit_rate"] = round(row["cache_hits"] / queries, 4) if queries else None
    return row


async def snapshot(state: AppState, history: StatsHistory, encoders: EncoderMetrics) -> dict[str, Any]:
    """The body of GET /ui/api/stats."""
    client, stats = state.client, state.client.stats
    ready = client.ready

    def rate(hits: str, queries: str) -> float | None:
        q = getattr(stats, queries, 0) if stats else 0
        return round(getattr(stats, hits) / q, 4) if q else None

    dispatcher, workers = state.dispatcher, state.encoder_workers
    infos = [e.as_json() for e in dispatcher.registry.all()] if dispatcher is not None else []
    fetched = await encoders.get([i["url"] for i in infos])
    totals = state.metrics.values(*COUNTERS)
    return {
        "model": state.cfg.served_model_name,
        "engine": {
            "alive": not client.dead,
            "running": stats.num_running if stats else 0,
            "waiting": stats.num_waiting if stats else 0,
            "in_flight": client.num_in_flight,
            "kv_usage": stats.kv_cache_usage if stats else 0.0,
            "kv_cache_tokens": ready.kv_cache_tokens,
            "prefix_cache_tokens": stats.prefix_cache_tokens if stats else 0,
            "max_model_len": ready.max_model_len,
            "prefix_cache_hit_rate": rate("prefix_cache_hits", "prefix_cache_queries"),
            "mm_cache_hit_rate": rate("mm_cache_hits", "mm_cache_queries"),
            "preemptions": stats.num_preemptions if stats else 0,
            "has_tower": ready.has_tower,
        },
        "totals": {
            "requests": int(totals["request_success_total"]),
            "errors": int(totals["request_errors_total"]),
            "prompt_tokens": int(totals["prompt_tokens_total"]),
            "generation_tokens": int(totals["generation_tokens_total"]),
        },
        "dispatch": None
        if dispatcher is None or not infos
        else {
            "routing": state.cfg.encoder_routing,
            "transport": dispatcher.routes.transport,
            "failovers": dispatcher.failovers,
            "local_fallbacks": dispatcher.local_fallbacks,
        },
        "encoders": [encoder_row(i, fetched[i["url"]]) for i in infos],
        # --encoder-workers: each one's state (running, restarting, failed) and restarts
        "encoder_workers": [w.as_json() for w in workers.states] if workers is not None else [],
        "latency": history.latency(),
        "series": history.series(),
        "sample_interval_s": history.interval_s,
    }
