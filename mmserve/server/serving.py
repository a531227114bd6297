"""One request's life in the API server: send to the engine, detokenize, apply stop strings, time it.

`Generation.start()` waits for the engine to accept the request (media encoded, length checked), so errors
in the media reach the client as a proper HTTP status before any streaming starts. Iterating the
generation then yields text deltas; closing it early (stop string, client gone) aborts the engine request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from mmserve.engine.detokenizer import IncrementalDetokenizer
from mmserve.engine.sampling_params import SamplingParams
from mmserve.multimodal.precomputed import to_encode
from mmserve.server.engine_client import EngineClient, EngineDeadError
from mmserve.server.metrics import ServerMetrics
from mmserve.server.protocol import APIError
from mmserve.transport import messages as m


@dataclass
class Timings:
    queue_s: float = 0.0
    encode_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    ttft_s: float = 0.0
    e2e_s: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 6) for k, v in self.__dict__.items()}


@dataclass
class Generation:
    client: EngineClient
    tokenizer: object
    metrics: ServerMetrics
    request_id: str
    prompt_token_ids: list[int]
    media: list[m.MediaItemMsg]
    params: SamplingParams  # max_tokens None: up to the context length
    dispatcher: object | None = None  # mmserve.dispatch.dispatcher.Dispatcher
    cache_salt: str | None = None  # tenant scope of every cache (mmserve.engine.cache_salt)
    handoff: m.KvTarget | None = None  # prefill server: hand the request to this decode engine
    adopt_timeout_s: float | None = None  # decode server: the request comes from a prefill engine
    start_time: float = field(default_factory=time.perf_counter)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    mm_items: int = 0
    mm_cache_hits: int = 0  # found by the engine's local encoder
    encoded_by: list[str] = field(default_factory=list)
    timings: Timings = field(default_factory=Timings)

    async def start(self) -> None:
        """Send the request and wait until the engine accepted it. Raises APIError."""
        parts = [] if self.adopt_timeout_s is not None else self._plan_parts()
        if self.adopt_timeout_s is not None:  # decode server: the prefill server did all of the above
            req = m.AdoptReq(self.request_id, self.adopt_timeout_s)
        else:
            req = m.GenerateReq(
                self.request_id,
                self.prompt_token_ids,
                self.media,
                self.params,
                num_parts=len(parts),
                cache_salt=self.cache_salt,
                handoff=self.handoff,
            )
        try:
            self._stream = self.client.generate(req)
            pending = asyncio.ensure_future(anext(self._stream))  # sends the request to the engine first
            if parts:
                # Held here: the event loop keeps only a weak reference to a task.
                self._dispatch = asyncio.ensure_future(
                    self.dispatcher.run(self.request_id, to_encode(self.media), parts, self.cache_salt)
                )
                # Its outcome reaches the engine (parts or a FailReq); retrieve it so nothing logs it as lost.
                self._dispatch.add_done_callback(lambda t: t.cancelled() or t.exception())
            first = await pending
        except EngineDeadError as e:
            raise APIError(503, str(e), "engine_unavailable") from e
        if isinstance(first, m.ErrorMsg):
            raise APIError.of(first.failure)
        assert isinstance(first, m.AcceptedMsg)
        self.prompt_tokens = first.prompt_tokens
        self.mm_items, self.mm_cache_hits = first.mm_items, first.mm_cache_hits
        self.encoded_by = list(first.encoded_by)
        self.timings.encode_s = first.encode_s
        self.metrics.encode_time.observe(first.encode_s)

    async def handed_off(self) -> m.HandedOffMsg:
        """Prefill server: wait until the decode engine has the request. Raises APIError."""
        try:
            msg = await anext(self._stream)
        except StopAsyncIteration as e:  # cannot happen: the stream ends only after one of the two below
            raise APIError(500, "the engine ended the handoff without an answer", "internal_error") from e
        finally:
            await self._stream.aclose()
        if isinstance(msg, m.ErrorMsg):
            self.metrics.requests.labels(self.metrics.model_name, "error").inc()
            raise APIError.of(msg.failure)
        assert isinstance(msg, m.HandedOffMsg), msg
        self.cached_tokens = msg.num_cached_tokens
        self.timings.queue_s, self.timings.prefill_s = msg.queue_s, msg.prefill_s
        self.timings.ttft_s = self.timings.e2e_s = time.perf_counter() - self.start_time
        self.metrics.queue_time.observe(msg.queue_s)
        self.metrics.prefill_time.observe(msg.prefill_s)
        self.metrics.requests.labels(self.metrics.model_name, "handoff").inc()
        return msg

    def _plan_parts(self) -> list:
        """EPD parts for this request's media still to encode (precomputed embeddings never go to an encoder;
        parts index `to_encode(media)`); [] to encode in the engine. Raises APIError 503 when neither can."""
        media = to_encode(self.media)
        if not media or self.dispatcher is None:
            return []
        if self.dispatcher.engine_has_tower and len(media) < self.dispatcher.min_items:
            return []  # adaptive dispatch: too few items to be worth an encoder's round trip
        parts = self.dispatcher.plan(media)
        if parts is not None:
            return parts
        if self.dispatcher.engine_has_tower:
            return []
        raise APIError(503, "no healthy encoder is available and this server has no vision weights",
                       "encoder_unavailable", headers={"Retry-After": "1"})  # fmt: skip

    async def deltas(self) -> AsyncIterator[str]:
        """Text deltas until the request finishes; sets finish_reason and usage. Raises APIError (engine death)."""
        detok = IncrementalDetokenizer(self.tokenizer, self.params, self.prompt_token_ids)
        last_token_time = None
        try:
            async for msg in self._stream:
                if isinstance(msg, m.ErrorMsg):
                    raise APIError.of(msg.failure)
                now = time.perf_counter()
                if not msg.token_ids and msg.finish_reason is None:
                    continue
                if self.completion_tokens == 0 and msg.token_ids:
                    self.timings.ttft_s = now - self.start_time
                    self.timings.queue_s, self.timings.prefill_s = msg.queue_s, msg.prefill_s
                    self.metrics.ttft.observe(self.timings.ttft_s)
                    self.metrics.queue_time.observe(msg.queue_s)
                    self.metrics.prefill_time.observe(msg.prefill_s)
                elif last_token_time is not None and msg.token_ids:
                    self.metrics.itl.observe(now - last_token_time)
                last_token_time = now
                self.cached_tokens = msg.num_cached_tokens
                for token in msg.token_ids:
                    self.completion_tokens += 1
                    if msg.finish_reason == "stop":
                        break  # the engine stopped on EOS or a stop token id: not part of the text
                    delta = detok.add(token)
                    if delta:
                        yield delta
                    if detok.stopped:
                        self.finish_reason = "stop"
                        return  # closing the engine stream aborts the request there
                if msg.finish_reason is not None:
                    self.finish_reason = msg.finish_reason
                    tail = detok.finish()
                    if tail:
                        yield tail
                    return
        finally:
            await self._stream.aclose()
            self._record()

    def _record(self) -> None:
        now = time.perf_counter()
        self.timings.e2e_s = now - self.start_time
        if self.timings.ttft_s:
            self.timings.decode_s = max(0.0, self.timings.e2e_s - self.timings.ttft_s)
            self.metrics.decode_time.observe(self.timings.decode_s)
        if self.finish_reason is None:
            return
        self.metrics.e2e.observe(self.timings.e2e_s)
        self.metrics.prompt_tokens.inc(self.prompt_tokens)
        self.metrics.generation_tokens.inc(self.completion_tokens)
        self.metrics.prompt_tokens_hist.observe(self.prompt_tokens)
        self.metrics.generation_tokens_hist.observe(self.completion_tokens)
        self.metrics.requests.labels(self.metrics.model_name, self.finish_reason).inc()

    def extra(self) -> dict:
        """Non-standard response field with per-request timings (the OpenAI SDK keeps unknown fields).

        `mm_cache_hits` counts the items found in an embedding cache: the engine's local encoder's, or (EPD)
        the encoders', which each part's header reports; every part arrives before the request is admitted.
        """
        return {
            "timings": self.timings.as_dict(),
            "encoded_by": ", ".join(self.encoded_by) or "none",
            "mm_items": self.mm_items,
            "mm_cache_hits": self.mm_cache_hits,
        }
