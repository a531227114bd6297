"""Offline Python API shaped like vLLM's: `LLM(model, **options)`, `.chat(...)`, `.generate(...)`.

All requests of one call run concurrently through the same scheduler loop. Every prompt of a call is
checked (token ids inside the vocabulary, `limit_mm_per_prompt`) before any of them is encoded or queued,
so a bad prompt fails the call with nothing run. Stop strings are handled here, by one incremental
detokenizer per choice (the engine works on token ids only): a choice whose stop string matched is ended
in the engine alone, its siblings (n > 1) go on. Results: mmserve.outputs (vLLM's shapes).
"""

from __future__ import annotations

import itertools
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from mmserve.encoder.runner import EncodeTimings, MediaInput, build_encoder
from mmserve.engine.cache_salt import check_cache_salt
from mmserve.engine.detokenizer import IncrementalDetokenizer
from mmserve.engine.engine import BatchFailed, Engine
from mmserve.engine.request import Request
from mmserve.llm_inputs import Prompt, check_mm_limits, check_prompts, engine_config, generate_prompt
from mmserve.models.loader import load_tokenizer
from mmserve.multimodal.items import Modality
from mmserve.multimodal.media import MediaRef
from mmserve.multimodal.messages import MediaPart, parse_messages
from mmserve.multimodal.precomputed import EmbedsRef, build_item
from mmserve.outputs import ChoiceState, RequestOutput, TokenText, prompt_logprob_dicts
from mmserve.sampling_params import SamplingParams

logger = logging.getLogger("mmserve")


def _metrics(reqs: list[Request]) -> dict[str, float]:
    req = reqs[0]  # the choice that prefilled the prompt
    timings = req.encode_timings
    encode = timings.total_s if timings is not None else 0.0
    scheduled = req.first_scheduled_time or req.arrival_time
    first = req.first_token_time or scheduled
    end = max((r.finish_time or first for r in reqs), default=first)
    return {
        "encode_s": encode,
        "queue_s": scheduled - req.arrival_time,
        "prefill_s": first - scheduled,
        "decode_s": end - first,
        "e2e_s": encode + end - req.arrival_time,
    }


@dataclass
class _Running:
    """One prompt of a call in the engine: its choices' requests and what they produced."""

    prompt: Prompt
    reqs: list[Request]
    choices: list[ChoiceState]
    prompt_logprobs: list | None = None

    @property
    def done(self) -> bool:
        return all(r.finished for r in self.reqs)


