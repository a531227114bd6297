"""Embedding wire format and ZMQ channel: bit-exact round trips, validation, loopback delivery."""

from __future__ import annotations

import gc
import time
import warnings
from collections.abc import Iterator

import msgspec
import pytest
import torch

from mmserve.multimodal.items import MAIN, ItemEmbedding, Modality
from mmserve.transport.embedding_wire import (
    ITEM_ALIGN,
    WIRE_VERSION,
    EmbeddingItem,
    WireError,
    decode_part,
    encode_error,
    encode_part,
)
from mmserve.transport.messages import Failure
from mmserve.transport.zmq_channel import EmbeddingReceiver, EmbeddingSender, SendTimeout

_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
RECV_TIMEOUT_S = 2.0


def _special_values(dtype: torch.dtype) -> torch.Tensor:
    t = torch.randn(5, 8).to(dtype)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-40, 65504.0, -1.5])
    t[0] = specials.to(dtype)
    bits = t.view(_INT_VIEW[dtype])
    bits[1, 0] = 0x7FC1 if dtype != torch.float32 else 0x7FC00123  # NaN with a non-default payload
    return t


def _item(
    index: int, emb: torch.Tensor, modality: str = "image", extras: dict | None = None
) -> EmbeddingItem:
    tensors = {MAIN: emb, **(extras or {})}
    return EmbeddingItem(
        index, ItemEmbedding(Modality(modality), bytes([index]) * 16, tensors, b"meta%d" % index)
    )


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(_INT_VIEW[a.dtype]), b.view(_INT_VIEW[b.dtype]))


def _good_frames() -> list:
    return encode_part("req", 0, 1, "local", [_item(0, torch.randn(3, 4))])


def _tamper_header(frames: list, **changes) -> list:
    header = msgspec.msgpack.decode(frames[0])
    header.update(changes)
    return [msgspec.msgpack.encode(header), frames[1]]


def _tamper_item(frames: list, **changes) -> list:
    header = msgspec.msgpack.decode(frames[0])
    header["items"][0].update(changes)
    return [msgspec.msgpack.encode(header), frames[1]]


