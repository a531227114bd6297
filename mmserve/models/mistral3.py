"""Mistral 3 (`mistral3`: Mistral Small 3.x in HF format, `Mistral3ForConditionalGeneration`): a Pixtral vision
tower with 2-D RoPE, the patch-merging projector and a plain (1-D RoPE) Mistral language model. Images only.

- Preprocessing: transformers' `PixtralImageProcessorPil` of the checkpoint. An image keeps its aspect ratio: it
  is shrunk to fit `longest_edge` when larger, then each side is rounded up to a multiple of patch_size x
  spatial_merge_size (transformers' `PixtralProcessor` passes that product as the image processor's patch
  size). Its resized (height, width) is the item's metadata (HF's `image_sizes`): rows x cols tokens, rows =
  height / (patch x merge), cols = width / (patch x merge).
- Expansion (as `PixtralProcessor.replace_image_token`): the chat template's one `[IMG]` per image becomes
  `[IMG]` x cols + `[IMG_BREAK]` for each row, the last `[IMG_BREAK]` replaced by `[IMG_END]`. The break and
  end tokens are text inside the item's span; the image's rows go only to its `[IMG]` positions (the ones
  holding its pad value), as transformers' model splices them.
- Tower: transformers' `PixtralVisionModel` runs a batch of images as ONE sequence (patches of every image,
  each cropped to its own size, a block-diagonal attention mask, per-patch (row, column) position ids for its
  2-D RoPE), then `Mistral3MultiModalProjector` (RMSNorm, 2 x 2 patch merging per image, two linears);
  `encode` calls transformers' own `Mistral3Model.get_image_features` on the padded batch, exactly as HF's
  model does for a request's images, and splits the rows per item.
- Language model: Mistral's, plain 1-D RoPE (break tokens advance positions like text); a Mistral
  `sliding_window` applies to every layer, as transformers' Mistral model applies it.

Mistral-native checkpoints (`params.json` + `consolidated*.safetensors`, no `config.json`) need
`mistral-common` and are refused when the model directory is resolved (`mmserve.models.resolve`).
"""

from __future__ import annotations

import copy
import importlib
import json
import os
import sys
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
    expand_placeholders,
    plain_setting,
)
from mmserve.models.layer_specs import layer_specs_from_hf
from mmserve.multimodal.errors import MediaDecodeError, UnsupportedMediaError
from mmserve.multimodal.items import MAIN, ExpandedPrompt, ItemEmbedding, Modality, TowerInput

# Image-processor attributes that change an image's pixels (all enter the content hash).
IMAGE_SETTINGS = (
    "size",
    "resample",
    "do_resize",
    "do_rescale",
    "rescale_factor",
    "do_normalize",
    "image_mean",
    "image_std",
    "do_convert_rgb",
)


class ImageMeta(msgspec.Struct, frozen=True, array_like=True):
    """A Mistral 3 image: its resized (height, width) in pixels (HF's `image_sizes`), multiples of the merged
    patch size."""

    image_hw: tuple[int, int]


