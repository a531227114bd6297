"""The language engine: scheduler + model runner + sampler. It holds no tower: encoders are its peers.

`add_request` takes a request's prompt (one placeholder token per item) and its items already encoded
(`ItemEmbedding`s, from a local encoder or from encoder services: the one entrance for every mode),
validates them against the model family, expands placeholders into pad values, computes positions once,
and queues it. `step` runs one scheduled forward, samples, applies finish rules and returns what each
request produced. Single-threaded: the owner calls `add_request`, `abort` and `step` from one thread.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging

import torch

from mmserve.config import EngineConfig, ModelConfig
from mmserve.engine.cache.budget import build_kv_pools, build_state_pool
from mmserve.engine.cache.kv_pool import KVPool
from mmserve.engine.cache.radix_cache import NoPrefixCache, RadixCache
from mmserve.engine.cache.transfer import CacheTransfer, HandoffSlots
from mmserve.engine.cache_salt import check_cache_salt
from mmserve.engine.logits_processors import RowState
from mmserve.engine.logprobs import token_logprobs
from mmserve.engine.model_runner import ModelRunner
from mmserve.engine.overlap import OverlapStages
from mmserve.engine.request import TEXT_PREFILL_SUFFIX, Request, choice_id, text_prefill_id
from mmserve.engine.sampler import Sampler, make_generator
from mmserve.engine.scheduler import Scheduler, SchedulerConfig
from mmserve.engine.step_output import (  # noqa: F401 (re-exported)
    BatchFailed,
    EngineStats,
    StepOutput,
    TokenHistogram,
)
from mmserve.engine.token_checks import check_prompt_ids, check_token_params
from mmserve.glibc_heap import keep_large_blocks, share_main_arena
from mmserve.logprobs import TokenLogprobs
from mmserve.models.family import ModelFamily, check_pixel_limit, load_family
from mmserve.models.layer_specs import has_item_blocks, window_of
from mmserve.models.loader import load_hf_config
from mmserve.multimodal.embedding import PlacedEmbedding
from mmserve.multimodal.items import ItemEmbedding, MultimodalItem, check_spans
from mmserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def _label(name: str):
    """A profiler label (`mmserve bench engine`'s step breakdown), free when no profiler runs: a label costs
    tens of microseconds even then."""
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


class Engine:
    def __init__(self, cfg: EngineConfig, family: ModelFamily | None = None) -> None:
        self.cfg = cfg
        share_main_arena()  # before torch's threads allocate (mmserve.glibc_heap)
        hf_config = load_hf_config(cfg.model)
        self.family = family or load_family(cfg.model, hf_config, dict(cfg.mm_processor_kwargs))
        self.model_config = ModelConfig.from_hf(cfg.model, hf_config, cfg.max_model_len)
        self.runner = ModelRunner(
            self.family,
            self.model_config,
            cfg.dtype,
            cfg.device,
            cfg.pack_weights,
            cfg.fuse_layers,
            cfg.cpu_kernels,
            cfg.fp32_gemm,
            cfg.quantization,
            cfg.quantize_lm_head,
        )
        specs = self.family.layer_specs
        self.pool, self.window_pool = build_kv_pools(cfg, self.model_config, specs)
        self.window = window_of(specs)
        self.states = build_state_pool(cfg, specs)
        # A decode server never prefills, so a prefix cache would only hold slots (mmserve.disagg).
        no_prefix = cfg.disable_prefix_cache or cfg.disaggregation_mode == "decode"
        prefix_cache = (
            NoPrefixCache(self.states)
            if no_prefix
            else RadixCache(self.pool, self.states, self.window_pool, self.window)
        )
        sched_cfg = SchedulerConfig(
            cfg.max_num_batched_tokens, cfg.max_num_seqs, self.model_config.max_model_len
        )
        self.scheduler = Scheduler(
            sched_cfg, self.pool, prefix_cache, self.states, self.window_pool, self.window
        )
        # a request's cache as bytes (P/D)
        self.transfer = CacheTransfer(specs, self.pool, self.states, self.window_pool)
        # The structured-output compiler's tokenizer view takes seconds for a real vocabulary: built on a
        # thread from the start, so neither start-up nor the first constrained request waits for all of it.
        self._grammar = concurrent.futures.ThreadPoolExecutor(1, "grammar").submit(self._build_grammar)
        kernels = self.runner.kernels
        self.sampler = Sampler(
            self._apply_grammar_masks, kernels.greedy_argmax if kernels is not None else None
        )
        self.requests: dict[str, Request] = {}  # by request id; n > 1: one entry per choice ("id#i")
        self.iteration_tokens = TokenHistogram()  # tokens per step (vLLM's iteration_tokens_total)
        self.groups: dict[str, list[Request]] = {}  # n > 1: group id -> its choices
        # n > 1: choices that wait until the first choice's prompt is in the prefix cache (prefilled once)
        self.held: dict[str, list[Request]] = {}
        self.placeholder_ids = frozenset(getattr(self.family, "placeholders", {}).values())
        # items computed whole where their tokens attend both ways
        self.item_blocks = has_item_blocks(specs)
        self.overlap = OverlapStages(self)  # encode-prefill overlap: a request's prompt prefilled in stages
        per_token = self.kv_bytes_per_token = KVPool.bytes_per_token(specs, self.pool.dtype, self.pool.layers)
        kv_layers = sum(s.has_kv for s in specs)
        kv_mb = self.pool.num_slots * per_token / 2**20
        logger.info(
            "KV cache: %d tokens, %.1f MB (%d bytes per token in %s, %d of %d layers with KV); max model len %d",
            *(self.pool.num_slots, kv_mb, per_token, str(self.pool.dtype).removeprefix("torch."), kv_layers),
            *(len(specs), self.model_config.max_model_len),
        )
        if self.window_pool is not None:
            rows = self.window_pool
            logger.info(
                "sliding-window KV: %d rows, %.1f MB (%d bytes per row, window %d): freed once behind the window",
                *(rows.num_slots, rows.num_slots * rows.token_bytes / 2**20, rows.token_bytes, self.window),
            )
        if self.states is not None:
            states = self.states
            logger.info(
                "state cache: %d request states, %.1f MB (%.2f MB each, %d linear-attention layers): running "
                "requests and prefix-cache checkpoints (--state-cache-mb)",
                *(states.num_slots, states.num_slots * states.slot_bytes / 2**20, states.slot_bytes / 2**20),
                len(states.layers),
            )
        keep_large_blocks()  # loaded: large temporaries reused from the heap from now on (mmserve.glibc_heap)

    # -- requests -------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        items: list[ItemEmbedding],
        cache_salt: str | None = None,
        handoff: object | None = None,
        prefill_only: bool = False,
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
        check_prompt_ids(prompt_token_ids, self.model_config.vocab_size, self.placeholder_ids)
        own_prefill = self.overlap.claim(request_id)
        check_cache_salt(cache_salt)
        for item in items:
            self.family.check_item(item)
        check_pixel_limit(self.family, items, self.cfg.max_mm_pixels_per_prompt)
        expanded = self.family.expand(prompt_token_ids, [MultimodalItem.of(it) for it in items])
        prompt_len = len(expanded.token_ids)
        limit = self.cfg.max_prompt_tokens
        if limit is not None and prompt_len > limit:
            message = f"prompt has {prompt_len} tokens (media expanded); this server allows at most {limit}"
            raise ValueError(message + " (--max-prompt-tokens)")
        if params.max_tokens is None:  # the rest of the context, as far as the KV cache holds every choice
            room = min(
                self.model_config.max_model_len - prompt_len, (self.pool.num_slots - prompt_len) // params.n
            )
            params = params.with_max_tokens(max(1, room))
        self.scheduler.check_fits(prompt_len, params.max_tokens)
        check_token_params(params, self.model_config.vocab_size)
        if params.n > 1 and prompt_len + params.n * params.max_tokens > self.pool.num_slots:
            raise ValueError(
                f"n={params.n} choices of up to {params.max_tokens} tokens each after a {prompt_len}-token prompt "
                f"exceed the KV cache capacity of {self.pool.num_slots} tokens; lower n or max_tokens"
            )
        if params.n > 1 and handoff is not None:
            raise ValueError("n > 1 is not supported by a prefill server of a disaggregated deployment")
        matchers = (
            [self.grammar().matcher(params.structured) for _ in range(params.n)]
            if params.structured
            else None
        )
        positions, rope_delta = self.family.positions(expanded)
        blocks = self.family.bidirectional_blocks(expanded) if self.item_blocks else []
        check_spans(expanded.items)
        ids = torch.tensor(expanded.token_ids, dtype=torch.int64)
        by_hash = {it.content_hash: it for it in items}
        embeddings = [
            PlacedEmbedding.at(ids, it.offset, it.span, it.pad_value, by_hash[it.content_hash].tensors)
            for it in expanded.items
        ]
        choices = []
        for i in range(params.n):
            p = params if params.n == 1 else params.for_choice(i)
            choices.append(
                Request(
                    request_id if params.n == 1 else choice_id(request_id, i),
                    expanded.token_ids,
                    p,
                    items=expanded.items,
                    embeddings=embeddings,
                    positions=positions,
                    rope_delta=rope_delta,
                    generator=make_generator(p),
                    cache_salt=cache_salt,
                    handoff=handoff,
                    group_id=request_id,
                    index=i,
                    matcher=matchers[i] if matchers else None,
                    prefill_only=prefill_only,
                    own_prefill_tokens=own_prefill if i == 0 else 0,
                    blocks=blocks,
                )
            )
        self.scheduler.check_window_fits(choices[0])
        for req in choices:
            self.requests[req.request_id] = req
        text = self.requests.get(text_prefill_id(request_id))
        if text is not None:  # its text is being prefilled: it joins when that is cached, and reuses it
            self.held.setdefault(text.group_id, []).append(choices[0])
        else:
            self.scheduler.add(choices[0])
        if params.n > 1:
            self.groups[request_id] = choices
            self.held[request_id] = choices[1:]
        choices[0].hf_prompt_ids = expanded.hf_token_ids  # what the API reports as the prompt's token ids
        return choices[0]

    def grammar(self):
        """The structured-output compiler (mmserve.engine.grammar) for this model's tokenizer. Raises
        ValueError (the request's 400) if it could not be built."""
        try:
            return self._grammar.result()
        except Exception as e:
            raise ValueError(f"structured outputs are unavailable for this model: {e}") from e

    def _build_grammar(self):
        from mmserve.engine.grammar import GrammarCompiler
        from mmserve.models.loader import load_tokenizer

        tokenizer = load_tokenizer(self.cfg.model)
        return GrammarCompiler(tokenizer, self.model_config.vocab_size, self.model_config.eos_token_ids)

    @staticmethod
    def _apply_grammar_masks(logits: torch.Tensor, matchers: list) -> None:
        from mmserve.engine.grammar import apply_grammar_masks

        apply_grammar_masks(logits, matchers)

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """End a request (all of its choices, given the group id, and its text prefill) now, freeing all it
        holds. Unknown or finished ids are ignored."""
        if request_id.endswith(
            TEXT_PREFILL_SUFFIX
        ):  # a text prefill: the request held behind it is released below
            text = self.requests.pop(request_id, None)
            if text is not None:
                self.scheduler.finish(text, reason)
                self.overlap.aborted(request_id)
                self._release_held(text)  # it computes the rest itself
            return
        self.overlap.drop(request_id, reason)
        group = self.groups.pop(request_id, None)
        self.held.pop(request_id, None)
        for req in group or [self.requests.get(request_id)]:
            if req is not None and self.requests.pop(req.request_id, None) is not None:
                self.scheduler.finish(req, reason)
                if group is None:  # one choice of an n > 1 request (its stop string matched)
                    self._release_held(req)
                    self._forget(req.group_id)

    def _forget(self, group_id: str) -> None:
        """Drop a group's bookkeeping once none of its choices is left."""
        group = self.groups.get(group_id)
        if group is not None and all(r.request_id not in self.requests for r in group):
            del self.groups[group_id]
            self.held.pop(group_id, None)

    def _release_held(self, req: Request) -> None:
        """n > 1: the first choice's prompt is cached (or it ended): its siblings may be admitted now, and hit
        the cache for all but their last prompt token."""
        for sibling in reversed(self.held.pop(req.group_id, [])):
            if sibling.request_id in self.requests:
                self.scheduler.waiting.appendleft(sibling)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def prefix_cached_len(self, tokens: list[int]) -> int | None:
        """How many leading `tokens` (prefix-cache keys) a request would reuse; None without a prefix cache."""
        if isinstance(self.scheduler.prefix_cache, NoPrefixCache):
            return None
        return self.scheduler.prefix_cache.cached_len(tokens)

    def end_stage(self, text: Request) -> None:
        """An overlap stage's prompt is in the prefix cache: it leaves (its state donated there too)."""
        self.scheduler.finish(text, "prefilled")
        self.requests.pop(text.request_id, None)

    @property
    def is_prefilling(self) -> bool:
        """Some request waits or still prefills (every running one decoding otherwise)."""
        return bool(self.scheduler.waiting) or any(r.is_prefill for r in self.scheduler.running)

    def stats(self) -> EngineStats:
        sched, pool, cache, states = self.scheduler, self.pool, self.scheduler.prefix_cache, self.states
        return EngineStats(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            kv_slots=pool.num_slots,
            kv_slots_used=pool.num_used,
            kv_slots_held=pool.num_used - cache.evictable_tokens,
            prefix_cache_tokens=cache.total_tokens,
            prefix_queries_tokens=sched.stats.prefix_queries_tokens,
            prefix_hit_tokens=sched.stats.prefix_hit_tokens,
            retractions=sched.stats.retractions,
            overlap_stages=self.overlap.stages,
            overlap_tokens=self.overlap.tokens,
            state_slots=states.num_slots if states is not None else 0,
            state_slots_used=states.num_used if states is not None else 0,
            state_checkpoints=cache.num_states,
            window_rows=self.window_pool.num_slots if self.window_pool is not None else 0,
            window_rows_used=self.window_pool.num_used if self.window_pool is not None else 0,
            iteration_token_counts=tuple(self.iteration_tokens.counts),
            iteration_tokens_sum=self.iteration_tokens.sum,
        )

    # -- one step -------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """One forward over the next batch. Raises BatchFailed (its requests already ended) if the forward or
        the sampler fails: one bad batch must not take the whole engine down."""
        with _label("mmserve::schedule"):
            chunks = self.scheduler.schedule()
        if not chunks:
            return []
        self.iteration_tokens.observe(sum(c.num_tokens for c in chunks))
        try:
            return self._run(chunks)
        except Exception as e:
            failed = []
            for chunk in chunks:
                self.scheduler.fail(chunk)
                if not chunk.request.prefill_only:  # internal: nobody to tell
                    failed.append(chunk.request.group_id)
                self.abort(chunk.request.group_id, "error")  # its other choices cannot complete the answer
            raise BatchFailed(list(dict.fromkeys(failed)), e) from e

    def _run(self, chunks: list) -> list[StepOutput]:
        out = self.runner.forward(chunks, self.pool, self.states, self.window_pool)
        self.scheduler.finish_step(chunks)  # states advanced, checkpoints into the prefix cache
        for chunk in chunks:  # share finished prompts now, not at the end: concurrent requests reuse them
            if chunk.start < chunk.request.prompt_len <= chunk.end:
                self.scheduler.cache_prompt(chunk.request)
                if chunk.request.prefill_only:  # a text prefill is done once its KV is in the cache
                    self.overlap.finished(chunk.request)
                self._release_held(chunk.request)
        for i, logits in out.prompt_logits.items():
            self._add_prompt_logprobs(chunks[i], logits)
        sampled_reqs = [c.request for c in chunks if c.samples]
        eos = self.model_config.eos_token_ids
        rows = [RowState(r.params, r.prompt_token_set, r.output_ids, r.matcher, eos) for r in sampled_reqs]
        with _label("mmserve::sample"):
            result = self.sampler.sample(out.logits, rows, [r.generator for r in sampled_reqs])
        outputs = []
        for req, token, lp in zip(sampled_reqs, result.token_ids, result.logprobs, strict=True):
            req.append_output(token)
            reason = self._finish_reason(req, token)
            first = len(req.output_ids) == 1 and req.params.prompt_logprobs is not None
            step = StepOutput(
                req.request_id,
                token,
                reason,
                req,
                logprobs=lp,
                prompt_logprobs=req.prompt_logprobs if first else None,
            )
            if req.handoff is not None:  # the decode engine continues (or just reports `reason`)
                self.scheduler.detach(req)
                self.requests.pop(req.request_id, None)
                step.handoff = True
                outputs.append(step)
                continue
            if reason is not None:
                self.scheduler.finish(req, reason)
                self.requests.pop(req.request_id, None)
                self._release_held(req)
                self._forget(req.group_id)
            outputs.append(step)
        return outputs

    def _add_prompt_logprobs(self, chunk, logits: torch.Tensor) -> None:
        """Logprobs of the prompt tokens after `chunk.start` that the chunk's rows predict (text tokens only:
        a media row's pad value is not a token of the vocabulary)."""
        req = chunk.request
        if not req.prompt_logprobs:
            req.prompt_logprobs = [None]
        skip = len(req.prompt_logprobs) - (chunk.start + 1)  # recomputed after a retraction: known already
        if skip >= logits.shape[0]:
            return
        logits = logits[max(0, skip) :]
        first = chunk.start + 1 + max(0, skip)
        targets = torch.tensor(req.prompt_ids[first : first + logits.shape[0]])
        text = targets < logits.shape[1]
        entries: list[TokenLogprobs | None] = [None] * targets.numel()
        idx = text.nonzero().squeeze(1)
        k = req.params.prompt_logprobs
        for j, lp in zip(
            idx.tolist(), token_logprobs(logits[idx], targets[idx], [k] * idx.numel()), strict=True
        ):
            entries[j] = lp
        req.prompt_logprobs.extend(entries)

    def _finish_reason(self, req: Request, token: int) -> str | None:
        params = req.params
        if req.matcher is not None:
            req.matcher.accept(token)  # EOS too: the grammar allows it once the output is complete
        if len(req.output_ids) > params.min_tokens:  # stop ids and EOS were masked before (min_tokens)
            if token in params.stop_token_ids:
                req.stop_reason, req.stopped_on_token = token, True
                return "stop"
            if not params.ignore_eos and token in self.model_config.eos_token_ids:
                req.stopped_on_token = True
                return "stop"
        if req.matcher is not None and req.matcher.terminated:  # complete: nothing but EOS may follow
            req.stopped_on_token = token in self.model_config.eos_token_ids
            return "stop"
        if len(req.output_ids) >= params.max_tokens or len(req.token_ids) >= self.model_config.max_model_len:
            return "length"
        return None

    # -- prefill-decode handoff (mmserve.disagg) -------------------------------------------------
    def end_handoff(self, req: Request, ok: bool) -> None:
        """Prefill side: the request's KV reached the decode engine (or never will): free its slots, its
        prompt staying in the prefix cache for the next request that shares it."""
        self.scheduler.finish(req, "handoff" if ok else "error")

    def handoff_cache(self, req: Request) -> HandoffSlots:
        """Prefill side: a detached request's prompt slots, the window rows of its last W - 1 prompt tokens
        (windowed models) and its state slot, held by it until `end_handoff`."""
        n = req.prompt_len
        rows = None
        if req.window_buffer is not None:
            rows = req.window_buffer[max(0, n - self.scheduler.window + 1) : n].clone()
        return HandoffSlots(req.slot_buffer[:n].clone(), rows, req.state_slot)

    def handoff_room(self) -> int:
        """Decode side: KV slots a new handoff may take, beyond what the running requests may still grow into."""
        return self.pool.num_free - self.scheduler.outstanding_growth()

    @property
    def max_request_tokens(self) -> int:
        """The longest request (prompt + output) this engine can ever hold."""
        return min(self.pool.num_slots, self.model_config.max_model_len)

    def reserve(self, rows: int, state: bool) -> HandoffSlots | None:
        """Decode side: slots for a handoff's `rows` KV rows (and window rows for the last W - 1 of them, windowed
        models) and, with `state`, a state slot, owned by the caller until `adopt` or `unreserve`; None when the
        pools are short."""
        return self.scheduler.reserve(rows, state and self.states is not None)

    def unreserve(self, held: HandoffSlots) -> None:
        self.scheduler.unreserve(held)

    def adopt(self, req: Request, held: HandoffSlots) -> None:
        """Decode side: a handed-off request (`recomputable=False`, one output token) whose prompt's cache is in
        the reserved slots `held` (written by the transfer) continues decoding here."""
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        if req.params.structured is not None:  # the matcher's state is rebuilt from the tokens so far
            req.matcher = self.grammar().matcher(req.params.structured)
            for token in req.output_ids:
                req.matcher.accept(token)
        self.scheduler.adopt(req, held)
        self.requests[req.request_id] = req

    def take_dropped(self) -> list[Request]:
        """Requests ended because the pool ran out and they could not be recomputed (decode server)."""
        dropped = self.scheduler.take_dropped()
        for req in dropped:
            self.requests.pop(req.request_id, None)
        return dropped

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
