"""Prefill side of the handoff: send a prefilled request's KV and state to its decode engine.

The engine loop detaches a request after its first token (its slots stay held) and calls `submit`; one
thread per decode engine (a `_Peer`, with its own DEALER socket) runs the protocol of
mmserve.disagg.kv_messages for its jobs in turn, and every outcome comes back through a pollable `Handoff`
for the loop, which alone frees the request's slots. A slow or dead decode engine delays only the jobs
addressed to it, and each job ends by its deadline (`kv_transfer_timeout_s` from submission) whatever
happens: a reply not received in time is a 504, a refusal carries the decode engine's status (503
`decode_at_capacity`: the router tries another decode server).

The sender thread reads the request's slots of the pools (its KV rows, and its state slot for a hybrid model)
while the loop runs other requests' forwards: those slots are owned by the detached request and written by
nobody until the loop frees them.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import queue
import threading
import time
from dataclasses import dataclass

import msgspec
import torch
import zmq

from mmserve.disagg import kv_messages as k
from mmserve.engine.cache.transfer import CacheTransfer, HandoffSlots
from mmserve.omp_pools import release_thread_pool
from mmserve.transport.cluster_auth import ClusterSecret
from mmserve.transport.handoff import Handoff
from mmserve.transport.messages import Failure

logger = logging.getLogger("mmserve.disagg")


@dataclass
class HandoffJob:
    request_id: str
    target: k.KvTarget
    state: k.HandoffState
    cache: HandoffSlots  # the prompt's slots in our pools and its state slot (held by the detached request)
    deadline: float  # time.monotonic()


@dataclass
class HandoffResult:
    request_id: str
    failure: Failure | None  # None: the decode engine committed the request
    kv_bytes: int = 0
    transfer_s: float = 0.0


class HandoffError(Exception):
    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.message)
        self.failure = failure


def _timeout(what: str, bootstrap: str) -> HandoffError:
    return HandoffError(
        Failure(504, "kv_transfer_timeout", f"decode engine {bootstrap} did not answer the KV {what} in time")
    )


class KvSender:
    def __init__(self, transfer: CacheTransfer, host: str, secret: ClusterSecret | None) -> None:
        self.transfer = transfer
        self.layout = k.cache_layout(transfer)
        self.host = host
        self.secret = secret
        self.results = Handoff()
        self.ctx = zmq.Context()
        self._peers: dict[str, _Peer] = {}
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()
        self._mooncake = None  # KvMooncake, created by the first mooncake job

    def submit(self, job: HandoffJob) -> None:
        peer = self._peers.get(job.target.bootstrap)
        if peer is None:
            peer = self._peers[job.target.bootstrap] = _Peer(self, job.target.bootstrap)
        peer.jobs.put(job)

    def cancel(self, request_id: str) -> None:
        """The request was aborted: its job stops at its next step (telling the decode engine) and reports."""
        with self._lock:
            self._cancelled.add(request_id)

    def is_cancelled(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._cancelled

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._cancelled.discard(request_id)

    def mooncake(self):
        with self._lock:
            if self._mooncake is None:
                from mmserve.disagg.kv_mooncake import KvMooncake

                self._mooncake = KvMooncake(self.transfer, self.host)
            return self._mooncake

    def frames(self, msg, payload: bytes | memoryview = b"") -> list:
        frames = [k.encoder.encode(msg), payload]
        return self.secret.sign(frames) if self.secret is not None else frames

    def close(self) -> None:
        for peer in self._peers.values():
            peer.stop()
        self.ctx.term()
        self.results.close()
        if self._mooncake is not None:
            self._mooncake.close()


class _Peer:
    """One decode engine: its socket and the thread that runs its jobs in order."""

    def __init__(self, sender: KvSender, bootstrap: str) -> None:
        self.sender = sender
        self.bootstrap = bootstrap
        self.jobs: queue.SimpleQueue[HandoffJob | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=f"kv-send-{bootstrap}", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=5)

    def _run(self) -> None:
        sock = self.sender.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.bootstrap)
        try:
            while (job := self.jobs.get()) is not None:
                start = time.perf_counter()
                try:
                    sent = self._handoff(sock, job)
                    result = HandoffResult(job.request_id, None, sent, time.perf_counter() - start)
                except HandoffError as e:
                    result = HandoffResult(job.request_id, e.failure)
                except Exception as e:  # a bug or a transport failure: this request fails, the peer goes on
                    logger.exception("KV handoff of %s to %s failed", job.request_id, self.bootstrap)
                    result = HandoffResult(
                        job.request_id, Failure(502, "kv_transfer_failed", f"{type(e).__name__}: {e}")
                    )
                self.sender.results.put(result)
                if self.jobs.empty():  # idle: the gather's OpenMP pool would slow the steps (omp_pools.py)
                    release_thread_pool()
        finally:
            sock.close(0)

    def _handoff(self, sock: zmq.Socket, job: HandoffJob) -> int:
        room, handoff = job.target.room, job.state
        cache = job.cache
        done = handoff.finish_reason is not None  # the first token ended it: nothing moves
        rows = 0 if done else cache.slots.numel()
        total = 0 if done else len(handoff.prompt_ids) + handoff.sampling.max_tokens
        window_rows = 0 if done or cache.window_slots is None else cache.window_slots.numel()
        backend = job.target.backend
        order: list[int] = []
        if rows and backend == "mooncake":
            ranks = torch.empty_like(cache.slots)
            ranks[cache.slots.argsort()] = torch.arange(rows)
            order = ranks.tolist()
        state = rows > 0 and cache.state_slot is not None
        reserve = k.Reserve(
            k.KV_PROTOCOL_VERSION, room, rows, total, self.sender.layout, backend, time.time(), state=state,
            order=order, window_rows=window_rows,
        )
        self._send(sock, reserve)
        reply = self._reply(sock, job, "reservation")
        if isinstance(reply, k.Refused):
            raise HandoffError(reply.failure)
        assert isinstance(reply, k.Reserved)
        if len(reply.slots) != rows or (reply.state_slot is None) == state or len(reply.window_slots) != window_rows:
            raise HandoffError(
                Failure(
                    502,
                    "kv_transfer_failed",
                    f"decode engine reserved {len(reply.slots)} slots for {rows} rows, "
                    f"{len(reply.window_slots)} window slots for {window_rows}"
                    + (" and no state slot" if state and reply.state_slot is None else ""),
                )
            )
        self._check_cancel(sock, job)
        payload: bytes | memoryview = b""
        src = HandoffSlots(cache.slots, cache.window_slots if window_rows else None, cache.state_slot if state else None)
        if rows and backend == "mooncake":
            if reply.mooncake is None:
                raise HandoffError(
                    Failure(502, "kv_transfer_failed", "decode engine offers no Mooncake target")
                )
            dst = HandoffSlots(
                torch.tensor(reply.slots, dtype=torch.int64),
                torch.tensor(reply.window_slots, dtype=torch.int64) if window_rows else None,
                reply.state_slot,
            )
            moved = self.sender.mooncake().write(reply.mooncake, src, dst)
        elif rows:
            data = self.sender.transfer.read(src)  # KV planes, then window planes, then state
            payload = memoryview(data.numpy())
            moved = payload.nbytes
        else:
            moved = 0
        if time.monotonic() > job.deadline:
            self._send(sock, k.Cancel(room, "timeout", time.time()))
            raise _timeout("transfer", self.bootstrap)
        self._check_cancel(sock, job)
        self._send(sock, k.Commit(room, handoff, time.time()), payload)
        reply = self._reply(sock, job, "commit")
        if isinstance(reply, k.Refused):
            raise HandoffError(reply.failure)
        return moved

    def _send(self, sock: zmq.Socket, msg, payload: bytes | memoryview = b"") -> None:
        sock.send_multipart(self.sender.frames(msg, payload), copy=False)

    def _check_cancel(self, sock: zmq.Socket, job: HandoffJob) -> None:
        if self.sender.is_cancelled(job.request_id):
            self._send(sock, k.Cancel(job.target.room, "aborted", time.time()))
            raise HandoffError(Failure(499, "aborted", "the request was aborted during its KV handoff"))

    def _reply(self, sock: zmq.Socket, job: HandoffJob, what: str):
        """The decode engine's answer for this job's room (answers to earlier, timed-out jobs are skipped)."""
        while True:
            left = job.deadline - time.monotonic()
            if left <= 0 or not sock.poll(int(left * 1000) + 1):
                with contextlib.suppress(zmq.ZMQError):
                    self._send(sock, k.Cancel(job.target.room, "timeout", time.time()))
                raise _timeout(what, self.bootstrap)
            frames = sock.recv_multipart()
            secret = self.sender.secret
            if secret is not None and (len(frames) != 3 or not _mac_ok(secret, frames)):
                logger.warning("dropped a KV reply from %s with a missing or wrong MAC", self.bootstrap)
                continue
            try:
                reply = k.from_decode.decode(frames[0])
            except msgspec.DecodeError:
                logger.warning("dropped an undecodable KV reply from %s", self.bootstrap)
                continue
            if reply.room == job.target.room:
                return reply


def _mac_ok(secret: ClusterSecret, frames: list[bytes]) -> bool:
    return hmac.compare_digest(frames[2], secret.mac(frames[0], frames[1]))
