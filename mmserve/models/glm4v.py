"""GLM-4.1V (`glm4v`) and GLM-4.5V (`glm4v_moe`): 3-D RoPE over per-frame grids, timestamped video frames,
GLM's own tower and tokens.

What differs from Qwen3-VL (whose per-frame M-RoPE positions, item metadata and precomputed fields this module
reuses):
- Tokens: an image is `<|begin_of_image|><|image|><|end_of_image|>` in the chat template and its placeholder
  becomes `<|image|>` x n; a video is `<|begin_of_video|><|video|><|end_of_video|>` and its placeholder
  becomes, per temporal patch (pair of frames), `<|begin_of_image|>` + `<|image|>` x n + `<|end_of_image|>` +
  the time of the pair's first frame in whole seconds as text (`processing_glm4v.py`). The video's frames are
  image tokens to transformers too (`get_placeholder_mask`); only the `<|begin_of_video|>` bracket tells them
  apart.
- Positions (transformers' `Glm4vModel.get_rope_index`): text advances (t, h, w) by one per token; every image
  and every video frame is a grid (1, h / merge, w / merge) at the current position that advances it by
  max(h, w) / merge. The height and width rows rotate their own frequency bands (`mrope_section`).
- Tower (`Glm4vVisionModel`, transformers' own): 2-D rope inside the ViT, learned positions interpolated to
  the grid, a conv downsample of each merge block and a gated merger. A video runs as one grid per temporal
  patch (as `get_video_features` flattens it), each attending within itself.
- Images: transformers' `Glm4vImageProcessorPil` (its pixel budget counts the two frames of a temporal patch).
- Video: transformers' video processor needs torchvision, so sampling and preprocessing are ours, after
  `video_processing_glm4v.py`: of the decoded frames, `fps` (default 2, `video_preprocessor_config.json`, or
  `--mm-processor-kwargs '{"fps": 1}'`) per second of the clip (spread evenly past `max_duration`), duplicates
  dropped, an odd count padded with the last; one size for the whole clip from the video pixel budget; each
  frame normalized by the image processor; pairs of frames stacked on the temporal patch axis.
- GLM-4.5V's language model holds sigmoid-routed MoE blocks with a shared expert: transformers' modules, their
  checkpoint experts fused at load by transformers' conversion rules (`weights.load_language_model`).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from functools import cached_property
from typing import Any

import numpy as np
import torch

from mmserve.models import qwen2_vl, qwen3_vl
from mmserve.models.family import expand_placeholders
from mmserve.models.qwen2_vl import VisionPreprocessConfig
from mmserve.models.qwen3_vl import VideoMeta
from mmserve.multimodal.errors import MediaDecodeError
from mmserve.multimodal.items import MAIN, ExpandedPrompt, Modality, TowerInput

# transformers' defaults for GLM-4.1V (`Glm4vImageProcessorPil`, `Glm4vVideoProcessor`).
GLM_PREPROCESS = VisionPreprocessConfig(
    patch_size=14,
    image_min_pixels=112 * 112,
    image_max_pixels=28 * 28 * 15000,
    video_min_pixels=112 * 112,
    video_max_pixels=28 * 28 * 2 * 30000,
)
VIDEO_SAMPLING = ("fps", "max_duration")  # the video processor's sampling settings (mm processor kwargs too)


def sample_frames(num_frames: int, fps: float, duration_s: float, target_fps: float, max_duration: float):
    """Indices of the frames `Glm4vVideoProcessor.sample_frames` keeps of a clip of `num_frames` frames at
    `fps` lasting `duration_s`: `target_fps` frames per second (evenly spread when the clip is longer than
    `max_duration`), duplicates dropped, an odd count padded with the last index."""
    last = num_frames - 1
    duration = duration_s or round(last / fps) + 1
    # NOTE: rounded before `ceil`: a decoded clip's rate is measured from its timestamps (2.0000000001 fps
    # must not push frame 1 to frame 2).
    if duration <= max_duration:
        count = max(int(math.floor(duration * target_fps)), 1)
        indices = [min(last, math.ceil(round(i * fps / target_fps, 6))) for i in range(count)]
    else:
        count = int(max_duration * target_fps)
        if count >= num_frames:
            indices = list(range(num_frames))
        else:
            times = np.linspace(0, duration, count, endpoint=True)
            indices = [min(last, math.ceil(round(float(t) * fps, 6))) for t in times]
    kept = list(dict.fromkeys(indices))
    if len(kept) % 2:
        kept.append(kept[-1])
    return kept


class Family(qwen3_vl.Family):
    """GLM-4.1V and GLM-4.5V (see module docstring)."""

    tool_call_parser = "glm45"  # <tool_call>NAME <arg_key>/<arg_value> pairs
    default_preprocess = GLM_PREPROCESS

    def __init__(self, path: str, hf_config, mm_processor_kwargs: Mapping[str, Any]) -> None:
        kwargs = dict(mm_processor_kwargs)
        sampling = {"fps": 2.0, "max_duration": 300.0, **video_sampling_from_dir(path)}
        sampling.update({k: float(kwargs.pop(k)) for k in VIDEO_SAMPLING if k in kwargs})
        if not (sampling["fps"] > 0 and sampling["max_duration"] > 0):
            raise ValueError(f"video sampling settings must be positive, got {sampling}")
        # Qwen2-VL's reading of the configs and the table of layers (Qwen3-VL's adds DeepStack, vision_start).
        qwen2_vl.Family.__init__(self, path, hf_config, kwargs)
        self.video_sampling = sampling
        self.extra_dims = {}
        self.tokens_per_second = None
        self.image_start_id = hf_config.image_start_token_id
        self.image_end_id = hf_config.image_end_token_id

    @cached_property
    def image_processor(self):
        from transformers import Glm4vImageProcessorPil

        cfg = self.cfg
        return Glm4vImageProcessorPil(
            size={"shortest_edge": cfg.image_min_pixels, "longest_edge": cfg.image_max_pixels},
            patch_size=cfg.patch_size,
            temporal_patch_size=cfg.temporal_patch_size,
            merge_size=cfg.merge_size,
            image_mean=list(cfg.image_mean),
            image_std=list(cfg.image_std),
        )

    def hash_settings(self, modality: Modality, settings: Mapping[str, Any]) -> dict[str, Any]:
        out = super().hash_settings(modality, settings)
        if modality == Modality.VIDEO:
            out.update(self.video_sampling)
        return out

    # -- video ----------------------------------------------------------------------------------------
    def sample(self, video) -> list[int]:
        """Indices of the decoded frames (a DecodedVideo) GLM's video processor keeps."""
        if video.frames.ndim != 4 or video.frames.shape[0] == 0:
            raise MediaDecodeError("video has no frames")
        return sample_frames(
            len(video.frames),
            video.fps,
            video.duration_s,
            self.video_sampling["fps"],
            self.video_sampling["max_duration"],
        )

    def process_video(self, video) -> TowerInput:
        """video: a DecodedVideo, frames (T, H, W, 3) uint8 at presentation times `video.timestamps_s`."""
        keep = self.sample(video)
        frames = self.pad_frames(video.frames[keep])  # an even count already: padded for other patch sizes
        times = [video.timestamps_s[i] for i in keep]
        tp = self.cfg.temporal_patch_size
        pixel_values, grid = self.clip_pixels(frames, len(frames), budget_frames=tp)
        meta = VideoMeta(grid, 1.0, tuple(float(t) for t in times[::tp]))
        return self.tower_input(Modality.VIDEO, pixel_values, meta)

    # -- prompt ---------------------------------------------------------------------------------------
    def timestamp_ids(self, seconds: float) -> tuple[int, ...]:
        """A frame's time as GLM writes it after the frame: whole seconds, between special tokens (so it
        tokenizes alone)."""
        return tuple(self.tokenizer(str(int(seconds)), add_special_tokens=False)["input_ids"])

    def expand(self, token_ids: list[int], items: list[Any]) -> ExpandedPrompt:
        image_id = self.placeholders[Modality.IMAGE]

        def render(item, placeholder: int) -> tuple[list[int], list[int]]:
            if item.modality != Modality.VIDEO:
                return [item.pad_value] * item.num_tokens, [image_id] * item.num_tokens
            meta = self.meta(item.metadata)
            _, h, w = meta.grid_thw
            per_frame = h * w // self.spatial_merge_size**2
            ours: list[int] = []
            theirs: list[int] = []
            for seconds in meta.timestamps:
                stamp = list(self.timestamp_ids(seconds))
                ours += [self.image_start_id, *[item.pad_value] * per_frame, self.image_end_id, *stamp]
                theirs += [self.image_start_id, *[image_id] * per_frame, self.image_end_id, *stamp]
            return ours, theirs

        return expand_placeholders(token_ids, items, self.placeholders, render)

    # -- weights and forward --------------------------------------------------------------------------
    def encode(self, tower: torch.nn.Module, batch: list[TowerInput]) -> list[dict[str, torch.Tensor]]:
        """One tower forward over the batch: an image is one grid, a video one grid (1, h, w) per temporal
        patch (as transformers' `get_video_features` runs it)."""
        device = next(tower.parameters()).device
        pixels = torch.cat([it.tensors["pixel_values"] for it in batch]).to(device, tower.dtype)
        grids = []
        for it in batch:
            t, h, w = self.meta(it.metadata).grid_thw
            grids += [(1, h, w)] * t
        merged = tower(pixels, grid_thw=torch.tensor(grids, device=device)).pooler_output
        return [{MAIN: rows.clone()} for rows in torch.split(merged, [it.num_tokens for it in batch])]


