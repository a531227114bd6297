"""What every model family's multimodal processor provides, and the registry that picks one.

A processor turns decoded media into tower inputs (`ProcessedItem`), knows how many LM tokens each item
becomes, expands one placeholder token per item into that many pad values, and computes the prompt's
position ids. Model-specific behaviour lives in the family's file, never in generic code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from mmserve.multimodal.items import Modality, MultimodalItem


@dataclass
class ProcessedItem:
    """Tower input for one item: `pixel_values` rows (num_patches, patch_dim) and its grid."""

    modality: Modality
    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    num_tokens: int
    second_per_grid_t: float = 1.0


@dataclass
class ExpandedPrompt:
    """A prompt after placeholder expansion.

    `token_ids`: engine ids, every item token replaced by the item's pad value (the radix-cache key).
    `hf_token_ids`: the same prompt with the model's own placeholder ids, as HF `generate` expects.
    `items`: the request's items in prompt order, with `offset` set.
    """

    token_ids: list[int]
    hf_token_ids: list[int]
    items: list[MultimodalItem]


class MultimodalProcessor(Protocol):
    placeholder_token_ids: dict[Modality, int]

    @classmethod
    def from_pretrained(
        cls, path: str, hf_config: Any, mm_processor_kwargs: dict[str, Any]
    ) -> MultimodalProcessor: ...

    def hash_settings(self, modality: Modality) -> dict[str, Any]: ...

    def process(self, modality: Modality, media: Any) -> ProcessedItem: ...

    def input_pixels(self, modality: Modality, grid_thw: tuple[int, int, int]) -> int: ...

    def expand(self, token_ids: list[int], items: list[MultimodalItem]) -> ExpandedPrompt: ...

    def positions(self, expanded: ExpandedPrompt) -> tuple[torch.Tensor, int]: ...


_REGISTRY: dict[str, Callable[..., MultimodalProcessor]] = {}


def register_processor(*model_types: str):
    """Class decorator: make a processor the one used for these HF `model_type`s."""

    def wrap(cls):
        for model_type in model_types:
            _REGISTRY[model_type] = cls
        return cls

    return wrap


def processor_class(model_type: str) -> Callable[..., MultimodalProcessor]:
    # Import the family modules so their @register_processor decorators have run.
    from mmserve.multimodal.processors import qwen2_vl  # noqa: F401

    if model_type not in _REGISTRY:
        raise ValueError(f"no multimodal processor for model_type {model_type!r}; known: {sorted(_REGISTRY)}")
    return _REGISTRY[model_type]
