"""The transfer seam: how embedding parts move from encoders to an engine, chosen by the endpoint's scheme.

An engine binds one receiver per transport it offers and announces their endpoints; the dispatcher tells
each encoder which endpoint to reply to; the encoder's :class:`PartSenders` picks the sender for that
endpoint's scheme. Nothing outside ``mmserve.transport`` constructs or polls a socket of a transport.

| scheme        | moves the payload                                      | where                      |
|---------------|--------------------------------------------------------|----------------------------|
| ``tcp://``    | ZMQ frames (``zmq_channel``)                           | anywhere                   |
| ``ipc://``    | ZMQ frames over a Unix socket                          | same host                  |
| ``shm://``    | a shared-memory pool; only header + region cross      | same host                  |
| ``mooncake://`` | Mooncake's transfer engine (TCP here, RDMA where present) | anywhere                 |

Every receiver yields the same ``(PartHeader, [EmbeddingItem])`` with tensors viewing its memory in place;
a region of a pool is given back when the last tensor viewing it is gone.
"""

from __future__ import annotations

import importlib
import threading
import uuid
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

from mmserve.transport.cluster_auth import ClusterSecret
from mmserve.transport.embedding_wire import EmbeddingItem, OutgoingPart, PartHeader

# scheme -> module that implements it (imported on first use: Mooncake's library loads only when asked for).
_MODULES = MappingProxyType(
    {
        "tcp": "mmserve.transport.zmq_channel",
        "ipc": "mmserve.transport.zmq_channel",
        "shm": "mmserve.transport.shm_channel",
        "mooncake": "mmserve.transport.mooncake_channel",
    }
)
SCHEMES = tuple(_MODULES)


class SendTimeout(TimeoutError):
    """The destination did not take the part within the sender's timeout (absent, full, or too slow)."""


@dataclass(frozen=True)
class TransferConfig:
    """Sizes and limits of the transports; the same on the sending and the receiving side."""

    send_timeout_s: float = 5.0
    shm_pool_mb: float = 256.0  # per (encoder, engine) pair, on the encoder: the parts in flight to it
    mooncake_pool_mb: float = 256.0  # registered with Mooncake's transfer engine, on each side
    host: str = "127.0.0.1"  # the address a Mooncake receiver or sender announces to its peer


class PartSender(Protocol):
    """Sends parts to endpoints of one transport. Thread-safe; ``close`` frees every pool and socket."""

    def send(self, endpoint: str, part: OutgoingPart) -> None: ...
    def stats(self) -> dict[str, float]: ...
    def close(self) -> None: ...


class PartReceiver(Protocol):
    """The engine side of one transport. Single consumer (the engine loop).

    ``pollable`` is what the loop's ``zmq.Poller`` waits on (a ZMQ socket or a file descriptor): readable
    when ``recv_part`` has something. ``recv_part`` raises ``WireError`` for a malformed part and
    ``PartRejected`` for one failing authentication or naming memory the sender does not own.
    """

    endpoint: str
    pollable: object

    def recv_part(self, timeout_s: float) -> tuple[PartHeader, list[EmbeddingItem]] | None: ...
    def stats(self) -> dict[str, float]: ...
    def close(self) -> None: ...


def scheme_of(endpoint: str) -> str:
    scheme = endpoint.split("://", 1)[0] if "://" in endpoint else ""
    if scheme not in _MODULES:
        raise ValueError(f"unknown transport in {endpoint!r}; one of {', '.join(f'{s}://' for s in SCHEMES)}")
    return scheme


def bind_address(scheme: str, host: str) -> str:
    """Where an engine binds its receiver of ``scheme`` on ``host`` (any free port, a fresh shm name)."""
    return {"shm": "shm://", "ipc": f"ipc:///tmp/mmserve-{uuid.uuid4().hex}"}.get(
        scheme, f"{scheme}://{host}:0"
    )


def open_receiver(
    bind: str, cfg: TransferConfig = TransferConfig(), secret: ClusterSecret | None = None
) -> PartReceiver:
    """Bind a receiver; ``bind`` is e.g. ``tcp://127.0.0.1:0``, ``shm://`` or ``mooncake://127.0.0.1:0``."""
    module = importlib.import_module(_MODULES[scheme_of(bind)])
    return module.open_receiver(bind, cfg, secret)


class PartSenders:
    """One sender per transport, created on first use of its scheme; ``send`` routes by the endpoint."""

    def __init__(self, cfg: TransferConfig = TransferConfig(), signer: ClusterSecret | None = None) -> None:
        self.cfg, self._signer = cfg, signer
        self._lock = threading.Lock()
        self._senders: dict[str, PartSender] = {}
        self._closed = False

    def _sender(self, scheme: str) -> PartSender:
        module = _MODULES[scheme]
        with self._lock:
            if self._closed:
                raise RuntimeError("PartSenders is closed")
            sender = self._senders.get(module)
            if sender is None:
                sender = importlib.import_module(module).open_sender(self.cfg, self._signer)
                self._senders[module] = sender
            return sender

    def send(self, endpoint: str, part: OutgoingPart) -> None:
        """Raises SendTimeout when the endpoint does not take the part in time; ValueError for a bad one."""
        self._sender(scheme_of(endpoint)).send(endpoint, part)

    def stats(self) -> dict[str, float]:
        with self._lock:
            senders = list(self._senders.values())
        out: dict[str, float] = {}
        for sender in senders:
            out.update(sender.stats())
        return out

    def close(self) -> None:
        with self._lock:
            self._closed = True
            senders, self._senders = list(self._senders.values()), {}
        for sender in senders:
            sender.close()
