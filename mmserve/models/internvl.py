"""InternVL 3 / 3.5, HF format (`internvl`): an InternViT tower over square tiles, pixel-shuffled 2x2 and projected
by an MLP, and a plain (1-D RoPE) Qwen2 / Qwen3 language model.

- Images: transformers' `GotOcr2ImageProcessorPil` with the processor's `crop_to_patches=True`: the image is
  resized onto the tile grid closest to its aspect ratio with between `min_patches` and `max_patches` tiles
  (InternVL's own name for the latter is `max_dynamic_patch`; both are accepted in `--mm-processor-kwargs` and in a
  request's `mm_processor_kwargs`, as SGLang takes them), plus a thumbnail tile when there are several. Every tile gives `image_seq_length` tokens. Each of these settings
  enters the content hash: two settings tile an image differently, so they never share an embedding.
- Videos: one tile per frame, each frame resized to the video processor's size (HF's video processor needs
  torchvision, so frames are prepared here with the image processor's own methods, as for LLaVA-OneVision).
- Expansion: transformers' processor writes `<img>` + `<IMG_CONTEXT>` x (tiles x image_seq_length) + `</img>` for
  an image's `<IMG_CONTEXT>` placeholder, and `Frame1: <img>...</img>\\nFrame2: ...` for a video's `<video>`: text
  that tokenizes with the prompt around it, expanded through the tokenizer (`text_expansion`). An item's span runs
  from its first context token to its last (a video's frame labels and wrappers inside it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict
from functools import cached_property
from typing import Any

import msgspec
import torch
from PIL import Image

from mmserve.models import weights
from mmserve.models.family import CausalLM, EmbeddingMismatch, LanguageModel, check_tensors, plain_setting
from mmserve.models.layer_specs import layer_specs_from_hf
from mmserve.models.llava_onevision import FrameSettings
from mmserve.models.text_expansion import expand_by_text
from mmserve.multimodal.errors import MediaDecodeError, UnsupportedMediaError
from mmserve.multimodal.items import MAIN, ExpandedPrompt, ItemEmbedding, Modality, TowerInput

# Tiling settings an operator may set (`--mm-processor-kwargs`); `max_dynamic_patch` is InternVL's name for
# `max_patches`.
TILING = ("crop_to_patches", "min_patches", "max_patches")
ALIASES = {"max_dynamic_patch": "max_patches"}
IMAGE_SETTINGS = (
    "size",
    "resample",
    "do_rescale",
    "rescale_factor",
    "do_normalize",
    "image_mean",
    "image_std",
)


def tiling_settings(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """`kwargs` (the operator's or a request's `mm_processor_kwargs`) as image-processor tiling settings, checked.
    Raises ValueError naming what is wrong."""
    settings = {ALIASES.get(k, k): v for k, v in kwargs.items()}
    unknown = set(settings) - set(TILING)
    if unknown:
        raise ValueError(
            f"unknown mm processor settings {sorted(unknown)}; InternVL takes {[*TILING, *ALIASES]}"
        )
    for key in ("min_patches", "max_patches"):
        value = settings.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key} must be a positive integer, not {value!r}")
    if not isinstance(settings.get("crop_to_patches", True), bool):
        raise ValueError(f"crop_to_patches must be true or false, not {settings['crop_to_patches']!r}")
    return settings


class VideoDefaults:
    """`InternVLVideoProcessor`'s class defaults (its module needs torchvision to import); the checkpoint's
    video_preprocessor_config.json overrides them."""

    size = {"height": 384, "width": 384}
    resample = 3  # bicubic
    do_resize = do_rescale = do_normalize = True
    rescale_factor = 1 / 255
    image_mean = (0.48145466, 0.4578275, 0.40821073)  # OPENAI_CLIP_MEAN / _STD
    image_std = (0.26862954, 0.26130258, 0.27577711)


class VisionMeta(msgspec.Struct, frozen=True, array_like=True):
    """An InternVL item: its tiles (an image's grid and thumbnail, a video's frames) and the tile size."""

    tiles: int
    tile_hw: tuple[int, int]


class Tower(torch.nn.Module):
    """transformers' InternViT `vision_tower` and `multi_modal_projector`, as `InternVLModel.get_image_features`."""

    def __init__(self, vision_tower: torch.nn.Module, projector: torch.nn.Module, hf_config) -> None:
        super().__init__()
        self.vision_tower = vision_tower
        self.multi_modal_projector = projector
        self.feature_layer = hf_config.vision_feature_layer
        self.strategy = hf_config.vision_feature_select_strategy
        self.ratio = hf_config.downsample_ratio

    @property
    def dtype(self) -> torch.dtype:
        return next(self.multi_modal_projector.parameters()).dtype

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(tiles, 3, H, W) -> (tiles, image_seq_length, hidden)."""
        from transformers.models.internvl.modeling_internvl import InternVLModel

        out = self.vision_tower(
            pixel_values=pixel_values, return_dict=True, output_hidden_states=self.feature_layer != -1
        )
        features = (
            out.last_hidden_state if self.feature_layer == -1 else out.hidden_states[self.feature_layer]
        )
        if self.strategy == "default":
            features = features[:, 1:, :]  # the CLS token
        tiles, patches, width = features.shape
        side = int(patches**0.5)
        # HF's pixel shuffle reads nothing of its module: called unbound rather than copied.
        shuffled = InternVLModel.pixel_shuffle(None, features.reshape(tiles, side, side, width), self.ratio)
        return self.multi_modal_projector(shuffled.reshape(tiles, -1, shuffled.shape[-1]))


class Family(CausalLM):
    """InternVL (see module docstring)."""

    modalities = frozenset({Modality.IMAGE, Modality.VIDEO})
    position_rows = 1
    extra_dims: dict[str, int] = {}
    audio_sample_rate_hz = None

    def __init__(self, path: str, hf_config, mm_processor_kwargs: Mapping[str, Any]) -> None:
        settings = tiling_settings(mm_processor_kwargs)
        self.path = path
        self.hf_config = hf_config
        self.model_type = hf_config.model_type
        self.overrides = settings
        self.hidden_size = hf_config.text_config.hidden_size
        self.layer_specs = layer_specs_from_hf(hf_config.get_text_config())
        self.tokens_per_tile = hf_config.image_seq_length
        self.context_token = hf_config.image_token_id
        self.soft_tokens = {Modality.IMAGE: self.context_token, Modality.VIDEO: self.context_token}

    # -- processor ------------------------------------------------------------------------------------
    @cached_property
    def placeholders(self) -> dict[Modality, int]:
        """The chat template's: `<IMG_CONTEXT>` per image (the context token itself), `<video>` per video."""
        return {Modality.IMAGE: self.context_token, Modality.VIDEO: self.tokenizer.video_token_id}

    @cached_property
    def image_processor(self):
        from transformers import GotOcr2ImageProcessorPil

        return GotOcr2ImageProcessorPil.from_pretrained(self.path)

    @cached_property
    def tiling(self) -> dict[str, Any]:
        """What the image processor tiles with: its own settings, the processor's `crop_to_patches=True`
        (`InternVLProcessor.images_kwargs`), then the operator's."""
        from transformers import InternVLProcessor

        proc = self.image_processor
        own = {k: getattr(proc, k) for k in TILING}
        return {**own, **InternVLProcessor.images_kwargs, **self.overrides}

    @cached_property
    def frames(self) -> FrameSettings:
        return FrameSettings.from_dir(self.path, VideoDefaults)

    def request_item_settings(
        self, modalities: Sequence[Modality], kwargs: Mapping[str, Any]
    ) -> list[dict[str, Any]]:
        """A request's own tiling (`mm_processor_kwargs`, e.g. `{"max_dynamic_patch": 2}`), for its images."""
        settings = tiling_settings(kwargs)
        return [dict(settings) if m == Modality.IMAGE else {} for m in modalities]

    def item_tiling(self, modality: Modality, settings: Mapping[str, Any]) -> dict[str, Any]:
        """The tiling of one item: the server's, then the request's. Raises UnsupportedMediaError (400) for
        settings that are not tiling ones (or on a video)."""
        try:
            own = tiling_settings(settings) if modality == Modality.IMAGE or not settings else None
        except ValueError as e:
            raise UnsupportedMediaError(str(e)) from e
        if own is None:
            raise UnsupportedMediaError(f"unknown item settings {sorted(settings)} for a video")
        return {**self.tiling, **own}

    def hash_settings(self, modality: Modality, settings: Mapping[str, Any]) -> dict[str, Any]:
        tiling = self.item_tiling(modality, settings)
        model = {"image_seq_length": self.tokens_per_tile}
        if modality == Modality.VIDEO:
            return {**asdict(self.frames), **model}
        proc = self.image_processor
        return {**{k: plain_setting(getattr(proc, k, None)) for k in IMAGE_SETTINGS}, **tiling, **model}

    def meta(self, metadata: bytes) -> VisionMeta:
        return msgspec.msgpack.decode(metadata, type=VisionMeta)

    def input_pixels(self, modality: Modality, metadata: bytes) -> int:
        meta = self.meta(metadata)
        return meta.tiles * meta.tile_hw[0] * meta.tile_hw[1]

    def check_item(self, item: ItemEmbedding) -> None:
        try:
            meta = self.meta(item.metadata)
        except msgspec.DecodeError as e:
            raise EmbeddingMismatch(
                f"{item.modality.value} embedding has no valid InternVL metadata: {e}"
            ) from e
        if meta.tiles < 1 or min(meta.tile_hw) < 1:
            raise EmbeddingMismatch(f"{item.modality.value} embedding has invalid InternVL metadata {meta}")
        check_tensors(self, item, meta.tiles * self.tokens_per_tile)

    def precomputed_metadata(self, modality: Modality, fields, settings: Mapping[str, Any]) -> bytes:
        """No field: the tile (or frame) count follows from the rows (tiles x `image_seq_length`)."""
        tiles, rest = divmod(fields.rows, self.tokens_per_tile)
        if tiles < 1 or rest:
            what = "tiles" if modality == Modality.IMAGE else "frames"
            raise fields.invalid(
                f"'{modality.value}_embeds' has {fields.rows} rows; an item has {what} x {self.tokens_per_tile} rows"
            )
        if modality == Modality.VIDEO:
            return msgspec.msgpack.encode(VisionMeta(tiles, (self.frames.height, self.frames.width)))
        size = self.image_processor.size
        return msgspec.msgpack.encode(VisionMeta(tiles, (size.height, size.width)))

    def precomputed_fields(self, modality: Modality, metadata: bytes) -> dict[str, torch.Tensor]:
        return {}

    def process(self, modality: Modality, media: Any, settings: Mapping[str, Any]) -> TowerInput:
        tiling = self.item_tiling(modality, settings)
        if modality == Modality.IMAGE:
            try:
                out = self.image_processor(images=[media], return_tensors="pt", **tiling)
            except ValueError as e:
                raise MediaDecodeError(f"image cannot be preprocessed: {e}") from e
            pixels = out["pixel_values"]  # (tiles, 3, H, W)
        elif modality == Modality.VIDEO:
            if media.frames.ndim != 4 or media.frames.shape[0] == 0:
                raise MediaDecodeError("video has no frames")
            pixels = self.frame_pixels(media.frames)
        else:
            raise UnsupportedMediaError(f"{modality.value} input is not supported by this model")
        meta = VisionMeta(pixels.shape[0], tuple(pixels.shape[-2:]))
        return TowerInput(
            modality,
            {"pixel_values": pixels},
            msgspec.msgpack.encode(meta),
            meta.tiles * self.tokens_per_tile,
            meta.tiles,
        )

    def frame_pixels(self, frames) -> torch.Tensor:
        """frames (T, H, W, 3) uint8 RGB -> (T, 3, height, width) float32, as `InternVLVideoProcessor`: each frame
        resized, rescaled and normalized, one tile a frame."""
        from mmserve.models.llava_onevision import frame_pixels

        return frame_pixels(self.image_processor, self.frames, frames)

    def probe_item(self) -> tuple[Modality, Any]:
        return Modality.IMAGE, Image.new("RGB", (16, 16), (128, 128, 128))

    # -- prompt ---------------------------------------------------------------------------------------
    def render(self, item) -> str:
        """transformers' `InternVLProcessor.replace_image_token` / `replace_video_token` for this item."""
        tok = self.tokenizer
        tile = tok.context_image_token * self.tokens_per_tile
        tiles = self.meta(item.metadata).tiles
        if item.modality == Modality.IMAGE:
            return f"{tok.start_image_token}{tile * tiles}{tok.end_image_token}"
        return "\n".join(
            f"Frame{i + 1}: {tok.start_image_token}{tile}{tok.end_image_token}" for i in range(tiles)
        )

    def runs(self, item) -> list[int]:
        """Its runs of context tokens in `render`'s text: one for an image, one per frame for a video."""
        tiles = self.meta(item.metadata).tiles
        if item.modality == Modality.IMAGE:
            return [tiles * self.tokens_per_tile]
        return [self.tokens_per_tile] * tiles

    def expand(self, token_ids: list[int], items: list[Any]) -> ExpandedPrompt:
        return expand_by_text(
            self.tokenizer, token_ids, items, self.placeholders, self.render, self.runs, self.soft_tokens
        )

    # -- weights and forward --------------------------------------------------------------------------
    def load_language_model(self, dtype: torch.dtype, attn_implementation: str) -> LanguageModel:
        return weights.load_nested_language_model(self.path, self.hf_config, dtype, attn_implementation)

    def load_tower(self, dtype: torch.dtype) -> torch.nn.Module:
        parts = {"model.vision_tower": "sdpa", "model.multi_modal_projector": None}
        model = weights.load_tower_parts(self.path, self.hf_config, dtype, parts)
        return Tower(model.model.vision_tower, model.model.multi_modal_projector, self.hf_config).eval()

    def encode(self, tower: torch.nn.Module, batch: list[TowerInput]) -> list[dict[str, torch.Tensor]]:
        device = next(tower.multi_modal_projector.parameters()).device
        pixels = torch.cat([it.tensors["pixel_values"] for it in batch]).to(device, tower.dtype)
        tiles = tower(pixels)  # (tiles, image_seq_length, hidden)
        per_item = torch.split(tiles, [it.cost for it in batch])
        return [{MAIN: rows.reshape(-1, rows.shape[-1]).clone()} for rows in per_item]


