"""The ``mooncake://`` transport: payloads move with Mooncake's transfer engine (TCP here, RDMA where the
hardware has it), the header over a small ZMQ control channel.

Both sides register one long-lived pool with their ``TransferEngine`` (P2P handshake: no metadata server;
``--mooncake-pool-mb``). Per part the encoder's :class:`MooncakeSender` writes the payload into a region of
its pool and sends ``(header, its engine's address, region address, nbytes)`` to the engine's control
socket; the engine's :class:`MooncakeReceiver` carves a region out of its own pool, pulls the bytes with one
``transfer_sync_read``, acknowledges (the sender reuses its region) and builds the tensors on the landed
bytes in place. The engine's region goes back to its pool when the last tensor viewing it is gone.

The endpoint names the control socket: ``mooncake://HOST:PORT``. A sender whose part is not acknowledged in
``send_timeout_s`` fails the send (the dispatcher retries elsewhere) and keeps the region out of use for a
grace period, since the engine might still read it. Mooncake's TCP transport authenticates nobody: run it on
a trusted network, as its users do; with a cluster secret the MAC covers the header and the landed bytes.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable

import msgspec
import torch
import zmq

from mmserve.transport.channel import SendTimeout, TransferConfig
from mmserve.transport.cluster_auth import ClusterSecret, PartRejected, PartVerifier
from mmserve.transport.embedding_wire import EmbeddingItem, OutgoingPart, PartHeader, WireError, decode_part
from mmserve.transport.handoff import Handoff, detached
from mmserve.transport.regions import PoolExhausted, RegionAllocator, owned_view

logger = logging.getLogger("mmserve.transport")
POLL_MS = 200


class Offer(msgspec.Struct, tag="offer"):
    seq: int
    header: bytes
    session: str  # the sender's transfer engine, "host:rpc_port"
    address: int  # of the payload in the sender's registered pool
    nbytes: int  # 0: no payload (an error part)
    mac: bytes = b""


class Ack(msgspec.Struct, tag="ack"):
    seq: int
    error: str = ""


_encoder = msgspec.msgpack.Encoder()
_offers = msgspec.msgpack.Decoder(Offer)
_acks = msgspec.msgpack.Decoder(Ack)


class _Pool:
    """A pool of ``nbytes`` registered with a freshly initialized transfer engine on ``host``."""

    def __init__(self, host: str, nbytes: int) -> None:
        from mooncake.engine import TransferEngine  # imported here: its native library loads only when used

        self.engine = TransferEngine()
        if self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
            raise OSError(f"Mooncake transfer engine did not start on {host}")
        self.tensor = torch.zeros(nbytes, dtype=torch.uint8)  # touched once: no page faults per transfer
        if self.engine.register_memory(self.tensor.data_ptr(), nbytes) != 0:
            raise OSError("Mooncake could not register the transfer pool")
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        self.regions = RegionAllocator(nbytes)

    @property
    def address(self) -> int:
        return self.tensor.data_ptr()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.engine.unregister_memory(self.address)


class MooncakeSender:
    """One control socket per engine; parts to one engine go one at a time (each waits for its ack)."""

    def __init__(self, cfg: TransferConfig, signer: ClusterSecret | None = None) -> None:
        self.cfg, self._signer = cfg, signer
        self._pool = _Pool(cfg.host, max(1 << 20, int(cfg.mooncake_pool_mb * 2**20)))
        self._ctx = zmq.Context()
        self._lock = threading.Lock()
        self._sockets: dict[str, tuple[zmq.Socket, threading.Lock]] = {}
        self._seq = itertools.count(1)
        self._timers: list[threading.Timer] = []
        self.sent = self.timeouts = 0

    def _socket(self, endpoint: str) -> tuple[zmq.Socket, threading.Lock]:
        with self._lock:
            entry = self._sockets.get(endpoint)
            if entry is None:
                sock = self._ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.IMMEDIATE, 1)  # no queueing towards an engine that is not there
                sock.setsockopt(zmq.SNDTIMEO, max(1, int(self.cfg.send_timeout_s * 1000)))
                sock.connect("tcp://" + endpoint.removeprefix("mooncake://"))
                entry = self._sockets[endpoint] = (sock, threading.Lock())
            return entry

    def send(self, endpoint: str, part: OutgoingPart) -> None:
        regions, offset = self._pool.regions, None
        if part.nbytes:
            try:
                offset = regions.alloc(part.nbytes, self.cfg.send_timeout_s)
            except PoolExhausted as e:
                raise SendTimeout(f"{endpoint}: Mooncake pool full ({e}); see --mooncake-pool-mb") from e
            part.write_into(self._pool.tensor[offset : offset + part.nbytes])
        try:
            self._offer(endpoint, part, offset or 0)
        except SendTimeout:
            if offset is not None:  # the engine may still read the region: keep it out of use for a while
                timer = threading.Timer(4 * self.cfg.send_timeout_s, regions.free, [offset])
                timer.daemon = True
                timer.start()
                self._timers = [t for t in self._timers if t.is_alive()] + [timer]
            self.timeouts += 1
            raise
        if offset is not None:
            regions.free(offset)
        self.sent += 1

    def _offer(self, endpoint: str, part: OutgoingPart, offset: int) -> None:
        header, seq = part.header(), next(self._seq)
        mac = b""
        if self._signer is not None:
            mac = self._signer.mac(header, self._pool.tensor[offset : offset + part.nbytes].numpy())
        offer = Offer(seq, header, self._pool.session, self._pool.address + offset, part.nbytes, mac)
        sock, lock = self._socket(endpoint)
        with lock:
            try:
                sock.send(_encoder.encode(offer))
            except zmq.Again as e:
                raise SendTimeout(f"{endpoint} is not reachable") from e
            deadline = time.monotonic() + self.cfg.send_timeout_s
            while (left := deadline - time.monotonic()) > 0 and sock.poll(max(1, int(left * 1000))):
                ack = _acks.decode(sock.recv())
                if ack.seq == seq:  # a late ack of an earlier, timed-out part is skipped
                    if ack.error:
                        raise SendTimeout(f"{endpoint} could not take the part: {ack.error}")
                    return
            raise SendTimeout(f"{endpoint} did not acknowledge the part within {self.cfg.send_timeout_s}s")

    def stats(self) -> dict[str, float]:
        return {
            "mooncake_pool_bytes": self._pool.regions.capacity,
            "mooncake_pool_used_bytes": self._pool.regions.used_bytes,
            "mooncake_send_timeouts": self.timeouts,
        }

    def close(self) -> None:
        for timer in self._timers:
            timer.cancel()
        with self._lock:
            sockets, self._sockets = list(self._sockets.values()), {}
        for sock, _ in sockets:
            sock.close(linger=0)
        self._ctx.term()
        self._pool.close()


class MooncakeReceiver:
    """Binds the control socket on ``mooncake://HOST:PORT`` (port 0: any free one); a thread pulls payloads
    into the pool and hands decoded parts to the engine loop (see module docstring)."""

    def __init__(self, bind: str, cfg: TransferConfig, secret: ClusterSecret | None = None) -> None:
        host, _, port = bind.removeprefix("mooncake://").rpartition(":")
        host = host or cfg.host
        self.cfg = cfg
        self._pool = _Pool(host, max(1 << 20, int(cfg.mooncake_pool_mb * 2**20)))
        self._verifier = PartVerifier(secret) if secret else None  # used by the thread only
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        if port in ("", "0"):
            self._router.bind_to_random_port(f"tcp://{host}")
        else:
            self._router.bind(f"tcp://{host}:{port}")
        self.endpoint = "mooncake://" + self._router.getsockopt_string(zmq.LAST_ENDPOINT).removeprefix(
            "tcp://"
        )
        self._ready = Handoff()
        self.pollable = self._ready
        self._releases: list[
            int
        ] = []  # appended by views' finalizers (list.append is atomic), freed by the thread
        self.parts = self.failed_transfers = 0
        self._running = True
        self._thread = threading.Thread(target=self._run, name="mooncake-receiver", daemon=True)
        self._thread.start()

    def recv_part(self, timeout_s: float) -> tuple[PartHeader, list[EmbeddingItem]] | None:
        return self._ready.get(timeout_s)

    def stats(self) -> dict[str, float]:
        self._free_released()  # exact now, not at the thread's next turn (finalizers only append: no race)
        return {
            "mooncake_held_bytes": self._pool.regions.used_bytes,
            "mooncake_failed_transfers": self.failed_transfers,
        }

    def close(self) -> None:
        if not self._running:
            return
        self._running = False
        self._thread.join(timeout=5)
        self._router.close(linger=0)
        self._ctx.term()
        self._ready.close()
        self._pool.close()

    # -- receiver thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        while self._running:
            self._free_released()
            if not self._router.poll(POLL_MS):
                continue
            identity, raw = self._router.recv_multipart()[:2]
            try:
                offer = _offers.decode(raw)
            except msgspec.DecodeError as e:
                self._ready.put(WireError(f"undecodable Mooncake offer: {e}"))
                continue
            error = self._take(offer)
            with contextlib.suppress(zmq.ZMQError):
                self._router.send_multipart([identity, _encoder.encode(Ack(offer.seq, error))], zmq.NOBLOCK)

    def _free_released(self) -> None:
        """Free the regions whose last view died (called by the receiver thread and by ``stats``)."""
        while True:
            try:
                offset = self._releases.pop()  # atomic: each offset is freed by exactly one caller
            except IndexError:
                return
            self._pool.regions.free(offset)

    def _take(self, offer: Offer) -> str:
        """Pull and hand over one part; returns the error to acknowledge with ("" when the bytes landed)."""
        payload: memoryview | bytes = b""
        if offer.nbytes < 0:
            return "negative size"
        if offer.nbytes:
            try:
                offset = self._pool.regions.alloc(offer.nbytes, self.cfg.send_timeout_s / 2)
            except PoolExhausted as e:
                return f"engine pool full: {e}"
            rc = self._pool.engine.transfer_sync_read(
                offer.session, self._pool.address + offset, offer.address, offer.nbytes
            )
            if rc != 0:
                self._pool.regions.free(offset)
                self.failed_transfers += 1
                self._ready.put(
                    PartRejected("forged", f"Mooncake read from {offer.session} failed (rc {rc})")
                )
                return f"transfer failed (rc {rc})"
            payload = owned_view(
                self._pool.tensor.numpy(), offset, offer.nbytes, _appender(self._releases, offset)
            )
        self.parts += 1
        try:
            if self._verifier is not None:
                mac = self._verifier.check_mac([offer.header, payload, offer.mac])
            header, items = decode_part([offer.header, payload], copy=False)
            if self._verifier is not None:
                self._verifier.check_fresh(mac, header.sent_at)
            self._ready.put((header, items))
        except (WireError, PartRejected) as e:
            del payload
            self._ready.put(detached(e))
        return ""


def _appender(target: list[int], offset: int) -> Callable[[], None]:
    return lambda: target.append(offset)


def open_sender(cfg: TransferConfig, signer: ClusterSecret | None) -> MooncakeSender:
    return MooncakeSender(cfg, signer)


def open_receiver(bind: str, cfg: TransferConfig, secret: ClusterSecret | None) -> MooncakeReceiver:
    return MooncakeReceiver(bind, cfg, secret)
