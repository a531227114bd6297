"""Continuous batching: which tokens of which requests the next forward computes.

Policy, within `max_num_batched_tokens` per step; chunks may stop anywhere (inside an image too), except strictly
inside a bidirectional block of a family that has them (Gemma: an image's tokens see each other both ways, so
they are computed in one forward: a chunk stops before the block, or takes the rest of it even past the budget;
`Request.chunk_end`):
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
|                 | (`decode_run`: the rest of a run of up to DECODE_RUN)      | pressure (`slots.alloc`) |
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
slot. Checkpoints are taken where hits come from (`Request.resume_points`): each item's start and end, the
prompt's last token but one (repeats, n > 1 siblings), and at the end by donation (multi-turn, a retracted
request, an overlap stage's text). Checkpoints take free slots or replace the least recently used one; a request
being admitted takes a checkpoint's slot when none is free. A checkpoint is skipped when requests hold every
slot: correctness never depends on one.

Models with sliding-window layers keep those layers' rows in a window pool (mmserve.engine.slots): every
scheduled token takes a slot there too, the rows behind a request's window are freed after each step (but those
kept for the prefix cache until its prompt is cached), and the prefix cache holds window rows where they still
exist. Only KV of whole bidirectional blocks enters the prefix cache (`Request.safe_prefix`).

The prefix cache is keyed by `Request.cache_key`, the token ids scoped by the request's cache salt (in the
first position only; see mmserve.engine.cache_salt), never by the ids themselves.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

from mmserve.engine.admission import check_fits, check_window_fits
from mmserve.engine.cache.kv_pool import KVPool
from mmserve.engine.cache.radix_cache import PrefixCache
from mmserve.engine.cache.state_pool import StatePool
from mmserve.engine.cache.transfer import HandoffSlots
from mmserve.engine.model_runner import ScheduledChunk
from mmserve.engine.request import Request, RequestStatus
from mmserve.engine.slots import DECODE_RUN, SlotAllocator

LOOKAHEAD = 16  # waiting requests considered per step (beyond them: first come, first served)
STARVATION_STEPS = 8  # steps a prefill may be passed over before it goes first
__all__ = ["DECODE_RUN", "Scheduler", "SchedulerConfig"]


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
        self,
        cfg: SchedulerConfig,
        pool: KVPool,
        prefix_cache: PrefixCache,
        states: StatePool | None = None,
        window_pool: KVPool | None = None,
        window: int | None = None,
    ) -> None:
        self.cfg = cfg
        self.pool = pool
        self.prefix_cache = prefix_cache
        self.states = states  # None: every layer is attention, KV is all a request needs
        self.window_pool = window_pool  # sliding-window layers' rows (None: the model has none)
        self.window = window
        self.slots = SlotAllocator(pool, prefix_cache, window_pool, window)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.detached: dict[str, Request] = {}  # prefill: KV being handed off
        self.reserved = 0  # decode: slots held by handoff reservations
        self.reserved_states = 0  # decode: state slots held by handoff reservations
        self.reserved_window = 0  # decode: window slots held by handoff reservations
        self.dropped: list[Request] = []  # not recomputable, retracted: the owner reports their failure
        self.stats = SchedulerStats()

    # -- admission ------------------------------------------------------------------------------
    def check_fits(self, prompt_len: int, max_tokens: int) -> None:
        """Raise ValueError if a request of this size can never run (admission.py)."""
        check_fits(self.cfg.max_model_len, self.pool, prompt_len, max_tokens)

    def check_window_fits(self, req: Request) -> None:
        """Raise ValueError if a request can never hold the window rows it needs at once (admission.py)."""
        check_window_fits(self.cfg.max_num_batched_tokens, self.window_pool, self.window, req)

    def add(self, request: Request) -> None:
        self.check_fits(request.prompt_len, request.params.max_tokens)
        self.check_window_fits(request)
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
            placed = self.slots.next_decode_slot(req)
            if not placed:  # short of memory: one slot, retracting the newest requests as needed
                budget -= self._grow(req, 1, batch)
                continue
            req.num_computed += 1
            batch[req.request_id] = ScheduledChunk(req, req.num_computed - 1, req.num_computed)
            budget -= 1
        candidates = [r for r in self.running if r.is_prefill] + list(self.waiting)[:LOOKAHEAD]
        candidates.sort(key=self._prefill_priority)
        admitting = True
        for req in candidates:
            if budget <= 0:  # an atomic block may take a chunk past the budget
                break
            if req.status == RequestStatus.RUNNING:
                budget -= self._grow(req, self._chunk(req, req.num_computed, budget), batch)
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
        if self.window_pool is not None and req.window_buffer is None:
            req.window_buffer = torch.full_like(req.slot_buffer, -1)
        match = self.prefix_cache.match(lookup)
        self.prefix_cache.lock(match.handle)
        # Held first: taking slots may evict window rows of the match (never its locked full rows or state)
        self.pool.ref(match.slots)
        req.slot_buffer[: match.num_tokens] = match.slots
        if req.window_buffer is not None:
            rows = match.window_slots
            self.window_pool.ref(rows[rows >= 0])
            req.window_buffer[: match.num_tokens] = rows
        n = self._chunk(req, match.num_tokens, budget)
        taken = self.slots.alloc(n, self.running)
        if taken is None:
            self.slots.unplace(req, 0, match.num_tokens)
            self.prefix_cache.unlock(match.handle)
            if state_slot is not None:
                self.states.free(state_slot)
            return False
        if state_slot is not None:  # resume at the checkpoint the hit ends at (the empty state: from scratch)
            if match.state is not None:
                self.states.copy_(match.state, state_slot)
            req.state_slot, req.state_pos = state_slot, match.num_tokens
        req.prefix_handle = match.handle
        req.num_computed = match.num_tokens
        if self.window_pool is not None and req.prefix_cache_pending:
            self.slots.keep(req, req.resume_points(0, req.prompt_len))
        if first_time:
            req.first_scheduled_time = time.perf_counter()
            # reuse of other requests' work only: its own text prefill (overlap) is not a cache hit
            req.num_cached_tokens = max(0, min(match.num_tokens, req.prompt_len) - req.own_prefill_tokens)
            self.stats.prefix_queries_tokens += req.prompt_len
            self.stats.prefix_hit_tokens += req.num_cached_tokens
        self.waiting.remove(req)
        self.running.append(req)
        req.status = RequestStatus.RUNNING
        self._append(req, taken, batch)
        return True

    @staticmethod
    def _chunk(req: Request, start: int, budget: int) -> int:
        """Tokens of the next prefill chunk from `start`: the budget's worth, never ending inside a block."""
        return req.chunk_end(start, start + min(len(req.token_ids) - start, budget)) - start

    def _grow(self, req: Request, n: int, batch: dict[str, ScheduledChunk]) -> int:
        """Schedule n more tokens of a running request, retracting others if memory is short.
        Returns the tokens scheduled (0 if `req` itself had to be retracted)."""
        while (taken := self.slots.alloc(n, self.running)) is None:
            victim = self.running[-1]
            self.retract(victim, batch)
            if victim is req:
                return 0
        self._append(req, taken, batch)
        return n

    def _append(self, req: Request, taken: tuple, batch: dict[str, ScheduledChunk]) -> None:
        start = req.num_computed
        self.slots.place(req, start, *taken)
        req.num_computed += taken[0].numel()
        chunk = ScheduledChunk(req, start, req.num_computed)
        if self.states is not None and self.prefix_cache.keeps_states:
            for p in req.resume_points(start, req.num_computed):
                slot = self._state_slot()
                if slot is None:
                    break
                chunk.checkpoints.append((p, slot))
                self.stats.checkpoints += 1
        batch[req.request_id] = chunk

    # -- state checkpoints (hybrid models) ----------------------------------------------------------
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
        prefix cache (which takes their slots); window rows behind each request's window are freed."""
        self.slots.release_behind_window([c.request for c in chunks])
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

    def cache_prompt(self, req: Request) -> None:
        """Insert a running request's whole prompt (its KV is now written) into the prefix cache and move the
        request's lock to the new path, so requests arriving meanwhile reuse it instead of recomputing it."""
        prompt = req.cache_key(req.prompt_len)
        if not self.prefix_cache.keeps_states:  # a state tree holds the prompt through its checkpoints
            rows = req.window_buffer[: req.prompt_len] if req.window_buffer is not None else None
            self.prefix_cache.insert(prompt, req.slot_buffer[: req.prompt_len], window_slots=rows)
        req.prefix_cache_pending = False
        self.slots.release_kept(req)  # the tree holds them now
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

    def reserve(self, n: int, state: bool = False) -> HandoffSlots | None:
        """Decode side: `n` slots for a handoff's rows (evicting the prefix cache if need be), window slots for
        the last W - 1 of them (models with sliding-window layers: all the first decode step reads) and, with
        `state`, a state slot for its linear layers' state; None when a pool is short."""
        state_slot = None
        if state:
            state_slot = self._state_slot()
            if state_slot is None:
                return None
        keep = min(n, self.window - 1) if self.window_pool is not None else None  # all the first step reads
        taken = self.slots.alloc(n, self.running, keep)
        if taken is None:
            if state_slot is not None:
                self.states.free(state_slot)
            return None
        slots, rows = taken
        if rows is not None:
            self.reserved_window += keep
        self.reserved += n
        self.reserved_states += state_slot is not None
        return HandoffSlots(slots, rows, state_slot)

    def unreserve(self, held: HandoffSlots) -> None:
        self.reserved -= held.slots.numel()
        self.pool.free(held.slots)
        if held.window_slots is not None:
            self.reserved_window -= held.window_slots.numel()
            self.window_pool.free(held.window_slots)
        if held.state_slot is not None:
            self.reserved_states -= 1
            self.states.free(held.state_slot)

    def adopt(self, req: Request, held: HandoffSlots) -> None:
        """Decode side: a handed-off request joins the running set with the reserved slots (now written) as the
        KV of its prompt (and the state slot, its state after the prompt); its sampled first token is computed by
        the next step, as after a local prefill."""
        slots, state_slot = held.slots, held.state_slot
        n = slots.numel()
        assert n == req.prompt_len and len(req.output_ids) == 1, (n, req.prompt_len, req.output_ids)
        assert (state_slot is None) == (self.states is None), "a hybrid model's request needs its state"
        assert (held.window_slots is None) == (self.window_pool is None), "a windowed model's request needs rows"
        self.reserved -= n
        req.slot_buffer[:n] = slots
        req.num_computed = n
        if held.window_slots is not None:
            if req.window_buffer is None:
                req.window_buffer = torch.full_like(req.slot_buffer, -1)
            k = held.window_slots.numel()
            req.window_buffer[n - k : n] = held.window_slots
            req.window_released = n - k
            req.prefix_cache_pending = False
            self.reserved_window -= k
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
            self.slots.unplace(req, chunk.start, chunk.end)
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
            self.slots.unplace(req, chunk.start, chunk.end)
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
        self.slots.return_run(req)
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
            cached = req.safe_prefix(computed)  # never KV of part of a block
            rows = req.window_buffer[:cached] if req.window_buffer is not None else None
            self.prefix_cache.insert(req.cache_key(cached), req.slots[:cached], window_slots=rows)
            self.pool.free(req.slots)
        self.slots.release_all(req)
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
        if self.window_pool is not None:
            self.window_pool.check_integrity()
            assert all(
                r.window_buffer is None or not bool((r.window_buffer >= 0).any()) for r in self.waiting
            )
            held = self.slots.held_window_rows([*self.running, *self.detached.values()])
            expected = held + self.prefix_cache.window_rows + self.reserved_window
            assert self.window_pool.num_used <= expected, (self.window_pool.num_used, expected)
            if not self.running and not self.detached:
                assert self.window_pool.num_used == expected, (self.window_pool.num_used, expected)
        if not self.running and not self.detached:
            assert self.pool.num_used == self.prefix_cache.total_tokens + self.reserved, (
                self.pool.num_used,
                self.prefix_cache.total_tokens,
                self.reserved,
            )
