"""`mmserve encoder`: the model's encoder (vision or audio tower) as an HTTP service that pushes embeddings to
engines over the transport each job names (tcp://, ipc://, shm://, mooncake://; see mmserve.transport.channel).

`POST /encode` takes a job (request id, part index and count, items with their media references, the
engine's embedding endpoint, the request's cache salt). The handler fetches, hashes (with the salt), looks
items up in the embedding cache, runs the misses through the fused-batch tower, pushes the part to the
engine, and answers once the part is handed to the socket:
- 200: the part was delivered to the engine's socket.
- 400/413: bad media. An error part is pushed too, so the engine fails the request at once.
- 503: too many pending jobs (`--max-pending`); nothing is pushed (the dispatcher retries elsewhere).
- 500/502: internal failure or engine unreachable; nothing is pushed (the dispatcher retries elsewhere).
`GET /health` runs a real tiny encode of the family's main modality (an image, or a short silent clip for
audio models); `GET /metrics` is Prometheus.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from mmserve.config import EncoderConfig
from mmserve.encoder.metrics import EncoderMetrics
from mmserve.encoder.runner import EncodeTimings, MediaInput, build_encoder
from mmserve.engine.cache_salt import MAX_CACHE_SALT_CHARS
from mmserve.models.family import load_family
from mmserve.multimodal.errors import MediaError
from mmserve.multimodal.items import Modality
from mmserve.multimodal.media import MediaRef
from mmserve.multimodal.media_options import MAX_MEDIA_UUID_CHARS
from mmserve.omp_pools import released
from mmserve.transport import cluster_auth
from mmserve.transport.channel import PartSenders, SendTimeout, TransferConfig
from mmserve.transport.cluster_auth import HTTP_HEADER
from mmserve.transport.embedding_wire import EmbeddingItem, build_part, error_part
from mmserve.transport.messages import Failure

logger = logging.getLogger("mmserve.encoder")


class JobItem(BaseModel):
    # A field this encoder does not know (a newer server's) is a 422, never silently dropped: an ignored
    # cache_salt would have shared this cache across tenants.
    model_config = ConfigDict(extra="forbid")

    item_index: int = Field(ge=0)
    modality: Modality
    url: str | None = None  # http(s) / data: / file://
    data_b64: str | None = None  # raw bytes, base64
    settings: dict[str, Any] = Field(default_factory=dict)  # the model family's per-item settings
    # The caller's identity, hashed instead of the bytes; with no url / data, a reference to a cached item.
    uuid: str | None = Field(default=None, min_length=1, max_length=MAX_MEDIA_UUID_CHARS)
    options: dict[str, Any] = Field(default_factory=dict)  # media options (mmserve.multimodal.media_options)


class EncodeJob(BaseModel):
    model_config = ConfigDict(extra="forbid")

    request_id: str = Field(min_length=1, max_length=256)
    part_index: int = Field(ge=0)
    num_parts: int = Field(ge=1)
    reply_endpoint: str = Field(pattern=r"^(tcp|ipc|shm|mooncake)://")
    items: list[JobItem] = Field(min_length=1)
    # The request's tenant scope (mmserve.engine.cache_salt): enters every item's content hash, so this
    # encoder's cache never serves one salt's item to another.
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)


class EncoderService:
    """Owns the encoder (tower batcher, embedding cache), the sender sockets and the job accounting."""

    def __init__(self, cfg: EncoderConfig) -> None:
        self.cfg = cfg
        self.family = load_family(cfg.model, mm_processor_kwargs=dict(cfg.mm_processor_kwargs))
        self.secret = cluster_auth.from_config(cfg.cluster_secret)
        self.encoder = build_encoder(
            self.family,
            cfg.dtype,
            cfg.device,
            cfg.embedding_cache_mb,
            cfg.media,
            cfg.max_batch_items,
            cfg.max_batch_wait_ms,
            store_cfg=cfg.embedding_store,
            model_path=cfg.model,
            secret=self.secret,
            pack_weights=cfg.pack_weights,
            fp32_gemm=cfg.fp32_gemm,
            cpu_kernels=cfg.cpu_kernels,
            quantization=cfg.quantization,
        )
        self.batcher, self.cache = self.encoder.batcher, self.encoder.cache
        transfer = TransferConfig(cfg.send_timeout_s, cfg.shm_pool_mb, cfg.mooncake_pool_mb, cfg.host)
        self.sender = PartSenders(transfer, signer=self.secret)
        self.metrics = EncoderMetrics()
        self.pending = 0

    def close(self) -> None:
        self.encoder.close()
        self.sender.close()

    @released  # an executor thread: its OpenMP pool would slow the tower thread's (omp_pools.py)
    def run_job(self, job: EncodeJob, queued_at: float) -> tuple[int, dict[str, Any]]:
        """Encode and push one part (runs on a worker thread). Returns (HTTP status, body)."""
        self.metrics.queue_wait.observe(time.perf_counter() - queued_at)
        timings, items = EncodeTimings(), []
        for it in job.items:
            ref = MediaRef.from_bytes(base64.b64decode(it.data_b64)) if it.data_b64 is not None else None
            try:
                ref = ref or (MediaRef.parse(it.url) if it.url is not None else None)  # None: by uuid
                item = MediaInput(it.modality, ref, it.settings, job.cache_salt, it.uuid, it.options)
                enc = self.encoder.encode(item, timings)
            except MediaError as e:
                self.metrics.requests.labels(it.modality.value, str(e.status)).inc()
                failure = Failure(e.status, e.code, f"{it.modality.value} item {it.item_index}: {e}")
                pushed = self._push_error(job, failure)
                return e.status, {
                    "error": {"message": failure.message, "code": e.code, "part_pushed": pushed}
                }
            except Exception as e:  # the dispatcher retries elsewhere: push nothing
                logger.exception("job %s part %d failed", job.request_id, job.part_index)
                self.metrics.requests.labels(it.modality.value, "500").inc()
                return 500, {"error": {"message": f"encoder failure: {e}", "code": "encoder_failed"}}
            items.append(EmbeddingItem(it.item_index, enc))
        start = time.perf_counter()
        try:
            part = build_part(
                job.request_id, job.part_index, job.num_parts, self.cfg.url, items, timings.hits
            )
            self.sender.send(job.reply_endpoint, part)
        except SendTimeout as e:
            message = f"engine at {job.reply_endpoint} did not take the part: {e}"
            return 502, {"error": {"message": message, "code": "engine_unreachable"}}
        self.metrics.transfer.observe(time.perf_counter() - start)
        self.metrics.preprocess.observe(timings.fetch_s + timings.preprocess_s)
        if timings.misses:
            self.metrics.forward.observe(timings.forward_s)
        for it in job.items:
            self.metrics.requests.labels(it.modality.value, "200").inc()
        return 200, {"items": len(items), "cache_hits": timings.hits, "encoder": self.cfg.url}

    def _push_error(self, job: EncodeJob, error: Failure) -> bool:
        """Tells the engine the part failed for a client reason; returns whether the part was handed over."""
        try:
            part = error_part(job.request_id, job.part_index, job.num_parts, self.cfg.url, error)
            self.sender.send(job.reply_endpoint, part)
        except SendTimeout:
            logger.warning("could not push an error part for %s to %s", job.request_id, job.reply_endpoint)
            return False
        return True

    @released
    def health_probe(self) -> None:
        """A real tiny encode of each of the family's modalities (bypassing the cache). Raises on failure."""
        self.encoder.health_probe(timeout_s=30)

    def cache_stats(self) -> dict[str, Any]:
        s = self.cache.stats
        return {"queries": s.queries, "hits": s.hits, "evictions": s.evictions, "bytes": self.cache.used_bytes,
                "entries": len(self.cache)}  # fmt: skip


