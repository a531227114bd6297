"""Fan a request's media out to encoder services, with failover, and keep the registry's health current.

`plan` splits a request's items over healthy encoders with the routing policy (routing key: the item's uuid
if the client gave one, else a hash of its bytes, or its URL): one part per encoder, or one per item when the
engine overlaps encode and prefill (each item then reaches the engine as soon as it is encoded, not with the
request's last). The key ignores the request's cache salt on purpose: an encoder keys its cache by the salted
content hash, so equal bytes of two tenants meet on one encoder without sharing a hit.
`run` POSTs one `/encode` job per part (with the request's cache salt) and decides each part's fate:
- 200: delivered to the engine by the encoder; done.
- 400/413: bad media; the encoder pushed an error part and the engine fails the request (no retry). Other
  4xx (nothing pushed: e.g. 422 from an encoder of another version, 401 from one with another secret) fail
  the attempt like a 5xx.
- 503 (overloaded), 5xx, connection refused, timeout: retried once on another healthy encoder; then encoded
  by the engine itself when it has a tower (`LocalEncodeReq`); otherwise the request is failed with
  503 / 502 / 504 naming the cause (`FailReq`).
Connection failures and timeouts count as strikes against the encoder (3 strikes: evicted until a health
probe succeeds); an overloaded encoder is not unhealthy.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass

import httpx

from mmserve.dispatch.policy import RoutingPolicy, plan
from mmserve.dispatch.registry import EncoderRegistry
from mmserve.multimodal.media import MediaRef
from mmserve.transport import messages as m
from mmserve.transport.messages import Failure

logger = logging.getLogger("mmserve.dispatch")


@dataclass
class Part:
    index: int
    url: str
    item_indices: list[int]


@dataclass(frozen=True)
class ReplyRoutes:
    """Which of the engine's embedding endpoints (one per transport) an encoder pushes its parts to."""

    endpoints: Mapping[str, str]  # transport scheme -> endpoint, as the engine announced them
    transport: str = "auto"  # auto: shared memory for encoders on this host (`local`), tcp for the rest
    local: frozenset[str] = frozenset()  # URLs of encoders known to share this host (--encoder-workers)

    def endpoint_for(self, url: str) -> str:
        scheme = self.transport
        if scheme == "auto":
            scheme = "shm" if url in self.local and "shm" in self.endpoints else "tcp"
        return self.endpoints[scheme]


