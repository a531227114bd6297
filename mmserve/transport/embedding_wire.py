"""Wire format (v2) for encoder -> engine embedding parts: a msgpack header frame plus one raw payload frame.

A part is always exactly two frames, ``[header, payload]``:

* ``header``: a msgpack-encoded :class:`PartHeader` (msgspec Struct, never pickle). Per item: its index in
  the request, content hash, modality, the model family's metadata (opaque bytes) and a list of named
  tensors (the main embedding and extras such as DeepStack levels), each with dtype, shape and its
  ``offset``/``nbytes`` within the payload. Error parts carry a :class:`Failure` and no items.
* ``payload``: the raw bytes of every tensor, each starting at a multiple of :data:`ITEM_ALIGN` bytes
  (zero-filled gaps), so a receiver can view them in place; ``decode_part`` accepts any non-overlapping
  in-bounds offsets, padded or not.

With a cluster secret, the sender appends a third frame, an HMAC over both (see ``cluster_auth``); the
receiver checks and strips it before ``decode_part``, which always sees the two frames above. Whether the
tensors fit the model (hidden size, rows, extras) is the engine's check against the family, not the wire's.

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

from mmserve.multimodal.items import MAIN, ItemEmbedding, Modality
from mmserve.transport.messages import Failure

WIRE_VERSION = 2
NUM_FRAMES = 2
HASH_BYTES = 16
# Tensor offsets in an encoded payload are multiples of this (a cache line; covers every dtype's alignment).
ITEM_ALIGN = 64
MAX_TENSORS_PER_ITEM = 64
MAX_TENSOR_DIMS = 4

_DTYPES = MappingProxyType({"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16})
_DTYPE_NAMES = MappingProxyType({dtype: name for name, dtype in _DTYPES.items()})
_MODALITIES = frozenset(m.value for m in Modality)


class WireError(ValueError):
    """A malformed or incompatible embedding message."""


class TensorHeader(msgspec.Struct, frozen=True):
    name: str  # MAIN or an extra's name
    dtype: str  # "float32" | "bfloat16" | "float16"
    shape: tuple[int, ...]
    offset: int  # byte offset of this tensor's data in the payload
    nbytes: int


class ItemHeader(msgspec.Struct, frozen=True):
    item_index: int  # position of the item in the request's item list
    content_hash: bytes  # 16 bytes
    modality: str  # "image" | "video" | "audio"
    metadata: bytes  # the model family's, opaque to the wire
    tensors: list[TensorHeader]


class PartHeader(msgspec.Struct, frozen=True):
    version: int
    request_id: str
    part_index: int
    num_parts: int
    encoder: str  # who computed it (URL or "local")
    items: list[ItemHeader]
    error: Failure | None = None
    sent_at: float = 0.0  # time.time() at send (for transfer-time metrics and the replay window)
    cache_hits: int = 0  # items of this part the encoder found in its caches (usage reports)


class _VersionOnly(msgspec.Struct):  # decoded first: another version gets a version error, not a schema one
    version: int


@dataclass
class EmbeddingItem:
    """One item's embedding with its index in the request; what the sender gives and the receiver gets."""

    item_index: int
    item: ItemEmbedding


