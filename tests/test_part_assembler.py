"""PartAssembler: a request's parts in any order give Progress for each new run of items from the first one,
then Complete with every item in prompt order (the engine prefills in stages meanwhile)."""

from __future__ import annotations

import torch

from mmserve.multimodal.items import ItemEmbedding, Modality
from mmserve.runtime.receiver import Complete, PartAssembler, Progress
from mmserve.transport.embedding_wire import WIRE_VERSION, EmbeddingItem, PartHeader


def item(index: int) -> EmbeddingItem:
    tensors = {"main": torch.full((2, 4), float(index))}
    return EmbeddingItem(index, ItemEmbedding(Modality.IMAGE, bytes([index]) * 16, tensors))


def part(index: int, item_indices: list[int], num_parts: int = 3) -> tuple[PartHeader, list[EmbeddingItem]]:
    return PartHeader(WIRE_VERSION, "r", index, num_parts, f"enc{index}", []), [item(i) for i in item_indices]


def hashes(items: list[ItemEmbedding]) -> list[int]:
    return [it.content_hash[0] for it in items]


def test_progress_reports_each_longer_run_of_first_items_then_complete():
    assembler = PartAssembler()
    assert assembler.expect("r", ["image"] * 5, num_parts=4, timeout_s=60) == []
    assert assembler.add(*part(2, [3], num_parts=4)) == []  # not from the first item: nothing to prefill yet
    assert assembler.add(*part(1, [1, 2], num_parts=4)) == []
    (progress,) = assembler.add(*part(0, [0], num_parts=4))  # items 0-3 are here now, item 4 is not
    assert isinstance(progress, Progress) and hashes(progress.items) == [0, 1, 2, 3]
    (complete,) = assembler.add(*part(3, [4], num_parts=4))
    assert isinstance(complete, Complete) and hashes(complete.items) == [0, 1, 2, 3, 4]
    assert complete.item_encoders == ["enc0", "enc1", "enc1", "enc2", "enc3"]


def test_progress_only_when_the_run_grows():
    assembler = PartAssembler()
    assembler.expect("r", ["image"] * 3, num_parts=3, timeout_s=60)
    (first,) = assembler.add(*part(0, [0]))
    assert hashes(first.items) == [0]
    assert assembler.add(*part(0, [0])) == []  # a duplicate part changes nothing
    (second,) = assembler.add(*part(1, [1]))
    assert hashes(second.items) == [0, 1]
    (complete,) = assembler.add(*part(2, [2]))
    assert isinstance(complete, Complete)