class Dispatcher:
    def __init__(
        self,
        registry: EncoderRegistry,
        policy: RoutingPolicy,
        engine,
        routes: ReplyRoutes,
        engine_has_tower: bool,
        attempt_timeout_s: float,
        headers: dict[str, str] | None = None,
        min_items: int = 0,
        part_per_item: bool = False,
    ) -> None:
        self.registry = registry
        self.policy = policy
        self.engine = engine  # EngineClient: send LocalEncodeReq / FailReq
        self.routes = routes
        self.min_items = min_items  # fewer media items: encoded by the engine's own tower (adaptive dispatch)
        # Each item its own part (job), pushed as soon as it is encoded, so that the engine prefills the prompt
        # up to the next missing item meanwhile (encode-prefill overlap), even when one encoder has them all.
        self.part_per_item = part_per_item
        self.engine_has_tower = engine_has_tower
        self.attempt_timeout_s = attempt_timeout_s
        self.http = httpx.AsyncClient(timeout=attempt_timeout_s, headers=headers)  # headers: cluster token
        self.failovers = 0
        self.local_fallbacks = 0

    async def close(self) -> None:
        await self.http.aclose()

    def plan(self, media: list[m.MediaItemMsg]) -> list[Part] | None:
        """Parts for this request's items still to encode (the caller passes `precomputed.to_encode(media)`:
        a client's precomputed embedding never goes to an encoder), or None when no encoder is healthy."""
        assert all(it.embedding is None for it in media), "precomputed embeddings are never dispatched"
        candidates = self.registry.healthy()
        if not candidates:
            return None
        keys = [_routing_key(item) for item in media]
        assignment = plan(self.policy, keys, candidates)
        if self.part_per_item:
            owner = {i: url for url, items in assignment.items() for i in items}
            return [Part(i, owner[i], [i]) for i in range(len(media))]
        return [Part(i, url, items) for i, (url, items) in enumerate(assignment.items())]

    async def run(
        self, request_id: str, media: list[m.MediaItemMsg], parts: list[Part], cache_salt: str | None = None
    ) -> int:
        """Settle every part; returns how many items the encoders found in their caches. `cache_salt` goes
        with every job: encoders hash it into each item, so their caches never serve one salt to another."""
        hits = await asyncio.gather(
            *(self._run_part(request_id, media, part, len(parts), cache_salt) for part in parts)
        )
        return sum(hits)

    async def _run_part(
        self, request_id: str, media: list[m.MediaItemMsg], part: Part, num_parts: int, cache_salt: str | None
    ) -> int:
        outcome = await self._attempt(request_id, media, part, num_parts, part.url, cache_salt)
        if isinstance(outcome, int):
            return outcome
        others = [e for e in self.registry.healthy() if e.url != part.url]
        if others:
            self.failovers += 1
            retry = plan(self.policy, [_routing_key(media[i]) for i in part.item_indices[:1]], others)
            url = next(iter(retry))
            logger.warning(
                "request %s part %d: %s; retrying on %s", request_id, part.index, outcome.message, url
            )
            outcome = await self._attempt(request_id, media, part, num_parts, url, cache_salt)
            if isinstance(outcome, int):
                return outcome
        if self.engine_has_tower:
            self.local_fallbacks += 1
            logger.warning(
                "request %s part %d: %s; encoding locally", request_id, part.index, outcome.message
            )
            await self.engine.send(m.LocalEncodeReq(request_id, part.index, num_parts, part.item_indices))
        else:
            await self.engine.send(m.FailReq(request_id, outcome))
        return 0

    async def _attempt(
        self,
        request_id: str,
        media: list[m.MediaItemMsg],
        part: Part,
        num_parts: int,
        url: str,
        cache_salt: str | None,
    ) -> Failure | int:
        """One POST /encode. An int (cache hits) when the part is settled (delivered, or a client error the
        engine reports), else why it failed (the status is what the client gets if nothing else can encode
        the part)."""
        items = [_job_item(i, media[i]) for i in part.item_indices]
        job = {"request_id": request_id, "part_index": part.index, "num_parts": num_parts,
               "reply_endpoint": self.routes.endpoint_for(url), "items": items}  # fmt: skip
        if cache_salt is not None:  # omitted when unsalted: an unsalted job is unchanged
            job["cache_salt"] = cache_salt
        self.registry.acquire(url)
        try:
            r = await self.http.post(url + "/encode", json=job)
        except httpx.TimeoutException:
            self.registry.record_failure(url)
            return Failure(
                504, "encoder_timeout", f"encoder {url} did not answer in {self.attempt_timeout_s}s"
            )
        except httpx.HTTPError as e:
            self.registry.record_failure(url)
            return Failure(502, "encoder_unreachable", f"encoder {url} is unreachable: {type(e).__name__}")
        finally:
            self.registry.release(url)
        if r.status_code == 200:
            self.registry.record_success(url)
            return int(r.json().get("cache_hits", 0))
        if r.status_code == 401:  # a misconfigured encoder (other secret): treat it as failed, loudly
            self.registry.record_failure(url)
            logger.error("encoder %s refused our cluster token: the cluster secrets differ", url)
            return Failure(502, "encoder_auth_failed", f"encoder {url} refused the cluster token")
        if 400 <= r.status_code < 500 and _error_part_pushed(r):
            return 0  # bad media: the encoder pushed an error part, the engine ends the request with it
        if 400 <= r.status_code < 500:  # e.g. 422 from an encoder of another version: nothing was pushed
            self.registry.record_failure(url)
            return Failure(502, "encoder_error", f"encoder {url} refused the job: HTTP {r.status_code} "
                                                     f"{r.text[:200]}")  # fmt: skip
        if r.status_code == 503:
            return Failure(503, "encoders_overloaded", f"encoder {url} is overloaded")
        self.registry.record_failure(url)
        return Failure(502, "encoder_error", f"encoder {url} failed with HTTP {r.status_code}")

    async def probe_forever(self) -> None:
        """Health-probe every known encoder each interval; evict / revive / drop through the registry."""
        cfg = self.registry.config
        async with httpx.AsyncClient(timeout=cfg.probe_timeout_s) as http:
            while True:
                await asyncio.gather(*(self._probe(http, url) for url in self.registry.urls_to_probe()))
                for url in self.registry.expire():
                    logger.warning("encoder %s dropped after being unhealthy for %ss", url, cfg.drop_after_s)
                await asyncio.sleep(cfg.probe_interval_s)

    async def _probe(self, http: httpx.AsyncClient, url: str) -> None:
        try:
            r = await http.get(url + "/health")
            ok = r.status_code == 200
        except httpx.HTTPError:
            ok = False
        if ok:
            self.registry.record_success(url, r.json().get("cache"))
        else:
            self.registry.record_failure(url)


def _error_part_pushed(r: httpx.Response) -> bool:
    try:
        return bool(r.json()["error"]["part_pushed"])
    except (ValueError, KeyError, TypeError):
        return False


def _job_item(index: int, item: m.MediaItemMsg) -> dict:
    job_item = {"item_index": index, "modality": item.modality, "url": item.url, "settings": item.settings}
    # Omitted when unset: the job of an item without them is unchanged (and an older encoder, which would
    # refuse them, still takes it).
    if item.uuid is not None:
        job_item["uuid"] = item.uuid
    if item.options:
        job_item["options"] = item.options
    return job_item


def _routing_key(item: m.MediaItemMsg) -> bytes:
    # An item with a uuid is keyed by it, with or without its media: a reference then goes to the encoder
    # that cached the item (cache affinity), as a repeated image does.
    if item.uuid is not None:
        return b"uuid\0" + item.uuid.encode()
    if item.data is not None:
        return MediaRef.from_bytes(item.data).routing_key()
    try:
        return MediaRef.parse(item.url or "").routing_key()
    except Exception:  # a malformed reference still needs a key; its encoder will report the error
        return (item.url or "").encode()
