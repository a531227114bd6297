"""Qwen2-VL / Qwen2.5-VL: preprocessing, token counts, placeholder expansion, M-RoPE positions, loading, encode.

Images go through transformers' PIL image processor (no torchvision). Videos are preprocessed here: HF's
video processor needs torchvision. Each sampled frame is resized / rescaled / normalized by the same image
processor (with the video pixel limits), then frames are paired along the temporal patch axis, giving the
`pixel_values_videos` layout of HF: rows ordered (t, h/m, w/m, m_h, m_w), columns (C, t_patch, p_h, p_w).

Checkpoint keys come in two layouts: the original one (`model.layers...`, `visual....`, `lm_head.weight`) and
transformers 5's (`model.language_model...`, `model.visual...`); both load, through transformers' own renames
(`mmserve.models.weights.load_parts`). With tied embeddings the checkpoint has no `lm_head.weight` and the head
shares the input embedding.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from functools import cached_property
from typing import Any

import msgspec
import numpy as np
import torch
from PIL import Image

from mmserve.models import weights
from mmserve.models.family import (
    CausalLM,
    EmbeddingMismatch,
    LanguageModel,
    check_tensors,
    expand_placeholders,
)
from mmserve.models.layer_specs import layer_specs_from_hf
from mmserve.multimodal.errors import MediaDecodeError, UnsupportedMediaError
from mmserve.multimodal.items import MAIN, ExpandedPrompt, ItemEmbedding, Modality, TowerInput


@dataclass(frozen=True)
class VisionPreprocessConfig:
    """Output-relevant preprocessing settings of the Qwen-VL families.

    Every field changes the pixels the tower sees, so all of them enter the content hash: an item
    preprocessed with other settings is a different cache entry.
    """

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_min_pixels: int = 56 * 56
    image_max_pixels: int = 28 * 28 * 1280
    video_min_pixels: int = 128 * 28 * 28
    video_max_pixels: int = 768 * 28 * 28
    image_mean: tuple[float, ...] = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple[float, ...] = (0.26862954, 0.26130258, 0.27577711)

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


class VisionMeta(msgspec.Struct, frozen=True, array_like=True):
    """What travels with a Qwen-VL item: its patch grid (t, h, w) before merging and, for videos, the
    seconds one temporal grid step covers (Qwen2.5-VL spaces temporal positions by real time)."""

    grid_thw: tuple[int, int, int]
    second_per_grid_t: float = 1.0


def make_image_processor(cfg: VisionPreprocessConfig | None = None):
    """A torchvision-free Qwen2-VL image processor configured from `cfg`."""
    from transformers import Qwen2VLImageProcessorPil

    cfg = cfg or VisionPreprocessConfig()
    return Qwen2VLImageProcessorPil(
        size={"shortest_edge": cfg.image_min_pixels, "longest_edge": cfg.image_max_pixels},
        patch_size=cfg.patch_size,
        temporal_patch_size=cfg.temporal_patch_size,
        merge_size=cfg.merge_size,
        image_mean=list(cfg.image_mean),
        image_std=list(cfg.image_std),
    )


def preprocess_config_from_dir(path: str, overrides: Mapping[str, Any], defaults: VisionPreprocessConfig):
    """Read a checkpoint's preprocessor_config.json (and video_preprocessor_config.json) into a
    VisionPreprocessConfig, then apply vLLM-style `--mm-processor-kwargs`. Raises ValueError on unknown keys."""
    values: dict[str, Any] = asdict(defaults)
    for name, prefix in (("preprocessor_config.json", "image"), ("video_preprocessor_config.json", "video")):
        file = os.path.join(path, name)
        if not os.path.exists(file):
            continue
        with open(file) as f:
            raw = json.load(f)
        size = raw.get("size") or {}
        pairs = {
            "patch_size": raw.get("patch_size"),
            "temporal_patch_size": raw.get("temporal_patch_size"),
            "merge_size": raw.get("merge_size"),
            f"{prefix}_min_pixels": raw.get("min_pixels", size.get("shortest_edge")),
            f"{prefix}_max_pixels": raw.get("max_pixels", size.get("longest_edge")),
        }
        if prefix == "image":
            pairs["image_mean"] = tuple(raw["image_mean"]) if "image_mean" in raw else None
            pairs["image_std"] = tuple(raw["image_std"]) if "image_std" in raw else None
        values.update({k: v for k, v in pairs.items() if v is not None})
    aliases = {"min_pixels": "image_min_pixels", "max_pixels": "image_max_pixels"}
    names = {f.name for f in fields(VisionPreprocessConfig)}
    for key, value in overrides.items():
        key = aliases.get(key, key)
        if key not in names:
            raise ValueError(f"unknown mm processor setting {key!r}; known: {sorted(names | set(aliases))}")
        values[key] = tuple(value) if isinstance(value, list) else value
    return VisionPreprocessConfig(**values)


class Family(CausalLM):
    """Qwen2-VL and Qwen2.5-VL (see module docstring); the base of Qwen3-VL."""

    modalities = frozenset({Modality.IMAGE, Modality.VIDEO})
    position_rows = 3
    extra_dims: dict[str, int] = {}
    audio_sample_rate_hz = None
    default_preprocess = VisionPreprocessConfig()
    linear_attention_class: str | None = None  # the transformers class of its linear-attention layers (Qwen3.5)

    def __init__(self, path: str, hf_config, mm_processor_kwargs: Mapping[str, Any]) -> None:
        self.path = path
        self.hf_config = hf_config
        self.model_type = hf_config.model_type
        self.cfg = preprocess_config_from_dir(path, mm_processor_kwargs, self.default_preprocess)
        self.placeholders = {
            Modality.IMAGE: hf_config.image_token_id,
            Modality.VIDEO: hf_config.video_token_id,
        }
        vision = hf_config.vision_config
        self.spatial_merge_size = vision.spatial_merge_size
        self.hidden_size = hf_config.get_text_config().hidden_size
        self.layer_specs = layer_specs_from_hf(hf_config.get_text_config(), self.linear_attention_class)
        # Qwen2.5-VL spaces video temporal positions by real time; Qwen2-VL (None) by grid index.
        self.tokens_per_second = (
            getattr(vision, "tokens_per_second", None) if self.model_type == "qwen2_5_vl" else None
        )

    # -- processor ------------------------------------------------------------------------------------
    @cached_property
    def image_processor(self):
        """Built on first use: the API server and a language-only engine never preprocess (and skip the
        import)."""
        return make_image_processor(self.cfg)

    def hash_settings(self, modality: Modality, settings: Mapping[str, Any]) -> dict[str, Any]:
        if settings:
            raise UnsupportedMediaError(f"unknown item settings {sorted(settings)} for this model")
        out = asdict(self.cfg)
        if modality == Modality.IMAGE:
            for key in ("video_min_pixels", "video_max_pixels"):
                out.pop(key)
        return out

    def num_tokens(self, grid_thw: tuple[int, int, int]) -> int:
        t, h, w = grid_thw
        return t * h * w // (self.spatial_merge_size**2)

    def meta(self, metadata: bytes) -> VisionMeta:
        return msgspec.msgpack.decode(metadata, type=VisionMeta)

    def input_pixels(self, modality: Modality, metadata: bytes) -> int:
        """Pixels the tower sees for an item: resized frames x height x width (an image is one frame)."""
        t, h, w = self.meta(metadata).grid_thw
        frames = t * self.cfg.temporal_patch_size if modality == Modality.VIDEO else t
        return frames * h * w * self.cfg.patch_size**2

    def check_item(self, item: ItemEmbedding) -> None:
        try:
            grid = self.meta(item.metadata).grid_thw
        except msgspec.DecodeError as e:
            raise EmbeddingMismatch(
                f"{item.modality.value} embedding has no valid Qwen-VL metadata: {e}"
            ) from e
        check_tensors(self, item, self.num_tokens(grid))

    def precomputed_grid(self, modality: Modality, fields) -> tuple[int, int, int]:
        """`image_grid_thw` / `video_grid_thw`: the patch grid before merging (as HF's processor returns it);
        h and w multiples of the merge size, t = 1 for an image."""
        name, m = f"{modality.value}_grid_thw", self.spatial_merge_size
        t, h, w = fields.ints(name, 3, "the (t, h, w) patch grid")
        if h % m or w % m:
            raise fields.invalid(f"tensor {name!r} is {[t, h, w]}; h and w must be multiples of {m}")
        if modality == Modality.IMAGE and t != 1:
            raise fields.invalid(f"tensor {name!r} is {[t, h, w]}; an image has t = 1")
        return t, h, w

    def precomputed_metadata(self, modality: Modality, fields, settings: Mapping[str, Any]) -> bytes:
        """The grid, and for a Qwen2.5-VL video `second_per_grid_t` (optional, HF's default 1.0: seconds per
        temporal grid step, which spaces its temporal positions)."""
        if settings:
            raise UnsupportedMediaError(f"unknown item settings {sorted(settings)} for this model")
        grid = self.precomputed_grid(modality, fields)
        seconds = 1.0
        if modality == Modality.VIDEO and self.tokens_per_second is not None:
            (seconds,) = fields.floats("second_per_grid_t", 1, "seconds per temporal grid step", (1.0,))
            if not 0 < seconds <= 3600:
                raise fields.invalid(f"'second_per_grid_t' is {seconds}; it must be in (0, 3600]")
        return msgspec.msgpack.encode(VisionMeta(grid, seconds))

    def precomputed_fields(self, modality: Modality, metadata: bytes) -> dict[str, torch.Tensor]:
        meta = self.meta(metadata)
        out = {f"{modality.value}_grid_thw": torch.tensor(meta.grid_thw)}
        if modality == Modality.VIDEO and self.tokens_per_second is not None:
            out["second_per_grid_t"] = torch.tensor([meta.second_per_grid_t])
        return out

    def process(self, modality: Modality, media: Any, settings: Mapping[str, Any]) -> TowerInput:
        """Tower input for one decoded item: a PIL image, or a DecodedVideo."""
        if settings:
            raise UnsupportedMediaError(f"unknown item settings {sorted(settings)} for this model")
        if modality == Modality.IMAGE:
            return self.process_image(media)
        if modality == Modality.VIDEO:
            return self.process_video(media)
        raise UnsupportedMediaError(f"{modality.value} input is not supported by this model")

    def tower_input(self, modality: Modality, pixel_values: torch.Tensor, meta: VisionMeta) -> TowerInput:
        tensors = {"pixel_values": pixel_values}
        return TowerInput(
            modality,
            tensors,
            msgspec.msgpack.encode(meta),
            self.num_tokens(meta.grid_thw),
            cost=pixel_values.shape[0],
        )

    def process_image(self, image: Image.Image) -> TowerInput:
        try:
            out = self.image_processor(images=[image], return_tensors="pt")
        except ValueError as e:  # e.g. aspect ratio beyond the resize rule's limit
            raise MediaDecodeError(f"image cannot be preprocessed: {e}") from e
        grid = tuple(int(x) for x in out["image_grid_thw"][0])
        return self.tower_input(Modality.IMAGE, out["pixel_values"], VisionMeta(grid))

    def video_pixels(
        self, frames: np.ndarray, size: dict[str, int]
    ) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """frames (T, H, W, 3) uint8, T a multiple of the temporal patch size -> HF's video layout + grid."""
        tp, p = self.cfg.temporal_patch_size, self.cfg.patch_size
        try:
            out = self.image_processor(
                images=[Image.fromarray(f) for f in frames], size=size, return_tensors="pt"
            )
        except ValueError as e:
            raise MediaDecodeError(f"video cannot be preprocessed: {e}") from e
        _, gh, gw = (int(x) for x in out["image_grid_thw"][0])
        num_frames, channels = frames.shape[0], 3
        # Each frame came back with its pixels broadcast over the temporal patch axis; keep one copy.
        per_frame = out["pixel_values"].view(num_frames, gh * gw, channels, tp, p, p)[:, :, :, 0]
        grid_t = num_frames // tp
        # (grid_t, tp, gh*gw, C, p, p) -> (grid_t, gh*gw, C, tp, p, p)
        pairs = per_frame.view(grid_t, tp, gh * gw, channels, p, p).permute(0, 2, 3, 1, 4, 5)
        return pairs.reshape(grid_t * gh * gw, channels * tp * p * p).contiguous(), (grid_t, gh, gw)

    def pad_frames(self, frames: np.ndarray) -> np.ndarray:
        """Pad to a whole number of temporal patches by repeating the last frame (as HF does)."""
        if frames.ndim != 4 or frames.shape[0] == 0:
            raise MediaDecodeError("video has no frames")
        tp = self.cfg.temporal_patch_size
        if frames.shape[0] % tp:
            pad = np.repeat(frames[-1:], tp - frames.shape[0] % tp, axis=0)
            frames = np.concatenate([frames, pad], axis=0)
        return frames

    def process_video(self, video) -> TowerInput:
        """video: a DecodedVideo, frames (T, H, W, 3) uint8 RGB sampled at `video.fps` frames per second."""
        frames, fps = self.pad_frames(video.frames), video.fps
        size = {"shortest_edge": self.cfg.video_min_pixels, "longest_edge": self.cfg.video_max_pixels}
        pixel_values, grid = self.video_pixels(frames, size)
        meta = VisionMeta(grid, second_per_grid_t=self.cfg.temporal_patch_size / fps)
        return self.tower_input(Modality.VIDEO, pixel_values, meta)

    def probe_item(self) -> tuple[Modality, Any]:
        return Modality.IMAGE, Image.new("RGB", (56, 56), (128, 128, 128))

    # -- prompt ---------------------------------------------------------------------------------------
    def expand(self, token_ids: list[int], items: list[Any]) -> ExpandedPrompt:
        return expand_placeholders(token_ids, items, self.placeholders)

    def positions(self, expanded: ExpandedPrompt) -> tuple[torch.Tensor, int]:
        """M-RoPE position ids (3, L) for the whole prompt and the rope delta for decode positions.

        Mirrors transformers' `get_rope_index`: text advances all three axes by one per token; an item
        occupies (t, h, w) positions starting at the current position (t scaled by the time interval for
        Qwen2.5-VL videos) and advances the position by max(h, w) // merge.
        """
        segments: list[torch.Tensor] = []
        cursor, pos = 0, 0  # index into the prompt, next position value
        for item in sorted(expanded.items, key=lambda it: it.offset):
            if item.offset > cursor:
                segments.append(torch.arange(item.offset - cursor).view(1, -1).expand(3, -1) + pos)
                pos += item.offset - cursor
            meta = self.meta(item.metadata)
            interval = 1.0
            if item.modality == Modality.VIDEO and self.tokens_per_second is not None:
                interval = self.tokens_per_second * meta.second_per_grid_t
            grid, advance = self.grid_positions(meta.grid_thw, interval)
            segments.append(grid + pos)
            pos += advance
            cursor = item.end
        return finish_positions(segments, cursor, pos, len(expanded.token_ids))

    def grid_positions(
        self, grid_thw: tuple[int, int, int], interval: float = 1.0
    ) -> tuple[torch.Tensor, int]:
        """Positions (3, t*h*w/m^2) of one vision grid relative to its start, and how far it advances."""
        t, h, w = grid_thw
        m = self.spatial_merge_size
        pt = (torch.arange(t) * interval).long()
        grid = torch.stack(torch.meshgrid(pt, torch.arange(h // m), torch.arange(w // m), indexing="ij"))
        return grid.reshape(3, -1), max(h, w) // m

    # -- weights and forward --------------------------------------------------------------------------
    def load_language_model(self, dtype: torch.dtype, attn_implementation: str) -> LanguageModel:
        return weights.load_language_model(
            self.path, self.hf_config, dtype, attn_implementation, "model.language_model"
        )

    def load_tower(self, dtype: torch.dtype) -> torch.nn.Module:
        return weights.load_submodule(self.path, self.hf_config, dtype, "model.visual")

    def encode(self, tower: torch.nn.Module, batch: list[TowerInput]) -> list[dict[str, torch.Tensor]]:
        device = next(tower.parameters()).device
        pixels = torch.cat([it.tensors["pixel_values"] for it in batch]).to(device, tower.dtype)
        grid = torch.tensor([self.meta(it.metadata).grid_thw for it in batch], device=device)
        merged = tower(pixels, grid_thw=grid).pooler_output  # (sum of tokens, hidden)
        # Independent storage per item: each lives on in the cache on its own.
        return [{MAIN: rows.clone()} for rows in torch.split(merged, [it.num_tokens for it in batch])]


def finish_positions(
    segments: list[torch.Tensor], cursor: int, pos: int, length: int
) -> tuple[torch.Tensor, int]:
    """Append the trailing text after `cursor` and return (positions (3, L), rope delta)."""
    if cursor < length:
        segments.append(torch.arange(length - cursor).view(1, -1).expand(3, -1) + pos)
    positions = torch.cat(segments, dim=1) if segments else torch.zeros(3, 0, dtype=torch.long)
    rope_delta = int(positions.max()) + 1 - length if length else 0
    return positions, rope_delta


def hf_video_inputs(family: Family, videos: list) -> dict[str, Any]:
    """HF's video-processor outputs for decoded videos, from our preprocessing (see hf_processor)."""
    from transformers.video_utils import VideoMetadata

    processed = [family.process(Modality.VIDEO, v, {}) for v in videos]
    return {
        "pixel_values_videos": torch.cat([p.tensors["pixel_values"] for p in processed]),
        "video_grid_thw": torch.tensor([family.meta(p.metadata).grid_thw for p in processed]),
        # Frame times as HF derives them (index / fps): what Qwen2.5-VL's and Qwen3-VL's processors read.
        "video_metadata": [
            VideoMetadata(
                total_num_frames=len(v.frames), fps=v.fps, frames_indices=[t * v.fps for t in v.timestamps_s]
            )
            for v in videos
        ],
    }


def hf_processor(path: str, family: Family):
    """Hugging Face's own processor class for this checkpoint (the parity oracle's preprocessing): the PIL
    image processor and HF's placeholder expansion. HF's video processors need torchvision, so video pixels
    come from our preprocessing (`PrecomputedVideos`, checked separately against the image processor)."""
    from transformers import AutoTokenizer, Qwen2_5_VLProcessor, Qwen2VLImageProcessorPil, Qwen2VLProcessor

    from mmserve.testing.reference import PrecomputedVideos, allow_any_video_processor

    cls = Qwen2VLProcessor if family.model_type == "qwen2_vl" else Qwen2_5_VLProcessor
    tokenizer = AutoTokenizer.from_pretrained(path)
    videos = PrecomputedVideos(
        lambda v: hf_video_inputs(family, v),
        merge_size=family.cfg.merge_size,
        temporal_patch_size=family.cfg.temporal_patch_size,
    )
    with allow_any_video_processor():
        return cls(
            image_processor=Qwen2VLImageProcessorPil.from_pretrained(path),
            tokenizer=tokenizer,
            video_processor=videos,
            chat_template=tokenizer.chat_template,
        )