def build_encoder_app(service: EncoderService) -> FastAPI:
    app = FastAPI(title="mmserve encoder")
    cfg = service.cfg

    @app.middleware("http")
    async def _cluster_auth(request: Request, call_next):
        # Before the body is parsed: an unauthenticated caller learns nothing about the job schema.
        if request.url.path == "/encode" and service.secret is not None:
            if not service.secret.check_token(request.headers.get(HTTP_HEADER)):
                return JSONResponse({"error": {"message": f"missing or invalid {HTTP_HEADER} (cluster secret)",
                                               "code": "invalid_cluster_token"}}, status_code=401)  # fmt: skip
        return await call_next(request)

    @app.post("/encode")
    async def encode(job: EncodeJob):
        if service.pending >= cfg.max_pending:
            service.metrics.rejected.inc()
            return JSONResponse({"error": {"message": f"encoder has {service.pending} pending jobs (limit "
                                                      f"{cfg.max_pending})", "code": "overloaded"}},
                                status_code=503, headers={"Retry-After": "1"})  # fmt: skip
        service.pending += 1
        try:
            status, body = await asyncio.to_thread(service.run_job, job, time.perf_counter())
        finally:
            service.pending -= 1
        return JSONResponse(body, status_code=status)

    @app.get("/health")
    async def health():
        try:
            await asyncio.wait_for(asyncio.to_thread(service.health_probe), timeout=30)
        except Exception as e:
            return JSONResponse({"status": "unhealthy", "reason": str(e)}, status_code=503)
        return {"status": "ok", "url": cfg.url, "pending": service.pending, "cache": service.cache_stats()}

    @app.get("/metrics")
    async def metrics():
        service.metrics.update(service)
        return Response(service.metrics.render(), media_type="text/plain; version=0.0.4")

    return app


async def register_loop(cfg: EncoderConfig, stop: asyncio.Event) -> None:
    """Register with each language server, then heartbeat so that a restarted server learns about us again.

    The first call is a registration; later calls are heartbeats, which a server ignores for an encoder that
    was explicitly unregistered there. A refusal (401: wrong or missing token; 403: the server has no secret
    and anonymous registration is off) is logged as an error once per server until it accepts us, not at
    every heartbeat.
    """
    registered: set[str] = set()
    refused: dict[str, int] = {}  # server -> status of its last refusal (already logged)
    secret = cluster_auth.from_config(cfg.cluster_secret)
    headers = secret.headers if secret else {}
    missing = "it requires a cluster secret and this encoder has none"
    reasons = {
        401: "the cluster secrets differ" if secret else missing,
        403: "it has no cluster secret and anonymous registration is off (set the same --cluster-secret on "
        "both, or start it with --enable-anonymous-registration)",
    }
    async with httpx.AsyncClient(timeout=5.0, headers=headers) as client:
        while not stop.is_set():
            for base in cfg.register_urls:
                body = {"url": cfg.url, "heartbeat": base in registered}
                try:
                    r = await client.post(base.rstrip("/") + "/register_encoder", json=body)
                    if r.status_code == 200:
                        registered.add(base)
                        refused.pop(base, None)
                    elif r.status_code in reasons and refused.get(base) != r.status_code:
                        refused[base] = r.status_code
                        reason = reasons[r.status_code]
                        logger.error("%s refused our registration (%d): %s", base, r.status_code, reason)
                except httpx.HTTPError as e:
                    logger.info("registration with %s failed: %s", base, e)
            try:
                await asyncio.wait_for(stop.wait(), cfg.register_interval_s)
            except TimeoutError:
                pass
