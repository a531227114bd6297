"""Embedding splice for one prefill chunk.

Given the chunk `[start, end)` of a request's expanded prompt, build its input embeddings: text rows from
the LM's token embedding, and every pad-value row replaced by the matching row of its item's embedding.
Only the item rows that fall inside the chunk are touched, so a chunk may cut through an item anywhere.
The result equals slicing the full-prompt splice (tested for every boundary).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from mmserve.multimodal.items import PAD_BASE


@dataclass
class PlacedEmbedding:
    """An item's embedding `(num_tokens, hidden)` placed at `[offset, offset + num_tokens)`."""

    offset: int
    embedding: torch.Tensor

    @property
    def end(self) -> int:
        return self.offset + self.embedding.shape[0]


def splice_chunk(
    token_ids: torch.Tensor,
    start: int,
    embed_tokens: Callable[[torch.Tensor], torch.Tensor],
    items: Sequence[PlacedEmbedding],
) -> torch.Tensor:
    """Input embeddings `(end - start, hidden)` for `token_ids` = prompt ids `[start, end)` (int64).

    Pad values (>= PAD_BASE) are outside the vocabulary: they are masked to 0 before the lookup and their
    rows overwritten from `items`. Raises ValueError if a pad row is not covered by any item.
    """
    end = start + token_ids.shape[0]
    is_pad = token_ids >= PAD_BASE
    embeds = embed_tokens(torch.where(is_pad, torch.zeros_like(token_ids), token_ids))  # (chunk, hidden)
    if not bool(is_pad.any()):
        return embeds
    covered = torch.zeros_like(is_pad)
    for item in items:
        lo, hi = max(item.offset, start), min(item.end, end)
        if lo >= hi:
            continue
        embeds[lo - start : hi - start] = item.embedding[lo - item.offset : hi - item.offset].to(embeds.dtype)
        covered[lo - start : hi - start] = True
    if bool((is_pad & ~covered).any()):
        raise ValueError(f"chunk [{start}, {end}) has placeholder tokens with no item embedding")
    return embeds
