"""Loopback throughput of every embedding transport against raw ZMQ and a memcpy, for ``mmserve bench
transfer``.

Not a test: figures depend on the machine. All paths are measured in one process and one run so they
are comparable, in interleaved rounds whose order alternates, so that drift in machine load (a few noisy
cores) hits all three alike; each figure is the median over every round's transfers, each round's
warm-up transfer excluded.
"""

from __future__ import annotations

import queue
import statistics
import threading
import time
from collections.abc import Callable

import torch
import zmq

from mmserve.multimodal.items import MAIN, ItemEmbedding, Modality
from mmserve.transport.channel import PartSenders, TransferConfig, bind_address, open_receiver
from mmserve.transport.cluster_auth import ClusterSecret
from mmserve.transport.embedding_wire import EmbeddingItem, build_part

HIDDEN = 4096
RECV_TIMEOUT_S = 30.0


def _timed_transfers(
    send_one: Callable[[], None], recv_one: Callable[[], object], repeats: int
) -> list[float]:
    """Seconds from the start of each send until a receiver thread holds the data; warm-up dropped."""
    done: queue.Queue[float | BaseException] = queue.Queue()

    def receive() -> None:
        try:
            for _ in range(repeats + 1):
                if recv_one() is None:
                    raise TimeoutError("receiver timed out")
                done.put(time.perf_counter())
        except BaseException as e:  # handed to the main thread, which re-raises
            done.put(e)

    thread = threading.Thread(target=receive, name="throughput-recv", daemon=True)
    thread.start()
    times: list[float] = []
    try:
        for _ in range(repeats + 1):
            start = time.perf_counter()
            send_one()
            end = done.get(timeout=RECV_TIMEOUT_S)
            if isinstance(end, BaseException):
                raise end
            times.append(end - start)
    finally:
        thread.join(timeout=RECV_TIMEOUT_S)
    return times[1:]


def _embedding_times(scheme: str, emb: torch.Tensor, repeats: int, signed: bool = False) -> list[float]:
    """build_part -> PartSenders.send -> receiver.recv_part -> tensors, over the transport ``scheme``."""
    item = EmbeddingItem(0, ItemEmbedding(Modality.IMAGE, b"\0" * 16, {MAIN: emb}))
    secret = ClusterSecret(b"throughput-benchmark-secret") if signed else None
    pool_mb = 4 * emb.numel() * emb.element_size() / 2**20 + 1
    cfg = TransferConfig(RECV_TIMEOUT_S, shm_pool_mb=pool_mb, mooncake_pool_mb=pool_mb)
    receiver = open_receiver(bind_address(scheme, "127.0.0.1"), cfg, secret)
    sender = PartSenders(cfg, signer=secret)
    try:
        return _timed_transfers(
            lambda: sender.send(receiver.endpoint, build_part("bench", 0, 1, "local", [item])),
            lambda: receiver.recv_part(RECV_TIMEOUT_S),
            repeats,
        )
    finally:
        sender.close()
        receiver.close()


def _raw_zmq_times(ctx: zmq.Context, emb: torch.Tensor, repeats: int) -> list[float]:
    payload = memoryview(emb.view(torch.uint8).reshape(-1).numpy())
    pull = ctx.socket(zmq.PULL)
    push = ctx.socket(zmq.PUSH)
    try:
        pull.bind("tcp://127.0.0.1:*")
        pull.setsockopt(zmq.RCVTIMEO, int(RECV_TIMEOUT_S * 1000))
        push.connect(pull.getsockopt_string(zmq.LAST_ENDPOINT))
        return _timed_transfers(
            lambda: push.send(payload, copy=False), lambda: pull.recv(copy=False), repeats
        )
    finally:
        push.close(linger=0)
        pull.close(linger=0)


def _memcpy_times(emb: torch.Tensor, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        emb.clone()
        times.append(time.perf_counter() - start)
    return times[1:]


PATHS = ("tcp", "tcp_signed", "ipc", "shm", "shm_signed", "mooncake", "zmq_raw", "memcpy")


def measure(
    size_mb: float, repeats: int = 5, rounds: int = 3, paths: tuple[str, ...] = PATHS
) -> dict[str, float]:
    """GB/s (1e9 bytes/s) moving a float32 (tokens, 4096) tensor of ``size_mb`` MiB over loopback.

    Paths: ``tcp`` / ``ipc`` / ``shm`` / ``mooncake`` (a part through that transport, sender to receiver
    to tensors), ``*_signed`` (the same with a cluster secret: HMAC-SHA256 signed and verified),
    ``zmq_raw`` (one copy=False frame, PUSH/PULL over tcp://127.0.0.1), ``memcpy`` (torch clone). Each is
    the median of ``rounds`` x ``repeats`` timed transfers. Owns and closes every socket and pool it opens.
    """
    num_tokens = max(1, round(size_mb * 2**20 / (HIDDEN * 4)))
    emb = torch.randn(num_tokens, HIDDEN, dtype=torch.float32)
    nbytes = emb.numel() * emb.element_size()
    ctx = zmq.Context()

    def run(path: str) -> list[float]:
        if path == "zmq_raw":
            return _raw_zmq_times(ctx, emb, repeats)
        if path == "memcpy":
            return _memcpy_times(emb, repeats)
        scheme, _, signed = path.partition("_")
        return _embedding_times(scheme, emb, repeats, signed=bool(signed))

    times: dict[str, list[float]] = {path: [] for path in paths}
    try:
        for r in range(rounds):
            for path in paths if r % 2 == 0 else reversed(paths):
                times[path] += run(path)
    finally:
        ctx.term()
    return {path: nbytes / statistics.median(ts) / 1e9 for path, ts in times.items()}