class Tower(torch.nn.Module):
    """transformers' Pixtral `vision_tower` and `multi_modal_projector`; `features` is `Mistral3Model`'s own
    `get_image_features` (feature layer selection, projection with patch merging, the split per image)."""

    def __init__(self, config, vision_tower: torch.nn.Module, projector: torch.nn.Module) -> None:
        super().__init__()
        self.config = config
        self.vision_tower = vision_tower
        self.multi_modal_projector = projector

    @property
    def dtype(self) -> torch.dtype:
        return self.multi_modal_projector.linear_1.weight.dtype

    def features(self, pixel_values: torch.Tensor, image_sizes: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(images, 3, H, W) padded pixels and their (height, width) -> per image its (tokens, hidden) rows."""
        from transformers.models.mistral3.modeling_mistral3 import Mistral3Model

        out = Mistral3Model.get_image_features(self, pixel_values=pixel_values, image_sizes=image_sizes)
        return out.pooler_output


def text_layer_config(text_config):
    """The text config `layer_specs_from_hf` reads: transformers' Mistral names no `layer_types` and applies a set
    `sliding_window` in every layer."""
    if getattr(text_config, "layer_types", None) or getattr(text_config, "sliding_window", None) is None:
        return text_config
    config = copy.copy(text_config)
    config.layer_types = ["sliding_attention"] * text_config.num_hidden_layers
    return config


class Family(CausalLM):
    """Mistral 3 (see module docstring)."""

    tool_call_parser = "mistral"  # [TOOL_CALLS] control-token calls
    modalities = frozenset({Modality.IMAGE})
    position_rows = 1
    extra_dims: dict[str, int] = {}
    audio_sample_rate_hz = None

    def __init__(self, path: str, hf_config, mm_processor_kwargs: Mapping[str, Any]) -> None:
        if mm_processor_kwargs:
            raise ValueError(
                f"unknown mm processor settings {sorted(mm_processor_kwargs)}: Mistral 3 takes none"
            )
        self.path = path
        self.hf_config = hf_config
        self.model_type = hf_config.model_type
        text = hf_config.get_text_config()
        self.hidden_size = text.hidden_size
        self.layer_specs = layer_specs_from_hf(text_layer_config(text))
        self.patch_size = hf_config.vision_config.patch_size
        self.merge = hf_config.spatial_merge_size
        self.factor = self.patch_size * self.merge  # pixels of one LM token's side
        self.image_token_id = hf_config.image_token_id
        self.placeholders = {Modality.IMAGE: self.image_token_id}

    # -- processor ------------------------------------------------------------------------------------
    @cached_property
    def image_processor(self):
        """transformers' PIL processor of the checkpoint, built on first use."""
        from transformers import PixtralImageProcessorPil

        return PixtralImageProcessorPil.from_pretrained(self.path)

    @cached_property
    def structural_ids(self) -> tuple[int, int]:
        """The ids of `[IMG_BREAK]` and `[IMG_END]` (PixtralProcessor's defaults, or its processor_config.json)."""
        names = {"image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"}
        names.update({k: v for k, v in processor_config(self.path).items() if k in names and v})
        ids = tuple(
            self.tokenizer.convert_tokens_to_ids(names[k]) for k in ("image_break_token", "image_end_token")
        )
        if any(i is None or i == self.tokenizer.unk_token_id for i in ids):
            raise ValueError(f"the tokenizer lacks {names['image_break_token']} / {names['image_end_token']}")
        return ids

    def hash_settings(self, modality: Modality, settings: Mapping[str, Any]) -> dict[str, Any]:
        check_settings(modality, settings)
        proc = self.image_processor
        out = {k: plain_setting(getattr(proc, k, None)) for k in IMAGE_SETTINGS}
        return {
            **out,
            "patch_size": self.patch_size,
            "spatial_merge_size": self.merge,
            "vision_feature_layer": plain_setting(self.hf_config.vision_feature_layer),
        }

    def meta(self, metadata: bytes) -> ImageMeta:
        return msgspec.msgpack.decode(metadata, type=ImageMeta)

    def grid(self, meta: ImageMeta) -> tuple[int, int]:
        """(rows, cols) of LM tokens."""
        return meta.image_hw[0] // self.factor, meta.image_hw[1] // self.factor

    def num_tokens(self, meta: ImageMeta) -> int:
        rows, cols = self.grid(meta)
        return rows * cols

    def input_pixels(self, modality: Modality, metadata: bytes) -> int:
        height, width = self.meta(metadata).image_hw
        return height * width

    def check_item(self, item: ItemEmbedding) -> None:
        try:
            meta = self.meta(item.metadata)
        except msgspec.DecodeError as e:
            raise EmbeddingMismatch(
                f"{item.modality.value} embedding has no valid Mistral 3 metadata: {e}"
            ) from e
        if item.modality != Modality.IMAGE or not self.valid_size(meta.image_hw):
            raise EmbeddingMismatch(f"{item.modality.value} embedding has invalid Mistral 3 metadata {meta}")
        check_tensors(self, item, self.num_tokens(meta))

    def valid_size(self, image_hw: tuple[int, int]) -> bool:
        return all(side >= self.factor and side % self.factor == 0 for side in image_hw)

    def precomputed_metadata(self, modality: Modality, fields, settings: Mapping[str, Any]) -> bytes:
        """`image_sizes`: the resized image's (height, width) in pixels, as HF's processor returns it (multiples
        of patch_size x spatial_merge_size); the rows must then be (height / f) x (width / f)."""
        check_settings(modality, settings)
        height, width = fields.ints("image_sizes", 2, "the resized image's (height, width)")
        if not self.valid_size((height, width)):
            raise fields.invalid(
                f"'image_sizes' is {[height, width]}; both must be positive multiples of {self.factor}"
            )
        return msgspec.msgpack.encode(ImageMeta((height, width)))

    def precomputed_fields(self, modality: Modality, metadata: bytes) -> dict[str, torch.Tensor]:
        return {"image_sizes": torch.tensor(self.meta(metadata).image_hw)}

    def process(self, modality: Modality, media: Any, settings: Mapping[str, Any]) -> TowerInput:
        check_settings(modality, settings)
        try:
            # As PixtralProcessor: the image processor rounds sides up to multiples of patch x merge.
            out = self.image_processor(images=[media], patch_size=self.factor, return_tensors="pt")
        except ValueError as e:
            raise MediaDecodeError(f"image cannot be preprocessed: {e}") from e
        pixels = out["pixel_values"][0]  # (3, height, width): one image, no padding
        meta = ImageMeta(tuple(int(x) for x in out["image_sizes"][0]))
        return TowerInput(
            Modality.IMAGE,
            {"pixel_values": pixels},
            msgspec.msgpack.encode(meta),
            self.num_tokens(meta),
            cost=meta.image_hw[0] * meta.image_hw[1] // self.patch_size**2,  # patches in the tower
        )

    def probe_item(self) -> tuple[Modality, Any]:
        return Modality.IMAGE, Image.new("RGB", (16, 16), (128, 128, 128))

    # -- prompt ---------------------------------------------------------------------------------------
    def expand(self, token_ids: list[int], items: list[Any]) -> ExpandedPrompt:
        brk, end = self.structural_ids

        def render(item, placeholder: int) -> tuple[list[int], list[int]]:
            rows, cols = self.grid(self.meta(item.metadata))
            ours = ([item.pad_value] * cols + [brk]) * rows
            theirs = ([placeholder] * cols + [brk]) * rows
            ours[-1] = theirs[-1] = end
            return ours, theirs

        return expand_placeholders(token_ids, items, self.placeholders, render)

    # -- weights and forward --------------------------------------------------------------------------
    def load_language_model(self, dtype: torch.dtype, attn_implementation: str) -> LanguageModel:
        return weights.load_nested_language_model(self.path, self.hf_config, dtype, attn_implementation)

    def load_tower(self, dtype: torch.dtype) -> torch.nn.Module:
        parts = {"model.vision_tower": "sdpa", "model.multi_modal_projector": None}
        model = weights.load_tower_parts(self.path, self.hf_config, dtype, parts)
        return Tower(self.hf_config, model.model.vision_tower, model.model.multi_modal_projector).eval()

    def encode(self, tower: torch.nn.Module, batch: list[TowerInput]) -> list[dict[str, torch.Tensor]]:
        device = tower.multi_modal_projector.linear_1.weight.device
        if sum(it.num_tokens for it in batch) == 1:
            # transformers' `get_image_features` squeezes the rows of a batch of one token to 1-D and fails to
            # split them (HF's model fails on such a request too): the lone item goes twice, in its own blocks.
            return self.encode(tower, [batch[0], batch[0]])[:1]
        sizes = [self.meta(it.metadata).image_hw for it in batch]
        height, width = max(h for h, _ in sizes), max(w for _, w in sizes)
        # Padded to the batch's largest sides as HF's image processor pads a request's images; the tower crops
        # each image's patches back to its own size.
        pixels = torch.zeros(len(batch), 3, height, width, dtype=tower.dtype, device=device)
        for i, (item, (h, w)) in enumerate(zip(batch, sizes, strict=True)):
            pixels[i, :, :h, :w] = item.tensors["pixel_values"].to(device, tower.dtype)
        rows = tower.features(pixels, torch.tensor(sizes, device=device))
        # Independent storage per item: each lives on in the cache on its own.
        return [{MAIN: r.clone()} for r in rows]


def check_settings(modality: Modality, settings: Mapping[str, Any]) -> None:
    if modality != Modality.IMAGE:
        raise UnsupportedMediaError(f"{modality.value} input is not supported by this model")
    if settings:
        raise UnsupportedMediaError(f"unknown item settings {sorted(settings)} for this model")


def processor_config(path: str) -> dict[str, Any]:
    file = os.path.join(path, "processor_config.json")
    if not os.path.exists(file):
        return {}
    with open(file) as f:
        return json.load(f)


def pixtral_processor_class():
    """transformers' `PixtralProcessor`. Its module imports one function (`get_resize_output_image_size`, for
    `_get_num_multimodal_tokens` only) from the torchvision image processor's module, which cannot load beside
    this CPU torch; the PIL image processor's module defines the same function, and serves that import."""
    name = "transformers.models.pixtral.processing_pixtral"
    if name in sys.modules:
        return sys.modules[name].PixtralProcessor
    from transformers.models.pixtral import image_processing_pil_pixtral

    torchvision_module = "transformers.models.pixtral.image_processing_pixtral"
    saved = sys.modules.get(torchvision_module)
    sys.modules[torchvision_module] = image_processing_pil_pixtral
    try:
        return importlib.import_module(name).PixtralProcessor
    finally:
        if saved is None:
            sys.modules.pop(torchvision_module, None)
        else:
            sys.modules[torchvision_module] = saved


def hf_processor(path: str, family: Family):
    """transformers' own `PixtralProcessor` for this checkpoint (the parity oracle's preprocessing and expansion):
    the PIL image processor, and the settings of its processor_config.json."""
    from transformers import AutoTokenizer, PixtralImageProcessorPil

    settings = {"patch_size": family.patch_size, "spatial_merge_size": family.merge}
    known = ("patch_size", "spatial_merge_size", "image_token", "image_break_token", "image_end_token")
    settings.update({k: v for k, v in processor_config(path).items() if k in known and v is not None})
    tokenizer = AutoTokenizer.from_pretrained(path)
    return pixtral_processor_class()(
        image_processor=PixtralImageProcessorPil.from_pretrained(path),
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
        **settings,
    )
