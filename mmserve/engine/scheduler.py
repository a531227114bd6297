"""Continuous batching: which tokens of which requests the next forward computes.

Policy, within `max_num_batched_tokens` per step; chunks may stop anywhere (inside an image too):
1. every decoding request gets its next token (one row each: decodes never wait behind prefills);
2. the rest of the budget goes to prefills, shortest remaining first: running prefills and the first
   `LOOKAHEAD` waiting requests compete on the tokens they still have to compute (a waiting request's prefix
   cache hit counted off, estimated once). So a request whose prompt is mostly cached gets its first token in
   the next step even while a long miss is prefilling, instead of after it. Starvation is bounded: a request
   passed over for `STARVATION_STEPS` steps goes first (oldest first) until its prefill is done, and a
   running prefill always gets whatever budget is left.

Slot ownership (see kv_pool / radix_cache):
| holder          | owns                                                       | released by            |
| request         | one pool reference per computed token (`request.slots`)    | `_release`             |
| prefix cache    | one pool reference per token stored in the tree            | `evict` / `reset`      |
| request (lock)  | one lock on the matched radix path while running           | `_release`             |
| request (run)   | the free slots taken ahead for its next decode tokens      | `_release`, or memory  |
|                 | (`decode_run`: the rest of a run of up to DECODE_RUN)      | pressure (`_alloc`)    |
A request's matched prefix slots are `pool.ref`'d, so a request always frees all of its slots the same way.
On finish, abort and retraction its computed tokens are inserted into the prefix cache first, so a
retracted request usually recomputes little.

When the pool is exhausted: evict the prefix cache, then take back the running requests' decode runs, then
retract the newest running request (free its slots, requeue it at the front, recompute later). Requests that
can never fit are refused in `add`.

Prefill-decode disaggregation (mmserve.disagg) adds two holders:
| holder               | owns                                                 | released by                 |
| detached request     | its slots while its KV is sent to a decode engine    | `finish` (after the send)   |
| reservation (decode) | slots reserved for a handoff's incoming rows         | `adopt` (to the request) or `unreserve` |
An adopted request cannot be recomputed (its embeddings stayed on the prefill server): retracting one fails it
(`take_dropped`); the decode server admits handoffs only when they fit to the end (`outstanding_growth`).

The prefix cache is keyed by `Request.cache_key`, the token ids scoped by the request's cache salt (in the
first position only; see mmserve.engine.cache_salt), never by the ids themselves.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

from mmserve.engine.kv_pool import KVPool
from mmserve.engine.model_runner import ScheduledChunk
from mmserve.engine.radix_cache import PrefixCache
from mmserve.engine.request import Request, RequestStatus

LOOKAHEAD = 16  # waiting requests considered per step (beyond them: first come, first served)
STARVATION_STEPS = 8  # steps a prefill may be passed over before it goes first
# A decoding request takes its slots this many at a time, a run ending at a multiple of DECODE_RUN of its token
# index: one slot a step would interleave every request's decode tokens, which the decode attention then
# gathers, where it reads a run of 16 consecutive slots in place (as it reads a prompt's).
DECODE_RUN = 16


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int


@dataclass
class SchedulerStats:
    prefix_queries_tokens: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int = 0  # of which found
    retractions: int = 0


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, pool: KVPool, prefix_cache: PrefixCache) -> None:
        self.cfg = cfg
        self.pool = pool
        self.prefix_cache = prefix_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.detached: dict[str, Request] = {}  # prefill: KV being handed off
        self.reserved = 0  # decode: slots held by handoff reservations
        self.dropped: list[Request] = []  # not recomputable, retracted: the owner reports their failure
        self.stats = SchedulerStats()

    # -- admission ------------------------------------------------------------------------------
    def check_fits(self, prompt_len: int, max_tokens: int) -> None:
        """Raise ValueError if a request of this size can never run."""
        total = prompt_len + max_tokens
        if prompt_len >= self.cfg.max_model_len:
            raise ValueError(
                f"prompt has {prompt_len} tokens (images expanded), the model's context is {self.cfg.max_model_len}"
            )
        if total > self.cfg.max_model_len:
            raise ValueError(
                f"prompt ({prompt_len} tokens, images expanded) + max_tokens ({max_tokens}) = {total} tokens exceeds "
                f"the model's context length of {self.cfg.max_model_len}"
            )
        if total > self.pool.num_slots:
            raise ValueError(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {total} tokens exceeds the KV cache "
                f"capacity of {self.pool.num_slots} tokens; lower max_tokens or raise --kv-cache-mb"
            )

    def add(self, request: Request) -> None:
        self.check_fits(request.prompt_len, request.params.max_tokens)
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step -------------------------------------------------------------------------------
    def schedule(self) -> list[ScheduledChunk]:
        """Pick the next batch; allocates the slots of every scheduled token (and advances num_computed)."""
        batch: dict[str, ScheduledChunk] = {}
        budget = self.cfg.max_num_batched_tokens
        for req in [r for r in self.running if not r.is_prefill][:budget]:
            if req.status != RequestStatus.RUNNING:  # retracted by an earlier _grow of this loop
                continue
            slot = self._next_decode_slot(req)
            if slot is None:  # short of memory: one slot, retracting the newest requests as needed
                budget -= self._grow(req, 1, batch)
                continue
            req.slot_buffer[req.num_computed] = slot  # no tensor per request (~20 us each, 64 a step)
            req.num_computed += 1
            batch[req.request_id] = ScheduledChunk(req, req.num_computed - 1, req.num_computed)
            budget -= 1
        candidates = [r for r in self.running if r.is_prefill] + list(self.waiting)[:LOOKAHEAD]
        candidates.sort(key=self._prefill_priority)
        admitting = True
        for req in candidates:
            if budget == 0:
                break
            if req.status == RequestStatus.RUNNING:
                budget -= self._grow(req, min(req.remaining, budget), batch)
            elif (
                admitting
                and req.status == RequestStatus.WAITING
                and len(self.running) < self.cfg.max_num_seqs
            ):
                if self._admit(req, budget, batch):
                    budget -= batch[req.request_id].num_tokens
                else:
                    admitting = False  # no memory: later ones would not fit either
        for req in candidates:  # aging: whoever got nothing moves toward the front, and stays until prefilled
            chunk = batch.get(req.request_id)
            if chunk is None:
                req.passed_over += 1
            elif chunk.samples:
                req.passed_over = 0
        return list(batch.values())

    def _prefill_priority(self, req: Request) -> tuple:
        if req.passed_over >= STARVATION_STEPS:
            return (0, req.arrival_time)
        if req.status == RequestStatus.WAITING:
            if req.uncached_estimate is None:
                cached = self.prefix_cache.cached_len(req.cache_key(len(req.token_ids) - 1))
                req.uncached_estimate = len(req.token_ids) - cached
            return (1, req.uncached_estimate, req.arrival_time)
        return (1, req.remaining, req.arrival_time)

    def _admit(self, req: Request, budget: int, batch: dict[str, ScheduledChunk]) -> bool:
        first_time = req.first_scheduled_time is None
        lookup = req.cache_key(len(req.token_ids) - 1)  # the last token is always computed: logits needed
        if req.params.prompt_logprobs is not None:  # every prompt row's logits are needed: compute them all
            lookup = []
        match = self.prefix_cache.match(lookup)
        self.prefix_cache.lock(match.handle)
        n = min(req.remaining - match.num_tokens, budget)
        slots = self._alloc(n)
        if slots is None:
            self.prefix_cache.unlock(match.handle)
            return False
        self.pool.ref(match.slots)
        req.prefix_handle = match.handle
        req.slot_buffer[: match.num_tokens] = match.slots
        req.num_computed = match.num_tokens
        if first_time:
            req.first_scheduled_time = time.perf_counter()
            # reuse of other requests' work only: its own text prefill (overlap) is not a cache hit
            req.num_cached_tokens = max(0, min(match.num_tokens, req.prompt_len) - req.own_prefill_tokens)
            self.stats.prefix_queries_tokens += req.prompt_len
            self.stats.prefix_hit_tokens += req.num_cached_tokens
        self.waiting.remove(req)
        self.running.append(req)
        req.status = RequestStatus.RUNNING
        self._append(req, slots, batch)
        return True

    def _grow(self, req: Request, n: int, batch: dict[str, ScheduledChunk]) -> int:
        """Schedule n more tokens of a running request, retracting others if memory is short.
        Returns the tokens scheduled (0 if `req` itself had to be retracted)."""
        while (slots := self._alloc(n)) is None:
            victim = self.running[-1]
            self.retract(victim, batch)
            if victim is req:
                return 0
        self._append(req, slots, batch)
        return n

    def _append(self, req: Request, slots: torch.Tensor, batch: dict[str, ScheduledChunk]) -> None:
        start = req.num_computed
        req.slot_buffer[start : start + slots.numel()] = slots
        req.num_computed += slots.numel()
        batch[req.request_id] = ScheduledChunk(req, start, req.num_computed)

    def _next_decode_slot(self, req: Request) -> int | None:
        """The next slot of the request's decode run, taking a new run (free or evicted slots, never another
        request's) when it is used up; None when not even that is there."""
        if not req.decode_run:
            run = self._free_or_evicted(
                min(DECODE_RUN - req.num_computed % DECODE_RUN, req.max_len - req.num_computed)
            )
            if run is None:
                return None
            req.decode_run = run.tolist()[::-1]  # popped from the end: in ascending order
        return req.decode_run.pop()

    def _return_run(self, req: Request) -> int:
        """Give the request's unused decode slots back to the pool; returns how many."""
        n = len(req.decode_run)
        if n:
            self.pool.free(torch.tensor(req.decode_run, dtype=torch.int64))
            req.decode_run = []
        return n

    def _drop_decode_runs(self) -> int:
        return sum(self._return_run(r) for r in self.running)

    def _free_or_evicted(self, n: int) -> torch.Tensor | None:
        """n free slots, evicting prefix-cache entries if the pool is short; None if even that is not enough."""
        slots = self.pool.alloc(n)
        if slots is None and self.prefix_cache.evict(n - self.pool.num_free) > 0:
            slots = self.pool.alloc(n)
        return slots

    def _alloc(self, n: int) -> torch.Tensor | None:
        slots = self._free_or_evicted(n)
        if slots is None and self._drop_decode_runs() > 0:  # before any request is retracted
            slots = self.pool.alloc(n)
        return slots

    def cache_prompt(self, req: Request) -> None:
        """Insert a running request's whole prompt (its KV is now written) into the prefix cache and move the
        request's lock to the new path, so requests arriving meanwhile reuse it instead of recomputing it."""
        prompt = req.cache_key(req.prompt_len)
        self.prefix_cache.insert(prompt, req.slot_buffer[: req.prompt_len])
        match = self.prefix_cache.match(prompt)
        self.prefix_cache.lock(match.handle)
        if req.prefix_handle is not None:
            self.prefix_cache.unlock(req.prefix_handle)
        req.prefix_handle = match.handle

    # -- prefill-decode handoff -------------------------------------------------------------------
    def detach(self, req: Request) -> None:
        """Prefill side: take a request that has its first token out of the running set, keeping its slots
        (the KV is being read for the decode engine) until `finish`."""
        self.running.remove(req)
        req.status = RequestStatus.HANDOFF
        self.detached[req.request_id] = req

    def reserve(self, n: int) -> torch.Tensor | None:
        """Decode side: `n` slots for a handoff's rows (evicting the prefix cache if need be), or None."""
        slots = self._alloc(n)
        if slots is not None:
            self.reserved += n
        return slots

    def unreserve(self, slots: torch.Tensor) -> None:
        self.reserved -= slots.numel()
        self.pool.free(slots)

    def adopt(self, req: Request, slots: torch.Tensor) -> None:
        """Decode side: a handed-off request joins the running set with `slots` (reserved, now written) as the
        KV of its prompt; its sampled first token is computed by the next step, as after a local prefill."""
        n = slots.numel()
        assert n == req.prompt_len and len(req.output_ids) == 1, (n, req.prompt_len, req.output_ids)
        self.reserved -= n
        req.slot_buffer[:n] = slots
        req.num_computed = n
        req.first_scheduled_time = req.first_scheduled_time or time.perf_counter()
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def outstanding_growth(self) -> int:
        """Slots the running requests may still take before they end (decode admission control)."""
        return sum(r.max_len - r.num_computed - len(r.decode_run) for r in self.running)

    def take_dropped(self) -> list[Request]:
        dropped, self.dropped = self.dropped, []
        return dropped

    # -- leaving the running set ----------------------------------------------------------------
    def retract(self, req: Request, batch: dict[str, ScheduledChunk] | None = None) -> None:
        """Free a running request's slots and requeue it first in line; it recomputes later. A request that
        cannot be recomputed (adopted from a prefill engine) is ended instead and listed in `dropped`."""
        chunk = batch.pop(req.request_id, None) if batch is not None else None
        if chunk is not None:  # its KV for this step is not written yet: un-schedule it
            self.pool.free(req.slot_buffer[chunk.start : chunk.end])
            req.num_computed = chunk.start
        if not req.recomputable:
            self.finish(req, "error")
            self.dropped.append(req)
            return
        self._release(req)
        self.running.remove(req)
        req.status = RequestStatus.WAITING
        req.uncached_estimate = None  # its tokens went into the prefix cache: mostly a hit now
        req.num_retractions += 1
        self.stats.retractions += 1
        self.waiting.appendleft(req)

    def fail(self, chunk: ScheduledChunk) -> None:
        """End a request whose step failed. This step's KV may be garbage: its slots are freed uncached, and
        only the tokens computed by earlier (successful) steps can enter the prefix cache."""
        req = chunk.request
        if req.finished:
            return
        if req.status == RequestStatus.RUNNING and req.num_computed == chunk.end:
            self.pool.free(req.slot_buffer[chunk.start : chunk.end])
            req.num_computed = chunk.start
        self.finish(req, "error")

    def finish(self, req: Request, reason: str) -> None:
        """End a request (stop / length / abort): frees everything it holds, at once."""
        if req.finished:
            return
        if req.status == RequestStatus.RUNNING:
            self._release(req)
            self.running.remove(req)
        elif req.status == RequestStatus.HANDOFF:
            self._release(req)
            del self.detached[req.request_id]
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.finish_time = time.perf_counter()

    def _release(self, req: Request) -> None:
        self._return_run(req)
        computed = req.num_computed
        if computed:
            self.prefix_cache.insert(req.cache_key(computed), req.slots)
            self.pool.free(req.slots)
        if req.prefix_handle is not None:
            self.prefix_cache.unlock(req.prefix_handle)
            req.prefix_handle = None
        req.num_computed = 0

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        self.prefix_cache.check_integrity()
        assert all(r.num_computed == 0 and r.status == RequestStatus.WAITING for r in self.waiting)
        assert all(r.status == RequestStatus.RUNNING for r in self.running)
        assert all(r.status == RequestStatus.HANDOFF for r in self.detached.values())
        assert self.reserved >= 0, self.reserved
        if not self.running and not self.detached:
            assert self.pool.num_used == self.prefix_cache.total_tokens + self.reserved, (
                self.pool.num_used,
                self.prefix_cache.total_tokens,
                self.reserved,
            )
