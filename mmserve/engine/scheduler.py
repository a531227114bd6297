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

Models with linear-attention layers (hybrids: Qwen3.5) also hold a state per request (mmserve.engine.cache.
state_pool): their KV alone cannot resume a sequence. So
| holder                | owns                                               | released by                        |
| request               | its running state slot (`state_slot`), at position `state_pos` | `_release`: donated to the prefix cache as a checkpoint at `num_computed`, or freed |
| chunk (this step)     | the checkpoint slots it fills (`checkpoints`)      | the step's end: inserted into the prefix cache (or freed on failure / retraction) |
| prefix cache          | one state per checkpoint node                      | `evict` / `evict_states` / `reset` |
| detached request, reservation | the state slot being sent / received       | as their KV slots                  |
A hit resumes at the deepest checkpoint (the prefix cache's `match`), whose state is copied into the request's
slot. Checkpoints are taken where hits come from (`checkpoint_positions`): each item's start and end, the
prompt's last token but one (repeats, n > 1 siblings), and at the end by donation (multi-turn, a retracted
request, an overlap stage's text). Checkpoints take free slots or replace the least recently used one; a request
being admitted takes a checkpoint's slot when none is free. A checkpoint is skipped when requests hold every
slot: correctness never depends on one.

The prefix cache is keyed by `Request.cache_key`, the token ids scoped by the request's cache salt (in the
first position only; see mmserve.engine.cache_salt), never by the ids themselves.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

from mmserve.engine.cache.kv_pool import KVPool
from mmserve.engine.cache.radix_cache import PrefixCache
from mmserve.engine.cache.state_pool import StatePool
from mmserve.engine.model_runner import ScheduledChunk
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
    checkpoints: int = 0  # hybrid models: states saved for prefix hits (donations at the end not counted)


