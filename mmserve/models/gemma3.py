"""Gemma 3 (`gemma3`): a SigLIP tower pooled to a fixed number of soft tokens per image (optionally pan-and-scan
crops, each its own image), and a language model of sliding-window layers (local RoPE base) around full ones,
where an image's tokens attend to each other both ways in every layer.

- Preprocessing: transformers' `Gemma3ImageProcessorPil` (resize to the tower's square, rescale, normalize;
  pan-and-scan crops of wide or tall images when `do_pan_and_scan` is on: `--mm-processor-kwargs
  '{"do_pan_and_scan": true}'`, with its `pan_and_scan_*` settings). As in transformers, the pan-and-scan settings
  are the processor's defaults (`Gemma3Processor.images_kwargs`) unless a request's settings say otherwise; the
  checkpoint's image processor keeps them null. An image becomes `1 + crops` tiles of `mm_tokens_per_image` soft
  tokens each; the crop count travels as the item's metadata and every setting that changes the tiles enters
  its content hash.
- Expansion: transformers' processor writes `"\\n\\n<start_of_image>" + soft tokens + "<end_of_image>\\n\\n"`
  for the chat template's `<start_of_image>` (with crops: "Here is the original image ... and here are some
  crops to help you see better ..."), text that tokenizes together with the prompt around it: expanded through
  the tokenizer (`text_expansion`).
- Attention: every run of soft tokens (one per tile) is a bidirectional block on every layer (transformers'
  `token_type_ids` mask): the engine computes each block whole and never caches part of one. Sliding layers
  read their window (`sliding_window`) from the engine's window pool.
- transformers' `Gemma3ForConditionalGeneration` applies no final logit soft-cap (only its text-only class
  does), and neither does mmserve for this family.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cached_property
from typing import Any

import msgspec
import torch
from PIL import Image

from mmserve.models import weights
from mmserve.models.family import (
    CausalLM,
    EmbeddingMismatch,
    LanguageModel,
    check_tensors,
    item_runs,
    plain_setting,
)
from mmserve.models.layer_specs import layer_specs_from_hf
from mmserve.models.text_expansion import expand_by_text
from mmserve.multimodal.errors import MediaDecodeError, UnsupportedMediaError
from mmserve.multimodal.items import MAIN, ExpandedPrompt, ItemEmbedding, Modality, TowerInput

# Image-processor settings a request may override (`--mm-processor-kwargs`): transformers' pan-and-scan ones.
PAN_AND_SCAN = (
    "do_pan_and_scan",
    "pan_and_scan_min_crop_size",
    "pan_and_scan_max_num_crops",
    "pan_and_scan_min_ratio_to_activate",
)
# Image-processor attributes that change a tile's pixels (all enter the content hash).
IMAGE_SETTINGS = (
    "size",
    "resample",
    "do_rescale",
    "rescale_factor",
    "do_normalize",
    "image_mean",
    "image_std",
)
# transformers' token_type_ids mask: an image's tokens see each other both ways on every layer
BOTH_WAYS = frozenset({"full_attention", "sliding_attention"})


class ImageMeta(msgspec.Struct, frozen=True, array_like=True):
    """A Gemma 3 image: its pan-and-scan crop count (tiles = 1 + crops) and the tile size."""

    num_crops: int
    tile_hw: tuple[int, int]


class Tower(torch.nn.Module):
    """transformers' SigLIP `vision_tower` and `multi_modal_projector` (pooling to the soft tokens)."""

    def __init__(self, vision_tower: torch.nn.Module, projector: torch.nn.Module) -> None:
        super().__init__()
        self.vision_tower = vision_tower
        self.multi_modal_projector = projector

    @property
    def dtype(self) -> torch.dtype:
        return self.multi_modal_projector.mm_input_projection_weight.dtype

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(tiles, 3, H, W) -> (tiles, soft tokens, hidden), as `Gemma3Model.get_image_features`."""
        hidden = self.vision_tower(pixel_values=pixel_values, return_dict=True).last_hidden_state
        return self.multi_modal_projector(hidden)


class Family(CausalLM):
    """Gemma 3 (see module docstring)."""

    modalities = frozenset({Modality.IMAGE})
    position_rows = 1
    extra_dims: dict[str, int] = {}
    audio_sample_rate_hz = None

    def __init__(self, path: str, hf_config, mm_processor_kwargs: Mapping[str, Any]) -> None:
        unknown = set(mm_processor_kwargs) - set(PAN_AND_SCAN)
        if unknown:
            raise ValueError(
                f"unknown mm processor settings {sorted(unknown)}; Gemma 3 takes {list(PAN_AND_SCAN)}"
            )
        self.path = path
        self.hf_config = hf_config
        self.model_type = hf_config.model_type
        self.overrides = dict(mm_processor_kwargs)
        from transformers import Gemma3Processor

        # transformers' processor passes its own pan-and-scan defaults to the image processor on every call
        defaults = {k: v for k, v in Gemma3Processor.images_kwargs.items() if k in PAN_AND_SCAN}
        self.pan_and_scan = {**defaults, **self.overrides}
        text = hf_config.get_text_config()
        if getattr(text, "use_bidirectional_attention", False):
            raise ValueError(
                "a Gemma 3 text model with bidirectional attention everywhere is not a generator"
            )
        self.hidden_size = text.hidden_size
        self.layer_specs = layer_specs_from_hf(text, bidirectional=BOTH_WAYS)
        self.tokens_per_tile = hf_config.mm_tokens_per_image
        self.soft_tokens = {Modality.IMAGE: hf_config.image_token_id}  # what an image's rows replace
        self.placeholders = {Modality.IMAGE: hf_config.boi_token_id}  # the chat template's, one per image

    # -- processor ------------------------------------------------------------------------------------
    @cached_property
    def image_processor(self):
        """transformers' PIL processor of the checkpoint, built on first use (pan-and-scan goes with each call)."""
        from transformers import Gemma3ImageProcessorPil

        return Gemma3ImageProcessorPil.from_pretrained(self.path)

    def hash_settings(self, modality: Modality, settings: Mapping[str, Any]) -> dict[str, Any]:
        if settings:
            raise UnsupportedMediaError(f"unknown item settings {sorted(settings)} for this model")
        proc = self.image_processor
        out = {k: plain_setting(getattr(proc, k, None)) for k in IMAGE_SETTINGS}
        return {**out, **self.pan_and_scan, "mm_tokens_per_image": self.tokens_per_tile}

    def meta(self, metadata: bytes) -> ImageMeta:
        return msgspec.msgpack.decode(metadata, type=ImageMeta)

    def num_tokens(self, meta: ImageMeta) -> int:
        return (1 + meta.num_crops) * self.tokens_per_tile

    def input_pixels(self, modality: Modality, metadata: bytes) -> int:
        meta = self.meta(metadata)
        return (1 + meta.num_crops) * meta.tile_hw[0] * meta.tile_hw[1]

    def check_item(self, item: ItemEmbedding) -> None:
        try:
            meta = self.meta(item.metadata)
        except msgspec.DecodeError as e:
            raise EmbeddingMismatch(
                f"{item.modality.value} embedding has no valid Gemma 3 metadata: {e}"
            ) from e
        if meta.num_crops < 0 or min(meta.tile_hw) < 1:
            raise EmbeddingMismatch(f"image embedding has invalid Gemma 3 metadata {meta}")
        check_tensors(self, item, self.num_tokens(meta))

    def precomputed_metadata(self, modality: Modality, fields, settings: Mapping[str, Any]) -> bytes:
        """No field: the crop count follows from the rows (tiles x `mm_tokens_per_image`)."""
        tiles, rest = divmod(fields.rows, self.tokens_per_tile)
        if tiles < 1 or rest:
            raise fields.invalid(
                f"'image_embeds' has {fields.rows} rows; an image has (1 + crops) x {self.tokens_per_tile} rows"
            )
        size = self.image_processor.size
        return msgspec.msgpack.encode(ImageMeta(tiles - 1, (size["height"], size["width"])))

    def precomputed_fields(self, modality: Modality, metadata: bytes) -> dict[str, torch.Tensor]:
        return {}

    def process(self, modality: Modality, media: Any, settings: Mapping[str, Any]) -> TowerInput:
        if settings:
            raise UnsupportedMediaError(f"unknown item settings {sorted(settings)} for this model")
        if modality != Modality.IMAGE:
            raise UnsupportedMediaError(f"{modality.value} input is not supported by this model")
        try:
            out = self.image_processor(images=[media], return_tensors="pt", **self.pan_and_scan)
        except ValueError as e:
            raise MediaDecodeError(f"image cannot be preprocessed: {e}") from e
        pixels = out["pixel_values"]  # (1 + crops, 3, H, W)
        meta = ImageMeta(int(out["num_crops"][0]), tuple(pixels.shape[-2:]))
        return TowerInput(
            Modality.IMAGE,
            {"pixel_values": pixels},
            msgspec.msgpack.encode(meta),
            self.num_tokens(meta),
            pixels.shape[0],
        )

    def probe_item(self) -> tuple[Modality, Any]:
        return Modality.IMAGE, Image.new("RGB", (16, 16), (128, 128, 128))

    # -- prompt ---------------------------------------------------------------------------------------
    def render(self, item) -> str:
        """transformers' `Gemma3Processor.replace_image_token` for this item."""
        tok = self.tokenizer
        tile = f"\n\n{tok.boi_token}{tok.image_token * self.tokens_per_tile}{tok.eoi_token}\n\n"
        crops = self.meta(item.metadata).num_crops
        if not crops:
            return tile
        return (
            f"Here is the original image {tile} and here are some crops to help you see better "
            + " ".join([tile] * crops)
        )

    def runs(self, item) -> list[int]:
        """Its runs of soft tokens in `render`'s text: one per tile."""
        return [self.tokens_per_tile] * (1 + self.meta(item.metadata).num_crops)

    def expand(self, token_ids: list[int], items: list[Any]) -> ExpandedPrompt:
        args = (self.placeholders, self.render, self.runs, self.soft_tokens)
        return expand_by_text(self.tokenizer, token_ids, items, *args)

    def bidirectional_blocks(self, expanded: ExpandedPrompt) -> list[tuple[int, int]]:
        return item_runs(expanded, self.modalities)

    # -- weights and forward --------------------------------------------------------------------------
    def load_language_model(self, dtype: torch.dtype, attn_implementation: str) -> LanguageModel:
        return weights.load_nested_language_model(self.path, self.hf_config, dtype, attn_implementation)

    def load_tower(self, dtype: torch.dtype) -> torch.nn.Module:
        parts = {"model.vision_tower": "sdpa", "model.multi_modal_projector": None}
        model = weights.load_tower_parts(self.path, self.hf_config, dtype, parts)
        return Tower(model.model.vision_tower, model.model.multi_modal_projector).eval()

    def encode(self, tower: torch.nn.Module, batch: list[TowerInput]) -> list[dict[str, torch.Tensor]]:
        device = tower.multi_modal_projector.mm_input_projection_weight.device
        pixels = torch.cat([it.tensors["pixel_values"] for it in batch]).to(device, tower.dtype)
        tiles = tower(pixels)  # (tiles, soft tokens, hidden)
        per_item = torch.split(tiles, [it.cost for it in batch])
        return [{MAIN: rows.reshape(-1, rows.shape[-1]).clone()} for rows in per_item]


def hf_processor(path: str, family: Family):
    """transformers' own `Gemma3Processor` for this checkpoint (the parity oracle's preprocessing and expansion),
    with the family's pan-and-scan settings."""
    from transformers import AutoTokenizer, Gemma3ImageProcessorPil, Gemma3Processor

    tokenizer = AutoTokenizer.from_pretrained(path)
    processor = Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil.from_pretrained(path),
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
        image_seq_length=family.tokens_per_tile,
    )
    processor.images_kwargs = {**Gemma3Processor.images_kwargs, **family.overrides}  # as a caller passes them
    return processor
