"""Offline Python API shaped like vLLM's: `LLM(model, **engine_config)`, `.chat(...)`, `.generate(...)`.

All requests of one call run concurrently through the same scheduler loop. Stop strings are handled here,
by each request's incremental detokenizer (the engine works on token ids only).
"""

from __future__ import annotations

import io
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any

from mmserve.config import EngineConfig, MediaConfig
from mmserve.encoder.runner import EncodeTimings, MediaInput, build_encoder
from mmserve.engine.cache_salt import check_cache_salt
from mmserve.engine.detokenizer import IncrementalDetokenizer
from mmserve.engine.engine import BatchFailed, Engine
from mmserve.engine.sampling_params import SamplingParams
from mmserve.models.loader import load_tokenizer, resolve_model_path
from mmserve.multimodal.items import Modality
from mmserve.multimodal.media import MediaRef
from mmserve.multimodal.messages import parse_messages
from mmserve.multimodal.precomputed import EmbedsRef, build_item

logger = logging.getLogger("mmserve")


@dataclass
class RequestOutput:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_token_ids: list[int] = field(repr=False)  # expanded (item tokens are pad values)
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(
        default_factory=dict
    )  # seconds: encode, queue, prefill (to 1st token), e2e


def _metrics(req) -> dict[str, float]:
    timings = req.encode_timings
    encode = timings.total_s if timings is not None else 0.0
    scheduled = req.first_scheduled_time or req.arrival_time
    first = req.first_token_time or scheduled
    end = req.finish_time or first
    return {"encode_s": encode, "queue_s": scheduled - req.arrival_time, "prefill_s": first - scheduled,
            "decode_s": end - first, "e2e_s": encode + end - req.arrival_time}  # fmt: skip


def _media_ref(value: Any) -> MediaRef:
    if isinstance(value, MediaRef):
        return value
    if isinstance(value, str):
        return MediaRef.parse(value)
    if isinstance(value, bytes | bytearray):
        return MediaRef.from_bytes(bytes(value))
    if hasattr(value, "save"):  # a PIL image: hand the encoder lossless bytes
        buf = io.BytesIO()
        value.save(buf, format="PNG")
        return MediaRef.from_bytes(buf.getvalue())
    if isinstance(value, tuple) and len(value) == 2:  # audio as vLLM takes it: (samples, sample rate)
        # Written as WAV: the encoder keys its cache on an item's bytes, and decodes / resamples them itself.
        import soundfile

        buf = io.BytesIO()
        soundfile.write(buf, value[0], int(value[1]), format="WAV", subtype="FLOAT")
        return MediaRef.from_bytes(buf.getvalue())
    raise ValueError(f"unsupported media value of type {type(value).__name__}")


