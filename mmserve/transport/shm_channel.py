"""The ``shm://`` transport: parts move through a shared-memory pool; only a header and a region cross a socket.

Set-up: the engine's :class:`ShmReceiver` listens on an abstract Unix socket (SOCK_SEQPACKET: message
boundaries kept, file descriptors passed). On its first part for that engine an encoder's :class:`ShmSender`
creates a pool with ``memfd_create`` (``--shm-pool-mb``), maps it and sends the descriptor with a hello.
Per part the sender carves a region out of its pool, writes the payload there (the one copy), and sends the
header with ``(offset, nbytes)``. The receiver maps each pool once, read-only, builds the tensors on the
region in place, and sends a release once the last of them is gone; the sender then reuses the region.

Nothing leaks: a memfd pool and an abstract socket have no name in any file system (nothing under
/dev/shm), and the kernel frees a pool when the last descriptor and mapping of it are gone, whichever side
dies first. A sender whose engine goes away (EOF) forgets every region and maps a fresh pool on
reconnecting; an engine whose sender dies keeps its views valid until its requests drop them.

Trust: a region is named relative to the connection's own pool, so a sender can only ever name its own
memory; a region out of bounds, misaligned, overlapping one the engine still holds, or a part before the
hello is refused (``PartRejected("forged")``). With a cluster secret the MAC covers the header and the
region's bytes as the engine reads them.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import queue
import secrets
import selectors
import socket
import threading

import msgspec
import torch

from mmserve.transport.channel import SendTimeout, TransferConfig
from mmserve.transport.cluster_auth import ClusterSecret, PartRejected, PartVerifier
from mmserve.transport.embedding_wire import EmbeddingItem, OutgoingPart, PartHeader, WireError, decode_part
from mmserve.transport.handoff import Handoff, detached
from mmserve.transport.regions import ALIGN, PoolExhausted, RegionAllocator, owned_view

logger = logging.getLogger("mmserve.transport")
PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 1 << 20  # a header: item metadata and tensor descriptors, never payload
MAX_POOL_BYTES = 1 << 40


class Hello(msgspec.Struct, tag="hello"):
    version: int
    sender: str  # for logs


class Part(msgspec.Struct, tag="part"):
    header: bytes
    offset: int
    nbytes: int  # 0: no region (an error part)
    mac: bytes = b""


class Release(msgspec.Struct, tag="release"):
    offsets: list[int]


_decoder = msgspec.msgpack.Decoder(Hello | Part | Release)
_encoder = msgspec.msgpack.Encoder()


def _bind_name(bind: str) -> str:
    name = bind.removeprefix("shm://")
    return name or f"mmserve-shm-{os.getpid()}-{secrets.token_hex(6)}"


# -- sender (encoder side) -----------------------------------------------------------------------
class _Link:
    """One encoder -> engine connection and the pool it writes into."""

    def __init__(self, endpoint: str, cfg: TransferConfig, on_dead) -> None:
        self.endpoint = endpoint
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.settimeout(cfg.send_timeout_s)
        try:
            self.sock.connect("\0" + endpoint.removeprefix("shm://"))
            size = max(ALIGN, int(cfg.shm_pool_mb * 2**20))
            fd = os.memfd_create("mmserve-shm-pool", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, size)
                self.pool = mmap.mmap(fd, size)
                socket.send_fds(
                    self.sock, [_encoder.encode(Hello(PROTOCOL_VERSION, f"pid {os.getpid()}"))], [fd]
                )
            finally:
                os.close(fd)  # the mapping (and the engine's copy of the descriptor) keep the pool alive
        except OSError:
            self.sock.close()
            raise
        self.tensor = torch.frombuffer(self.pool, dtype=torch.uint8)
        self.regions = RegionAllocator(size)
        self.send_lock = threading.Lock()
        self.alive = True
        self._on_dead = on_dead
        threading.Thread(target=self._read_releases, name="shm-releases", daemon=True).start()

    def _read_releases(self) -> None:
        while self.alive:
            try:
                data = self.sock.recv(MAX_MESSAGE_BYTES)
            except TimeoutError:
                continue
            except OSError:
                data = b""
            if not data:
                break
            try:
                msg = _decoder.decode(data)
            except msgspec.DecodeError:
                logger.warning("shm: undecodable message from %s", self.endpoint)
                continue
            if isinstance(msg, Release):
                for offset in msg.offsets:
                    with contextlib.suppress(KeyError):  # a confused engine must not kill the sender
                        self.regions.free(offset)
        self.close()

    def close(self) -> None:
        if not self.alive:
            return
        self.alive = False
        self.regions.free_all()  # the engine is gone: nothing of the pool is held any more
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._on_dead(self)


class ShmSender:
    """Links to engines by endpoint, each with its own pool. Thread-safe."""

    def __init__(self, cfg: TransferConfig, signer: ClusterSecret | None = None) -> None:
        self.cfg, self._signer = cfg, signer
        self._lock = threading.Lock()
        self._links: dict[str, _Link] = {}
        self._closed = False

    def _link(self, endpoint: str) -> _Link:
        with self._lock:
            if self._closed:
                raise RuntimeError("ShmSender is closed")
            link = self._links.get(endpoint)
            if link is None or not link.alive:
                try:
                    link = _Link(endpoint, self.cfg, self._forget)
                except OSError as e:
                    raise SendTimeout(f"{endpoint} is not reachable: {e}") from e
                self._links[endpoint] = link
            return link

    def _forget(self, link: _Link) -> None:
        with self._lock:
            if self._links.get(link.endpoint) is link:
                del self._links[link.endpoint]

    def send(self, endpoint: str, part: OutgoingPart) -> None:
        link = self._link(endpoint)
        offset = 0
        if part.nbytes:
            try:
                offset = link.regions.alloc(part.nbytes, self.cfg.send_timeout_s)
            except PoolExhausted as e:
                raise SendTimeout(f"{endpoint}: shared-memory pool full ({e}); see --shm-pool-mb") from e
            region = link.tensor[offset : offset + part.nbytes]
            part.write_into(region)
        header = part.header()
        mac = b""
        if self._signer is not None:
            payload = memoryview(link.pool)[offset : offset + part.nbytes]
            mac = self._signer.mac(header, payload)
            payload.release()
        try:
            with link.send_lock:
                link.sock.send(_encoder.encode(Part(header, offset, part.nbytes, mac)))
        except OSError as e:
            link.close()
            raise SendTimeout(f"{endpoint} did not take the part: {e}") from e

    def stats(self) -> dict[str, float]:
        with self._lock:
            links = list(self._links.values())
        return {
            "shm_links": len(links),
            "shm_pool_bytes": sum(link.regions.capacity for link in links),
            "shm_pool_used_bytes": sum(link.regions.used_bytes for link in links),
        }

    def close(self) -> None:
        with self._lock:
            self._closed = True
            links = list(self._links.values())
        for link in links:
            link.close()


# -- receiver (engine side) ----------------------------------------------------------------------
class _Peer:
    """One encoder's connection as the engine sees it: its pool and the regions still viewed here."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.pool: mmap.mmap | None = None
        self.held: dict[int, int] = {}  # offset -> nbytes, regions some tensor still views
        self.open = True


