"""Wire format for encoder -> engine embedding parts: a msgpack header frame plus one raw payload frame.

A part is always exactly two frames, ``[header, payload]``:

* ``header``: a msgpack-encoded :class:`PartHeader` (msgspec Struct, never pickle).
* ``payload``: the raw bytes of every item's embedding in item order; each :class:`ItemHeader` gives its
  ``offset``/``nbytes`` within it. Error parts carry an empty payload. ``encode_part`` starts every item
  at a multiple of :data:`ITEM_ALIGN` bytes (zero-filled gaps), so a receiver can view items in place;
  ``decode_part`` accepts any non-overlapping in-bounds offsets, padded or not.

With a cluster secret, the sender appends a third frame, an HMAC over both (see ``cluster_auth``); the
receiver checks and strips it before ``decode_part``, which always sees the two frames above.

Tensors travel as their raw bytes (a uint8 view, so bf16 needs no numpy dtype), which makes round trips
bit-exact, NaN payloads and signed zeros included.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from types import MappingProxyType

import msgspec
import numpy as np
import torch
import zmq

WIRE_VERSION = 1
NUM_FRAMES = 2
HASH_BYTES = 16
# Item offsets in an encoded payload are multiples of this (a cache line; covers every dtype's alignment).
ITEM_ALIGN = 64

_DTYPES = MappingProxyType({"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16})
_DTYPE_NAMES = MappingProxyType({dtype: name for name, dtype in _DTYPES.items()})
_MODALITIES = frozenset({"image", "video", "audio"})


class WireError(ValueError):
    """A malformed or incompatible embedding message."""


class ItemHeader(msgspec.Struct, frozen=True):
    item_index: int  # position of the item in the request's item list
    content_hash: bytes  # 16 bytes
    modality: str  # "image" | "video" | "audio"
    grid_thw: tuple[int, int, int]
    second_per_grid_t: float
    shape: tuple[int, int]  # (num_tokens, hidden)
    dtype: str  # "float32" | "bfloat16" | "float16"
    offset: int  # byte offset of this item's data in the payload
    nbytes: int


class PartError(msgspec.Struct, frozen=True):
    status: int  # HTTP-like: 400 bad media, 413 too large, 500 internal, 503 overloaded
    code: str
    message: str


class PartHeader(msgspec.Struct, frozen=True):
    version: int
    request_id: str
    part_index: int
    num_parts: int
    encoder: str  # who computed it (URL or "local")
    items: list[ItemHeader]
    error: PartError | None = None
    sent_at: float = 0.0  # time.time() at send (for transfer-time metrics)


class _VersionOnly(msgspec.Struct):  # decoded first: another version gets a version error, not a schema one
    version: int


@dataclass
class EmbeddingItem:
    """One item's embedding with its identity; what the sender gives and the receiver gets back."""

    item_index: int
    content_hash: bytes
    modality: str
    grid_thw: tuple[int, int, int]
    second_per_grid_t: float
    embedding: torch.Tensor  # (num_tokens, hidden)


