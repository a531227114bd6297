"""Multimodal items: modality, content hash, pad value and offsets.

Invariants (see docs/architecture.md):
- content hash: 128-bit blake2b over (modality, the media's raw bytes, the output-relevant preprocessing
  settings). Two items share an embedding iff their hashes are equal. It is computed from the raw bytes
  before decoding, so a cache hit skips decoding entirely.
- pad value: PAD_BASE + the low PAD_BITS bits of the digest. PAD_BASE = 2**62 lies above every vocabulary
  id and the sum stays below 2**63, so pad values are valid int64 token ids that the radix prefix cache can
  key on ("same text + same image" matches, "same text + other image" does not).
- offsets: the half-open range [offset, offset + num_tokens) of the item's tokens in the expanded prompt.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

PAD_BASE = 1 << 62
PAD_BITS = 61  # >= 60 bits of the digest; PAD_BASE + 2**61 < 2**63 keeps pad values in int64


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
class MultimodalItem:
    """One image, video or audio clip of a request, from reference to placement in the prompt.

    `grid_thw` is the vision grid in patches (t, h, w) before merging; `num_tokens` the number of LM tokens
    the item expands to. `offset` is set when the prompt is expanded (-1 before).
    """

    modality: Modality
    content_hash: bytes
    num_tokens: int
    grid_thw: tuple[int, int, int] | None = None
    offset: int = -1
    # Video only (Qwen2.5-VL temporal positions): seconds covered by one temporal grid step.
    second_per_grid_t: float = 1.0

    @property
    def pad_value(self) -> int:
        return pad_value(self.content_hash)

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens
