"""The transfer seam at the channel level: region allocation, shared memory and Mooncake's transfer engine.

Real sockets, a real memfd pool and real Mooncake transfer engines on 127.0.0.1; no server.
"""

from __future__ import annotations

import gc
import os
import socket
import time

import msgspec
import pytest
import torch

from mmserve.multimodal.items import MAIN, ItemEmbedding, Modality
from mmserve.transport.channel import PartSenders, SendTimeout, TransferConfig, bind_address, open_receiver
from mmserve.transport.cluster_auth import ClusterSecret, PartRejected
from mmserve.transport.embedding_wire import EmbeddingItem, WireError, build_part, error_part
from mmserve.transport.messages import Failure
from mmserve.transport.regions import PoolExhausted, RegionAllocator
from mmserve.transport.shm_channel import Hello, Part

SECRET = ClusterSecret(b"transfer-test-secret-0123456789")
WAIT_S = 5.0


def item(seed: int, rows: int = 64, extras: bool = True) -> EmbeddingItem:
    g = torch.Generator().manual_seed(seed)
    tensors = {MAIN: torch.randn(rows, 96, generator=g)}
    if extras:
        tensors["deepstack.0"] = torch.randn(rows, 96, generator=g).to(torch.bfloat16)
    return EmbeddingItem(seed, ItemEmbedding(Modality.IMAGE, seed.to_bytes(16, "little"), tensors, b"meta"))


