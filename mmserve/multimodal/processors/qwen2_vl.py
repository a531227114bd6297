"""Qwen2-VL / Qwen2.5-VL: preprocessing, token counts, placeholder expansion, M-RoPE positions.

Images go through transformers' PIL image processor (no torchvision). Videos are preprocessed here: HF's
video processor needs torchvision. Each sampled frame is resized / rescaled / normalized by the same image
processor (with the video pixel limits), then frames are paired along the temporal patch axis, giving the
`pixel_values_videos` layout of HF: rows ordered (t, h/m, w/m, m_h, m_w), columns (C, t_patch, p_h, p_w).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import numpy as np
import torch
from PIL import Image

from mmserve.config import VisionPreprocessConfig
from mmserve.multimodal.errors import MediaDecodeError, UnsupportedMediaError
from mmserve.multimodal.items import Modality, MultimodalItem
from mmserve.multimodal.processors.base import ExpandedPrompt, ProcessedItem, register_processor


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


def preprocess_config_from_dir(path: str, **overrides: Any) -> VisionPreprocessConfig:
    """Read a checkpoint's preprocessor_config.json into a VisionPreprocessConfig (+ user overrides)."""
    import json
    import os

    fields: dict[str, Any] = {}
    cfg_path = os.path.join(path, "preprocessor_config.json")
    if os.path.exists(cfg_path):
        with open(cfg_path) as f:
            raw = json.load(f)
        size = raw.get("size") or {}
        pairs = {
            "patch_size": raw.get("patch_size"),
            "temporal_patch_size": raw.get("temporal_patch_size"),
            "merge_size": raw.get("merge_size"),
            "image_min_pixels": raw.get("min_pixels", size.get("shortest_edge")),
            "image_max_pixels": raw.get("max_pixels", size.get("longest_edge")),
            "image_mean": tuple(raw["image_mean"]) if "image_mean" in raw else None,
            "image_std": tuple(raw["image_std"]) if "image_std" in raw else None,
        }
        fields = {k: v for k, v in pairs.items() if v is not None}
    # vLLM-style --mm-processor-kwargs names
    aliases = {"min_pixels": "image_min_pixels", "max_pixels": "image_max_pixels"}
    for key, value in overrides.items():
        key = aliases.get(key, key)
        if key not in VisionPreprocessConfig.__dataclass_fields__:
            raise ValueError(f"unknown mm processor setting {key!r}")
        fields[key] = tuple(value) if isinstance(value, list) else value
    return VisionPreprocessConfig(**fields)


