"""The language engine: scheduler + model runner + sampler. It holds no tower: encoders are its peers.

`add_request` takes a request's prompt (one placeholder token per item) and its items already encoded
(`ItemEmbedding`s, from a local encoder or from encoder services: the one entrance for every mode),
validates them against the model family, expands placeholders into pad values, computes positions once,
and queues it. `step` runs one scheduled forward, samples, applies finish rules and returns what each
request produced. Single-threaded: the owner calls `add_request`, `abort` and `step` from one thread.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from mmserve.config import EngineConfig, ModelConfig
from mmserve.engine.cache_salt import check_cache_salt
from mmserve.engine.kv_pool import KVPool
from mmserve.engine.model_runner import ModelRunner
from mmserve.engine.radix_cache import NoPrefixCache, RadixCache
from mmserve.engine.request import Request
from mmserve.engine.sampler import Sampler, make_generator
from mmserve.engine.sampling_params import SamplingParams
from mmserve.engine.scheduler import Scheduler, SchedulerConfig
from mmserve.models.family import ModelFamily, check_pixel_limit, load_family
from mmserve.models.loader import load_hf_config, parse_dtype
from mmserve.multimodal.embedding import PlacedEmbedding
from mmserve.multimodal.items import ItemEmbedding, MultimodalItem

logger = logging.getLogger(__name__)


class BatchFailed(RuntimeError):
    """A step's forward or sampling raised; the batch's requests were ended with finish reason "error"."""

    def __init__(self, request_ids: list[str], cause: Exception) -> None:
        super().__init__(f"step failed for {len(request_ids)} request(s): {type(cause).__name__}: {cause}")
        self.request_ids = request_ids


@dataclass
class StepOutput:
    request_id: str
    token_id: int | None  # None when the request ended without a new token (abort)
    finish_reason: str | None  # "stop" / "length" / "abort" once finished
    request: Request
    handoff: bool = False  # prefill server: the request is detached, its KV to be sent (mmserve.disagg)


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def build_kv_pool(cfg: EngineConfig, model: ModelConfig) -> KVPool:
    device, dtype = torch.device(cfg.device), parse_dtype(cfg.dtype)
    if cfg.kv_cache_mb is not None:
        budget = int(cfg.kv_cache_mb * 1024 * 1024)
    else:
        budget = int(available_memory_bytes(device) * cfg.kv_cache_memory_fraction)
    per_token = KVPool.bytes_per_token(model.num_layers, model.num_kv_heads, model.head_dim, dtype)
    if budget < per_token:
        raise ValueError(f"KV cache budget of {budget} bytes holds no token ({per_token} bytes per token)")
    return KVPool.from_budget(budget, model.num_layers, model.num_kv_heads, model.head_dim, dtype, device)


class Engine:
    def __init__(self, cfg: EngineConfig, family: ModelFamily | None = None) -> None:
        self.cfg = cfg
        hf_config = load_hf_config(cfg.model)
        self.family = family or load_family(cfg.model, hf_config, dict(cfg.mm_processor_kwargs))
        self.model_config = ModelConfig.from_hf(cfg.model, hf_config, cfg.max_model_len)
        self.runner = ModelRunner(self.family, self.model_config, cfg.dtype, cfg.device)
        self.pool = build_kv_pool(cfg, self.model_config)
        # A decode server never prefills, so a prefix cache would only hold slots (mmserve.disagg).
        no_prefix = cfg.disable_prefix_cache or cfg.disaggregation_mode == "decode"
        prefix_cache = NoPrefixCache() if no_prefix else RadixCache(self.pool)
        sched_cfg = SchedulerConfig(
            cfg.max_num_batched_tokens, cfg.max_num_seqs, self.model_config.max_model_len
        )
        self.scheduler = Scheduler(sched_cfg, self.pool, prefix_cache)
        self.sampler = Sampler()
        self.requests: dict[str, Request] = {}
        per_token = KVPool.bytes_per_token(self.model_config.num_layers, self.model_config.num_kv_heads,
                                           self.model_config.head_dim, parse_dtype(cfg.dtype))  # fmt: skip
        logger.info(
            "KV cache: %d tokens, %.1f MB (%d bytes per token); max model len %d",
            self.pool.num_slots, self.pool.num_slots * per_token / 2**20, per_token, self.model_config.max_model_len,
        )  # fmt: skip

    # -- requests -------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        items: list[ItemEmbedding],
        cache_salt: str | None = None,
        handoff: object | None = None,
    ) -> Request:
        """Queue a request whose prompt has one placeholder token per item; `items` in prompt order.

        With `handoff` (a KvTarget, prefill server), the request stops after its first token: `step` reports it
        with `handoff=True` and keeps its slots until `end_handoff`.

        `params.max_tokens` None means the rest of the context, as far as the KV cache can hold it.
        `cache_salt` scopes the request's prefix-cache hits (mmserve.engine.cache_salt); its items must have
        been hashed with the same salt (the encoder's `item_hash`).
        Raises EmbeddingMismatch (an item does not fit this model), MediaTooLargeError (pixel limit) or
        ValueError (bad prompt / too long); nothing is queued then.
        """
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        check_cache_salt(cache_salt)
        for item in items:
            self.family.check_item(item)
        check_pixel_limit(self.family, items, self.cfg.max_mm_pixels_per_prompt)
        expanded = self.family.expand(prompt_token_ids, [MultimodalItem.of(it) for it in items])
        prompt_len = len(expanded.token_ids)
        limit = self.cfg.max_prompt_tokens
        if limit is not None and prompt_len > limit:
            raise ValueError(f"prompt has {prompt_len} tokens (media expanded); this server allows "
                             f"at most {limit} (--max-prompt-tokens)")  # fmt: skip
        if params.max_tokens is None:
            room = min(self.model_config.max_model_len, self.pool.num_slots) - prompt_len
            params = params.with_max_tokens(max(1, room))
        self.scheduler.check_fits(prompt_len, params.max_tokens)
        positions, rope_delta = self.family.positions(expanded)
        ids = torch.tensor(expanded.token_ids, dtype=torch.int64)
        by_hash = {it.content_hash: it for it in items}
        embeddings = [
            PlacedEmbedding.at(ids, it.offset, it.span, it.pad_value, by_hash[it.content_hash].tensors)
            for it in expanded.items
        ]
        req = Request(
            request_id, expanded.token_ids, params, items=expanded.items, embeddings=embeddings,
            positions=positions, rope_delta=rope_delta, generator=make_generator(params),
            cache_salt=cache_salt, handoff=handoff,
        )  # fmt: skip
        self.scheduler.add(req)
        self.requests[request_id] = req
        return req

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """End a request now, freeing all it holds. Unknown or finished ids are ignored."""
        req = self.requests.pop(request_id, None)
        if req is not None:
            self.scheduler.finish(req, reason)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # -- one step -------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """One forward over the next batch. Raises BatchFailed (its requests already ended) if the forward or
        the sampler fails: one bad batch must not take the whole engine down."""
        chunks = self.scheduler.schedule()
        if not chunks:
            return []
        try:
            return self._run(chunks)
        except Exception as e:
            for chunk in chunks:
                self.scheduler.fail(chunk)
                self.requests.pop(chunk.request.request_id, None)
            raise BatchFailed([c.request.request_id for c in chunks], e) from e

    def _run(self, chunks: list) -> list[StepOutput]:
        logits = self.runner.forward(chunks, self.pool)
        for chunk in chunks:  # share finished prompts now, not at the end: concurrent requests reuse them
            if chunk.start < chunk.request.prompt_len <= chunk.end:
                self.scheduler.cache_prompt(chunk.request)
        sampled_reqs = [c.request for c in chunks if c.samples]
        tokens = self.sampler(logits, [r.params for r in sampled_reqs], [r.generator for r in sampled_reqs])
        outputs = []
        for req, token in zip(sampled_reqs, tokens.tolist(), strict=True):
            req.append_output(token)
            reason = self._finish_reason(req, token)
            if req.handoff is not None:  # the decode engine continues (or just reports `reason`)
                self.scheduler.detach(req)
                self.requests.pop(req.request_id, None)
                outputs.append(StepOutput(req.request_id, token, reason, req, handoff=True))
                continue
            if reason is not None:
                self.scheduler.finish(req, reason)
                self.requests.pop(req.request_id, None)
            outputs.append(StepOutput(req.request_id, token, reason, req))
        return outputs

    def _finish_reason(self, req: Request, token: int) -> str | None:
        params = req.params
        if token in params.stop_token_ids or (
            not params.ignore_eos and token in self.model_config.eos_token_ids
        ):
            return "stop"
        if len(req.output_ids) >= params.max_tokens or len(req.token_ids) >= self.model_config.max_model_len:
            return "length"
        return None

    # -- prefill-decode handoff (mmserve.disagg) -------------------------------------------------
    def end_handoff(self, req: Request, ok: bool) -> None:
        """Prefill side: the request's KV reached the decode engine (or never will): free its slots, its
        prompt staying in the prefix cache for the next request that shares it."""
        self.scheduler.finish(req, "handoff" if ok else "error")

    def adopt(self, req: Request, slots) -> None:
        """Decode side: a handed-off request (`recomputable=False`, one output token) whose prompt KV is in
        `slots` (reserved through the scheduler) continues decoding here."""
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        self.scheduler.adopt(req, slots)
        self.requests[req.request_id] = req

    def take_dropped(self) -> list[Request]:
        """Requests ended because the pool ran out and they could not be recomputed (decode server)."""
        dropped = self.scheduler.take_dropped()
        for req in dropped:
            self.requests.pop(req.request_id, None)
        return dropped

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