def _tamper_tensor(frames: list, **changes) -> list:
    header = msgspec.msgpack.decode(frames[0])
    header["items"][0]["tensors"][0].update(changes)
    return [msgspec.msgpack.encode(header), frames[1]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_bit_exact(dtype: torch.dtype) -> None:
    emb = _special_values(dtype)
    header, items = decode_part(encode_part("req-1", 0, 1, "local", [_item(3, emb)]))
    assert header.version == WIRE_VERSION and header.request_id == "req-1" and header.error is None
    assert header.sent_at > 0
    (got,) = items
    assert _bits_equal(got.item.embedding, emb)
    assert (got.item_index, got.item.content_hash, got.item.modality) == (3, bytes([3]) * 16, Modality.IMAGE)
    assert got.item.metadata == b"meta3"  # the family's metadata travels opaque
    got.item.embedding.add_(1)  # decoded tensors own writable memory


@pytest.mark.parametrize("copy", [True, False], ids=["copy", "view"])
def test_named_extra_tensors_round_trip(copy: bool) -> None:
    """Wire v2: an item carries its main rows and named extras (e.g. DeepStack levels), each aligned."""
    main = torch.randn(6, 8)
    extras = {"deepstack.0": torch.randn(6, 8), "deepstack.1": torch.randn(6, 4).bfloat16()}
    header, (got,) = decode_part(encode_part("r", 0, 1, "e", [_item(0, main, extras=extras)]), copy=copy)
    assert list(got.item.tensors) == [MAIN, "deepstack.0", "deepstack.1"]
    assert _bits_equal(got.item.embedding, main)
    assert all(_bits_equal(got.item.tensors[k], v) for k, v in extras.items())
    assert all(t.offset % ITEM_ALIGN == 0 for t in header.items[0].tensors)


@pytest.mark.parametrize("copy", [True, False], ids=["copy", "view"])
def test_multiple_items_mixed_shapes_and_dtypes(copy: bool) -> None:
    embs = [
        torch.randn(3, 5, dtype=torch.float16),  # odd byte count: the next item needs padding to align
        torch.randn(7, 16),
        torch.randn(0, 16).bfloat16(),
        torch.randn(4, 6).bfloat16().t(),  # non-contiguous input
    ]
    items = [
        _item(i, e, modality)
        for i, (e, modality) in enumerate(zip(embs, ["image", "video", "audio", "image"], strict=True))
    ]
    header, got = decode_part(encode_part("req-2", 1, 3, "http://enc:8000", items), copy=copy)
    assert (header.part_index, header.num_parts, header.encoder) == (1, 3, "http://enc:8000")
    assert [it.item_index for it in got] == [0, 1, 2, 3]
    assert [it.item.modality.value for it in got] == ["image", "video", "audio", "image"]
    for want, have in zip(embs, got, strict=True):
        emb = have.item.embedding
        assert emb.shape == want.shape and _bits_equal(emb, want.contiguous())
        assert emb.is_contiguous()
        assert emb.data_ptr() % emb.element_size() == 0
    assert all(t.offset % ITEM_ALIGN == 0 for ih in header.items for t in ih.tensors)


def test_padding_between_items_is_zero() -> None:
    items = [_item(0, torch.randn(3, 5, dtype=torch.float16)), _item(1, torch.randn(2, 3))]
    header_frame, payload = encode_part("r", 0, 1, "local", items)
    first, second = (it["tensors"][0] for it in msgspec.msgpack.decode(header_frame)["items"])
    assert (first["offset"], second["offset"]) == (0, ITEM_ALIGN)
    assert bytes(payload)[first["nbytes"] : ITEM_ALIGN] == b"\0" * (ITEM_ALIGN - first["nbytes"])
    assert len(payload) == ITEM_ALIGN + second["nbytes"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_view_decode_of_misaligned_item_copies(dtype: torch.dtype) -> None:
    emb = _special_values(dtype)
    frames = encode_part("r", 0, 1, "local", [_item(0, emb)])
    payload = bytearray(b"\0" + bytes(frames[1]))  # unpadded producers may put an item at any offset
    _, (got,) = decode_part(_tamper_tensor([frames[0], payload], offset=1), copy=False)
    emb_got = got.item.embedding
    assert emb_got.data_ptr() % emb_got.element_size() == 0 and _bits_equal(emb_got, emb)


def test_view_decode_shares_the_payload_and_keeps_it_alive() -> None:
    embs = [torch.randn(4, 8), torch.randn(5, 8).bfloat16()]
    frames = encode_part("r", 0, 1, "local", [_item(i, e) for i, e in enumerate(embs)])
    payload = bytes(frames[1])  # immutable, so viewing it in place is safe
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the read-only-buffer warning from torch.frombuffer is expected quiet
        header, got = decode_part([frames[0], payload], copy=False)
    # Both items view one buffer: their addresses differ by exactly their offsets.
    assert (
        got[1].item.embedding.data_ptr() - got[0].item.embedding.data_ptr()
        == header.items[1].tensors[0].offset
    )
    del frames, payload
    gc.collect()
    assert all(_bits_equal(have.item.embedding, want) for have, want in zip(got, embs, strict=True))


def test_empty_item_view_decode() -> None:
    emb = torch.randn(0, 16).bfloat16()
    _, (got,) = decode_part(encode_part("r", 0, 1, "local", [_item(0, emb)]), copy=False)
    assert got.item.embedding.shape == (0, 16) and got.item.embedding.dtype == torch.bfloat16


def test_decoded_tensor_outlives_frame_buffer() -> None:
    emb = torch.randn(4, 8)
    header_frame, payload = encode_part("r", 0, 1, "local", [_item(0, emb)])
    buf = bytearray(payload)
    _, (got,) = decode_part([header_frame, buf])
    buf[:] = b"\0" * len(buf)
    assert torch.equal(got.item.embedding, emb)


def test_error_part() -> None:
    err = Failure(413, "too_large", "image exceeds 50 MB")
    header, items = decode_part(encode_error("req-3", 2, 4, "http://enc:1", err))
    assert header.error == err and items == [] and header.part_index == 2


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda f: _tamper_header(f, version=WIRE_VERSION + 1), "version"),
        (lambda f: f + [b"extra"], "frames"),
        (lambda f: f[:1], "frames"),
        (lambda f: [f[0], bytes(f[1])[:-1]], "outside payload"),
        (lambda f: _tamper_tensor(f, offset=10_000), "outside payload"),
        (lambda f: _tamper_tensor(f, nbytes=44), "nbytes"),
        (lambda f: _tamper_tensor(f, dtype="float64"), "dtype"),
        (lambda f: _tamper_tensor(f, name="not-main"), "tensors"),
        (lambda f: _tamper_tensor(f, shape=[]), "shape"),
        (lambda f: _tamper_item(f, metadata="text"), "header"),
        (lambda f: _tamper_item(f, modality="smell"), "modality"),
        (lambda f: [b"\xc1not msgpack", f[1]], "header"),
        (lambda f: [msgspec.msgpack.encode([1, 2, 3]), f[1]], "header"),
        (lambda f: _tamper_item(f, content_hash=b"short"), "content_hash"),
        (lambda f: _tamper_header(f, part_index=1), "part_index"),
        (lambda f: _tamper_header(f, error={"status": 500, "code": "x", "message": "y"}), "error part"),
    ],
    ids=[
        "bad-version",
        "too-many-frames",
        "too-few-frames",
        "truncated-payload",
        "offset-past-end",
        "nbytes-mismatch",
        "unknown-dtype",
        "no-main-tensor",
        "scalar-shape",
        "metadata-not-bytes",
        "unknown-modality",
        "non-msgpack-header",
        "wrong-header-type",
        "wrong-hash-length",
        "part-index-range",
        "error-with-items",
    ],
)
def test_malformed_raises_wire_error(make, match: str) -> None:
    with pytest.raises(WireError, match=match):
        decode_part(make(_good_frames()))


