"""The ``tcp://`` and ``ipc://`` transports: ZMQ PUSH/PULL carrying embedding parts (see ``embedding_wire``).

Encoders hold one :class:`EmbeddingSender` (a PUSH socket per destination, reused across parts); the
engine binds one :class:`EmbeddingReceiver` (a PULL socket) that every encoder connects to. The payload
travels in the message itself; the receiver's tensors view the received frame in place.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType

import zmq

from mmserve.transport.channel import SendTimeout, TransferConfig
from mmserve.transport.cluster_auth import ClusterSecret, PartVerifier
from mmserve.transport.embedding_wire import NUM_FRAMES, EmbeddingItem, OutgoingPart, PartHeader, decode_part

__all__ = ["EmbeddingReceiver", "EmbeddingSender", "SendTimeout", "open_receiver", "open_sender"]

# Messages (parts) queued per endpoint before send blocks; parts are large, so keep these modest.
SEND_HWM = 16
RECV_HWM = 64


@dataclass
class _Endpoint:
    socket: zmq.Socket
    lock: threading.Lock  # zmq sockets are not thread-safe: one sender at a time per socket
    closed: bool = False


class EmbeddingSender:
    """One persistent PUSH socket per destination endpoint, created on first use, with SNDTIMEO/LINGER set.

    Owns its sockets, and the context when none is passed in. Thread-safe: sends to different endpoints
    proceed in parallel, sends to the same endpoint are serialized. Do not call ``send`` after ``close``.
    """

    def __init__(
        self, send_timeout_s: float = 5.0, ctx: zmq.Context | None = None, signer: ClusterSecret | None = None
    ) -> None:
        self._signer = signer  # appends an HMAC frame to every part (cluster secret set)
        self._timeout_s = send_timeout_s
        self._timeout_ms = max(1, math.ceil(send_timeout_s * 1000))
        self._owns_ctx = ctx is None
        self._ctx = zmq.Context() if ctx is None else ctx
        self._lock = threading.Lock()  # guards _endpoints and _closed
        self._endpoints: dict[str, _Endpoint] = {}
        self._closed = False

    @property
    def num_sockets(self) -> int:
        """Number of open destination sockets."""
        with self._lock:
            return len(self._endpoints)

    def _new_socket(self, endpoint: str) -> zmq.Socket:
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDTIMEO, self._timeout_ms)
        # Unsent parts get the same grace as a send; close() never hangs longer than that.
        sock.setsockopt(zmq.LINGER, self._timeout_ms)
        sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        # Without IMMEDIATE a PUSH socket queues to a peer that never came up, and the send "succeeds".
        sock.setsockopt(zmq.IMMEDIATE, 1)
        try:
            sock.connect(endpoint)
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        return sock

    def _endpoint(self, endpoint: str) -> _Endpoint:
        with self._lock:
            if self._closed:
                raise RuntimeError("EmbeddingSender is closed")
            ep = self._endpoints.get(endpoint)
            if ep is None:
                ep = _Endpoint(self._new_socket(endpoint), threading.Lock())
                self._endpoints[endpoint] = ep
            return ep

    def stats(self) -> dict[str, float]:
        return {}

    def send(self, endpoint: str, frames: OutgoingPart | Sequence[bytes | memoryview | zmq.Frame]) -> None:
        """Send one part (or raw multipart message) to ``endpoint``, connecting on first use.

        Frames are sent without copying, so their buffers must stay unmodified after this returns.
        Raises :class:`SendTimeout` when the peer is absent or does not take the message (its queue is
        full) within ``send_timeout_s``; nothing of the message is sent in that case.
        """
        if isinstance(frames, OutgoingPart):
            frames = frames.frames()
        if self._signer is not None:
            frames = self._signer.sign(frames)
        ep = self._endpoint(endpoint)
        with ep.lock:
            if ep.closed:
                raise RuntimeError("EmbeddingSender is closed")
            try:
                ep.socket.send_multipart(frames, copy=False)
            except zmq.Again as e:
                raise SendTimeout(f"{endpoint} did not take the message within {self._timeout_s}s") from e

    def close(self) -> None:
        """Close every socket (pending parts linger at most ``send_timeout_s``), and the context if owned."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            endpoints = list(self._endpoints.values())
            self._endpoints.clear()
        for ep in endpoints:
            with ep.lock:
                ep.closed = True
                ep.socket.close()
        if self._owns_ctx:
            self._ctx.term()

    def __enter__(self) -> EmbeddingSender:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class EmbeddingReceiver:
    """PULL socket bound to an endpoint ("tcp://127.0.0.1:0" picks a free port; ``endpoint`` is the actual one).

    Owns the socket, and the context when none is passed in. Single consumer: not thread-safe.
    ``socket`` is exposed for registering with a ``zmq.Poller``; read from it only via ``recv_part``.
    """

    def __init__(
        self,
        bind: str = "tcp://127.0.0.1:0",
        ctx: zmq.Context | None = None,
        verifier: PartVerifier | None = None,
    ) -> None:
        # With a verifier, only signed, fresh, first-seen parts are accepted (PartRejected otherwise); without,
        # a signature frame is ignored.
        self._verifier = verifier
        self._owns_ctx = ctx is None
        self._ctx = zmq.Context() if ctx is None else ctx
        self._closed = False
        self.socket: zmq.Socket = self._ctx.socket(zmq.PULL)
        self.socket.setsockopt(zmq.RCVHWM, RECV_HWM)
        self.socket.setsockopt(zmq.LINGER, 0)
        try:
            self.socket.bind(bind)
        except zmq.ZMQError:
            self.close()
            raise
        self.endpoint: str = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.pollable = self.socket

    def stats(self) -> dict[str, float]:
        return {}

    def recv_part(
        self, timeout_s: float, *, copy: bool = False
    ) -> tuple[PartHeader, list[EmbeddingItem]] | None:
        """Receive and decode one part; ``None`` if nothing arrives within ``timeout_s``.

        Raises ``WireError`` for a malformed message, ``PartRejected`` for one failing authentication.
        The whole multipart message is consumed before
        decoding (ZMQ delivers multipart messages atomically), so the next call starts at a message
        boundary. By default the returned tensors are read-only views over the received frame, which they
        keep alive; ZMQ never reuses a delivered message's memory, so later receives cannot change them.
        Pass ``copy=True`` for tensors that own writable memory (see ``decode_part``).
        """
        if not self.socket.poll(max(0, math.ceil(timeout_s * 1000)), zmq.POLLIN):
            return None
        try:
            frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        if self._verifier is None:
            return decode_part(frames[:NUM_FRAMES] if len(frames) == NUM_FRAMES + 1 else frames, copy=copy)
        mac = self._verifier.check_mac(frames)
        header, items = decode_part(frames[:NUM_FRAMES], copy=copy)
        self._verifier.check_fresh(mac, header.sent_at)
        return header, items

    def close(self) -> None:
        """Close the socket, dropping anything unread, and the context if owned."""
        if self._closed:
            return
        self._closed = True
        self.socket.close(linger=0)
        if self._owns_ctx:
            self._ctx.term()

    def __enter__(self) -> EmbeddingReceiver:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def open_sender(cfg: TransferConfig, signer: ClusterSecret | None) -> EmbeddingSender:
    return EmbeddingSender(cfg.send_timeout_s, signer=signer)


def open_receiver(bind: str, cfg: TransferConfig, secret: ClusterSecret | None) -> EmbeddingReceiver:
    return EmbeddingReceiver(bind, verifier=PartVerifier(secret) if secret else None)