class ShmReceiver:
    """Listens on an abstract Unix socket; a thread takes hellos, parts and releases (see module docstring).

    Decoded parts wait in a :class:`Handoff` for the engine loop, which polls it.
    """

    def __init__(self, bind: str = "shm://", secret: ClusterSecret | None = None) -> None:
        name = _bind_name(bind)
        self.endpoint = f"shm://{name}"
        self._verifier = PartVerifier(secret) if secret else None  # used by the thread only
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._listener.bind("\0" + name)
        self._listener.listen(64)
        self._listener.setblocking(False)
        self._ready = Handoff()
        self.pollable = self._ready
        self._releases: queue.SimpleQueue[tuple[_Peer, int]] = queue.SimpleQueue()
        self._kick_r, self._kick_w = socket.socketpair()
        self._kick_w.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._kick_r, selectors.EVENT_READ)
        self._peers: dict[socket.socket, _Peer] = {}
        self.parts = self.held_bytes = self.rejected = 0
        self._running = True
        self._thread = threading.Thread(target=self._run, name="shm-receiver", daemon=True)
        self._thread.start()

    # -- engine loop side ------------------------------------------------------------------------
    def recv_part(self, timeout_s: float) -> tuple[PartHeader, list[EmbeddingItem]] | None:
        return self._ready.get(timeout_s)

    def stats(self) -> dict[str, float]:
        return {"shm_peers": len(self._peers), "shm_held_bytes": self.held_bytes}

    def close(self) -> None:
        if not self._running:
            return
        self._running = False
        self._kick()
        self._thread.join(timeout=5)
        for peer in list(self._peers.values()):
            peer.conn.close()
        self._selector.close()
        self._listener.close()
        self._kick_r.close()
        self._kick_w.close()
        self._ready.close()

    # -- receiver thread -------------------------------------------------------------------------
    def _kick(self) -> None:
        with contextlib.suppress(OSError):  # a full socketpair already wakes the thread
            self._kick_w.send(b"k")

    def _run(self) -> None:
        while self._running:
            for key, _ in self._selector.select(timeout=1.0):
                if key.fileobj is self._listener:
                    self._accept()
                elif key.fileobj is self._kick_r:
                    with contextlib.suppress(BlockingIOError):
                        self._kick_r.recv(4096)
                elif (peer := self._peers.get(key.fileobj)) is not None:  # not dropped earlier in this batch
                    self._read(peer)
            self._send_releases()

    def _accept(self) -> None:
        with contextlib.suppress(BlockingIOError):
            conn, _ = self._listener.accept()
            conn.setblocking(False)
            self._peers[conn] = _Peer(conn)
            self._selector.register(conn, selectors.EVENT_READ)

    def _drop(self, peer: _Peer) -> None:
        """The sender is gone: its regions stay valid for the tensors viewing them; nothing to tell it."""
        peer.open = False
        self._selector.unregister(peer.conn)
        del self._peers[peer.conn]
        peer.conn.close()
        peer.pool = None  # the views hold the mapping; the kernel frees the pool after the last one

    def _read(self, peer: _Peer) -> None:
        try:
            data, fds, flags, _ = socket.recv_fds(peer.conn, MAX_MESSAGE_BYTES, 1)
        except BlockingIOError:
            return
        except OSError:
            data, fds, flags = b"", [], 0
        if not data:
            self._drop(peer)
            return
        try:
            if flags & socket.MSG_TRUNC:
                raise WireError(f"message over {MAX_MESSAGE_BYTES} bytes")
            try:
                msg = _decoder.decode(data)
            except msgspec.DecodeError as e:
                raise WireError(f"undecodable shm message: {e}") from e
            if isinstance(msg, Hello):
                self._hello(peer, msg, fds)
                fds = []
            elif isinstance(msg, Part):
                self._part(peer, msg)
        except (WireError, PartRejected) as e:
            self.rejected += 1
            self._ready.put(e)
        finally:
            for fd in fds:
                os.close(fd)

    def _hello(self, peer: _Peer, msg: Hello, fds: list[int]) -> None:
        if peer.pool is not None or len(fds) != 1 or msg.version != PROTOCOL_VERSION:
            for fd in fds:
                os.close(fd)
            self._drop(peer)
            raise PartRejected("forged", "shm hello must come once, first, with one pool descriptor")
        try:
            size = os.fstat(fds[0]).st_size
            if not 0 < size <= MAX_POOL_BYTES:
                raise OSError(f"pool size {size}")
            peer.pool = mmap.mmap(
                fds[0], size, prot=mmap.PROT_READ
            )  # the engine never writes a sender's pool
        finally:
            os.close(fds[0])

    def _part(self, peer: _Peer, msg: Part) -> None:
        if msg.nbytes == 0:
            payload: memoryview | bytes = b""
        else:
            size = len(peer.pool) if peer.pool is not None else 0
            if (
                peer.pool is None
                or msg.offset < 0
                or msg.nbytes < 0
                or msg.offset % ALIGN
                or msg.offset + msg.nbytes > size
                or any(o < msg.offset + msg.nbytes and msg.offset < o + n for o, n in peer.held.items())
            ):
                raise PartRejected(
                    "forged",
                    f"shm region [{msg.offset}, {msg.offset + msg.nbytes}) is not the sender's to name",
                )
            peer.held[msg.offset] = msg.nbytes
            self.held_bytes += msg.nbytes
            offset, releases, kick = msg.offset, self._releases, self._kick

            def release() -> None:  # runs in whichever thread drops the last view: queue and wake only
                releases.put((peer, offset))
                kick()

            payload = owned_view(peer.pool, msg.offset, msg.nbytes, release)
        self.parts += 1
        try:
            if self._verifier is None:
                self._ready.put(decode_part([msg.header, payload], copy=False))
                return
            mac = self._verifier.check_mac([msg.header, payload, msg.mac])
            header, items = decode_part([msg.header, payload], copy=False)
            self._verifier.check_fresh(mac, header.sent_at)
            self._ready.put((header, items))
        except (WireError, PartRejected) as e:
            del payload
            raise detached(e) from None

    def _send_releases(self) -> None:
        by_peer: dict[_Peer, list[int]] = {}
        while True:
            try:
                peer, offset = self._releases.get_nowait()
            except queue.Empty:
                break
            self.held_bytes -= peer.held.pop(offset)
            if peer.open:
                by_peer.setdefault(peer, []).append(offset)
        for peer, offsets in by_peer.items():
            try:
                peer.conn.send(_encoder.encode(Release(offsets)))
            except OSError:  # the sender is gone or not reading: it frees everything when it reconnects
                pass


def open_sender(cfg: TransferConfig, signer: ClusterSecret | None) -> ShmSender:
    return ShmSender(cfg, signer)


def open_receiver(bind: str, cfg: TransferConfig, secret: ClusterSecret | None) -> ShmReceiver:
    return ShmReceiver(bind, secret)