def hf_processor(path: str, family: Family):
    """transformers' own `InternVLProcessor` for this checkpoint (the parity oracle's tiling and expansion) with
    the PIL image processor and the family's tiling settings; video pixels from our preprocessing
    (`PrecomputedVideos`: HF's video processor needs torchvision), checked frame by frame elsewhere."""
    import json
    import os

    from transformers import AutoTokenizer, GotOcr2ImageProcessorPil, InternVLProcessor

    from mmserve.testing.reference import PrecomputedVideos, allow_any_video_processor

    seq = family.tokens_per_tile
    file = os.path.join(path, "processor_config.json")
    if os.path.exists(file):
        with open(file) as f:
            seq = json.load(f).get("image_seq_length", seq)
    tokenizer = AutoTokenizer.from_pretrained(path)
    videos = PrecomputedVideos(
        lambda vs: {"pixel_values_videos": torch.stack([family.frame_pixels(v.frames) for v in vs])}
    )
    with allow_any_video_processor():
        processor = InternVLProcessor(
            image_processor=GotOcr2ImageProcessorPil.from_pretrained(path),
            tokenizer=tokenizer,
            video_processor=videos,
            image_seq_length=seq,
            chat_template=tokenizer.chat_template,
        )
    processor.images_kwargs = {
        **InternVLProcessor.images_kwargs,
        **family.overrides,
    }  # as a caller passes them
    return processor
