"""Assemble a request's embedding parts from encoders, with a deadline, in the engine process.

The API server tells the engine a request will arrive in `num_parts` parts (`expect`); encoders push parts
(`add`). Outcomes:
- all parts present and consistent -> `Complete` with the items in prompt order;
- a part that extends the run of items present from the first one, but not to the last -> `Progress` with
  that run (the engine prefills the prompt up to the next missing item meanwhile);
- an error part with a client status (< 500: bad media) -> `Failed` at once;
- an error part with a server status (>= 500) is remembered but not fatal: the dispatcher retries that part
  elsewhere (or locally) or fails the request itself; the deadline is the backstop -> `Failed` 504.
Parts can overtake their request (different sockets): parts for an unknown id wait in a bounded early buffer
for `early_ttl_s`; parts for a request that already completed or failed are dropped and counted as stale.
Single-threaded: the engine loop owns it.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from mmserve.multimodal.items import ItemEmbedding
from mmserve.transport.embedding_wire import EmbeddingItem, PartHeader
from mmserve.transport.messages import Failure


@dataclass
class Complete:
    request_id: str
    items: list[ItemEmbedding]  # in prompt order
    encoders: list[str]  # who computed each part
    cache_hits: int = 0  # items the encoders found in their caches
    item_encoders: list[str] = field(default_factory=list)  # who computed each item, in prompt order
    transfer_s: float = 0.0  # the last part's send (encoder's wall clock) to its arrival here


@dataclass
class Progress:
    """More of a request's first items are here (a prompt-order prefix of its items to encode), not yet all:
    its prompt up to the next missing item can be prefilled meanwhile (encode-prefill overlap)."""

    request_id: str
    items: list[ItemEmbedding]


@dataclass
class Failed:
    request_id: str
    failure: Failure


@dataclass
class ReceiverStats:
    parts: int = 0
    dropped_stale: int = 0  # for requests already finished / failed / aborted
    dropped_unknown: int = 0  # never claimed by a request before the early-buffer TTL
    dropped_invalid: int = 0  # inconsistent with the request (item index, modality, count)
    dropped_duplicate: int = 0
    early_buffered: int = 0


@dataclass
class _Pending:
    modalities: list[str]  # expected modality of every item, by item index
    num_parts: int
    deadline: float
    parts: dict[int, list[EmbeddingItem]] = field(default_factory=dict)
    encoders: dict[int, str] = field(default_factory=dict)
    cache_hits: int = 0
    server_errors: dict[int, str] = field(default_factory=dict)
    ready: int = 0  # items 0..ready-1 are here (what the last Progress reported)


class PartAssembler:
    def __init__(self, clock: Callable[[], float] = time.monotonic, early_ttl_s: float = 5.0,
                 max_early: int = 4096, remember_finished: int = 4096) -> None:  # fmt: skip
        self.clock = clock
        self.early_ttl_s = early_ttl_s
        self.max_early = max_early
        self.stats = ReceiverStats()
        self._pending: dict[str, _Pending] = {}
        self._early: OrderedDict[tuple[str, int], tuple[float, PartHeader, list[EmbeddingItem]]] = (
            OrderedDict()
        )
        self._finished: deque[str] = deque(maxlen=remember_finished)
        self._finished_set: set[str] = set()

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def expect(
        self, request_id: str, modalities: list[str], num_parts: int, timeout_s: float
    ) -> list[Complete | Progress | Failed]:
        """Start waiting for a request's parts; returns outcomes if early parts already complete it."""
        self._pending[request_id] = _Pending(modalities, num_parts, self.clock() + timeout_s)
        outcomes = []
        for key in [k for k in self._early if k[0] == request_id]:
            _, header, items = self._early.pop(key)
            outcomes.extend(self.add(header, items))
        return outcomes

    def cancel(self, request_id: str) -> None:
        """Forget a request (aborted, or failed elsewhere); later parts for it are dropped as stale."""
        if self._pending.pop(request_id, None) is not None:
            self._mark_finished(request_id)

    def add(self, header: PartHeader, items: list[EmbeddingItem]) -> list[Complete | Progress | Failed]:
        self.stats.parts += 1
        rid = header.request_id
        pending = self._pending.get(rid)
        if pending is None:
            if rid in self._finished_set:
                self.stats.dropped_stale += 1
            else:
                self._buffer_early(header, items)
            return []
        if header.num_parts != pending.num_parts or header.part_index >= pending.num_parts:
            self.stats.dropped_invalid += 1
            return []
        if header.error is not None:
            if header.error.status < 500:
                return [self._fail(rid, header.error)]
            pending.server_errors[header.part_index] = header.error.message
            return []
        if header.part_index in pending.parts:
            self.stats.dropped_duplicate += 1  # e.g. a slow encoder finishing after its retry did
            return []
        seen = {i for part in pending.parts.values() for i in (it.item_index for it in part)}
        for it in items:
            if (
                it.item_index >= len(pending.modalities)
                or it.item_index in seen
                or pending.modalities[it.item_index] != it.item.modality.value
            ):
                self.stats.dropped_invalid += 1
                return []
        pending.parts[header.part_index] = items
        pending.encoders[header.part_index] = header.encoder
        pending.cache_hits += header.cache_hits
        if len(pending.parts) < pending.num_parts:
            return self._progress(rid, pending)
        got = sorted((it for part in pending.parts.values() for it in part), key=lambda it: it.item_index)
        if [it.item_index for it in got] != list(range(len(pending.modalities))):
            failure = Failure(502, "incomplete_parts", "encoders returned parts that do not cover every item")
            return [self._fail(rid, failure)]
        del self._pending[rid]
        self._mark_finished(rid)
        owner = {it.item_index: pending.encoders[p] for p, part in pending.parts.items() for it in part}
        # A locally encoded part (failover) has no send time; a remote clock may be skewed: never below 0.
        transfer_s = max(0.0, time.time() - header.sent_at) if header.sent_at else 0.0
        return [
            Complete(
                rid,
                [it.item for it in got],
                [pending.encoders[i] for i in sorted(pending.encoders)],
                pending.cache_hits,
                [owner[it.item_index] for it in got],
                transfer_s,
            )
        ]

    def _progress(self, rid: str, pending: _Pending) -> list[Progress]:
        by_index = {it.item_index: it.item for part in pending.parts.values() for it in part}
        ready = pending.ready
        while ready in by_index:
            ready += 1
        if ready == pending.ready:
            return []
        pending.ready = ready
        return [Progress(rid, [by_index[i] for i in range(ready)])]

    def expire(self) -> list[Failed]:
        """Fail requests past their deadline and drop early parts past their TTL."""
        now = self.clock()
        failed = []
        for rid, pending in list(self._pending.items()):
            if now >= pending.deadline:
                missing = sorted(set(range(pending.num_parts)) - set(pending.parts))
                why = "; ".join(pending.server_errors.values()) or "no answer from the encoder"
                message = f"embedding part(s) {missing} did not arrive in time ({why})"
                failed.append(self._fail(rid, Failure(504, "encode_timeout", message)))
        while self._early:
            key, (arrived, _, _) = next(iter(self._early.items()))
            if now - arrived < self.early_ttl_s:
                break
            del self._early[key]
            self.stats.dropped_unknown += 1
        return failed

    def _buffer_early(self, header: PartHeader, items: list[EmbeddingItem]) -> None:
        if len(self._early) >= self.max_early:
            self._early.popitem(last=False)
            self.stats.dropped_unknown += 1
        self._early[(header.request_id, header.part_index)] = (self.clock(), header, items)
        self.stats.early_buffered += 1

    def _fail(self, rid: str, failure: Failure) -> Failed:
        self._pending.pop(rid, None)
        self._mark_finished(rid)
        return Failed(rid, failure)

    def _mark_finished(self, rid: str) -> None:
        if len(self._finished) == self._finished.maxlen:
            self._finished_set.discard(self._finished[0])
        self._finished.append(rid)
        self._finished_set.add(rid)