def wait_for(check, what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def receive(receiver, timeout_s: float = WAIT_S):
    got = receiver.recv_part(timeout_s)
    assert got is not None, "no part arrived"
    return got


# -- regions -------------------------------------------------------------------------------------
def test_region_allocator_fits_frees_coalesces_and_bounds_its_wait():
    pool = RegionAllocator(1024)
    a, b, c = pool.alloc(100, 0), pool.alloc(64, 0), pool.alloc(256, 0)
    assert (a, b, c) == (0, 128, 192) and pool.used_bytes == 448
    pool.free(b)
    assert pool.alloc(10, 0) == 128  # first fit reuses the hole
    pool.free(a), pool.free(128), pool.free(c)
    pool.check_integrity()
    assert pool.used_bytes == 0 and pool.alloc(1024, 0) == 0  # the holes coalesced into one block
    start = time.monotonic()
    with pytest.raises(PoolExhausted):
        pool.alloc(64, 0.2)
    assert 0.15 < time.monotonic() - start < 2
    with pytest.raises(PoolExhausted):
        RegionAllocator(1024).alloc(4096, 10)  # can never fit: no wait
    pool.free_all()
    pool.check_integrity()


# -- every transport: the same part, bit-exact, regions back to zero ----------------------------------
@pytest.mark.parametrize("scheme", ["tcp", "shm", "mooncake"])
@pytest.mark.parametrize("signed", [False, True])
def test_parts_arrive_bit_exact_and_pools_drain(scheme, signed):
    secret = SECRET if signed else None
    cfg = TransferConfig(send_timeout_s=WAIT_S, shm_pool_mb=4, mooncake_pool_mb=4)
    receiver = open_receiver(bind_address(scheme, "127.0.0.1"), cfg, secret)
    senders = PartSenders(cfg, signer=secret)
    try:
        sent = [item(1), item(2, rows=7)]
        senders.send(receiver.endpoint, build_part("req", 0, 2, "enc-a", sent))
        senders.send(receiver.endpoint, error_part("req", 1, 2, "enc-a", Failure(400, "bad_media", "no")))
        header, items = receive(receiver)
        assert (header.request_id, header.part_index, header.encoder) == ("req", 0, "enc-a")
        for want, got in zip(sent, items, strict=True):
            assert got.item_index == want.item_index and got.item.metadata == b"meta"
            for name, tensor in want.item.tensors.items():
                assert got.item.tensors[name].dtype == tensor.dtype
                assert torch.equal(got.item.tensors[name].view(torch.uint8), tensor.view(torch.uint8))
        error, none = receive(receiver)
        assert error.error == Failure(400, "bad_media", "no") and none == []
        held = {k: v for k, v in receiver.stats().items() if k.endswith("held_bytes")}
        assert scheme == "tcp" or sum(held.values()) > 0
        del items, got  # the engine is done with the request: the regions go back
        gc.collect()
        wait_for(
            lambda: all(v == 0 for k, v in receiver.stats().items() if k.endswith("held_bytes")),
            "receiver regions released",
        )
        wait_for(
            lambda: all(v == 0 for k, v in senders.stats().items() if k.endswith("used_bytes")),
            "sender pool drained",
        )
    finally:
        senders.close()
        receiver.close()


def test_shm_leaves_nothing_under_dev_shm_and_survives_a_restarted_engine():
    before = set(os.listdir("/dev/shm"))
    cfg = TransferConfig(send_timeout_s=WAIT_S, shm_pool_mb=1)
    senders = PartSenders(cfg)
    receiver = open_receiver("shm://", cfg)
    try:
        senders.send(receiver.endpoint, build_part("a", 0, 1, "e", [item(3)]))
        header, items = receive(receiver)
        assert senders.stats()["shm_pool_used_bytes"] > 0
        assert set(os.listdir("/dev/shm")) == before  # memfd pools and abstract sockets have no names
        receiver.close()  # the engine dies holding the region: the sender forgets every region
        wait_for(lambda: senders.stats()["shm_links"] == 0, "sender saw the engine go")
        assert torch.equal(items[0].item.tensors[MAIN], item(3).item.tensors[MAIN])  # views stay valid
        with pytest.raises(SendTimeout):
            senders.send(receiver.endpoint, build_part("b", 0, 1, "e", [item(4)]))
        receiver = open_receiver(receiver.endpoint, cfg)  # the same name again: a restarted engine
        senders.send(receiver.endpoint, build_part("c", 0, 1, "e", [item(5)]))
        assert receive(receiver)[0].request_id == "c"
        # A pool too small for a part is a clear send failure, never a hang.
        with pytest.raises(SendTimeout, match="shm-pool-mb"):
            senders.send(receiver.endpoint, build_part("d", 0, 1, "e", [item(6, rows=4096)]))
    finally:
        senders.close()
        receiver.close()
    assert set(os.listdir("/dev/shm")) == before


# -- forged shared-memory handles ----------------------------------------------------------------------
class RawShmPeer:
    """A hand-made sender: its own memfd pool, and whatever messages the test writes."""

    def __init__(self, endpoint: str, pool_bytes: int = 1 << 16, hello: bool = True) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.connect("\0" + endpoint.removeprefix("shm://"))
        self.fd = os.memfd_create("forger")
        os.ftruncate(self.fd, pool_bytes)
        if hello:
            socket.send_fds(self.sock, [msgspec.msgpack.encode(Hello(1, "forger"))], [self.fd])

    def send_part(self, offset: int, nbytes: int, header: bytes | None = None) -> None:
        part = build_part("forged", 0, 1, "forger", [item(7, rows=4, extras=False)])
        payload = header or part.header()
        self.sock.send(msgspec.msgpack.encode(Part(payload, offset, nbytes)))

    def close(self) -> None:
        self.sock.close()
        os.close(self.fd)


def test_forged_shm_handles_are_refused_and_counted():
    receiver = open_receiver("shm://", TransferConfig())
    peers = []
    try:
        good_bytes = 4 * 96 * 4
        peer = RawShmPeer(receiver.endpoint)
        peers.append(peer)
        peer.send_part(1 << 20, good_bytes)  # beyond its own pool
        peer.send_part(64 + 1, good_bytes)  # misaligned
        peer.send_part(-64, good_bytes)  # negative
        for _ in range(3):
            with pytest.raises(PartRejected, match="not the sender's"):
                receive(receiver)
        peer.send_part(0, good_bytes)  # a real region of its own pool: accepted (zeros, but well formed)
        kept = receive(receiver)
        peer.send_part(0, good_bytes)  # the same region while the engine still views it
        with pytest.raises(PartRejected, match="not the sender's"):
            receive(receiver)
        del kept
        gc.collect()
        wait_for(lambda: receiver.stats()["shm_held_bytes"] == 0, "region released")
        no_hello = RawShmPeer(receiver.endpoint, hello=False)  # a part naming a pool it never shared
        peers.append(no_hello)
        no_hello.send_part(0, good_bytes)
        with pytest.raises(PartRejected):
            receive(receiver)
        peer.send_part(0, good_bytes, header=b"\xc1 not msgpack")
        with pytest.raises(WireError):
            receive(receiver)
        wait_for(lambda: receiver.stats()["shm_held_bytes"] == 0, "a malformed part's region released")
        assert receiver.recv_part(0.05) is None  # nothing else was delivered
    finally:
        for peer in peers:
            peer.close()
        receiver.close()


def test_tampered_shm_region_fails_the_mac():
    cfg = TransferConfig(send_timeout_s=WAIT_S, shm_pool_mb=1)
    receiver = open_receiver("shm://", cfg, SECRET)
    forger = PartSenders(cfg, signer=ClusterSecret(b"another-secret-entirely-0000"))
    senders = PartSenders(cfg, signer=SECRET)
    try:
        forger.send(receiver.endpoint, build_part("f", 0, 1, "e", [item(8)]))
        with pytest.raises(PartRejected, match="MAC"):
            receive(receiver)
        senders.send(receiver.endpoint, build_part("g", 0, 1, "e", [item(9)]))
        assert receive(receiver)[0].request_id == "g"
    finally:
        forger.close()
        senders.close()
        receiver.close()


# -- Mooncake ---------------------------------------------------------------------------------------
def test_mooncake_refuses_memory_the_sender_does_not_own_and_times_out_on_a_dead_engine():
    from mmserve.transport.mooncake_channel import Offer

    cfg = TransferConfig(send_timeout_s=1.0, mooncake_pool_mb=2)
    receiver = open_receiver("mooncake://127.0.0.1:0", cfg)
    senders = PartSenders(cfg)
    try:
        senders.send(receiver.endpoint, build_part("m", 0, 1, "e", [item(10)]))
        assert receive(receiver)[0].request_id == "m"
        sender = senders._sender("mooncake")
        part = build_part("forged", 0, 1, "e", [item(11)])
        # An address outside every buffer the sender registered: the transfer engine refuses the read.
        offer = Offer(99, part.header(), sender._pool.session, sender._pool.address + (64 << 20), part.nbytes)
        sock, _ = sender._socket(receiver.endpoint)
        sock.send(msgspec.msgpack.encode(offer))
        with pytest.raises(PartRejected, match="read"):
            receive(receiver)
        assert receiver.stats()["mooncake_failed_transfers"] == 1
        wait_for(lambda: receiver.stats()["mooncake_held_bytes"] == 0, "failed read's region freed")
        endpoint = receiver.endpoint
        receiver.close()
        start = time.monotonic()
        with pytest.raises(SendTimeout):
            senders.send(endpoint, build_part("late", 0, 1, "e", [item(12)]))
        assert time.monotonic() - start < 5
    finally:
        senders.close()
        receiver.close()
