"""Prometheus metrics of the API server (vLLM-like names, `mmserve:` prefix), one registry per app.

Request-level histograms are observed here as responses complete; engine gauges and counters are copied from
the engine's periodic StatsMsg (the engine process owns those numbers).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from mmserve.encoder.embedding_store import METRIC_DOCS as STORE_METRIC_DOCS
from mmserve.transport.messages import StatsMsg

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]

        def hist(name, doc, buckets=_LATENCY_BUCKETS):
            return Histogram(f"mmserve:{name}", doc, labels, registry=r, buckets=buckets).labels(model_name)

        def gauge(name, doc):
            return Gauge(f"mmserve:{name}", doc, labels, registry=r).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token")
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive output tokens")
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency")
        self.queue_time = hist("request_queue_time_seconds", "Time waiting for the scheduler")
        self.prefill_time = hist("request_prefill_time_seconds", "Scheduled to first token")
        self.decode_time = hist("request_decode_time_seconds", "First to last token")
        self.encode_time = hist("request_encode_time_seconds", "Media fetch + encode time per request")
        self.prompt_tokens_hist = hist("request_prompt_tokens", "Prompt tokens per request", _TOKEN_BUCKETS)
        self.generation_tokens_hist = hist(
            "request_generation_tokens", "Output tokens per request", _TOKEN_BUCKETS
        )
        self.prompt_tokens = Counter("mmserve:prompt_tokens", "Prompt tokens (images expanded)", labels,
                                     registry=r).labels(model_name)  # fmt: skip
        self.generation_tokens = Counter("mmserve:generation_tokens", "Generated tokens", labels,
                                         registry=r).labels(model_name)  # fmt: skip
        self.requests = Counter("mmserve:request_success", "Finished requests by finish reason",
                                labels + ["finished_reason"], registry=r)  # fmt: skip
        self.errors = Counter("mmserve:request_errors", "Requests answered with an error, by HTTP status",
                              labels + ["status"], registry=r)  # fmt: skip
        self.running = gauge("num_requests_running", "Requests in the running batch")
        self.waiting = gauge("num_requests_waiting", "Requests queued or encoding")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV slots in use (0-1)")
        self.prefix_queries = gauge("prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = gauge("prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.mm_queries = gauge("mm_cache_queries", "Multimodal item lookups in the embedding cache")
        self.mm_hits = gauge("mm_cache_hits", "Multimodal embedding cache hits")
        self.encode_seconds = gauge(
            "encode_seconds_total", "Seconds the engine spent fetching and encoding media"
        )
        self.parts_received = gauge("embedding_parts_received", "Embedding parts received from encoders")
        self.parts_dropped = gauge(
            "embedding_parts_dropped", "Parts dropped: stale, unknown, invalid, malformed, forged, replayed"
        )
        self.preemptions = gauge(
            "num_preemptions", "Running requests retracted to free KV (recomputed later)"
        )
        self.parts_forged = gauge("embedding_parts_forged", "Parts dropped for a missing or wrong HMAC")
        self.parts_replayed = gauge("embedding_parts_replayed", "Signed parts dropped as replays or stale")
        self.transfer_held = gauge(
            "transfer_held_bytes", "Shared-memory / Mooncake pool bytes live requests view"
        )
        # Prefill-decode disaggregation (mmserve.disagg): handoffs sent (prefill) or adopted (decode).
        self.kv_handoffs = gauge(
            "kv_handoffs", "Requests handed to a decode server (prefill) or adopted (decode)"
        )
        self.kv_handoff_failures = gauge(
            "kv_handoff_failures", "Handoffs that failed, timed out or were refused"
        )
        self.kv_bytes = gauge("kv_transfer_bytes", "KV bytes sent (prefill) or received (decode)")
        self.kv_pending = gauge("kv_handoffs_pending", "Handoffs in progress (their KV slots held)")
        # The engine's local encoder's global embedding store (--embedding-store); absent: all 0.
        self.store = {name: gauge(f"embedding_store_{name}", doc) for name, doc in STORE_METRIC_DOCS.items()}
        self.model_name = model_name

    def update_engine(self, stats: StatsMsg | None) -> None:
        if stats is None:
            return
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.prefix_queries.set(stats.prefix_cache_queries)
        self.prefix_hits.set(stats.prefix_cache_hits)
        self.mm_queries.set(stats.mm_cache_queries)
        self.mm_hits.set(stats.mm_cache_hits)
        self.encode_seconds.set(stats.encode_seconds_total)
        self.parts_received.set(stats.parts_received)
        self.parts_dropped.set(stats.parts_dropped)
        self.parts_forged.set(stats.parts_forged)
        self.preemptions.set(stats.num_preemptions)
        self.parts_replayed.set(stats.parts_replayed)
        self.transfer_held.set(stats.transfer_held_bytes)
        self.kv_handoffs.set(stats.kv_handoffs)
        self.kv_handoff_failures.set(stats.kv_handoff_failures)
        self.kv_bytes.set(stats.kv_bytes)
        self.kv_pending.set(stats.kv_pending)
        for name, value in stats.embedding_store.items():
            if name in self.store:
                self.store[name].set(value)

    def record_error(self, status: int) -> None:
        self.errors.labels(self.model_name, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
