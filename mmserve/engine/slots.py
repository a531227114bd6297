"""Slots for the tokens the scheduler schedules: taken from the KV pools, evicting the prefix cache when short, and
given back; for models with sliding-window layers, the window pool's rows freed once behind every window.

A token takes one slot of the KV pool (its full-attention layers' rows) and, when the model has sliding-window
layers, one slot of the window pool (their rows). A decoding request takes its slots in runs (`DECODE_RUN`), so
the decode attention reads a run of consecutive slots in place.

Window rows (W: the window). The token at position i reads the window rows of positions (i - W, i]; so once a
request has computed n tokens, the rows before n - W + 1 are never read again by it, and it frees them
(`release_behind_window`). Some are kept a while longer for the prefix cache (`keep`): the W - 1 rows before each
position a later request is likely to resume at (each item's start and end, the prompt's last token but one: the
positions `Request.resume_points` names), until the request's prompt is in the prefix cache, which then
holds them. A request's `window_buffer` has its window slot per position, -1 where it holds none.

Not thread-safe: the scheduler's thread owns it.
"""

from __future__ import annotations

import torch

from mmserve.engine.cache.kv_pool import KVPool
from mmserve.engine.cache.radix_cache import PrefixCache
from mmserve.engine.request import Request

# A decoding request takes its slots this many at a time, a run ending at a multiple of DECODE_RUN of its token
# index: one slot a step would interleave every request's decode tokens, which the decode attention then
# gathers, where it reads a run of 16 consecutive slots in place (as it reads a prompt's).
DECODE_RUN = 16


