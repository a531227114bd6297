"""Prometheus metrics of an encoder service (`mmserve:encoder_` prefix), one registry per service."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from mmserve.encoder.embedding_store import METRIC_DOCS

_SECONDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class EncoderMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("mmserve:encoder_items", "Items handled, by modality and HTTP status",
                                ["modality", "status"], registry=r)  # fmt: skip
        self.rejected = Counter(
            "mmserve:encoder_rejected_jobs", "Jobs refused with 503 (queue full)", registry=r
        )
        self.queue_wait = Histogram("mmserve:encoder_queue_wait_seconds", "Job wait before a worker took it",
                                    registry=r, buckets=_SECONDS)  # fmt: skip
        self.preprocess = Histogram("mmserve:encoder_preprocess_seconds", "Fetch + decode + preprocess per job",
                                    registry=r, buckets=_SECONDS)  # fmt: skip
        self.forward = Histogram("mmserve:encoder_forward_seconds", "Tower time per job with cache misses",
                                 registry=r, buckets=_SECONDS)  # fmt: skip
        self.transfer = Histogram("mmserve:encoder_transfer_seconds", "Pushing a part to the engine",
                                  registry=r, buckets=_SECONDS)  # fmt: skip
        self.items_per_batch = Gauge(
            "mmserve:encoder_items_per_batch", "Mean items per tower forward", registry=r
        )
        self.batches = Gauge("mmserve:encoder_batches", "Tower forwards run", registry=r)
        self.pending = Gauge("mmserve:encoder_pending_jobs", "Jobs queued or running", registry=r)
        self.cache_queries = Gauge("mmserve:encoder_cache_queries", "Embedding cache lookups", registry=r)
        self.cache_hits = Gauge("mmserve:encoder_cache_hits", "Embedding cache hits", registry=r)
        self.cache_evictions = Gauge(
            "mmserve:encoder_cache_evictions", "Embedding cache evictions", registry=r
        )
        self.cache_bytes = Gauge(
            "mmserve:encoder_cache_bytes", "Bytes held by the embedding cache", registry=r
        )
        self.transport = Gauge(
            "mmserve:encoder_transport",
            "Transfer pools and links by stat (shm_pool_used_bytes, shm_links, mooncake_pool_used_bytes ...)",
            ["stat"],
            registry=r,
        )
        self.store = {
            name: Gauge(f"mmserve:encoder_embedding_store_{name}", doc, registry=r)
            for name, doc in METRIC_DOCS.items()
        }

    def update(self, service) -> None:
        stats, cache = service.batcher.stats, service.cache
        self.batches.set(stats.batches)
        self.items_per_batch.set(stats.items / stats.batches if stats.batches else 0.0)
        self.pending.set(service.pending)
        self.cache_queries.set(cache.stats.queries)
        self.cache_hits.set(cache.stats.hits)
        self.cache_evictions.set(cache.stats.evictions)
        self.cache_bytes.set(cache.used_bytes)
        for name, value in service.sender.stats().items():
            self.transport.labels(name).set(value)
        store = service.encoder.store
        if store is not None:
            for name, value in store.snapshot().as_dict().items():
                self.store[name].set(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)
