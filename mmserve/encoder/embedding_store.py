"""The global embedding store: item embeddings shared by every instance pointed at the same Mooncake master.

`MultimodalEncoder.encode` looks an item up in three tiers: its local LRU (`EmbeddingCache`), then this
store, then the tower; what the tower computed is written here in the background. Two instances serving
the same checkpoint (monolithic servers, encoder services, encoder workers) thus encode an item once.

Keys (content hash + model fingerprint) and values (a one-item wire part, signed with a cluster secret) are
`store_entry.py`'s; the store clients (Mooncake) `store_backends.py`'s. This file is the policy: tiers,
bounded calls, back-off, background writes, counters.

With a cluster secret, entries are signed with a key derived for this purpose only, and an entry without a
valid MAC is refused; without one, MACs are not checked (the store is then trusted like an unauthenticated
ZMQ peer). Every entry read is also checked to be the requested item (content hash, modality) and to fit
the model (`ModelFamily.check_item`); a refused entry is counted, recomputed and overwritten.

Degradation: Mooncake's calls block in C++ (measured here: 4.3 s per call with the master gone, 30 s with it
stopped). Each get or put runs on its own daemon thread and is given up after `timeout_s` (the item is
encoded locally); at most `MAX_CALLS_IN_FLIGHT` may be outstanding. A failed or timed-out call, or a failed
setup, leaves the store alone for `retry_s` (lookups skip it, puts are dropped, all counted). Setup runs on a
background thread, retried every `retry_s`, so a server starts without its store and picks it up later.
`setup` and `close` hold the GIL (4.4 s for a setup against a dead master), so setup is attempted only when
the master's port answers; `close` (at shutdown) blocks ~5 s when the master is gone.

Threads: the connector (until set up), one put worker (bounded queue), one short-lived thread per call.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from mmserve.config import EmbeddingStoreConfig
from mmserve.encoder.store_backends import BACKENDS, StoreBackend, StoreError, reachable
from mmserve.encoder.store_entry import EntryRejected, decode_entry, encode_entry, entry_key
from mmserve.multimodal.items import ItemEmbedding, Modality
from mmserve.transport.cluster_auth import ClusterSecret

logger = logging.getLogger("mmserve.embedding_store")

MAX_CALLS_IN_FLIGHT = 4  # calls stuck in C++ past their timeout still hold a slot until they return
REPAIR_MEMORY = 1024  # keys of refused entries remembered, so that the recomputed value replaces them


# -- counters ---------------------------------------------------------------------------------------
@dataclass
class StoreStats:
    """Counters since start, one metric each (`METRIC_DOCS`) on the encoder service's and the API server's
    /metrics. Mean latencies: get_seconds_total / (hits + misses + rejected + get_errors), and
    put_seconds_total / (puts + put_errors)."""

    hits: int = 0
    misses: int = 0
    rejected: int = 0
    get_errors: int = 0
    skipped: int = 0
    puts: int = 0
    put_errors: int = 0
    puts_dropped: int = 0
    get_seconds_total: float = 0.0
    put_seconds_total: float = 0.0
    connected: int = 0

    def as_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in asdict(self).items()}


# StoreStats field -> help text; the metrics modules name each `<prefix>embedding_store_<field>`.
METRIC_DOCS: dict[str, str] = {
    "hits": "Items found in the global embedding store",
    "misses": "Lookups the embedding store did not have",
    "rejected": "Store entries refused (bad signature, malformed, another item or model) and recomputed",
    "get_errors": "Store lookups that failed or ran past --embedding-store-timeout-s (encoded locally)",
    "skipped": "Lookups answered locally without asking the store (not set up, or backing off)",
    "puts": "Entries written to the embedding store",
    "put_errors": "Store writes that failed or ran past the timeout",
    "puts_dropped": "Entries not written: put queue full, entry too large, or store unavailable",
    "get_seconds_total": "Seconds spent in embedding store lookups",
    "put_seconds_total": "Seconds spent writing embedding store entries",
    "connected": "1 while the embedding store is set up and not backing off after an error",
}


# -- the tier -----------------------------------------------------------------------------------------------
@dataclass
class _Put:
    key: str
    item: ItemEmbedding
    replace: bool


class EmbeddingStore:
    """The store tier of one encoder (see module docstring). Thread-safe: `get` and `put` are called by any
    number of encode threads; `close` stops the background threads."""

    def __init__(
        self,
        cfg: EmbeddingStoreConfig,
        fingerprint: str,
        secret: ClusterSecret | None = None,
        check_item: Callable[[ItemEmbedding], None] | None = None,
    ) -> None:
        if cfg.scheme not in BACKENDS:
            raise ValueError(f"unknown embedding store scheme {cfg.scheme!r}; known: {sorted(BACKENDS)}")
        BACKENDS[cfg.scheme].configure_process()
        self.cfg = cfg
        self.fingerprint = fingerprint
        # NOTE: a key derived for the store alone: a signed entry cannot pass for a ZMQ part, nor the reverse.
        self._mac_key = secret.derive(b"embedding-store") if secret is not None else None
        self._check_item = check_item
        self.stats = StoreStats()
        self._lock = threading.Lock()  # stats, _backend, _down_until, _repair
        self._backend: StoreBackend | None = None
        self._down_until = 0.0
        self._repair: OrderedDict[str, None] = OrderedDict()
        self._slots = threading.BoundedSemaphore(MAX_CALLS_IN_FLIGHT)
        self._puts: queue.Queue[_Put | None] = queue.Queue(maxsize=cfg.put_queue_items)
        self._pending_puts = 0  # queued or being written
        self._closed = threading.Event()
        self._threads = [
            threading.Thread(target=self._connect_loop, name="emb-store-connect", daemon=True),
            threading.Thread(target=self._put_loop, name="emb-store-put", daemon=True),
        ]
        for t in self._threads:
            t.start()

    @property
    def connected(self) -> bool:
        return self._available() is not None

    def key(self, digest: bytes) -> str:
        return entry_key(self.fingerprint, digest)

    # -- lookups --------------------------------------------------------------------------------------
    def get(self, digest: bytes, modality: Modality) -> ItemEmbedding | None:
        """The stored embedding of the item `digest`, or None (not there, refused, or the store is
        unavailable or slow: never raises). Blocks at most `timeout_s`."""
        backend = self._available()
        if backend is None:
            self._count(skipped=1)
            return None
        key = self.key(digest)
        start = time.perf_counter()
        try:
            value = self._bounded(backend.get, key)
            item = None if value is None else self._accept(key, value, digest, modality)
        except EntryRejected as e:
            logger.warning("refused embedding store entry %s: %s", key, e)
            with self._lock:
                self._repair[key] = None
                while len(self._repair) > REPAIR_MEMORY:
                    self._repair.popitem(last=False)
            self._count(rejected=1, get_seconds_total=time.perf_counter() - start)
            return None
        except StoreError as e:
            self._failed("lookup", e)
            self._count(get_errors=1, get_seconds_total=time.perf_counter() - start)
            return None
        if item is None:
            self._count(misses=1, get_seconds_total=time.perf_counter() - start)
        else:
            self._count(hits=1, get_seconds_total=time.perf_counter() - start)
        return item

    def _accept(self, key: str, value: bytes, digest: bytes, modality: Modality) -> ItemEmbedding:
        try:
            item = decode_entry(key, value, self._mac_key)
        except EntryRejected:
            raise
        except Exception as e:  # whatever bytes another writer left there: never a failed request
            raise EntryRejected(f"undecodable entry ({type(e).__name__}: {e})") from e
        if bytes(item.content_hash) != digest or item.modality != modality:
            raise EntryRejected("entry holds another item than its key names")
        if self._check_item is not None:
            try:
                self._check_item(item)
            except Exception as e:  # EmbeddingMismatch, or metadata the family cannot even parse
                raise EntryRejected(str(e)) from e
        return item

    # -- writes ---------------------------------------------------------------------------------------
    def put(self, item: ItemEmbedding) -> None:
        """Write `item` in the background (never blocks; dropped and counted when the queue is full or the
        store unavailable). Its tensors must not be modified afterwards (they are read on another thread)."""
        if self._closed.is_set() or self._available() is None:
            self._count(puts_dropped=1)
            return
        key = self.key(bytes(item.content_hash))
        with self._lock:
            replace = key in self._repair  # a refused entry is there: overwrite it
            self._repair.pop(key, None)
            self._pending_puts += 1
        try:
            self._puts.put_nowait(_Put(key, item, replace))
        except queue.Full:
            self._put_finished()
            self._count(puts_dropped=1)

    def _put_loop(self) -> None:
        while True:
            job = self._puts.get()
            if job is None:
                return
            try:
                self._write(job)
            except Exception:  # a bug here must not end the worker: the store is an optimisation
                logger.exception("embedding store put of %s failed", job.key)
            finally:
                self._put_finished()

    def _write(self, job: _Put) -> None:
        backend = self._available()
        parts = encode_entry(job.key, job.item, self._mac_key) if backend is not None else []
        if backend is None or sum(memoryview(p).nbytes for p in parts) > self.cfg.buffer_mb * 2**20:
            self._count(puts_dropped=1)
            return
        start = time.perf_counter()
        try:
            self._bounded(backend.put, job.key, parts, job.replace)
        except StoreError as e:
            self._failed("write", e)
            self._count(put_errors=1, put_seconds_total=time.perf_counter() - start)
            return
        self._count(puts=1, put_seconds_total=time.perf_counter() - start)

    def drain(self, timeout_s: float) -> bool:
        """Wait until every queued put is written or dropped; False if that took longer than `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self._pending_puts:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    # -- availability -----------------------------------------------------------------------------------
    def _available(self) -> StoreBackend | None:
        with self._lock:
            if self._backend is None or time.monotonic() < self._down_until:
                return None
            return self._backend

    def _failed(self, what: str, error: Exception) -> None:
        with self._lock:
            was_up = time.monotonic() >= self._down_until
            self._down_until = time.monotonic() + self.cfg.retry_s
        if was_up:
            retry = self.cfg.retry_s
            logger.warning(
                "embedding store %s failed (%s); encoding locally, retrying in %g s", what, error, retry
            )

    def _bounded(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on its own daemon thread, given up after timeout_s (the thread runs on; it keeps a
        call slot until it returns). Raises StoreError for a failure, a timeout or no free slot."""
        if not self._slots.acquire(blocking=False):
            raise StoreError(f"{MAX_CALLS_IN_FLIGHT} calls still outstanding")
        done = threading.Event()
        outcome: list = []

        def run() -> None:
            try:
                outcome.append((True, fn(*args)))
            except BaseException as e:
                outcome.append((False, e))
            finally:
                self._slots.release()
                done.set()

        threading.Thread(target=run, name="emb-store-call", daemon=True).start()
        if not done.wait(self.cfg.timeout_s):
            raise StoreError(f"no answer in {self.cfg.timeout_s} s")
        ok, result = outcome[0]
        if ok:
            return result
        if isinstance(result, StoreError | EntryRejected):
            raise result
        raise StoreError(f"{type(result).__name__}: {result}") from result

    def _connect_loop(self) -> None:
        cfg, warned = self.cfg, False
        while not self._closed.is_set():
            error: Exception | None = None
            # setup() holds the GIL for seconds against a dead master: try only when its port answers.
            if not reachable(cfg.address, cfg.timeout_s):
                error = StoreError(f"master {cfg.address} not reachable")
            else:
                try:
                    backend = BACKENDS[cfg.scheme](cfg)
                except ImportError as e:
                    logger.error(
                        "embedding store disabled: %s (install mooncake-transfer-engine-non-cuda)", e
                    )
                    return
                except Exception as e:
                    error = e
                else:
                    with self._lock:
                        self._backend = backend
                    logger.info("embedding store %s connected (model %s)", cfg.url, self.fingerprint)
                    if self._closed.is_set():
                        self._close_backend()
                    return
            if not warned:
                msg = "embedding store %s unavailable (%s); serving without it, retrying every %g s"
                logger.warning(msg, cfg.url, error, cfg.retry_s)
                warned = True
            self._closed.wait(cfg.retry_s)

    def _put_finished(self) -> None:
        with self._lock:
            self._pending_puts -= 1

    def _count(self, **deltas: float) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self.stats, name, getattr(self.stats, name) + delta)
            self.stats.connected = int(self._backend is not None and time.monotonic() >= self._down_until)

    def snapshot(self) -> StoreStats:
        """A consistent copy of the counters."""
        self._count()
        with self._lock:
            return StoreStats(**asdict(self.stats))

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the threads (queued puts are written for up to `timeout_s`) and close the client. At
        shutdown only: closing holds the GIL (see module docstring)."""
        self.drain(timeout_s)
        self._closed.set()
        try:
            self._puts.put_nowait(None)
        except queue.Full:
            pass  # the worker is stuck in a call: it is a daemon thread
        self._close_backend()

    def _close_backend(self) -> None:
        with self._lock:
            backend, self._backend = self._backend, None
        if backend is not None:
            # NOTE: with the master gone this blocks ~5 s holding the GIL (Mooncake retries unmounting its
            # segment); its exit hook would do the same for a client left open. Only at shutdown.
            backend.close()
