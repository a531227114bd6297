"""Fuse tower work across concurrent jobs: one forward for up to `max_batch_items` items.

Callers (encoder job threads) `submit` a preprocessed item and block on the returned Future. A single worker
thread owns the tower: it takes the first waiting item, waits up to `max_batch_wait_ms` for more (never past
`max_batch_items` items or `max_batch_cost` cost units, the family's measure of an item's work, e.g.
patches), and runs the family's `encode` over them, which splits the outputs back per item.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from mmserve.glibc_heap import IdleTrim
from mmserve.multimodal.items import TowerInput
from mmserve.omp_pools import release_thread_pool

EncodeFn = Callable[[list[TowerInput]], list[dict[str, torch.Tensor]]]


@dataclass
class BatchStats:
    batches: int = 0
    items: int = 0
    forward_s: float = 0.0
    items_per_batch: list[int] = field(default_factory=list)  # last 1000 batches


class TowerBatcher:
    """Owns the worker thread; `encode(batch)` runs on it only (the tower is never called concurrently)."""

    def __init__(
        self,
        encode: EncodeFn,
        max_batch_items: int = 8,
        max_batch_wait_ms: float = 5.0,
        max_batch_cost: int = 65536,
    ) -> None:
        self.encode = encode
        self.max_batch_items = max_batch_items
        self.max_batch_wait_s = max_batch_wait_ms / 1000.0
        self.max_batch_cost = max_batch_cost
        self.stats = BatchStats()
        self._queue: queue.Queue[tuple[TowerInput, Future] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="tower-batcher", daemon=True)
        self._thread.start()

    def submit(self, item: TowerInput) -> Future:
        """Queue one item; the Future resolves to its tensors (MAIN and extras) or the forward's error."""
        future: Future = Future()
        self._queue.put((item, future))
        return future

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _collect(self, first: tuple[TowerInput, Future]) -> list[tuple[TowerInput, Future]]:
        batch, cost = [first], first[0].cost
        deadline = time.monotonic() + self.max_batch_wait_s
        while len(batch) < self.max_batch_items:
            remaining = deadline - time.monotonic()
            try:
                entry = (
                    self._queue.get(timeout=max(remaining, 0)) if remaining > 0 else self._queue.get_nowait()
                )
            except queue.Empty:
                break
            if entry is None:  # closing: finish this batch, then stop
                self._queue.put(None)
                break
            if cost + entry[0].cost > self.max_batch_cost:
                self._queue.put(entry)  # NOTE: goes to the back; it is served by the next batch
                break
            batch.append(entry)
            cost += entry[0].cost
        return batch

    def _run(self) -> None:
        trim = IdleTrim()  # a burst's large temporaries go back to the OS once the tower is idle (glibc_heap)
        while True:
            try:
                first = self._queue.get(timeout=trim.wait_s())
            except queue.Empty:
                trim.idle(time.monotonic())
                continue
            if first is None:
                return
            batch = self._collect(first)
            try:
                outputs = self.forward([item for item, _ in batch])
            except Exception as e:  # every waiter learns about it; the worker lives on
                for _, future in batch:
                    future.set_exception(e)
            else:
                for (_, future), out in zip(batch, outputs, strict=True):
                    future.set_result(out)
            trim.worked()
            if self._queue.empty():  # idle: its OpenMP pool would slow the engine's steps (omp_pools.py)
                release_thread_pool()
                trim.idle(time.monotonic())

    @torch.no_grad()
    def forward(self, items: list[TowerInput]) -> list[dict[str, torch.Tensor]]:
        start = time.perf_counter()
        outputs = self.encode(items)
        self.stats.batches += 1
        self.stats.items += len(items)
        self.stats.forward_s += time.perf_counter() - start
        self.stats.items_per_batch = (self.stats.items_per_batch + [len(items)])[-1000:]
        return outputs
