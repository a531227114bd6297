"""Embedding splice for one prefill chunk.

Given the chunk `[start, end)` of a request's expanded prompt, build its input embeddings: text rows from
the LM's token embedding, and every pad-value row replaced by the matching row of its item's embedding.
Only the item rows that fall inside the chunk are touched, so a chunk may cut through an item anywhere.
Extra tensors of an item (e.g. DeepStack levels) are sliced by the same rows and returned with the chunk
positions they belong to. The result equals slicing the full-prompt splice (tested for every boundary).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from mmserve.multimodal.items import MAIN, PAD_BASE


@dataclass
class PlacedEmbedding:
    """An item's tensors (`MAIN` `(num_tokens, hidden)` + row-aligned extras) placed in a prompt: row `i`
    goes to absolute position `positions[i]` (int64, increasing; contiguous unless the family interleaves
    text inside the item)."""

    positions: torch.Tensor
    tensors: dict[str, torch.Tensor]

    @classmethod
    def at(cls, token_ids: torch.Tensor, offset: int, span: int, pad: int, tensors: dict[str, torch.Tensor]):
        """Place an item whose rows fill the positions of `[offset, offset + span)` holding `pad`."""
        hits = torch.nonzero(token_ids[offset : offset + span] == pad).flatten() + offset
        rows = tensors[MAIN].shape[0]
        if hits.shape[0] != rows:
            raise ValueError(
                f"item at [{offset}, {offset + span}) has {hits.shape[0]} placeholder tokens "
                f"but {rows} embedding rows"
            )
        return cls(hits, tensors)

    def rows_in(self, start: int, end: int) -> tuple[int, int]:
        """Rows `[lo, hi)` of this item that land in prompt positions `[start, end)`."""
        bounds = torch.searchsorted(self.positions, torch.tensor([start, end]))
        return int(bounds[0]), int(bounds[1])


@dataclass
class ChunkExtras:
    """The extra item tensors of one chunk: `rows[name]` holds the rows in position order, and `positions`
    (chunk-relative, increasing) where each row belongs."""

    positions: list[torch.Tensor] = field(default_factory=list)
    rows: dict[str, list[torch.Tensor]] = field(default_factory=dict)


def splice_chunk(
    token_ids: torch.Tensor,
    start: int,
    embed_tokens: Callable[[torch.Tensor], torch.Tensor],
    items: Sequence[PlacedEmbedding],
    extras: ChunkExtras | None = None,
) -> torch.Tensor:
    """Input embeddings `(end - start, hidden)` for `token_ids` = prompt ids `[start, end)` (int64).

    Pad values (>= PAD_BASE) are outside the vocabulary: they are masked to 0 before the lookup and their
    rows overwritten from `items` (in position order). If `extras` is given, each item's extra tensors
    inside the chunk are appended to it. Raises ValueError if a pad row is not covered by any item.
    """
    end = start + token_ids.shape[0]
    is_pad = token_ids >= PAD_BASE
    embeds = embed_tokens(torch.where(is_pad, torch.zeros_like(token_ids), token_ids))  # (chunk, hidden)
    if not bool(is_pad.any()):
        return embeds
    covered = torch.zeros_like(is_pad)
    for item in items:
        lo, hi = item.rows_in(start, end)
        if lo >= hi:
            continue
        where = item.positions[lo:hi] - start
        embeds[where] = item.tensors[MAIN][lo:hi].to(embeds.device, embeds.dtype)
        covered[where] = True
        if extras is not None and len(item.tensors) > 1:
            extras.positions.append(where)
            for name, tensor in item.tensors.items():
                if name != MAIN:
                    extras.rows.setdefault(name, []).append(tensor[lo:hi])
    if bool((is_pad & ~covered).any()):
        raise ValueError(f"chunk [{start}, {end}) has placeholder tokens with no item embedding")
    return embeds