def test_overlapping_items_rejected() -> None:
    frames = encode_part("r", 0, 1, "local", [_item(0, torch.randn(2, 2)), _item(1, torch.randn(2, 2))])
    header = msgspec.msgpack.decode(frames[0])
    header["items"][1]["tensors"][0]["offset"] = 8
    with pytest.raises(WireError, match="overlaps"):
        decode_part([msgspec.msgpack.encode(header), bytes(frames[1]) + b"\0" * 8])


@pytest.fixture(params=["tcp", "ipc"])
def receiver(request, tmp_path) -> Iterator[EmbeddingReceiver]:
    bind = "tcp://127.0.0.1:0" if request.param == "tcp" else f"ipc://{tmp_path}/emb.sock"
    with EmbeddingReceiver(bind) as rx:
        yield rx


@pytest.fixture
def sender() -> Iterator[EmbeddingSender]:
    with EmbeddingSender(send_timeout_s=RECV_TIMEOUT_S) as tx:
        yield tx


def test_part_arrives_intact_and_socket_is_reused(
    receiver: EmbeddingReceiver, sender: EmbeddingSender
) -> None:
    embs = [torch.randn(64, 32).bfloat16(), torch.randn(16, 32)]
    for part in range(2):
        sender.send(receiver.endpoint, encode_part("req", part, 2, "local", [_item(part, embs[part])]))
    assert sender.num_sockets == 1
    for part in range(2):
        got = receiver.recv_part(RECV_TIMEOUT_S)
        assert got is not None
        header, (item,) = got
        assert header.part_index == part and _bits_equal(item.item.embedding, embs[part])
    assert receiver.recv_part(0.05) is None


