"""Precomputed item embeddings from the client (`mmserve serve --enable-mm-embeds`).

A chat content part `{"type": "image_embeds", "image_embeds": "<base64>"}` (likewise `video_embeds`,
`audio_embeds`) carries one item as the base64 of a safetensors file (named tensors, no code: never pickle):

| tensor               | shape, dtype                                  | what                             |
|----------------------|-----------------------------------------------|----------------------------------|
| `<modality>_embeds`  | `(rows, hidden)` float32 / bfloat16 / float16 | the main rows the tower gives    |
| each of `extra_dims` | `(rows, width)`, the main dtype               | row-aligned extras (DeepStack)   |
| family metadata      | integers / floats                             | grids, sizes, lengths            |

The API server (which has the family loaded) turns a part into an `ItemEmbedding` with `build_item`:
every name, rank, dtype, width, NaN / Inf, size and metadata field is checked, and the family's `check_item`
ties the rows to the metadata, all before admission; any problem is a 400 (413 over the size cap) naming
the part and the tensor. The content hash covers the tensors' bytes, the metadata and the cache salt, so a
repeated embedding hits the prefix cache. The item crosses to the engine inside its `MediaItemMsg`
(`PrecomputedEmbedding`: raw bytes in msgpack); it never goes to an encoder: EPD parts index
`to_encode(media)`, the items still to compute, and the intake `merge`s the two back into prompt order
before `Engine.add_request`.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch

from mmserve.models.family import EmbeddingMismatch
from mmserve.multimodal.errors import MediaError, MediaTooLargeError
from mmserve.multimodal.items import MAIN, ItemEmbedding, Modality
from mmserve.transport.messages import MediaItemMsg, PrecomputedEmbedding, TensorData

if TYPE_CHECKING:
    from mmserve.models.family import ModelFamily

EMBED_DTYPES = MappingProxyType(
    {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
)
_BY_NAME = MappingProxyType({name: dtype for dtype, name in EMBED_DTYPES.items()})
INT_DTYPES = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})
FLOAT_DTYPES = frozenset({*EMBED_DTYPES, torch.float64})
# Metadata integers (grid sides, sizes, frame counts) above this are not a real item; refusing them keeps
# every derived count (tokens, pixels, positions) small.
MAX_METADATA_INT = 1 << 24


class InvalidEmbedsError(MediaError):
    """A precomputed embedding that does not fit this model or is not a well-formed part (HTTP 400)."""

    code = "invalid_embeds"


@dataclass(frozen=True)
class EmbedsRef:
    """A precomputed-embedding content part as parsed from the messages: the client's base64, unparsed."""

    data: Any  # a base64 string when well-formed; checked by `build_item`
    where: str  # e.g. "messages[0].content[1] (image_embeds)", for error messages

    def __repr__(self) -> str:
        return f"EmbedsRef({self.where})"


def part_name(modality: Modality) -> str:
    """The content-part type and main tensor name of a modality: "image_embeds"."""
    return f"{modality.value}_embeds"


