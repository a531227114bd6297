"""Multimodal items: modality, content hash, pad value, tower inputs, embeddings and their place in a prompt.

Invariants (see docs/architecture.md):
- content hash: 128-bit blake2b over (modality, the media's raw bytes, every setting that changes the item's
  output: the family's preprocessing, the media sampling, per-request item settings), and the request's
  cache salt if it has one (mmserve.engine.cache_salt: tenants never share an entry); a caller's `uuid`, when
  given, stands for the bytes (mmserve.multimodal.media_options). Two items share an embedding iff their
  hashes are equal. It is computed from the raw bytes before decoding, so a cache hit skips decoding entirely.
- pad value: PAD_BASE + the low PAD_BITS bits of the digest. PAD_BASE = 2**62 lies above every vocabulary
  id and the sum stays below 2**63, so pad values are valid int64 token ids that the radix prefix cache can
  key on ("same text + same image" matches, "same text + other image" does not).
- span: an item occupies the half-open range [offset, offset + span) of the expanded prompt. Its
  `num_tokens` embedding rows go, in order, to the positions of that range holding its pad value; the span
  is longer than `num_tokens` only when the family interleaves text inside an item (Qwen3-VL puts a
  timestamp before every video frame). The spans of a request's items are disjoint (`check_spans`): media
  that interleave, like Qwen-Omni's video with its own audio track, are ONE item whose rows are interleaved.

Generic code carries an item's family metadata as opaque bytes and its tensors by name; only the model
family (mmserve.models) reads them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

PAD_BASE = 1 << 62
PAD_BITS = 61  # >= 60 bits of the digest; PAD_BASE + 2**61 < 2**63 keeps pad values in int64
MAIN = "main"  # name of an item's main embedding among its tensors: (num_tokens, hidden)


class Modality(StrEnum):
    IMAGE = "image"
    VIDEO = "video"
    AUDIO = "audio"


def content_hash(modality: Modality, data: bytes, settings: Mapping[str, Any]) -> bytes:
    """16-byte digest identifying the embedding this item will produce."""
    h = hashlib.blake2b(digest_size=16)
    # Length-prefix each field so that no two different (modality, data, settings) triples can collide by
    # shifting bytes from one field into the next.
    for part in (
        modality.value.encode(),
        data,
        json.dumps(dict(settings), sort_keys=True, default=str).encode(),
    ):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


def pad_value(digest: bytes) -> int:
    """The token id that stands for every placeholder token of the item with this digest."""
    return PAD_BASE + (int.from_bytes(digest, "little") & ((1 << PAD_BITS) - 1))


@dataclass
class TowerInput:
    """One preprocessed item, ready for its family's tower.

    `tensors` and `metadata` are the family's own (pixel values and a grid, audio features and a length
    ...); `num_tokens` is how many LM tokens the item becomes; `cost` weighs it for the tower batcher's
    budget (patches, frames).
    """

    modality: Modality
    tensors: dict[str, torch.Tensor]
    metadata: bytes
    num_tokens: int
    cost: int


@dataclass
class ItemEmbedding:
    """An item's embedding as it travels: encoder -> cache -> wire -> engine.

    `tensors[MAIN]` is `(num_tokens, hidden)`; every other tensor is an extra input of the family's language
    model, row-aligned with the main one (`(num_tokens, dim)`, e.g. Qwen3-VL's DeepStack levels) so a prefill
    chunk slices it exactly like the main rows. `metadata` is the family's, opaque here.
    """

    modality: Modality
    content_hash: bytes
    tensors: dict[str, torch.Tensor]
    metadata: bytes = b""

    @property
    def embedding(self) -> torch.Tensor:
        return self.tensors[MAIN]

    @property
    def num_tokens(self) -> int:
        return self.tensors[MAIN].shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values()) + len(self.metadata)

    @property
    def pad_value(self) -> int:
        return pad_value(self.content_hash)


@dataclass
class MultimodalItem:
    """An item placed in an expanded prompt: `offset` and `span` are set by the family's `expand` (-1 / 0
    before)."""

    modality: Modality
    content_hash: bytes
    num_tokens: int
    metadata: bytes = b""
    offset: int = -1
    span: int = 0

    @classmethod
    def of(cls, item: ItemEmbedding) -> MultimodalItem:
        return cls(item.modality, item.content_hash, item.num_tokens, item.metadata)

    @property
    def pad_value(self) -> int:
        return pad_value(self.content_hash)

    @property
    def end(self) -> int:
        return self.offset + self.span


@dataclass
class ExpandedPrompt:
    """A prompt after placeholder expansion.

    `token_ids`: engine ids, every item token replaced by the item's pad value (the radix-cache key).
    `hf_token_ids`: the same prompt with the model's own placeholder ids, as HF `generate` expects.
    `items`: the request's items in prompt order, with `offset` and `span` set.
    """

    token_ids: list[int]
    hf_token_ids: list[int]
    items: list[MultimodalItem] = field(default_factory=list)


def check_spans(items: list[MultimodalItem]) -> None:
    """Raises ValueError unless the items' spans are disjoint (the splice gives each prompt position to at most
    one item's row)."""
    end = 0
    for item in sorted(items, key=lambda it: it.offset):
        if item.offset < end:
            raise ValueError(
                f"{item.modality.value} item at [{item.offset}, {item.end}) overlaps the item before it "
                f"(which ends at {end}): item spans must be disjoint"
            )
        end = item.end
