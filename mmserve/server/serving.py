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
from mmserve.engine.request import choice_id
from mmserve.logprobs import TokenLogprobs
from mmserve.multimodal.precomputed import to_encode
from mmserve.sampling_params import SamplingParams
from mmserve.server.engine_client import EngineClient, EngineDeadError
from mmserve.server.metrics import ServerMetrics
from mmserve.server.protocol import APIError
from mmserve.transport import messages as m


@dataclass
class Timings:
    queue_s: float = 0.0
    encode_s: float = 0.0
    transfer_s: float = 0.0  # EPD: the last embedding part's trip to the engine (part of encode_s)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    ttft_s: float = 0.0
    e2e_s: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 6) for k, v in self.__dict__.items()}


@dataclass
class ChoiceDelta:
    """What one choice produced in one engine message."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs]  # parallel to token_ids when the request asked for logprobs
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended the choice
    index: int = 0
    # The tokens this message gave the choice, the EOS or stop token id included (return_token_ids, as vLLM)
    all_ids: list[int] = field(default_factory=list)


@dataclass
class _Choice:
    detok: IncrementalDetokenizer
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def take(self, msg: m.TokensMsg) -> ChoiceDelta:
        """Detokenize one message's tokens; a stop string or a finish ends the choice."""
        texts, ids, logprobs = [], [], []
        for k, token in enumerate(msg.token_ids):
            if msg.eos and k == len(msg.token_ids) - 1:
                break  # the engine stopped on EOS or a stop token id: not part of the text
            ids.append(token)
            if msg.logprobs is not None:
                logprobs.append(msg.logprobs[k])
            texts.append(self.detok.add(token))
            if self.detok.stopped:
                self.finish_reason, self.stop_reason = "stop", self.detok.matched_stop
                return ChoiceDelta("".join(texts), ids, logprobs, "stop", self.stop_reason, all_ids=list(ids))
        if msg.finish_reason is not None:
            self.finish_reason, self.stop_reason = msg.finish_reason, msg.stop_reason
            texts.append(self.detok.finish())
        return ChoiceDelta(
            "".join(texts), ids, logprobs, self.finish_reason, self.stop_reason, all_ids=list(msg.token_ids)
        )


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
    return_prompt_ids: bool = False  # ask the engine for the expanded prompt (`prompt_ids` once started)
    start_time: float = field(default_factory=time.perf_counter)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    mm_items: int = 0
    mm_cache_hits: int = 0  # found by the engine's local encoder
    encoded_by: list[str] = field(default_factory=list)
    item_encoders: list[str] = field(default_factory=list)  # per media item the engine encoded or received
    timings: Timings = field(default_factory=Timings)
    choices: dict[int, _Choice] = field(default_factory=dict)
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # when the params ask for them
    prompt_tail: list[int] = field(default_factory=list)  # decode server: the detokenizer's context
    prompt_ids: list[int] | None = None  # the expanded prompt (HF's ids), when `return_prompt_ids`

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
                return_prompt_ids=self.return_prompt_ids,
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
        self.prompt_tail = list(first.prompt_tail)
        self.prompt_ids = list(first.prompt_ids) if first.prompt_ids is not None else None
        self.mm_items, self.mm_cache_hits = first.mm_items, first.mm_cache_hits
        self.encoded_by = list(first.encoded_by)
        self.item_encoders = list(first.item_encoders)
        self.timings.encode_s, self.timings.transfer_s = first.encode_s, first.transfer_s
        self.metrics.encode_time.observe(first.encode_s)

    async def close(self) -> None:
        """Abort a started request that will not be iterated (a batch whose other prompt failed to start)."""
        await self._stream.aclose()

    async def handed_off(self) -> m.HandedOffMsg:
        """Prefill server: wait until the decode engine has the request. Raises APIError."""
        try:
            msg = await anext(self._stream)
        except StopAsyncIteration as e:  # cannot happen: the stream ends only after one of the two below
            raise APIError(500, "the engine ended the handoff without an answer", "internal_error") from e
        finally:
            await self._stream.aclose()
        if isinstance(msg, m.ErrorMsg):
            self.metrics.count_finished("error")
            raise APIError.of(msg.failure)
        assert isinstance(msg, m.HandedOffMsg), msg
        self.cached_tokens = msg.num_cached_tokens
        self.timings.queue_s, self.timings.prefill_s = msg.queue_s, msg.prefill_s
        self.timings.ttft_s = self.timings.e2e_s = time.perf_counter() - self.start_time
        self.metrics.record_handoff(self.timings, self.prompt_tokens, msg.num_cached_tokens)
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
        """Text deltas of a one-choice request (see `events`)."""
        async for event in self.events():
            if event.text:
                yield event.text

    async def events(self) -> AsyncIterator[ChoiceDelta]:
        """What each choice produced, message by message, until every choice finished; sets each choice's
        finish and stop reasons and the usage. Raises APIError (engine death)."""
        choices = {
            i: _Choice(IncrementalDetokenizer(self.tokenizer, self.params, self.prompt_token_ids or self.prompt_tail))
            for i in range(self.params.n)
        }
        self.choices = choices
        open_choices = set(choices)
        last_token_time: dict[int, float] = {}  # per choice, for the inter-token latency
        choice_tokens = dict.fromkeys(choices, 0)  # per choice, for the longest choice's length
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
                    self.metrics.record_first_token(self.timings, self.prompt_tokens, msg.num_cached_tokens)
                elif msg.index in last_token_time and msg.token_ids:
                    self.metrics.record_output_gap(now - last_token_time[msg.index])
                last_token_time[msg.index] = now
                if msg.index == 0:  # n > 1: the other choices reuse the first one's prompt, not the client's
                    self.cached_tokens = msg.num_cached_tokens
                if msg.prompt_logprobs is not None:
                    self.prompt_logprobs = msg.prompt_logprobs
                choice = choices.get(msg.index)
                if choice is None or msg.index not in open_choices:
                    continue  # a choice this server already ended (its stop string matched)
                event = choice.take(msg)
                self.completion_tokens += len(msg.token_ids)
                self.metrics.generation_tokens.inc(len(msg.token_ids))  # as produced, as in vLLM
                choice_tokens[msg.index] += len(msg.token_ids)
                if event.finish_reason is not None:
                    open_choices.discard(msg.index)
                    if choice.detok.stopped and msg.finish_reason is None and open_choices:
                        # one choice of several hit its stop string: end it in the engine, the rest go on
                        await self.client.abort(choice_id(self.request_id, msg.index))
                event.index = msg.index
                yield event
                if not open_choices:
                    return  # closing the engine stream aborts what is left there
        finally:
            await self._stream.aclose()
            self.finish_reason = choices[0].finish_reason if choices else None
            self._record(max(choice_tokens.values(), default=0))

    def _record(self, longest_choice_tokens: int) -> None:
        now = time.perf_counter()
        self.timings.e2e_s = now - self.start_time
        if self.timings.ttft_s:
            self.timings.decode_s = max(0.0, self.timings.e2e_s - self.timings.ttft_s)
        if self.finish_reason is not None:
            self.metrics.record_finished(
                self.finish_reason,
                self.timings,
                self.prompt_tokens,
                self.completion_tokens,
                longest_choice_tokens,
                self.params,
            )

    def extra(self) -> dict:
        """Non-standard response field with per-request timings (the OpenAI SDK keeps unknown fields).

        `mm_cache_hits` counts the items found in an embedding cache: the engine's local encoder's, or (EPD)
        the encoders', which each part's header reports; every part arrives before the request is admitted.
        `items` says who encoded each media item, in prompt order ("precomputed": the client's embedding).
        """
        encoders = iter(self.item_encoders)
        fallback = ", ".join(self.encoded_by) or "none"  # a decode server knows only the request's encoders
        items = [
            {
                "modality": it.modality,
                "encoded_by": "precomputed" if it.embedding is not None else next(encoders, fallback),
            }
            for it in self.media
        ]
        return {
            "timings": self.timings.as_dict(),
            "encoded_by": fallback,
            "mm_items": self.mm_items,
            "mm_cache_hits": self.mm_cache_hits,
            "items": items,
        }