@register_processor("qwen2_vl", "qwen2_5_vl")
class QwenVLProcessor:
    """Multimodal processor of the Qwen2-VL family (see module docstring)."""

    def __init__(
        self,
        preprocess: VisionPreprocessConfig,
        *,
        image_token_id: int,
        video_token_id: int,
        spatial_merge_size: int,
        tokens_per_second: float | None = None,
    ) -> None:
        self.cfg = preprocess
        self.image_processor = make_image_processor(preprocess)
        self.placeholder_token_ids = {Modality.IMAGE: image_token_id, Modality.VIDEO: video_token_id}
        self.spatial_merge_size = spatial_merge_size
        # Qwen2.5-VL spaces video temporal positions by real time; Qwen2-VL (None) by grid index.
        self.tokens_per_second = tokens_per_second

    @classmethod
    def from_pretrained(cls, path: str, hf_config, mm_processor_kwargs: dict[str, Any]) -> QwenVLProcessor:
        preprocess = preprocess_config_from_dir(path, **mm_processor_kwargs)
        vision = hf_config.vision_config
        tps = getattr(vision, "tokens_per_second", None) if hf_config.model_type == "qwen2_5_vl" else None
        return cls(
            preprocess,
            image_token_id=hf_config.image_token_id,
            video_token_id=hf_config.video_token_id,
            spatial_merge_size=vision.spatial_merge_size,
            tokens_per_second=tps,
        )

    # -- hashing ----------------------------------------------------------------------------------
    def hash_settings(self, modality: Modality) -> dict[str, Any]:
        settings = asdict(self.cfg)
        if modality == Modality.IMAGE:
            for key in ("video_min_pixels", "video_max_pixels"):
                settings.pop(key)
        return settings

    # -- preprocessing ----------------------------------------------------------------------------
    def num_tokens(self, grid_thw: tuple[int, int, int]) -> int:
        t, h, w = grid_thw
        return t * h * w // (self.spatial_merge_size**2)

    def input_pixels(self, modality: Modality, grid_thw: tuple[int, int, int]) -> int:
        """Pixels the tower sees for an item: resized frames x height x width (an image is one frame)."""
        t, h, w = grid_thw
        frames = t * self.cfg.temporal_patch_size if modality == Modality.VIDEO else t
        return frames * h * w * self.cfg.patch_size**2

    def process(self, modality: Modality, media: Any) -> ProcessedItem:
        """Tower input for one decoded item: a PIL image, or a video (frames `(T, H, W, 3)` uint8 + fps)."""
        if modality == Modality.IMAGE:
            return self.process_image(media)
        if modality == Modality.VIDEO:
            return self.process_video(media.frames, media.fps)
        raise UnsupportedMediaError(f"{modality.value} input is not supported by this model")

    def process_image(self, image: Image.Image) -> ProcessedItem:
        try:
            out = self.image_processor(images=[image], return_tensors="pt")
        except ValueError as e:  # e.g. aspect ratio beyond the resize rule's limit
            raise MediaDecodeError(f"image cannot be preprocessed: {e}") from e
        grid = tuple(int(x) for x in out["image_grid_thw"][0])
        return ProcessedItem(Modality.IMAGE, out["pixel_values"], grid, self.num_tokens(grid))

    def process_video(self, frames: np.ndarray, fps: float) -> ProcessedItem:
        """frames: (T, H, W, 3) uint8 RGB, sampled at `fps` frames per second."""
        if frames.ndim != 4 or frames.shape[0] == 0:
            raise MediaDecodeError("video has no frames")
        tp, p = self.cfg.temporal_patch_size, self.cfg.patch_size
        # Pad to a whole number of temporal patches by repeating the last frame (as HF does).
        if frames.shape[0] % tp:
            pad = np.repeat(frames[-1:], tp - frames.shape[0] % tp, axis=0)
            frames = np.concatenate([frames, pad], axis=0)
        size = {"shortest_edge": self.cfg.video_min_pixels, "longest_edge": self.cfg.video_max_pixels}
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
        pixel_values = pairs.reshape(grid_t * gh * gw, channels * tp * p * p).contiguous()
        grid = (grid_t, gh, gw)
        return ProcessedItem(
            Modality.VIDEO, pixel_values, grid, self.num_tokens(grid), second_per_grid_t=tp / fps
        )

    # -- prompt -----------------------------------------------------------------------------------
    def expand(self, token_ids: list[int], items: list[MultimodalItem]) -> ExpandedPrompt:
        """Replace the k-th placeholder of each modality by the k-th item of that modality's tokens.

        Raises ValueError when the number of placeholders and items differ.
        """
        by_modality = {m: [it for it in items if it.modality == m] for m in self.placeholder_token_ids}
        remaining = {m: iter(v) for m, v in by_modality.items()}
        counts = {m: 0 for m in self.placeholder_token_ids}
        token_to_modality = {tid: m for m, tid in self.placeholder_token_ids.items()}
        engine_ids: list[int] = []
        hf_ids: list[int] = []
        ordered: list[MultimodalItem] = []
        for tid in token_ids:
            modality = token_to_modality.get(tid)
            if modality is None:
                engine_ids.append(tid)
                hf_ids.append(tid)
                continue
            counts[modality] += 1
            item = next(remaining[modality], None)
            if item is None:
                break
            item.offset = len(engine_ids)
            engine_ids.extend([item.pad_value] * item.num_tokens)
            hf_ids.extend([tid] * item.num_tokens)
            ordered.append(item)
        for modality, expected in by_modality.items():
            if counts[modality] != len(expected):
                raise ValueError(
                    f"prompt has {counts[modality]} {modality.value} placeholder(s) but "
                    f"{len(expected)} {modality.value} item(s) were given"
                )
        return ExpandedPrompt(engine_ids, hf_ids, ordered)

    def positions(self, expanded: ExpandedPrompt) -> tuple[torch.Tensor, int]:
        """M-RoPE position ids (3, L) for the whole prompt and the rope delta for decode positions.

        Mirrors transformers' `get_rope_index`: text advances all three axes by one per token; an item
        occupies (t, h, w) positions starting at the current position (t scaled by the time interval for
        Qwen2.5-VL videos) and advances the position by max(h, w) // merge.
        """
        length = len(expanded.token_ids)
        m = self.spatial_merge_size
        segments: list[torch.Tensor] = []
        cursor = 0  # index into the prompt
        pos = 0  # next position value
        for item in sorted(expanded.items, key=lambda it: it.offset):
            if item.offset > cursor:
                n = item.offset - cursor
                segments.append(torch.arange(n).view(1, -1).expand(3, -1) + pos)
                pos += n
            t, h, w = item.grid_thw
            interval = 1.0
            if item.modality == Modality.VIDEO and self.tokens_per_second is not None:
                interval = self.tokens_per_second * item.second_per_grid_t
            pt = (torch.arange(t) * interval).long()
            grid = torch.stack(torch.meshgrid(pt, torch.arange(h // m), torch.arange(w // m), indexing="ij"))
            segments.append(grid.reshape(3, -1) + pos)
            pos += max(h, w) // m
            cursor = item.end
        if cursor < length:
            segments.append(torch.arange(length - cursor).view(1, -1).expand(3, -1) + pos)
        positions = torch.cat(segments, dim=1) if segments else torch.zeros(3, 0, dtype=torch.long)
        rope_delta = int(positions.max()) + 1 - length if length else 0
        return positions, rope_delta