def _send_and_receive(
    rx: EmbeddingReceiver, tx: EmbeddingSender, embs: list[torch.Tensor]
) -> list[EmbeddingItem]:
    tx.send(rx.endpoint, encode_part("req", 0, 1, "local", [_item(i, e) for i, e in enumerate(embs)]))
    got = rx.recv_part(RECV_TIMEOUT_S)
    assert got is not None
    return got[1]


def test_received_views_survive_later_messages(receiver: EmbeddingReceiver, sender: EmbeddingSender) -> None:
    # A small part is received into ZMQ's shared receive arena, a large one into its own buffer: neither
    # may be reused while a decoded view still points into it.
    parts = [
        [torch.randn(3, 8), torch.randn(2, 5, dtype=torch.float16)],
        [torch.randn(600, 64).bfloat16(), torch.randn(300, 64)],
    ]
    kept = [[e.clone() for e in embs] for embs in parts]
    received = [_send_and_receive(receiver, sender, embs) for embs in parts]
    for n in range(20):  # same sizes, other contents: a reused buffer would show up as changed values
        for embs in parts:
            _send_and_receive(receiver, sender, [torch.full_like(e, float(n + 1)) for e in embs])
    gc.collect()
    receiver.close()  # also terminates its context; the views hold their frames, not the socket
    for got, want in zip(received, kept, strict=True):
        assert all(_bits_equal(have.item.embedding, w) for have, w in zip(got, want, strict=True))


def test_recv_part_copy_gives_writable_owned_tensors(
    receiver: EmbeddingReceiver, sender: EmbeddingSender
) -> None:
    emb = torch.randn(64, 32)
    sender.send(receiver.endpoint, encode_part("req", 0, 1, "local", [_item(0, emb)]))
    got = receiver.recv_part(RECV_TIMEOUT_S, copy=True)
    assert got is not None
    (item,) = got[1]
    item.item.embedding.add_(1)
    assert torch.equal(item.item.embedding, emb + 1)


def test_malformed_message_then_good_one(receiver: EmbeddingReceiver, sender: EmbeddingSender) -> None:
    sender.send(receiver.endpoint, [b"junk", b"more", b"frames"])
    sender.send(receiver.endpoint, encode_error("req", 0, 1, "local", Failure(503, "busy", "overloaded")))
    with pytest.raises(WireError):
        receiver.recv_part(RECV_TIMEOUT_S)
    got = receiver.recv_part(RECV_TIMEOUT_S)
    assert got is not None and got[0].error is not None and got[0].error.status == 503


@pytest.mark.parametrize("scheme", ["tcp", "ipc"])
def test_send_without_listener_times_out(scheme: str, tmp_path) -> None:
    if scheme == "tcp":
        with EmbeddingReceiver() as gone:
            endpoint = gone.endpoint
    else:
        endpoint = f"ipc://{tmp_path}/nobody.sock"
    with EmbeddingSender(send_timeout_s=0.3) as tx:
        start = time.monotonic()
        with pytest.raises(SendTimeout):
            tx.send(endpoint, _good_frames())
        assert 0.25 < time.monotonic() - start < 1.5


def test_send_after_close_raises() -> None:
    tx = EmbeddingSender(send_timeout_s=0.1)
    tx.close()
    with pytest.raises(RuntimeError):
        tx.send("ipc:///nonexistent/x.sock", _good_frames())


def test_throughput_measure_moves_real_bytes_on_every_path():
    from mmserve.transport.throughput import PATHS, measure

    rates = measure(0.25, repeats=1, rounds=1)
    assert set(rates) == set(PATHS) >= {"tcp", "tcp_signed", "ipc", "shm", "shm_signed", "mooncake", "memcpy"}
    assert all(r > 0 for r in rates.values()), rates