class LLM:
    def __init__(self, model: str, **engine_config: Any) -> None:
        media = engine_config.pop("media", None)
        if media is None:
            media_keys = set(MediaConfig.__dataclass_fields__) & set(engine_config)
            media = MediaConfig(**{k: engine_config.pop(k) for k in media_keys})
        kwargs = dict(engine_config)
        if isinstance(kwargs.get("mm_processor_kwargs"), dict):
            kwargs["mm_processor_kwargs"] = tuple(kwargs["mm_processor_kwargs"].items())
        path = resolve_model_path(model)
        cfg = EngineConfig(model=path, media=media, **kwargs)
        self.engine = Engine(cfg)
        # The local encoder is the engine's peer, not part of it (as in the server's engine process).
        self.encoder = (
            None
            if cfg.language_only
            else build_encoder(self.engine.family, cfg.dtype, cfg.device, cfg.embedding_cache_mb, media)
        )
        self.tokenizer = load_tokenizer(path)
        self._ids = itertools.count()

    # -- public API -----------------------------------------------------------------------------
    def chat(
        self,
        conversations: list,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        cache_salt: str | None = None,
    ):
        """One output per conversation (a list of OpenAI-style messages), in order. `cache_salt` scopes the
        cache hits of every conversation of this call (mmserve.engine.cache_salt)."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = []
        for messages in conversations:
            template, media = parse_messages(messages)
            text = self.tokenizer.apply_chat_template(template, add_generation_prompt=True, tokenize=False)
            prompts.append((self.tokenizer(text, add_special_tokens=False)["input_ids"], media, cache_salt))
        return self._run(prompts, sampling_params)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None):
        """Raw prompts: strings, token id lists, or {"prompt" | "prompt_token_ids", "multi_modal_data",
        "cache_salt"}.

        `cache_salt` (optional, as in vLLM) scopes the prompt's cache hits (mmserve.engine.cache_salt).
        `multi_modal_data` maps "image" / "video" / "audio" to one item or a list (URL strings, bytes, PIL
        images, `(samples, sample_rate)` audio); the prompt must hold one placeholder token per item.
        """
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        prepared = []
        for prompt in prompts:
            if isinstance(prompt, str):
                prompt = {"prompt": prompt}
            elif isinstance(prompt, list):
                prompt = {"prompt_token_ids": prompt}
            ids = prompt.get("prompt_token_ids")
            if ids is None:
                ids = self.tokenizer(prompt["prompt"], add_special_tokens=False)["input_ids"]
            media = []
            for key, values in (prompt.get("multi_modal_data") or {}).items():
                values = values if isinstance(values, list) else [values]
                media.extend((Modality(key), _media_ref(v)) for v in values)
            prepared.append((list(ids), media, prompt.get("cache_salt")))
        return self._run(prepared, sampling_params)

    # -- the loop -------------------------------------------------------------------------------
    def encode(
        self, media: list[tuple[Modality, MediaRef | EmbedsRef]], cache_salt: str | None = None
    ) -> tuple[list, EncodeTimings]:
        """Encode one prompt's media (in order) with the local encoder, hashed with `cache_salt`; precomputed
        embeddings (`image_embeds` ... parts) are checked against the family instead. Raises MediaError
        naming the item."""
        timings = EncodeTimings()
        if not media:
            return [], timings
        family = self.engine.family
        pairs = list(zip(media, family.item_settings([mod for mod, _ in media]), strict=True))
        inputs = [
            MediaInput(mod, ref, s, cache_salt) for (mod, ref), s in pairs if not isinstance(ref, EmbedsRef)
        ]
        if inputs and self.encoder is None:
            raise ValueError("this LLM was built with language_only=True and cannot encode media")
        limit = self.engine.cfg.max_mm_pixels_per_prompt
        encoded = iter(self.encoder.encode_all(inputs, timings, limit) if inputs else [])
        max_bytes = self.engine.cfg.media.max_media_bytes
        items = [
            build_item(family, mod, ref, s, max_bytes, cache_salt)
            if isinstance(ref, EmbedsRef)
            else next(encoded)
            for (mod, ref), s in pairs
        ]
        return items, timings

    def check_integrity(self) -> None:
        self.engine.check_integrity()
        if self.encoder is not None:
            self.encoder.check_integrity()

    def _run(self, prompts: list[tuple[list[int], list, str | None]], sampling_params) -> list[RequestOutput]:
        params = (
            sampling_params
            if isinstance(sampling_params, list)
            else [sampling_params or SamplingParams()] * len(prompts)
        )
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        order, detoks, reqs = [], {}, {}
        try:
            for (ids, media, salt), p in zip(prompts, params, strict=True):
                rid = f"llm-{next(self._ids)}"
                check_cache_salt(salt)  # before encoding: the salt enters every item's hash
                items, timings = self.encode(media, salt)
                reqs[rid] = self.engine.add_request(rid, ids, p, items, cache_salt=salt)
                reqs[rid].encode_timings = timings
                detoks[rid] = IncrementalDetokenizer(self.tokenizer, p)
                order.append(rid)
        except Exception:
            for rid in order:
                self.engine.abort(rid)
            raise
        while self.engine.has_work:
            try:
                outputs = self.engine.step()
            except BatchFailed:  # those requests ended with finish_reason "error"; the others go on
                logger.exception("a batch failed")
                self.engine.check_integrity()
                continue
            for out in outputs:
                det = detoks.get(out.request_id)
                if det is None or out.token_id is None:
                    continue
                det.add(out.token_id)
                if det.stopped and out.finish_reason is None:
                    self.engine.abort(out.request_id, reason="stop")
        results = []
        for rid in order:
            req, det = reqs[rid], detoks[rid]
            if not det.stopped:
                det.finish()
            results.append(RequestOutput(rid, det.text, list(req.output_ids), req.finish_reason or "abort",
                                         req.prompt_ids, req.num_cached_tokens, _metrics(req)))  # fmt: skip
        return results