def video_sampling_from_dir(path: str) -> dict[str, float]:
    """`fps` and `max_duration` of the checkpoint's video_preprocessor_config.json (those it sets)."""
    file = os.path.join(path, "video_preprocessor_config.json")
    if not os.path.exists(file):
        return {}
    with open(file) as f:
        raw = json.load(f)
    return {k: float(raw[k]) for k in VIDEO_SAMPLING if raw.get(k) is not None}


def hf_video_inputs(family: Family, videos: list) -> dict[str, Any]:
    """What transformers' GLM-4.1V video processor returns for decoded videos (`return_metadata`), from our
    preprocessing (see hf_processor): pixels, grids, and metadata whose timestamps are the sampled frames'."""
    from transformers.video_utils import VideoMetadata

    processed = [family.process(Modality.VIDEO, v, {}) for v in videos]
    metadata = []
    for video in videos:
        times = [video.timestamps_s[i] for i in family.sample(video)]
        metadata.append(
            # fps 1: HF's timestamps (index / fps) are then the frames' own times, bit for bit.
            VideoMetadata(total_num_frames=len(video.frames), fps=1.0, frames_indices=times)
        )
    return {
        "pixel_values_videos": torch.cat([p.tensors["pixel_values"] for p in processed]),
        "video_grid_thw": torch.tensor([family.meta(p.metadata).grid_thw for p in processed]),
        "video_metadata": metadata,
    }