class SlotAllocator:
    def __init__(
        self,
        pool: KVPool,
        prefix_cache: PrefixCache,
        window_pool: KVPool | None = None,
        window: int | None = None,
    ) -> None:
        self.pool = pool
        self.prefix_cache = prefix_cache
        self.window_pool = window_pool  # None: every attention layer keeps all its rows in `pool`
        self.window = window

    # -- taking and giving back -----------------------------------------------------------------------
    def free_or_evicted(
        self, n: int, window_rows: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """n slots of the KV pool and `window_rows` (default n) of the window pool (None without one), evicting
        prefix-cache entries where a pool is short; None (taking nothing) if even that is not enough."""
        slots = self.pool.alloc(n)
        if slots is None and self.prefix_cache.evict(n - self.pool.num_free) > 0:
            slots = self.pool.alloc(n)
        if slots is None or self.window_pool is None:
            return None if slots is None else (slots, None)
        k = n if window_rows is None else window_rows
        rows = self.window_pool.alloc(k)
        if rows is None and self.prefix_cache.evict_window(k - self.window_pool.num_free) > 0:
            rows = self.window_pool.alloc(k)
        if rows is None:
            self.pool.free(slots)
            return None
        return slots, rows

    def alloc(
        self, n: int, running: list[Request], window_rows: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """`free_or_evicted`, then the running requests' unused decode runs given back before anyone is
        retracted."""
        taken = self.free_or_evicted(n, window_rows)
        if taken is None and self.drop_decode_runs(running) > 0:
            taken = self.free_or_evicted(n, window_rows)
        return taken

    def give_back(self, slots: torch.Tensor, rows: torch.Tensor | None) -> None:
        self.pool.free(slots)
        if rows is not None:
            self.window_pool.free(rows[rows >= 0])

    def place(self, req: Request, start: int, slots: torch.Tensor, rows: torch.Tensor | None) -> None:
        """Record taken slots as those of positions [start, start + n) of `req` (which now owns them)."""
        req.slot_buffer[start : start + slots.numel()] = slots
        if rows is not None:
            req.window_buffer[start : start + rows.numel()] = rows

    def unplace(self, req: Request, start: int, end: int) -> None:
        """Give back the slots of positions [start, end) of `req` (a chunk that will not run)."""
        window = req.window_buffer[start:end] if req.window_buffer is not None else None
        self.give_back(req.slot_buffer[start:end], window)
        if window is not None:
            window.fill_(-1)

    # -- decode runs ----------------------------------------------------------------------------------
    def next_decode_slot(self, req: Request) -> bool:
        """Place the next decode token's slots (at `req.num_computed`) from the request's runs, taking new runs
        (free or evicted slots, never another request's) when they are used up; False when not even that is
        there (nothing placed)."""
        if not req.decode_run:
            n = min(DECODE_RUN - req.num_computed % DECODE_RUN, req.max_len - req.num_computed)
            taken = self.free_or_evicted(n)
            if taken is None:
                return False
            req.decode_run = taken[0].tolist()[::-1]  # popped from the end: in ascending order
            req.window_run = taken[1].tolist()[::-1] if taken[1] is not None else []
        i = req.num_computed
        req.slot_buffer[i] = req.decode_run.pop()  # no tensor per request (~20 us each, 64 a step)
        if req.window_buffer is not None:
            req.window_buffer[i] = req.window_run.pop()
        return True

    def return_run(self, req: Request) -> int:
        """Give the request's unused decode slots back to the pools; returns how many."""
        n = len(req.decode_run)
        if n:
            self.pool.free(torch.tensor(req.decode_run, dtype=torch.int64))
            req.decode_run = []
        if req.window_run:
            self.window_pool.free(torch.tensor(req.window_run, dtype=torch.int64))
            req.window_run = []
        return n

    def drop_decode_runs(self, running: list[Request]) -> int:
        return sum(self.return_run(r) for r in running)

    # -- window rows ----------------------------------------------------------------------------------
    def keep(self, req: Request, positions: list[int]) -> None:
        """Keep the W - 1 window rows before each of `positions` (where later requests may resume) until the
        request's prompt is in the prefix cache (`release_kept`)."""
        if self.window_pool is None or not positions:
            return
        mask = torch.zeros(req.max_len, dtype=torch.bool)
        for p in positions:
            mask[max(0, p - self.window + 1) : p] = True
        req.window_keep = mask

    def release_behind_window(self, requests: list[Request]) -> None:
        """Free the window rows the requests will never read again: every row before `num_computed - W + 1`
        except those kept for the prefix cache. Mutates the requests' window buffers and the window pool."""
        if self.window_pool is None:
            return
        freed: list[torch.Tensor] = []
        single: list[int] = []  # decode steps' rows: one tensor for all of them
        for req in requests:
            end = req.num_computed - self.window + 1
            if end <= req.window_released or req.window_buffer is None:
                continue
            start, req.window_released = req.window_released, end
            if end - start == 1 and req.window_keep is None:  # a decode step: one row, no tensor ops
                slot = int(req.window_buffer[start])
                if slot >= 0:
                    single.append(slot)
                    req.window_buffer[start] = -1
                continue
            rows = req.window_buffer[start:end]
            drop = rows >= 0
            if req.window_keep is not None:
                drop &= ~req.window_keep[start:end]
            freed.append(rows[drop].clone())
            rows[drop] = -1
        if single:
            freed.append(torch.tensor(single, dtype=torch.int64))
        if freed:
            self.window_pool.free(torch.cat(freed))

    def release_kept(self, req: Request) -> None:
        """The request's prompt is in the prefix cache (which took its own references to the kept rows): it keeps
        nothing more for it, and frees what is behind its window."""
        if req.window_keep is None:
            return
        req.window_keep = None
        req.window_released = 0
        self.release_behind_window([req])

    def release_all(self, req: Request) -> None:
        """Free every window row the request holds (it leaves, or is retracted)."""
        if req.window_buffer is None:
            return
        held = req.window_buffer >= 0
        if bool(held.any()):
            self.window_pool.free(req.window_buffer[held])
        req.window_buffer.fill_(-1)
        req.window_keep = None
        req.window_released = 0

    def held_window_rows(self, requests) -> int:
        """Window rows the requests hold, their unused runs included."""
        total = 0
        for req in requests:
            if req.window_buffer is not None:
                total += int((req.window_buffer >= 0).sum()) + len(req.window_run)
        return total