class Fields:
    """One item's tensors as the client named them. The generic code takes the embeddings, the family its
    metadata fields (`ints` / `floats`); `finish` refuses what nobody took (never accepted and ignored)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], where: str) -> None:
        self._left = dict(tensors)
        self._known: list[str] = []  # every name asked for, for the "this model takes" message
        self.where = where
        self.rows = 0  # rows of the main embedding, set once it was taken

    def invalid(self, message: str) -> InvalidEmbedsError:
        return InvalidEmbedsError(message, item=self.where)

    def has(self, name: str) -> bool:
        return name in self._left

    def _take(self, name: str, what: str) -> torch.Tensor:
        self._known.append(name)
        if name not in self._left:
            raise self.invalid(f"no {name!r} tensor ({what})")
        return self._left.pop(name)

    def embedding(self, name: str, width: int) -> torch.Tensor:
        """A `(rows, width)` float tensor of finite values."""
        t = self._take(name, f"the (rows, {width}) embedding")
        if t.dtype not in EMBED_DTYPES:
            raise self.invalid(
                f"tensor {name!r} is {t.dtype}; embeddings must be float32, bfloat16 or float16"
            )
        if t.dim() != 2 or t.shape[1] != width:
            raise self.invalid(
                f"tensor {name!r} has shape {tuple(t.shape)}; this model needs (rows, {width})"
            )
        if t.shape[0] < 1:
            raise self.invalid(f"tensor {name!r} has no rows")
        if not bool(torch.isfinite(t).all()):
            raise self.invalid(f"tensor {name!r} holds NaN or Inf values")
        return t

    def ints(self, name: str, count: int, what: str) -> tuple[int, ...]:
        """`count` integers in [1, MAX_METADATA_INT] (shape `(count,)`, `(1, count)`, or a scalar for 1)."""
        t = self._take(name, what)
        if t.dtype not in INT_DTYPES:
            raise self.invalid(f"tensor {name!r} ({what}) is {t.dtype}; it must hold integers")
        if t.numel() != count or t.dim() > 2:
            raise self.invalid(
                f"tensor {name!r} has shape {tuple(t.shape)}; it must hold {count} integer(s) ({what})"
            )
        values = tuple(int(v) for v in t.flatten().tolist())
        if min(values) < 1 or max(values) > MAX_METADATA_INT:
            raise self.invalid(
                f"tensor {name!r} ({what}) is {list(values)}; every value must be in [1, {MAX_METADATA_INT}]"
            )
        return values

    def floats(self, name: str, count: int, what: str, default: tuple[float, ...] | None = None):
        """`count` finite floats; `default` when the tensor is absent and may be."""
        if default is not None and name not in self._left:
            self._known.append(name)
            return default
        t = self._take(name, what)
        if t.dtype not in FLOAT_DTYPES:
            raise self.invalid(f"tensor {name!r} ({what}) is {t.dtype}; it must hold floats")
        if t.numel() != count or t.dim() > 2:
            raise self.invalid(
                f"tensor {name!r} has shape {tuple(t.shape)}; it must hold {count} float(s) ({what})"
            )
        values = tuple(float(v) for v in t.flatten().tolist())
        if not all(math.isfinite(v) for v in values):
            raise self.invalid(f"tensor {name!r} ({what}) holds NaN or Inf values")
        return values

    def finish(self) -> None:
        if self._left:
            raise self.invalid(
                f"unexpected tensor(s) {sorted(self._left)}; this model takes "
                f"{sorted(set(self._known))} for this item"
            )


def decode_tensors(data: Any, max_bytes: int, where: str) -> dict[str, torch.Tensor]:
    """The named tensors of a part's base64 safetensors blob. Raises InvalidEmbedsError, or
    MediaTooLargeError past `max_bytes` (checked before decoding)."""
    from safetensors.torch import load

    if not isinstance(data, str) or not data:
        raise InvalidEmbedsError("must be a non-empty base64 string of a safetensors file", item=where)
    if len(data) > (max_bytes + 2) // 3 * 4:
        raise MediaTooLargeError(
            f"embedding is about {len(data) * 3 // 4} bytes; this server allows at most {max_bytes} per item "
            "(--max-media-mb)",
            item=where,
        )
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise InvalidEmbedsError(f"is not valid base64: {e}", item=where) from e
    try:
        tensors = load(raw)
    except Exception as e:  # safetensors raises its own error type (and others on odd headers): all are 400
        raise InvalidEmbedsError(f"is not a safetensors file: {e}", item=where) from e
    if not tensors:
        raise InvalidEmbedsError("the safetensors file holds no tensors", item=where)
    return tensors


def embeds_hash(
    modality: Modality, tensors: Mapping[str, torch.Tensor], metadata: bytes, cache_salt: str | None = None
) -> bytes:
    """16-byte content hash of a precomputed item: its modality, metadata and every tensor (name, dtype,
    shape, bytes), and the request's cache salt if any (tenants never share a pad value, as for media).
    Its own blake2b personalisation keeps it apart from the hashes of media bytes."""
    h = hashlib.blake2b(digest_size=16, person=b"mmserve-embeds")
    salt = b"" if cache_salt is None else b"salt:" + cache_salt.encode("utf-8", "surrogatepass")
    parts: list[bytes] = [modality.value.encode(), metadata, salt]
    for name in sorted(tensors):
        t = tensors[name]
        parts += [name.encode(), EMBED_DTYPES[t.dtype].encode(), repr(tuple(t.shape)).encode(), _raw(t)]
    for field in parts:  # length-prefixed: no two different items can collide by shifting bytes
        h.update(len(field).to_bytes(8, "little"))
        h.update(field)
    return h.digest()


def build_item(
    family: ModelFamily,
    modality: Modality,
    ref: EmbedsRef,
    settings: Mapping[str, Any],
    max_bytes: int,
    cache_salt: str | None = None,
) -> ItemEmbedding:
    """The checked ItemEmbedding of one part (see module docstring). `settings` are the family's
    `item_settings` for this item; `cache_salt` the request's. Raises InvalidEmbedsError /
    MediaTooLargeError naming the part."""
    fields = Fields(decode_tensors(ref.data, max_bytes, ref.where), ref.where)
    main = part_name(modality)
    tensors = {MAIN: fields.embedding(main, family.hidden_size)}
    fields.rows = tensors[MAIN].shape[0]
    for name, width in family.extra_dims.items():
        extra = fields.embedding(name, width)
        if extra.shape[0] != fields.rows or extra.dtype != tensors[MAIN].dtype:
            raise fields.invalid(
                f"tensor {name!r} is {extra.dtype} with {extra.shape[0]} rows; extras must "
                f"match {main!r} ({tensors[MAIN].dtype}, {fields.rows} rows)"
            )
        tensors[name] = extra
    metadata = family.precomputed_metadata(modality, fields, settings)
    fields.finish()
    digest = embeds_hash(modality, tensors, metadata, cache_salt)
    item = ItemEmbedding(modality, digest, tensors, metadata)
    try:
        family.check_item(item)
    except EmbeddingMismatch as e:  # rows vs the metadata; name the client's tensor, not our internal key
        raise fields.invalid(str(e).replace(repr(MAIN), repr(main))) from e
    return item


def content_part(family: ModelFamily, item: ItemEmbedding) -> dict[str, str]:
    """The chat content part carrying `item` (e.g. from mmserve's own `MultimodalEncoder`): what a client
    sends to a server started with --enable-mm-embeds."""
    from safetensors.torch import save

    main = part_name(item.modality)
    tensors = {main: item.tensors[MAIN], **{k: v for k, v in item.tensors.items() if k != MAIN}}
    tensors.update(family.precomputed_fields(item.modality, item.metadata))
    blob = save({k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()})
    return {"type": main, main: base64.b64encode(blob).decode()}


# -- API server -> engine ------------------------------------------------------------------------------------
def _raw(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def item_msg(
    family: ModelFamily,
    modality: Modality,
    ref: EmbedsRef,
    settings: Mapping[str, Any],
    max_bytes: int,
    cache_salt: str | None = None,
) -> MediaItemMsg:
    """The checked item as it travels to the engine (raw tensor bytes in msgpack)."""
    item = build_item(family, modality, ref, settings, max_bytes, cache_salt)
    tensors = [TensorData(k, EMBED_DTYPES[t.dtype], tuple(t.shape), _raw(t)) for k, t in item.tensors.items()]
    embedding = PrecomputedEmbedding(item.content_hash, item.metadata, tensors)
    return MediaItemMsg(modality.value, settings=dict(settings), embedding=embedding)


def from_msg(modality: Modality, msg: PrecomputedEmbedding) -> ItemEmbedding:
    """The engine's ItemEmbedding of a precomputed item. Raises ValueError if the message is inconsistent
    (the API server built it, so only a bug or a foreign sender gets here)."""
    tensors = {}
    for t in msg.tensors:
        dtype = _BY_NAME.get(t.dtype)
        if dtype is None or len(t.shape) != 2 or len(t.data) != math.prod(t.shape) * dtype.itemsize:
            raise ValueError(f"precomputed tensor {t.name!r} ({t.dtype}, {t.shape}) is inconsistent")
        # A copy (bytearray): torch wants a writable buffer, and the message is freed after admission.
        tensors[t.name] = torch.frombuffer(bytearray(t.data), dtype=torch.uint8).view(dtype).view(t.shape)
    if MAIN not in tensors or len(msg.content_hash) != 16:
        raise ValueError("precomputed embedding has no main tensor or no valid content hash")
    return ItemEmbedding(modality, msg.content_hash, tensors, msg.metadata)


def to_encode(media: list[MediaItemMsg]) -> list[MediaItemMsg]:
    """The items an encoder still has to compute, in prompt order: EPD parts and local encodes index this
    list; precomputed items travel with the request and never reach an encoder."""
    return [it for it in media if it.embedding is None]


def merge(media: list[MediaItemMsg], encoded: list[ItemEmbedding]) -> list[ItemEmbedding]:
    """Every item of a request in prompt order: `encoded` (for `to_encode(media)`, in order) with the
    precomputed ones in their places. Raises ValueError when the counts differ."""
    out = merge_prefix(media, encoded)
    if len(out) < len(media):
        raise ValueError("fewer encoded items than items to encode")
    if len(encoded) > len(to_encode(media)):
        raise ValueError("more encoded items than items to encode")
    return out


def merge_prefix(media: list[MediaItemMsg], encoded: list[ItemEmbedding]) -> list[ItemEmbedding]:
    """A request's first items in prompt order, up to its first item still to encode: `encoded` (the first
    items of `to_encode(media)`) with the precomputed ones in their places."""
    rest = iter(encoded)
    out = []
    for it in media:
        item = from_msg(Modality(it.modality), it.embedding) if it.embedding is not None else next(rest, None)
        if item is None:
            break
        out.append(item)
    return out
