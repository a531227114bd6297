"""Chunk splice equals slicing the full-prompt splice, for every chunk boundary: main rows, items whose span
holds text (Qwen3-VL video frames), and extra row-aligned tensors (DeepStack levels)."""

from __future__ import annotations

import pytest
import torch

from mmserve.models.loader import load_model
from mmserve.multimodal.embedding import ChunkExtras, PlacedEmbedding, splice_chunk
from mmserve.multimodal.items import MAIN, Modality, content_hash, pad_value


@pytest.fixture(scope="module")
def two_item_prompt(tiny_qwen2_vl):
    model = load_model(tiny_qwen2_vl)
    embed = model.model.language_model.get_input_embeddings()
    hidden = embed.weight.shape[1]
    pa, pb = (pad_value(content_hash(Modality.IMAGE, x, {})) for x in (b"a", b"b"))
    # Item b is a "video" whose two frames are separated by two text tokens inside its span.
    ids = [10, 11, 12] + [pa] * 6 + [13, 14, 15] + [pb] * 2 + [18, 19] + [pb] * 2 + [16, 17]
    t = torch.tensor(ids)
    placed = [
        PlacedEmbedding.at(t, 3, 6, pa, {MAIN: torch.randn(6, hidden), "deep": torch.randn(6, 3)}),
        PlacedEmbedding.at(t, 12, 6, pb, {MAIN: torch.randn(4, hidden), "deep": torch.randn(4, 3)}),
    ]
    # Reference: HF-style masked_scatter over the whole prompt; extras in mask order.
    hf_ids = torch.tensor([t if t < 1000 else 0 for t in ids])
    mask = torch.tensor([t >= 1000 for t in ids])
    with torch.no_grad():
        full = embed(hf_ids).masked_scatter(mask.unsqueeze(-1), torch.cat([p.tensors[MAIN] for p in placed]))
    deep = torch.cat([p.tensors["deep"] for p in placed])
    return t, embed, placed, full, mask, deep


def splice(ids, start, embed, placed):
    extras = ChunkExtras()
    out = splice_chunk(ids, start, embed, placed, extras)
    where = torch.cat(extras.positions) + start if extras.positions else torch.zeros(0, dtype=torch.long)
    rows = torch.cat(extras.rows["deep"]) if extras.rows else torch.zeros(0, 3)
    return out, where, rows


def test_placement_follows_the_pad_values_inside_a_span(two_item_prompt):
    _, _, placed, _, _, _ = two_item_prompt
    assert placed[0].positions.tolist() == list(range(3, 9))
    assert placed[1].positions.tolist() == [12, 13, 16, 17]  # the text at 14, 15 is skipped
    with pytest.raises(ValueError, match="placeholder tokens"):
        PlacedEmbedding.at(torch.tensor([1, 2, 3]), 0, 3, 2**62 + 5, {MAIN: torch.zeros(2, 4)})


def test_full_prompt_splice_equals_masked_scatter(two_item_prompt):
    ids, embed, placed, full, mask, deep = two_item_prompt
    with torch.no_grad():
        out, where, rows = splice(ids, 0, embed, placed)
    assert torch.equal(out, full)
    assert torch.equal(where, torch.nonzero(mask).flatten()) and torch.equal(rows, deep)


def test_every_single_split_point(two_item_prompt):
    ids, embed, placed, full, mask, deep = two_item_prompt
    n = ids.shape[0]
    with torch.no_grad():
        for split in range(1, n):
            head, hw, hr = splice(ids[:split], 0, embed, placed)
            tail, tw, tr = splice(ids[split:], split, embed, placed)
            assert torch.equal(torch.cat([head, tail]), full), split
            assert torch.equal(torch.cat([hw, tw]), torch.nonzero(mask).flatten()), split
            assert torch.equal(torch.cat([hr, tr]), deep), split


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 7, 64])
def test_fixed_chunk_sizes(two_item_prompt, chunk):
    ids, embed, placed, full, _, deep = two_item_prompt
    with torch.no_grad():
        parts = [splice(ids[s : s + chunk], s, embed, placed) for s in range(0, ids.shape[0], chunk)]
    assert torch.equal(torch.cat([p[0] for p in parts]), full)
    assert torch.equal(torch.cat([p[2] for p in parts]), deep)


def test_missing_item_embedding_is_an_error(two_item_prompt):
    ids, embed, placed, _, _, _ = two_item_prompt
    with torch.no_grad(), pytest.raises(ValueError, match="no item embedding"):
        splice_chunk(ids, 0, embed, placed[:1])