class Scheduler:
    def __init__(
        self, cfg: SchedulerConfig, pool: KVPool, prefix_cache: PrefixCache, states: StatePool | None = None
    ) -> None:
        self.cfg = cfg
        self.pool = pool
        self.prefix_cache = prefix_cache
        self.states = states  # None: every layer is attention, KV is all a request needs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.detached: dict[str, Request] = {}  # prefill: KV being handed off
        self.reserved = 0  # decode: slots held by handoff reservations
        self.reserved_states = 0  # decode: state slots held by handoff reservations
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
        # Hybrids: the state slot first, since taking one may evict checkpoints; not the one `match` returns.
        state_slot = self._state_slot() if self.states is not None else None
        if self.states is not None and state_slot is None:  # no state: like no memory, wait for one to end
            return False
        lookup = req.cache_key(len(req.token_ids) - 1)  # the last token is always computed: logits needed
        if req.params.prompt_logprobs is not None:  # every prompt row's logits are needed: compute them all
            lookup = []
        match = self.prefix_cache.match(lookup)
        self.prefix_cache.lock(match.handle)
        n = min(req.remaining - match.num_tokens, budget)
        slots = self._alloc(n)  # may evict unlocked leaves: never the locked match, whose state stays
        if slots is None:
            self.prefix_cache.unlock(match.handle)
            if state_slot is not None:
                self.states.free(state_slot)
            return False
        if state_slot is not None:  # resume at the checkpoint the hit ends at (the empty state: from scratch)
            if match.state is not None:
                self.states.copy_(match.state, state_slot)
            req.state_slot, req.state_pos = state_slot, match.num_tokens
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
        chunk = ScheduledChunk(req, start, req.num_computed)
        if self.states is not None and self.prefix_cache.keeps_states:
            for p in self.checkpoint_positions(req, start, req.num_computed):
                slot = self._state_slot()
                if slot is None:
                    break
                chunk.checkpoints.append((p, slot))
                self.stats.checkpoints += 1
        batch[req.request_id] = chunk

    # -- state checkpoints (hybrid models) ----------------------------------------------------------
    @staticmethod
    def checkpoint_positions(req: Request, start: int, end: int) -> list[int]:
        """Positions p in (start, end] after which a chunk of `req` saves its state for prefix hits: every item's
        start and end (same system prompt + another image; same image + another question; overlap stages end
        at item starts) and the prompt's last token but one (a repeat and n > 1 siblings look up all but the last
        token). The end of what a request computed is saved by donation when it leaves (`_release`)."""
        wanted = {req.prompt_len - 1}
        for item in req.items:
            wanted.update((item.offset, item.end))
        return sorted(p for p in wanted if start < p <= end and p < req.prompt_len)

    def _state_holders(self) -> int:
        """State slots held by requests (running, handed off, reserved), not by the prefix cache."""
        running = sum(r.state_slot is not None for r in self.running)
        detached = sum(r.state_slot is not None for r in self.detached.values())
        return running + detached + self.reserved_states

    def _state_slot(self) -> int | None:
        """A free state slot, else the least recently used checkpoint's (None when requests hold them all)."""
        slot = self.states.alloc()
        if slot is None and self.prefix_cache.evict_states(1) > 0:
            slot = self.states.alloc()
        return slot

    def finish_step(self, chunks: list[ScheduledChunk]) -> None:
        """The step's forward succeeded: each chunk's state now stands at its end, and its checkpoints go into the
        prefix cache (which takes their slots)."""
        for chunk in chunks:
            req = chunk.request
            if req.state_slot is None:
                continue
            req.state_pos = chunk.end
            for p, slot in chunk.checkpoints:
                self.prefix_cache.insert(req.cache_key(p), req.slot_buffer[:p], slot)
            chunk.checkpoints = []

    def _drop_checkpoints(self, chunk: ScheduledChunk) -> None:
        for _, slot in chunk.checkpoints:
            self.states.free(slot)
        chunk.checkpoints = []

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
        if not self.prefix_cache.keeps_states:  # a state tree holds the prompt through its checkpoints
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

    def reserve(self, n: int, state: bool = False) -> tuple[torch.Tensor, int | None] | None:
        """Decode side: `n` slots for a handoff's rows (evicting the prefix cache if need be) and, with `state`,
        a state slot for its linear layers' state; None when either is short."""
        state_slot = None
        if state:
            state_slot = self._state_slot()
            if state_slot is None:
                return None
        slots = self._alloc(n)
        if slots is None:
            if state_slot is not None:
                self.states.free(state_slot)
            return None
        self.reserved += n
        self.reserved_states += state_slot is not None
        return slots, state_slot

    def unreserve(self, slots: torch.Tensor, state_slot: int | None = None) -> None:
        self.reserved -= slots.numel()
        self.pool.free(slots)
        if state_slot is not None:
            self.reserved_states -= 1
            self.states.free(state_slot)

    def adopt(self, req: Request, slots: torch.Tensor, state_slot: int | None = None) -> None:
        """Decode side: a handed-off request joins the running set with `slots` (reserved, now written) as the
        KV of its prompt (and `state_slot`, its state after the prompt); its sampled first token is computed by
        the next step, as after a local prefill."""
        n = slots.numel()
        assert n == req.prompt_len and len(req.output_ids) == 1, (n, req.prompt_len, req.output_ids)
        assert (state_slot is None) == (self.states is None), "a hybrid model's request needs its state"
        self.reserved -= n
        req.slot_buffer[:n] = slots
        req.num_computed = n
        if state_slot is not None:
            self.reserved_states -= 1
            req.state_slot, req.state_pos = state_slot, n
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
            self._drop_checkpoints(chunk)
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
        self._drop_checkpoints(chunk)
        if req.finished:
            return
        if req.status == RequestStatus.RUNNING and req.num_computed == chunk.end:
            self.pool.free(req.slot_buffer[chunk.start : chunk.end])
            req.num_computed = chunk.start
        req.state_pos = None  # the forward may have advanced some layers' state: it resumes nowhere
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
        if req.state_slot is not None:  # donated as the checkpoint at `computed` if it stands there, else freed
            if computed and req.state_pos == computed:
                self.prefix_cache.insert(req.cache_key(computed), req.slots, req.state_slot)
            else:
                self.states.free(req.state_slot)
            req.state_slot = req.state_pos = None
            if computed:
                self.pool.free(req.slots)
        elif computed:
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
        if self.states is not None:
            self.states.check_integrity()
            assert all(r.state_slot is None for r in self.waiting)
            assert all(r.state_slot is not None for r in self.running)
            held = self._state_holders() + self.prefix_cache.num_states
            assert self.states.num_used == held, (self.states.num_used, held)
        if not self.running and not self.detached:
            assert self.pool.num_used == self.prefix_cache.total_tokens + self.reserved, (
                self.pool.num_used,
                self.prefix_cache.total_tokens,
                self.reserved,
            )