# -- encoding ------------------------------------------------------------------------------------
def _check_item(item: EmbeddingItem) -> None:
    if item.embedding.dtype not in _DTYPE_NAMES:
        raise ValueError(f"item {item.item_index}: unsupported dtype {item.embedding.dtype}")
    if item.embedding.dim() != 2:
        raise ValueError(f"item {item.item_index}: embedding must be 2-D, got {tuple(item.embedding.shape)}")
    if len(item.content_hash) != HASH_BYTES:
        raise ValueError(f"item {item.item_index}: content_hash must be {HASH_BYTES} bytes")
    if item.modality not in _MODALITIES:
        raise ValueError(f"item {item.item_index}: unknown modality {item.modality!r}")


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 CPU view of ``t``; no copy when ``t`` is already a contiguous CPU tensor."""
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


def _header_bytes(
    request_id: str,
    part_index: int,
    num_parts: int,
    encoder: str,
    items: list[ItemHeader],
    error: PartError | None,
) -> bytes:
    header = PartHeader(WIRE_VERSION, request_id, part_index, num_parts, encoder, items, error, time.time())
    return msgspec.msgpack.encode(header)


def _item_header(item: EmbeddingItem, offset: int, nbytes: int) -> ItemHeader:
    return ItemHeader(
        item_index=item.item_index,
        content_hash=bytes(item.content_hash),
        modality=item.modality,
        grid_thw=tuple(int(x) for x in item.grid_thw),
        second_per_grid_t=float(item.second_per_grid_t),
        shape=(int(item.embedding.shape[0]), int(item.embedding.shape[1])),
        dtype=_DTYPE_NAMES[item.embedding.dtype],
        offset=offset,
        nbytes=nbytes,
    )


def _align_up(n: int) -> int:
    return -(-n // ITEM_ALIGN) * ITEM_ALIGN


def encode_part(
    request_id: str, part_index: int, num_parts: int, encoder: str, items: list[EmbeddingItem]
) -> list[bytes | memoryview]:
    """Encode a part as ``[header, payload]`` frames; mutates nothing.

    A single item of a contiguous CPU tensor is sent zero-copy: the payload frame aliases the caller's
    tensor memory, and ZMQ may still read it after ``send`` returns (and an ``inproc://`` receiver may
    view it in place), so embeddings must not be modified in place once handed over. Several items are
    gathered into one fresh buffer (one copy), each starting at a multiple of :data:`ITEM_ALIGN` bytes.
    """
    for item in items:
        _check_item(item)
    flats = [_flat_bytes(item.embedding) for item in items]
    headers: list[ItemHeader] = []
    end = 0
    for item, flat in zip(items, flats, strict=True):
        offset = _align_up(end)
        headers.append(_item_header(item, offset, flat.numel()))
        end = offset + flat.numel()
    if not flats:
        payload: bytes | memoryview = b""
    else:
        if len(flats) == 1:
            buf = flats[0]
        else:
            buf = torch.empty(end, dtype=torch.uint8)
            pos = 0
            for ih, flat in zip(headers, flats, strict=True):
                buf[pos : ih.offset].zero_()  # padding: never leak stale process memory onto the wire
                buf[ih.offset : ih.offset + ih.nbytes].copy_(flat)
                pos = ih.offset + ih.nbytes
        payload = memoryview(buf.numpy())  # keeps the tensor alive for as long as ZMQ holds the frame
    return [_header_bytes(request_id, part_index, num_parts, encoder, headers, None), payload]


def encode_error(
    request_id: str, part_index: int, num_parts: int, encoder: str, error: PartError
) -> list[bytes]:
    """Encode a failed part: a header carrying ``error``, no items, and an empty payload frame."""
    return [_header_bytes(request_id, part_index, num_parts, encoder, [], error), b""]


# -- decoding ------------------------------------------------------------------------------------
def _frame_buffer(frame: bytes | memoryview | zmq.Frame) -> memoryview:
    try:
        view = frame.buffer if isinstance(frame, zmq.Frame) else memoryview(frame)
        return view if view.format == "B" and view.ndim == 1 else view.cast("B")
    except TypeError as e:
        raise WireError(f"frame is not a contiguous byte buffer: {e}") from e


def _decode_header(buf: memoryview) -> PartHeader:
    try:
        version = msgspec.msgpack.decode(buf, type=_VersionOnly).version
    except msgspec.DecodeError as e:
        raise WireError(f"header is not a valid part header: {e}") from e
    if version != WIRE_VERSION:
        raise WireError(f"unsupported wire version {version} (expected {WIRE_VERSION})")
    try:
        return msgspec.msgpack.decode(buf, type=PartHeader)
    except msgspec.DecodeError as e:
        raise WireError(f"header is not a valid part header: {e}") from e


def _check_item_header(item: ItemHeader, payload_len: int) -> None:
    where = f"item {item.item_index}"
    if item.item_index < 0:
        raise WireError(f"{where}: negative item_index")
    if len(item.content_hash) != HASH_BYTES:
        raise WireError(f"{where}: content_hash is {len(item.content_hash)} bytes, expected {HASH_BYTES}")
    if item.modality not in _MODALITIES:
        raise WireError(f"{where}: unknown modality {item.modality!r}")
    if item.dtype not in _DTYPES:
        raise WireError(f"{where}: unknown dtype {item.dtype!r}")
    if min(item.shape) < 0:
        raise WireError(f"{where}: negative shape {item.shape}")
    expected = math.prod(item.shape) * _DTYPES[item.dtype].itemsize
    if item.nbytes != expected:
        raise WireError(f"{where}: nbytes {item.nbytes} != {expected} for shape {item.shape} {item.dtype}")
    if item.offset < 0 or item.offset + item.nbytes > payload_len:
        raise WireError(
            f"{where}: bytes [{item.offset}, {item.offset + item.nbytes}) outside payload of {payload_len}"
        )


def _check_header(header: PartHeader, payload_len: int) -> None:
    if header.num_parts < 1 or not 0 <= header.part_index < header.num_parts:
        raise WireError(f"part_index {header.part_index} out of range for num_parts {header.num_parts}")
    if header.error is not None and (header.items or payload_len):
        raise WireError("error part must carry no items and an empty payload")
    for item in header.items:
        _check_item_header(item, payload_len)
    if len({item.item_index for item in header.items}) != len(header.items):
        raise WireError("duplicate item_index in part")
    end = 0
    for item in sorted(header.items, key=lambda it: it.offset):
        if item.nbytes and item.offset < end:
            raise WireError(f"item {item.item_index}: payload range overlaps another item")
        end = max(end, item.offset + item.nbytes)


def _copy_out(payload: memoryview, item: ItemHeader) -> torch.Tensor:
    """Copy one item out of the payload into fresh, writable, aligned torch storage."""
    out = torch.empty(item.nbytes, dtype=torch.uint8)
    if item.nbytes:
        out.numpy()[:] = np.frombuffer(payload, dtype=np.uint8, count=item.nbytes, offset=item.offset)
    return out.view(_DTYPES[item.dtype]).view(item.shape)


def _view_or_copy(payload: memoryview, item: ItemHeader) -> torch.Tensor:
    """A tensor viewing the item's bytes in ``payload`` in place, or a copy where they are misaligned.

    The view's storage holds a reference to ``payload`` (and through it to the frame that exports it), so
    the frame's memory lives as long as any tensor viewing it.
    """
    dtype = _DTYPES[item.dtype]
    if not item.nbytes:  # frombuffer rejects empty ranges; nothing to share anyway
        return torch.empty(item.shape, dtype=dtype)
    view = torch.frombuffer(payload, dtype=dtype, count=item.nbytes // dtype.itemsize, offset=item.offset)
    # frombuffer does not check alignment; misaligned elements are undefined behaviour for torch kernels.
    if view.data_ptr() % dtype.itemsize:
        return _copy_out(payload, item)
    return view.view(item.shape)


def _views(payload: memoryview, items: list[ItemHeader]) -> list[torch.Tensor]:
    if not payload.readonly:
        return [_view_or_copy(payload, ih) for ih in items]
    with warnings.catch_warnings():
        # Read-only buffers (bytes; zmq.Frame before pyzmq 26) make frombuffer warn that the tensor is
        # writable anyway; decode_part documents its views as read-only, so the warning adds nothing.
        warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
        return [_view_or_copy(payload, ih) for ih in items]


def decode_part(
    frames: Sequence[bytes | memoryview | zmq.Frame], *, copy: bool = True
) -> tuple[PartHeader, list[EmbeddingItem]]:
    """Validate and decode a part; raises :class:`WireError` on anything malformed.

    With ``copy=True`` each embedding is copied out of the payload once, so the returned tensors own their
    memory: they outlive the frames, are writable, and are correctly aligned whatever the payload offsets.

    With ``copy=False`` each embedding is, where its bytes are aligned for its dtype, a view over the
    payload frame's memory (no copy; otherwise it falls back to a copy). The views keep the whole payload
    frame alive for as long as any of them lives, and must be treated as read-only: they share memory
    with the frame, which for ``inproc://`` is the sender's own tensor. The payload must not be modified
    afterwards either, so pass only buffers nobody else writes to, such as received ``zmq.Frame`` objects
    (ZMQ never reuses a delivered message's memory) or ``bytes``.
    """
    if len(frames) != NUM_FRAMES:
        raise WireError(f"expected {NUM_FRAMES} frames, got {len(frames)}")
    header = _decode_header(_frame_buffer(frames[0]))
    payload = _frame_buffer(frames[1])
    _check_header(header, len(payload))
    if copy:
        embeddings = [_copy_out(payload, ih) for ih in header.items]
    else:
        embeddings = _views(payload, header.items)
    items = [
        EmbeddingItem(
            item_index=ih.item_index,
            content_hash=ih.content_hash,
            modality=ih.modality,
            grid_thw=ih.grid_thw,
            second_per_grid_t=ih.second_per_grid_t,
            embedding=embedding,
        )
        for ih, embedding in zip(header.items, embeddings, strict=True)
    ]
    return header, items