class LLM:
    """`LLM(model, limit_mm_per_prompt=None, seed=None, **options)`.

    `options` are EngineConfig / MediaConfig fields (the CLI's engine flags: dtype, max_model_len,
    max_num_seqs, max_num_batched_tokens, kv_cache_mb, allowed_local_media_path, mm_processor_kwargs ...) and
    vLLM's `enable_prefix_caching`; any other keyword is a TypeError. `limit_mm_per_prompt` ({"image": 2})
    bounds the items of each modality in one prompt (a modality not named is unbounded). `seed` makes the
    sampling of requests without their own seed reproducible from run to run (as vLLM's).
    """

    def __init__(
        self,
        model: str,
        *,
        limit_mm_per_prompt: dict[str, int] | None = None,
        seed: int | None = None,
        **options: Any,
    ) -> None:
        self.limit_mm_per_prompt = check_mm_limits(limit_mm_per_prompt or {})
        cfg = engine_config(model, options)
        self.engine = Engine(cfg)
        # The local encoder is the engine's peer, not part of it (as in the server's engine process).
        self.encoder = (
            None
            if cfg.language_only
            else build_encoder(
                self.engine.family,
                cfg.dtype,
                cfg.device,
                cfg.embedding_cache_mb,
                cfg.media,
                pack_weights=cfg.pack_weights,
                fp32_gemm=cfg.fp32_gemm,
                cpu_kernels=cfg.cpu_kernels,
                quantization=cfg.quantization if cfg.quantize_tower else None,
            )
        )
        self.tokenizer = load_tokenizer(cfg.model)
        self._ids = itertools.count()
        self._seeds = random.Random(seed) if seed is not None else None

    def get_tokenizer(self):
        return self.tokenizer

    # -- public API -----------------------------------------------------------------------------
    def chat(
        self,
        messages: list,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """One output per conversation (a list of OpenAI-style messages; a list of them for a batch), in
        order. Content parts as the server's (mmserve.multimodal.messages), plus `image_pil` (a PIL image).
        `cache_salt` scopes the cache hits of every conversation of this call (mmserve.engine.cache_salt)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conversation in conversations:
            template, media = parse_messages(conversation, allow_pil=True)
            text = self.tokenizer.apply_chat_template(
                template,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **(chat_template_kwargs or {}),
            )
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            prompts.append(Prompt(text, ids, media, cache_salt))
        return self._run(prompts, sampling_params, use_tqdm)

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
    ) -> list[RequestOutput]:
        """Raw prompts: strings, token id lists, or {"prompt" | "prompt_token_ids", "multi_modal_data",
        "cache_salt"}; one or a list.

        `cache_salt` (optional, as in vLLM) scopes the prompt's cache hits (mmserve.engine.cache_salt).
        `multi_modal_data` maps "image" / "video" / "audio" to one item or a list (URL strings, bytes, PIL
        images, `(samples, sample_rate)` audio); the prompt must hold one placeholder token per item.
        """
        if isinstance(prompts, str | dict) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prepared = [generate_prompt(i, p, self.tokenizer) for i, p in enumerate(prompts)]
        return self._run(prepared, sampling_params, use_tqdm)

    # -- the loop -------------------------------------------------------------------------------
    def encode(
        self, media: list[tuple[Modality, MediaPart | MediaRef | EmbedsRef]], cache_salt: str | None = None
    ) -> tuple[list, EncodeTimings]:
        """Encode one prompt's media (in order) with the local encoder, hashed with `cache_salt`; precomputed
        embeddings (`image_embeds` ... parts) are checked against the family instead. Raises MediaError
        naming the item."""
        timings = EncodeTimings()
        if not media:
            return [], timings
        family = self.engine.family
        media = [(mod, MediaPart(p) if isinstance(p, MediaRef) else p) for mod, p in media]  # a bare ref: no uuid
        pairs = list(zip(media, family.item_settings([mod for mod, _ in media]), strict=True))
        inputs = [
            MediaInput(mod, part.ref, s, cache_salt, part.uuid, part.options)
            for (mod, part), s in pairs
            if not isinstance(part, EmbedsRef)
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

    def _params(self, count: int, sampling_params) -> list[SamplingParams]:
        if isinstance(sampling_params, list | tuple):
            params = list(sampling_params)
        else:
            params = [sampling_params or SamplingParams()] * count
        if len(params) != count:
            raise ValueError(f"{len(params)} sampling params for {count} prompts")
        if self._seeds is not None:  # the LLM's seed: each unseeded request its own reproducible stream
            params = [
                p if p.seed is not None else msgspec.structs.replace(p, seed=self._seeds.randrange(2**32))
                for p in params
            ]
        return params

    def _run(self, prompts: list[Prompt], sampling_params, use_tqdm) -> list[RequestOutput]:
        params = self._params(len(prompts), sampling_params)
        check_prompts(prompts, self.engine.model_config.vocab_size, self.limit_mm_per_prompt)
        running: dict[str, _Running] = {}
        try:
            for prompt, p in zip(prompts, params, strict=True):
                running.update(self._add(prompt, p))
        except Exception as e:
            for rid in running:
                self.engine.abort(rid)
            e.add_note(f"(prompt {len(running)}; no prompt of this call was run)")
            raise
        bar = _progress(use_tqdm, len(running))
        try:
            self._drive(running, bar)
        except BaseException:  # e.g. KeyboardInterrupt: leave no request behind for the next call to run
            for rid in running:
                self.engine.abort(rid)
            raise
        finally:
            bar.close()
        decode = TokenText(self.tokenizer)
        return [
            RequestOutput(
                rid,
                run.prompt.text,
                list(run.reqs[0].prompt_ids),
                None if run.prompt_logprobs is None else prompt_logprob_dicts(run.prompt_logprobs, decode),
                [c.output(decode) for c in run.choices],
                True,
                _metrics(run.reqs),
                run.reqs[0].num_cached_tokens,
            )
            for rid, run in running.items()
        ]

    def _add(self, prompt: Prompt, params: SamplingParams) -> dict[str, _Running]:
        rid = f"llm-{next(self._ids)}"
        check_cache_salt(prompt.cache_salt)  # before encoding: the salt enters every item's hash
        items, timings = self.encode(prompt.media, prompt.cache_salt)
        first = self.engine.add_request(rid, prompt.token_ids, params, items, cache_salt=prompt.cache_salt)
        reqs = list(self.engine.groups.get(rid, [first]))
        for req in reqs:
            req.encode_timings = timings
        choices = [
            ChoiceState(
                i,
                IncrementalDetokenizer(self.tokenizer, params, prompt.token_ids),
                params.include_stop_str_in_output,
                params.logprobs is not None,
            )
            for i in range(params.n)
        ]
        return {rid: _Running(prompt, reqs, choices)}

    def _drive(self, running: dict[str, _Running], bar) -> None:
        """Step the engine until every request of the call ended, feeding each choice its tokens."""
        pending = set(running)
        while self.engine.has_work:
            touched = set()
            try:
                outputs = self.engine.step()
            except BatchFailed as e:  # those requests ended with finish_reason "error"; the others go on
                logger.exception("a batch failed")
                self.engine.check_integrity()
                outputs, touched = [], set(e.request_ids)
            for out in outputs:
                req = out.request
                run = running.get(req.group_id)
                if run is None:
                    continue
                touched.add(req.group_id)
                if out.prompt_logprobs and run.prompt_logprobs is None:
                    run.prompt_logprobs = out.prompt_logprobs
                choice = run.choices[req.index]
                stop_reason = req.stop_reason if out.finish_reason == "stop" else None
                if choice.take(
                    out.token_id, out.logprobs, out.finish_reason, stop_reason, req.stopped_on_token
                ):
                    self.engine.abort(out.request_id, reason="stop")  # this choice only (its own id)
            for rid in touched & pending:
                if running[rid].done:
                    pending.discard(rid)
                    bar.update(1)
        for run in running.values():  # ended without a final output: a failed batch, an abort
            for choice, req in zip(run.choices, run.reqs, strict=True):
                choice.finish(req.finish_reason or "abort", req.stop_reason)


class _NoProgress:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(use_tqdm: bool | Callable[..., Any], total: int):
    """vLLM's `use_tqdm`: True for a tqdm bar (shown on a terminal only), False for none, or a tqdm-like
    factory."""
    if not use_tqdm:
        return _NoProgress()
    if callable(use_tqdm):
        return use_tqdm(total=total, desc="Processed prompts")
    from tqdm import tqdm

    return tqdm(total=total, desc="Processed prompts", unit="prompt", disable=None)  # None: off unless a TTY