def hf_processor(path: str, family: Family):
    """transformers' own `Glm4vProcessor` for this checkpoint (the parity oracle's preprocessing): the PIL
    image processor with the checkpoint's settings (and the `--mm-processor-kwargs` pixel budget), HF's
    expansion of images and of videos, timestamps included. HF's video processor needs torchvision, so video
    pixels come from our preprocessing (`PrecomputedVideos`, tested on its own against the image
    processor)."""
    from transformers import AutoTokenizer, Glm4vImageProcessorPil, Glm4vProcessor

    from mmserve.testing.reference import PrecomputedVideos, allow_any_video_processor

    tokenizer = AutoTokenizer.from_pretrained(path)
    cfg = family.cfg
    image_processor = Glm4vImageProcessorPil.from_pretrained(
        path, size={"shortest_edge": cfg.image_min_pixels, "longest_edge": cfg.image_max_pixels}
    )
    videos = PrecomputedVideos(
        lambda v: hf_video_inputs(family, v),
        merge_size=cfg.merge_size,
        temporal_patch_size=cfg.temporal_patch_size,
    )
    with allow_any_video_processor():
        return Glm4vProcessor(
            image_processor=image_processor,
            tokenizer=tokenizer,
            video_processor=videos,
            chat_template=tokenizer.chat_template,
        )