# -- encoding ------------------------------------------------------------------------------------
def _check_item(entry: EmbeddingItem) -> None:
    where, item = f"item {entry.item_index}", entry.item
    if len(item.content_hash) != HASH_BYTES:
        raise ValueError(f"{where}: content_hash must be {HASH_BYTES} bytes")
    if MAIN not in item.tensors:
        raise ValueError(f"{where}: no {MAIN!r} tensor")
    for name, tensor in item.tensors.items():
        if tensor.dtype not in _DTYPE_NAMES:
            raise ValueError(f"{where}: tensor {name!r} has unsupported dtype {tensor.dtype}")


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 CPU view of ``t``; no copy when ``t`` is already a contiguous CPU tensor."""
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


def _align_up(n: int) -> int:
    return -(-n // ITEM_ALIGN) * ITEM_ALIGN


@dataclass
class OutgoingPart:
    """A part laid out for sending: each transport writes the payload where it wants it (a ZMQ frame, a
    shared-memory region, a buffer registered with Mooncake) and sends the header beside it."""

    request_id: str
    part_index: int
    num_parts: int
    encoder: str
    items: list[ItemHeader]
    flats: list[torch.Tensor]  # flat uint8 views of the tensors, in payload order
    nbytes: int  # payload size
    error: Failure | None = None
    cache_hits: int = 0

    def header(self) -> bytes:
        """The msgpack header, stamped with the send time (the replay window and transfer metrics)."""
        header = PartHeader(
            WIRE_VERSION,
            self.request_id,
            self.part_index,
            self.num_parts,
            self.encoder,
            self.items,
            self.error,
            time.time(),
            self.cache_hits,
        )
        return msgspec.msgpack.encode(header)

    def write_into(self, dest: torch.Tensor) -> None:
        """Write the payload into the uint8 tensor ``dest`` (at least ``nbytes`` long), gaps zeroed."""
        pos = 0
        offsets = (t.offset for h in self.items for t in h.tensors)
        for offset, flat in zip(offsets, self.flats, strict=True):
            dest[pos:offset].zero_()  # padding: never leak stale process memory onto the wire
            dest[offset : offset + flat.numel()].copy_(flat)
            pos = offset + flat.numel()

    def payload(self) -> bytes | memoryview:
        """The payload as one buffer: a single contiguous tensor is sent as itself (zero-copy: it must not
        be modified afterwards, ZMQ may still read it after ``send`` returns); several are gathered once."""
        if not self.flats:
            return b""
        if len(self.flats) == 1:
            buf = self.flats[0]
        else:
            buf = torch.empty(self.nbytes, dtype=torch.uint8)
            self.write_into(buf)
        return memoryview(buf.numpy())  # keeps the tensor alive for as long as ZMQ holds the frame

    def frames(self) -> list[bytes | memoryview]:
        return [self.header(), self.payload()]


def build_part(
    request_id: str,
    part_index: int,
    num_parts: int,
    encoder: str,
    items: list[EmbeddingItem],
    cache_hits: int = 0,
) -> OutgoingPart:
    """Lay out a part (no copy yet): every tensor starts at a multiple of :data:`ITEM_ALIGN` bytes."""
    for entry in items:
        _check_item(entry)
    flats: list[torch.Tensor] = []
    headers: list[ItemHeader] = []
    end = 0
    for entry in items:
        tensors = []
        for name, tensor in entry.item.tensors.items():
            flat = _flat_bytes(tensor)
            offset = _align_up(end)
            dtype, shape = _DTYPE_NAMES[tensor.dtype], tuple(int(x) for x in tensor.shape)
            tensors.append(TensorHeader(name, dtype, shape, offset, flat.numel()))
            flats.append(flat)
            end = offset + flat.numel()
        it = entry.item
        headers.append(
            ItemHeader(
                entry.item_index, bytes(it.content_hash), it.modality.value, bytes(it.metadata), tensors
            )
        )
    return OutgoingPart(
        request_id, part_index, num_parts, encoder, headers, flats, end, cache_hits=cache_hits
    )


def error_part(
    request_id: str, part_index: int, num_parts: int, encoder: str, error: Failure
) -> OutgoingPart:
    """A failed part: a header carrying ``error``, no items, an empty payload."""
    return OutgoingPart(request_id, part_index, num_parts, encoder, [], [], 0, error)


def encode_part(
    request_id: str, part_index: int, num_parts: int, encoder: str, items: list[EmbeddingItem]
) -> list[bytes | memoryview]:
    """A part as ``[header, payload]`` frames (see :meth:`OutgoingPart.payload` on zero-copy)."""
    return build_part(request_id, part_index, num_parts, encoder, items).frames()


def encode_error(
    request_id: str, part_index: int, num_parts: int, encoder: str, error: Failure
) -> list[bytes | memoryview]:
    return error_part(request_id, part_index, num_parts, encoder, error).frames()


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


def _check_tensor_header(where: str, t: TensorHeader, payload_len: int) -> None:
    where = f"{where} tensor {t.name!r}"
    if t.dtype not in _DTYPES:
        raise WireError(f"{where}: unknown dtype {t.dtype!r}")
    if not 1 <= len(t.shape) <= MAX_TENSOR_DIMS or min(t.shape) < 0:
        raise WireError(f"{where}: invalid shape {t.shape}")
    expected = math.prod(t.shape) * _DTYPES[t.dtype].itemsize
    if t.nbytes != expected:
        raise WireError(f"{where}: nbytes {t.nbytes} != {expected} for shape {t.shape} {t.dtype}")
    if t.offset < 0 or t.offset + t.nbytes > payload_len:
        raise WireError(
            f"{where}: bytes [{t.offset}, {t.offset + t.nbytes}) outside payload of {payload_len}"
        )


def _check_item_header(item: ItemHeader, payload_len: int) -> None:
    where = f"item {item.item_index}"
    if item.item_index < 0:
        raise WireError(f"{where}: negative item_index")
    if len(item.content_hash) != HASH_BYTES:
        raise WireError(f"{where}: content_hash is {len(item.content_hash)} bytes, expected {HASH_BYTES}")
    if item.modality not in _MODALITIES:
        raise WireError(f"{where}: unknown modality {item.modality!r}")
    names = [t.name for t in item.tensors]
    if MAIN not in names or len(set(names)) != len(names) or len(names) > MAX_TENSORS_PER_ITEM:
        raise WireError(
            f"{where}: tensors {names} must be unique, at most {MAX_TENSORS_PER_ITEM}, with {MAIN!r}"
        )
    for t in item.tensors:
        _check_tensor_header(where, t, payload_len)


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
    for t in sorted((t for it in header.items for t in it.tensors), key=lambda t: t.offset):
        if t.nbytes and t.offset < end:
            raise WireError(f"tensor {t.name!r}: payload range overlaps another tensor")
        end = max(end, t.offset + t.nbytes)


def _copy_out(payload: memoryview, t: TensorHeader) -> torch.Tensor:
    """Copy one tensor out of the payload into fresh, writable, aligned torch storage."""
    out = torch.empty(t.nbytes, dtype=torch.uint8)
    if t.nbytes:
        out.numpy()[:] = np.frombuffer(payload, dtype=np.uint8, count=t.nbytes, offset=t.offset)
    return out.view(_DTYPES[t.dtype]).view(t.shape)


def _view_or_copy(payload: memoryview, t: TensorHeader) -> torch.Tensor:
    """A tensor viewing its bytes in ``payload`` in place, or a copy where they are misaligned.

    The view's storage holds a reference to ``payload`` (and through it to the frame that exports it), so
    the frame's memory lives as long as any tensor viewing it.
    """
    dtype = _DTYPES[t.dtype]
    if not t.nbytes:  # frombuffer rejects empty ranges; nothing to share anyway
        return torch.empty(t.shape, dtype=dtype)
    view = torch.frombuffer(payload, dtype=dtype, count=t.nbytes // dtype.itemsize, offset=t.offset)
    # frombuffer does not check alignment; misaligned elements are undefined behaviour for torch kernels.
    if view.data_ptr() % dtype.itemsize:
        return _copy_out(payload, t)
    return view.view(t.shape)


def _tensors(payload: memoryview, item: ItemHeader, copy: bool) -> dict[str, torch.Tensor]:
    if copy:
        return {t.name: _copy_out(payload, t) for t in item.tensors}
    if not payload.readonly:
        return {t.name: _view_or_copy(payload, t) for t in item.tensors}
    with warnings.catch_warnings():
        # Read-only buffers (bytes; zmq.Frame before pyzmq 26) make frombuffer warn that the tensor is
        # writable anyway; decode_part documents its views as read-only, so the warning adds nothing.
        warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
        return {t.name: _view_or_copy(payload, t) for t in item.tensors}


def decode_part(
    frames: Sequence[bytes | memoryview | zmq.Frame], *, copy: bool = True
) -> tuple[PartHeader, list[EmbeddingItem]]:
    """Validate and decode a part; raises :class:`WireError` on anything malformed.

    With ``copy=True`` each tensor is copied out of the payload once, so the returned tensors own their
    memory: they outlive the frames, are writable, and are correctly aligned whatever the payload offsets.

    With ``copy=False`` each tensor is, where its bytes are aligned for its dtype, a view over the payload
    frame's memory (no copy; otherwise it falls back to a copy). The views keep the whole payload frame
    alive for as long as any of them lives, and must be treated as read-only: they share memory with the
    frame, which for ``inproc://`` is the sender's own tensor. The payload must not be modified afterwards
    either, so pass only buffers nobody else writes to, such as received ``zmq.Frame`` objects (ZMQ never
    reuses a delivered message's memory) or ``bytes``.
    """
    if len(frames) != NUM_FRAMES:
        raise WireError(f"expected {NUM_FRAMES} frames, got {len(frames)}")
    header = _decode_header(_frame_buffer(frames[0]))
    payload = _frame_buffer(frames[1])
    _check_header(header, len(payload))
    items = [
        EmbeddingItem(
            ih.item_index,
            ItemEmbedding(Modality(ih.modality), ih.content_hash, _tensors(payload, ih, copy), ih.metadata),
        )
        for ih in header.items
    ]
    return header, items
