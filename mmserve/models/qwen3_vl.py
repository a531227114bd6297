"""Qwen3-VL: DeepStack features, timestamped video frames, interleaved M-RoPE.

What differs from Qwen2-VL (whose preprocessing, loading and M-RoPE this module reuses):
- DeepStack: the vision tower also returns one feature map per `deepstack_visual_indexes` layer; they are
  added to the hidden states of the item's tokens after the first decoder layers (level k after layer k).
  Each travels with the item as a row-aligned extra tensor `deepstack.k` (through the cache and the wire)
  and is sliced per prefill chunk like the main embedding; `lm_inputs` hands the rows of one packed
  forward to the text model as `visual_pos_masks` / `deepstack_visual_embeds`.
- Video: every temporal patch (pair of frames) is its own segment
  `<t seconds><|vision_start|><|video_pad|>*n<|vision_end|>` inside the video's placeholder, t the mean
  time of its frames; so a video item spans text tokens too, and each frame starts its own M-RoPE grid
  (t = 1) at the current position (transformers' `get_rope_index` splits video grids the same way).
- Video frames are resized together: one size for the whole clip from the video processor's total pixel
  budget (`video_preprocessor_config.json` shortest/longest edge), as transformers' Qwen3-VL video
  processor does; each frame is then normalized by the PIL image processor.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

import msgspec
import numpy as np
import torch
from PIL import Image

from mmserve.models import qwen2_vl
from mmserve.models.family import expand_placeholders
from mmserve.models.qwen2_vl import VisionPreprocessConfig, finish_positions
from mmserve.multimodal.errors import MediaDecodeError
from mmserve.multimodal.items import MAIN, ExpandedPrompt, Modality, TowerInput

DEEPSTACK = "deepstack.{}"


class VideoMeta(msgspec.Struct, frozen=True, array_like=True):
    """A Qwen3-VL item: its grid, and for videos the time (s) of every temporal patch."""

    grid_thw: tuple[int, int, int]
    second_per_grid_t: float = 1.0
    timestamps: tuple[float, ...] = ()


def smart_resize_video(
    num_frames: int,
    height: int,
    width: int,
    temporal_factor: int,
    factor: int,
    min_pixels: int,
    max_pixels: int,
) -> tuple[int, int]:
    """One (height, width) for every frame of a clip: multiples of `factor`, the clip's total pixels
    (frames x height x width) within [min_pixels, max_pixels], the aspect ratio kept (as transformers'
    Qwen3-VL video processor)."""
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise MediaDecodeError(
            f"video aspect ratio must be below 200, got {max(height, width) / min(height, width):.0f}"
        )
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt(num_frames * height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def group_timestamps(times: list[float], group: int) -> list[float]:
    """Mean time of the first and last frame of every temporal patch (the last frame repeats to fill)."""
    times = list(times) + [times[-1]] * (-len(times) % group)
    return [(times[i] + times[i + group - 1]) / 2 for i in range(0, len(times), group)]


class Family(qwen2_vl.Family):
    default_preprocess = VisionPreprocessConfig(
        patch_size=16,
        image_mean=(0.5, 0.5, 0.5),
        image_std=(0.5, 0.5, 0.5),
        video_min_pixels=128 * 32 * 32,
        video_max_pixels=768 * 32 * 32,
    )

    def __init__(self, path: str, hf_config, mm_processor_kwargs: Mapping[str, Any]) -> None:
        super().__init__(path, hf_config, mm_processor_kwargs)
        vision = hf_config.vision_config
        levels = getattr(vision, "deepstack_visual_indexes", None) or []  # Qwen3.5's tower has none
        self.extra_dims = {DEEPSTACK.format(k): vision.out_hidden_size for k in range(len(levels))}
        self.vision_start_id = hf_config.vision_start_token_id
        self.vision_end_id = hf_config.vision_end_token_id
        self.tokens_per_second = None

    def meta(self, metadata: bytes) -> VideoMeta:
        return msgspec.msgpack.decode(metadata, type=VideoMeta)

    def precomputed_metadata(self, modality: Modality, fields, settings: Mapping[str, Any]) -> bytes:
        """The grid (as Qwen2-VL), and for a video `video_timestamps`: the time (s) of every temporal grid
        step, rendered as text before its frame (so bounded: finite, in [0, 1e6])."""
        if modality != Modality.VIDEO:
            return super().precomputed_metadata(modality, fields, settings)
        grid = self.precomputed_grid(modality, fields)
        times = fields.floats("video_timestamps", grid[0], "seconds of every temporal grid step")
        if not all(0 <= t <= 1e6 for t in times):
            raise fields.invalid(f"'video_timestamps' {list(times)} must lie in [0, 1e6] seconds")
        return msgspec.msgpack.encode(VideoMeta(grid, 1.0, times))

    def precomputed_fields(self, modality: Modality, metadata: bytes) -> dict[str, torch.Tensor]:
        meta = self.meta(metadata)
        out = {f"{modality.value}_grid_thw": torch.tensor(meta.grid_thw)}
        if modality == Modality.VIDEO:
            out["video_timestamps"] = torch.tensor(meta.timestamps, dtype=torch.float64)
        return out

    # -- processor ------------------------------------------------------------------------------------
    def process_video(self, video) -> TowerInput:
        """video: a DecodedVideo, frames (T, H, W, 3) uint8 at presentation times `video.timestamps_s`."""
        tp = self.cfg.temporal_patch_size
        num_frames = len(video.frames)
        frames = self.pad_frames(video.frames)
        if num_frames < tp:
            raise MediaDecodeError(f"video has {num_frames} frame(s); this model needs at least {tp}")
        pixel_values, grid = self.clip_pixels(frames, num_frames)
        meta = VideoMeta(grid, 1.0, tuple(group_timestamps(list(video.timestamps_s), tp)))
        return self.tower_input(Modality.VIDEO, pixel_values, meta)

    def clip_pixels(
        self, frames: np.ndarray, num_frames: int, budget_frames: int = 1
    ) -> tuple[torch.Tensor, Any]:
        """(pixel values, grid) of a clip: one size for the whole clip (`smart_resize_video` of its `num_frames`
        frames), each frame resized to it, then normalized by the image processor, whose own resize is then the
        identity given a pixel budget of `budget_frames` frames of that size (GLM's counts the temporal patch)."""
        h, w = smart_resize_video(
            num_frames,
            frames.shape[1],
            frames.shape[2],
            self.cfg.temporal_patch_size,
            self.cfg.factor,
            self.cfg.video_min_pixels,
            self.cfg.video_max_pixels,
        )
        resized = np.stack(
            [np.asarray(Image.fromarray(f).resize((w, h), Image.Resampling.BICUBIC)) for f in frames]
        )
        budget = budget_frames * h * w
        return self.video_pixels(resized, {"shortest_edge": budget, "longest_edge": budget})

    # -- prompt ---------------------------------------------------------------------------------------
    @lru_cache(maxsize=4096)  # noqa: B019 (the family lives as long as the process)
    def timestamp_ids(self, seconds: float) -> tuple[int, ...]:
        return tuple(self.tokenizer(f"<{seconds:.1f} seconds>", add_special_tokens=False)["input_ids"])

    def collapse_video_wrappers(self, token_ids: list[int]) -> list[int]:
        """The chat template wraps each video placeholder in `<|vision_start|>` / `<|vision_end|>`, and every frame
        of the expansion brings its own pair: the template's outer pair is dropped, as transformers' Qwen3-VL
        processor drops it (5.25: "avoid an extra vision start/end pair around all frames")."""
        video = self.placeholders[Modality.VIDEO]
        out: list[int] = []
        skip_end = False
        for i, tid in enumerate(token_ids):
            if skip_end:
                skip_end = False
                if tid == self.vision_end_id:
                    continue
            if tid == video and out and out[-1] == self.vision_start_id:
                nxt = token_ids[i + 1] if i + 1 < len(token_ids) else None
                if nxt == self.vision_end_id:
                    out.pop()
                    skip_end = True
            out.append(tid)
        return out

    def expand(self, token_ids: list[int], items: list[Any]) -> ExpandedPrompt:
        token_ids = self.collapse_video_wrappers(token_ids)

        def render(item, placeholder: int) -> tuple[list[int], list[int]]:
            if item.modality != Modality.VIDEO:
                return [item.pad_value] * item.num_tokens, [placeholder] * item.num_tokens
            meta = self.meta(item.metadata)
            t, h, w = meta.grid_thw
            per_frame = h * w // self.spatial_merge_size**2
            ours: list[int] = []
            theirs: list[int] = []
            for seconds in meta.timestamps:
                text = [*self.timestamp_ids(seconds), self.vision_start_id]
                ours += text + [item.pad_value] * per_frame + [self.vision_end_id]
                theirs += text + [placeholder] * per_frame + [self.vision_end_id]
            return ours, theirs

        return expand_placeholders(token_ids, items, self.placeholders, render)

    def positions(self, expanded: ExpandedPrompt) -> tuple[torch.Tensor, int]:
        """M-RoPE positions: text advances every axis by one; every image and every video frame is a grid
        (1, h, w) at the current position that advances it by max(h, w) // merge."""
        segments: list[torch.Tensor] = []
        cursor, pos = 0, 0
        ids = expanded.token_ids
        for item in sorted(expanded.items, key=lambda it: it.offset):
            _, h, w = self.meta(item.metadata).grid_thw
            frame_tokens = h * w // self.spatial_merge_size**2
            i = item.offset
            while i < item.end:  # text before each frame (timestamps), then the frame's grid
                if ids[i] != item.pad_value:
                    i += 1
                    continue
                if i > cursor:
                    segments.append(torch.arange(i - cursor).view(1, -1).expand(3, -1) + pos)
                    pos += i - cursor
                grid, advance = self.grid_positions((1, h, w))
                segments.append(grid + pos)
                pos += advance
                i = cursor = i + frame_tokens
        return finish_positions(segments, cursor, pos, len(ids))

    # -- weights and forward --------------------------------------------------------------------------
    def encode(self, tower: torch.nn.Module, batch: list[TowerInput]) -> list[dict[str, torch.Tensor]]:
        device = next(tower.parameters()).device
        pixels = torch.cat([it.tensors["pixel_values"] for it in batch]).to(device, tower.dtype)
        grid = torch.tensor([self.meta(it.metadata).grid_thw for it in batch], device=device)
        out = tower(pixels, grid_thw=grid)
        sizes = [it.num_tokens for it in batch]
        features = getattr(out, "deepstack_features", None) or []
        levels = [torch.split(feature, sizes) for feature in features]  # per level, per item
        return [
            {MAIN: main.clone(), **{DEEPSTACK.format(k): level[i].clone() for k, level in enumerate(levels)}}
            for i, main in enumerate(torch.split(out.pooler_output, sizes))
        ]

    def lm_inputs(
        self, num_tokens: int, positions: torch.Tensor, rows: dict[str, torch.Tensor]
    ) -> dict[str, Any]:
        mask = torch.zeros(1, num_tokens, dtype=torch.bool, device=positions.device)
        mask[0, positions] = True
        return {"visual_pos_masks": mask, "deepstack_visual_embeds": [rows[name] for name in self.extra_dims]}


def hf_processor(path: str, family: Family):
    """Hugging Face's Qwen3VLProcessor for this checkpoint (the parity oracle's preprocessing): the PIL image
    processor and HF's expansion, timestamps included. HF's video processor needs torchvision, so video
    pixels come from our preprocessing (`PrecomputedVideos`, checked separately)."""
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil, Qwen3VLProcessor

    from mmserve.testing.reference import PrecomputedVideos, allow_any_video_processor

    tokenizer = AutoTokenizer.from_pretrained(path)
    videos = PrecomputedVideos(
        lambda v: qwen2_vl.hf_video_inputs(family, v),
        merge_size=family.cfg.merge_size,
        temporal_patch_size=family.cfg.temporal_patch_size,
    )
    with allow_any_video_processor():
        return Qwen3VLProcessor(
            image_processor=Qwen2VLImageProcessorPil.from_pretrained(path),
            tokenizer=tokenizer,
            video_processor=videos,
            chat_template=tokenizer.chat_template,
        )
