"""Chunk splice equals slicing the full-prompt splice, for every chunk boundary."""

from __future__ import annotations

import pytest
import torch

from mmserve.models.loader import load_model
from mmserve.multimodal.embedding import PlacedEmbedding, splice_chunk
from mmserve.multimodal.items import Modality, MultimodalItem, content_hash


@pytest.fixture(scope="module")
def two_image_prompt(tiny_qwen2_vl):
    model = load_model(tiny_qwen2_vl)
    embed = model.model.language_model.get_input_embeddings()
    hidden = embed.weight.shape[1]
    a = MultimodalItem(Modality.IMAGE, content_hash(Modality.IMAGE, b"a", {}), 6, offset=3)
    b = MultimodalItem(Modality.IMAGE, content_hash(Modality.IMAGE, b"b", {}), 4, offset=12)
    ids = [10, 11, 12] + [a.pad_value] * 6 + [13, 14, 15] + [b.pad_value] * 4 + [16, 17]
    placed = [
        PlacedEmbedding(a.offset, torch.randn(6, hidden)),
        PlacedEmbedding(b.offset, torch.randn(4, hidden)),
    ]
    # Reference: HF-style masked_scatter over the whole prompt.
    hf_ids = torch.tensor([t if t < 1000 else 0 for t in ids])
    mask = torch.tensor([t >= 1000 for t in ids])
    with torch.no_grad():
        full = embed(hf_ids).masked_scatter(mask.unsqueeze(-1), torch.cat([p.embedding for p in placed]))
    return torch.tensor(ids), embed, placed, full


def test_full_prompt_splice_equals_masked_scatter(two_image_prompt):
    ids, embed, placed, full = two_image_prompt
    with torch.no_grad():
        assert torch.equal(splice_chunk(ids, 0, embed, placed), full)


def test_every_single_split_point(two_image_prompt):
    ids, embed, placed, full = two_image_prompt
    n = ids.shape[0]
    with torch.no_grad():
        for split in range(1, n):
            head = splice_chunk(ids[:split], 0, embed, placed)
            tail = splice_chunk(ids[split:], split, embed, placed)
            assert torch.equal(torch.cat([head, tail]), full), split


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 7, 64])
def test_fixed_chunk_sizes(two_image_prompt, chunk):
    ids, embed, placed, full = two_image_prompt
    with torch.no_grad():
        parts = [splice_chunk(ids[s : s + chunk], s, embed, placed) for s in range(0, ids.shape[0], chunk)]
    assert torch.equal(torch.cat(parts), full)


def test_missing_item_embedding_is_an_error(two_image_prompt):
    ids, embed, placed, _ = two_image_prompt
    with torch.no_grad(), pytest.raises(ValueError, match="no item embedding"):
        splice_chunk(ids, 0, embed, placed[:1])
