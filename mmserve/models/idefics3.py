"""Idefics3 (`idefics3`) and SmolVLM / SmolVLM2 (`smolvlm`): an image split into square tiles plus a global image,
each tile through a SigLIP-like ViT and pixel-shuffled into a few soft tokens by `Idefics3Connector`; a plain
(1-D RoPE, causal) Llama-style language model.

- Images: transformers' PIL image processor of the checkpoint (`Idefics3ImageProcessorPil` /
  `SmolVLMImageProcessorPil`): the longest edge resized to `size`, then (with `do_image_splitting`) to multiples of
  `max_image_size` and cut into rows x cols tiles of that size, followed by the whole image resized to one tile
  (the global image); without splitting, or for an image no larger than a tile, the global image alone. Every
  tile is `image_seq_len` soft tokens ((tile / patch)^2 / scale_factor^2). `--mm-processor-kwargs` may set
  `do_image_splitting` and `size` (the tile count); every setting that changes the tiles enters the content hash.
- Expansion: transformers' processor replaces `<image>` by text, `<fake_token_around_image><row_1_col_1>` + soft
  tokens per tile, a newline after each row, then `\\n<fake_token_around_image><global-img>` + soft tokens +
  `<fake_token_around_image>`; it tokenizes with the prompt (`text_expansion`). The item's span runs from its
  first soft token to its last: the row / column markers and newlines between tiles are text inside it.
- Videos (SmolVLM2): transformers' video processor needs torchvision, so it is done here as it does it: frames
  sampled by its rule (`sample_frames`: `fps` per second, at most `num_frames`, skipping a second at each end of a
  long video) from the frames mmserve decoded, each frame resized to `size`, then squared to `max_image_size`,
  rescaled and normalized (no splitting) by the image processor with the video processor's settings. Each frame is
  one global image; the text is the processor's: "You are provided the following series of {two} frames from a
  {0:00:02} [H:MM:SS] video.\\n", then "\\nFrame from mm:ss:" + the frame's global image per frame, then "\\n\\n".
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from functools import cached_property
from typing import Any

import msgspec
import numpy as np
import torch
from PIL import Image

from mmserve.models import weights
from mmserve.models.family import CausalLM, EmbeddingMismatch, LanguageModel, check_tensors, plain_setting
from mmserve.models.layer_specs import layer_specs_from_hf
from mmserve.models.text_expansion import expand_by_text
from mmserve.multimodal.errors import MediaDecodeError, UnsupportedMediaError
from mmserve.multimodal.items import MAIN, ExpandedPrompt, ItemEmbedding, Modality, TowerInput

# Image-processor settings `--mm-processor-kwargs` may set: the ones that choose the tiles.
TILE_KWARGS = ("do_image_splitting", "size")
# Image-processor attributes that change an image's tiles (all enter the content hash).
IMAGE_SETTINGS = (
    "size",
    "max_image_size",
    "do_image_splitting",
    "resample",
    "do_resize",
    "do_rescale",
    "rescale_factor",
    "do_normalize",
    "image_mean",
    "image_std",
    "do_convert_rgb",
)
# The video processor's settings (SmolVLMVideoProcessor's class defaults, then the checkpoint's): how a frame is
# preprocessed (passed to the image processor), then how frames are sampled.
FRAME_SETTINGS = (
    "size",
    "max_image_size",
    "resample",
    "do_rescale",
    "rescale_factor",
    "do_normalize",
    "image_mean",
    "image_std",
)
VIDEO_SETTINGS = (*FRAME_SETTINGS, "do_sample_frames", "fps", "num_frames")
SKIP_SECS = 1  # `SmolVLMVideoProcessor.sample_frames`' default: a long video loses a second at each end


class VisionMeta(msgspec.Struct, frozen=True, array_like=True):
    """An image: its rows x cols tiles (0 x 0: the global image alone) of `tile` pixels square. A video: one global
    image per frame, the frames' times (s) and the video's duration (s)."""

    rows: int
    cols: int
    tile: int
    timestamps: tuple[float, ...] = ()
    duration_s: float = 0.0

    @property
    def tiles(self) -> int:
        if self.timestamps:
            return len(self.timestamps)
        return self.rows * self.cols + 1 if self.rows or self.cols else 1


class Tower(torch.nn.Module):
    """transformers' `vision_model` (SigLIP-like, variable resolution) and `connector` (pixel shuffle + projection)."""

    def __init__(self, vision_model: torch.nn.Module, connector: torch.nn.Module) -> None:
        super().__init__()
        self.vision_model = vision_model
        self.connector = connector

    @property
    def dtype(self) -> torch.dtype:
        return self.connector.modality_projection.proj.weight.dtype

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(tiles, 3, S, S) -> (tiles, soft tokens, hidden), as `Idefics3Model.get_image_features` (every pixel of a
        tile is real: HF's pixel mask is all ones for tiles of one size)."""
        hidden = self.vision_model(pixel_values=pixel_values, return_dict=True).last_hidden_state
        return self.connector(hidden)


def sample_frames(count: int, fps: float, duration_s: float, settings: Mapping[str, Any]) -> np.ndarray:
    """Indices of the frames `SmolVLMVideoProcessor.sample_frames` keeps of `count` frames at `fps` lasting
    `duration_s`: `settings["fps"]` a second, at most `num_frames`, uniformly, a second off each end of a long video."""
    target, most = settings["fps"], settings["num_frames"]
    desired = max(min(int(round(target * duration_s)), most), 1)
    start, end = 0, count - 1
    if SKIP_SECS > 0 and (duration_s - 2 * SKIP_SECS) > most * target:
        start, end = int(SKIP_SECS * fps), int(count - SKIP_SECS * fps)
    start, end = max(0, start), min(end, count - 1)
    if start >= end:
        start, end = 0, count - 1
    return np.unique(np.linspace(start, end, desired, dtype=int))


def split_image(processor, images: list[Image.Image], **settings) -> tuple[torch.Tensor, int, int]:
    """(tiles (N, 3, S, S), rows, cols) of one image, or the frames of a video as global images, through transformers'
    image processor: the crops row by row, then the global image."""
    out = processor(images=[images], return_tensors="pt", return_row_col_info=True, **settings)
    return out["pixel_values"][0], int(out["rows"][0][0]), int(out["cols"][0][0])


class Family(CausalLM):
    """Idefics3 / SmolVLM (see module docstring)."""

    position_rows = 1
    extra_dims: dict[str, int] = {}
    audio_sample_rate_hz = None

    def __init__(self, path: str, hf_config, mm_processor_kwargs: Mapping[str, Any]) -> None:
        unknown = set(mm_processor_kwargs) - set(TILE_KWARGS)
        if unknown:
            raise ValueError(
                f"unknown mm processor settings {sorted(unknown)}; {hf_config.model_type} takes {list(TILE_KWARGS)}"
            )
        self.path = path
        self.hf_config = hf_config
        self.model_type = hf_config.model_type
        self.overrides = dict(mm_processor_kwargs)
        text = hf_config.get_text_config()
        self.hidden_size = text.hidden_size
        self.layer_specs = layer_specs_from_hf(text)
        vision = hf_config.vision_config
        # `Idefics3Model.image_seq_len`: soft tokens of a tile after the pixel shuffle
        self.tokens_per_tile = (vision.image_size // vision.patch_size) ** 2 // hf_config.scale_factor**2
        self.modalities = frozenset(
            {Modality.IMAGE, Modality.VIDEO} if self.model_type == "smolvlm" else {Modality.IMAGE}
        )
        self.image_token_id = hf_config.image_token_id

    # -- processor ------------------------------------------------------------------------------------
    @cached_property
    def image_processor(self):
        from transformers import Idefics3ImageProcessorPil, SmolVLMImageProcessorPil

        cls = SmolVLMImageProcessorPil if self.model_type == "smolvlm" else Idefics3ImageProcessorPil
        proc = cls.from_pretrained(self.path, **self.overrides)
        if proc.max_image_size["longest_edge"] != self.hf_config.vision_config.image_size:
            raise ValueError(
                f"max_image_size {proc.max_image_size} is not the tower's image_size "
                f"{self.hf_config.vision_config.image_size}: the tiles' token count would not be the model's"
            )
        return proc

    @cached_property
    def video_settings(self) -> dict[str, Any]:
        """SmolVLM2's video processor settings: its class defaults, then the checkpoint's
        video_preprocessor_config.json, else the `video_sampling` of its preprocessor_config.json (read here,
        since transformers' class needs torchvision)."""
        from transformers.models.smolvlm.video_processing_smolvlm import SmolVLMVideoProcessor as Defaults

        settings = {k: getattr(Defaults, k, None) for k in VIDEO_SETTINGS}
        raw = _json(self.path, "video_preprocessor_config.json") or _json(
            self.path, "preprocessor_config.json"
        )
        settings.update({k: raw[k] for k in VIDEO_SETTINGS if raw.get(k) is not None})
        sampling = raw.get("video_sampling")
        # as `SmolVLMVideoProcessor.__init__` reads it: a `size` beside it wins over its video_size
        if sampling:
            settings.update(num_frames=sampling["max_frames"], fps=sampling["fps"])
            settings["size"] = raw.get("size") or sampling["video_size"]
        if settings["do_sample_frames"] and not (settings["fps"] and settings["num_frames"]):
            raise ValueError(f"{self.path}: the video processor samples frames but names no fps / num_frames")
        return settings

    @cached_property
    def placeholders(self) -> dict[Modality, int]:
        """The chat template's placeholders: `<image>` (also every soft token) and SmolVLM2's `<video>`."""
        out = {Modality.IMAGE: self.image_token_id}
        if Modality.VIDEO in self.modalities:
            video = self.tokenizer.convert_tokens_to_ids(getattr(self.tokenizer, "video_token", "<video>"))
            if video is not None and video != self.tokenizer.unk_token_id:
                out[Modality.VIDEO] = video
        return out

    def hash_settings(self, modality: Modality, settings: Mapping[str, Any]) -> dict[str, Any]:
        if settings:
            raise UnsupportedMediaError(f"unknown item settings {sorted(settings)} for this model")
        model = {"tokens_per_tile": self.tokens_per_tile, "scale_factor": self.hf_config.scale_factor}
        if modality == Modality.VIDEO:
            video = {
                k: v if isinstance(v, bool) else plain_setting(v) for k, v in self.video_settings.items()
            }
            return {**video, "skip_secs": SKIP_SECS, **model}
        proc = self.image_processor
        return {**{k: plain_setting(getattr(proc, k, None)) for k in IMAGE_SETTINGS}, **model}

    def meta(self, metadata: bytes) -> VisionMeta:
        return msgspec.msgpack.decode(metadata, type=VisionMeta)

    def input_pixels(self, modality: Modality, metadata: bytes) -> int:
        meta = self.meta(metadata)
        return meta.tiles * meta.tile * meta.tile

    def check_item(self, item: ItemEmbedding) -> None:
        try:
            meta = self.meta(item.metadata)
        except msgspec.DecodeError as e:
            raise EmbeddingMismatch(
                f"{item.modality.value} embedding has no valid Idefics3 metadata: {e}"
            ) from e
        if (
            min(meta.rows, meta.cols) < 0
            or meta.tile < 1
            or (item.modality == Modality.VIDEO) != bool(meta.timestamps)
        ):
            raise EmbeddingMismatch(f"{item.modality.value} embedding has invalid Idefics3 metadata {meta}")
        check_tensors(self, item, meta.tiles * self.tokens_per_tile)

    def precomputed_metadata(self, modality: Modality, fields, settings: Mapping[str, Any]) -> bytes:
        """An image: `rows` and `cols`, its tile grid as HF's processor returns it (both absent: the global image
        alone). A video: `video_timestamps`, the seconds of every frame, and optionally `video_duration` (default:
        the last frame's time, as HF's processor falls back to)."""
        tile = self.hf_config.vision_config.image_size
        per_tile = self.tokens_per_tile
        tiles, rest = divmod(fields.rows, per_tile)
        if tiles < 1 or rest:
            raise fields.invalid(f"the embedding has {fields.rows} rows; an item has tiles x {per_tile} rows")
        if modality == Modality.VIDEO:
            times = fields.floats("video_timestamps", tiles, "seconds of every frame")
            (duration,) = fields.floats("video_duration", 1, "the video's seconds", default=(times[-1],))
            if not all(0 <= t <= 1e6 for t in (*times, duration)):
                raise fields.invalid("'video_timestamps' and 'video_duration' must lie in [0, 1e6] seconds")
            return msgspec.msgpack.encode(VisionMeta(0, 0, tile, tuple(times), duration))
        rows = cols = 0
        if fields.has("rows") or fields.has("cols"):
            (rows,) = fields.ints("rows", 1, "the image's rows of tiles")
            (cols,) = fields.ints("cols", 1, "the image's columns of tiles")
        meta = VisionMeta(rows, cols, tile)
        if meta.tiles != tiles:
            raise fields.invalid(f"{rows} x {cols} tiles and the global image are not {fields.rows} rows")
        return msgspec.msgpack.encode(meta)

    def precomputed_fields(self, modality: Modality, metadata: bytes) -> dict[str, torch.Tensor]:
        meta = self.meta(metadata)
        if modality == Modality.VIDEO:
            return {
                "video_timestamps": torch.tensor(meta.timestamps, dtype=torch.float64),
                "video_duration": torch.tensor([meta.duration_s], dtype=torch.float64),
            }
        return {"rows": torch.tensor([meta.rows]), "cols": torch.tensor([meta.cols])} if meta.rows else {}

    def process(self, modality: Modality, media: Any, settings: Mapping[str, Any]) -> TowerInput:
        if settings:
            raise UnsupportedMediaError(f"unknown item settings {sorted(settings)} for this model")
        if modality not in self.modalities:
            raise UnsupportedMediaError(f"{modality.value} input is not supported by this model")
        if modality == Modality.IMAGE:
            try:
                pixels, rows, cols = split_image(self.image_processor, [media])
            except ValueError as e:
                raise MediaDecodeError(f"image cannot be preprocessed: {e}") from e
            meta = VisionMeta(rows, cols, pixels.shape[-1])
        else:
            pixels, times = self.frame_pixels(media)
            meta = VisionMeta(0, 0, pixels.shape[-1], times, float(media.duration_s))
        tokens = meta.tiles * self.tokens_per_tile
        return TowerInput(
            modality, {"pixel_values": pixels}, msgspec.msgpack.encode(meta), tokens, meta.tiles
        )

    def frame_pixels(self, video) -> tuple[torch.Tensor, tuple[float, ...]]:
        """A decoded video's sampled frames (T, 3, S, S) and their times: the video processor's work, each frame a
        global image through the image processor with the video processor's settings (see module docstring)."""
        s = self.video_settings
        frames = video.frames
        if frames.ndim != 4 or frames.shape[0] == 0:
            raise MediaDecodeError("video has no frames")
        keep = np.arange(len(frames))
        if s["do_sample_frames"]:
            keep = sample_frames(len(frames), video.fps, video.duration_s, s)
        images = [Image.fromarray(frames[i]) for i in keep]
        frame_settings = {k: s[k] for k in FRAME_SETTINGS}
        pixels, _, _ = split_image(self.image_processor, images, do_image_splitting=False, **frame_settings)
        return pixels, tuple(float(video.timestamps_s[i]) for i in keep)

    def probe_item(self) -> tuple[Modality, Any]:
        return Modality.IMAGE, Image.new("RGB", (16, 16), (128, 128, 128))

    # -- prompt ---------------------------------------------------------------------------------------
    def render(self, item) -> str:
        """transformers' `replace_image_token` / SmolVLM's `replace_video_token` for this item."""
        from transformers.models.smolvlm import processing_smolvlm as hf

        tok = self.tokenizer
        marks = {
            "fake_token_around_image": getattr(tok, "fake_image_token", "<fake_token_around_image>"),
            "image_token": getattr(tok, "image_token", "<image>"),
            "global_image_token": getattr(tok, "global_image_token", "<global-img>"),
        }
        meta = self.meta(item.metadata)
        if item.modality == Modality.IMAGE:
            return hf.get_image_prompt_string(meta.rows, meta.cols, self.tokens_per_tile, **marks)
        from datetime import timedelta

        from num2words import num2words

        duration = timedelta(seconds=int(meta.duration_s))
        text = hf.DEFAULT_VIDEO_INTRO.format(frame_count=num2words(meta.tiles), video_duration=str(duration))
        frame = hf._prompt_single_image(self.tokens_per_tile, **marks)
        for t in meta.timestamps:
            text += (
                hf.FRAME_TIMESTAMP_MESSAGE.format(timestamp=f"{int(t // 60):02d}:{int(t % 60):02d}") + frame
            )
        return text + hf.DEFAULT_MEDIA_OUTTRO

    def runs(self, item) -> list[int]:
        """Its runs of soft tokens in `render`'s text: one per tile (crops, then the global image) or frame."""
        return [self.tokens_per_tile] * self.meta(item.metadata).tiles

    def expand(self, token_ids: list[int], items: list[Any]) -> ExpandedPrompt:
        soft = dict.fromkeys(self.modalities, self.image_token_id)
        return expand_by_text(
            self.tokenizer, token_ids, items, self.placeholders, self.render, self.runs, soft
        )

    # -- weights and forward --------------------------------------------------------------------------
    def load_language_model(self, dtype: torch.dtype, attn_implementation: str) -> LanguageModel:
        return weights.load_language_model(
            self.path, self.hf_config, dtype, attn_implementation, "model.text_model"
        )

    def load_tower(self, dtype: torch.dtype) -> torch.nn.Module:
        parts = {"model.vision_model": "sdpa", "model.connector": None}
        model = weights.load_tower_parts(self.path, self.hf_config, dtype, parts)
        return Tower(model.model.vision_model, model.model.connector).eval()

    def encode(self, tower: torch.nn.Module, batch: list[TowerInput]) -> list[dict[str, torch.Tensor]]:
        device = tower.connector.modality_projection.proj.weight.device
        pixels = torch.cat([it.tensors["pixel_values"] for it in batch]).to(device, tower.dtype)
        tiles = tower(pixels)  # (tiles, soft tokens, hidden)
        per_item = torch.split(tiles, [it.cost for it in batch])
        return [{MAIN: rows.reshape(-1, rows.shape[-1]).clone()} for rows in per_item]


def _json(path: str, name: str) -> dict:
    file = os.path.join(path, name)
    if not os.path.exists(file):
        return {}
    with open(file) as f:
        return json.load(f)


def hf_video_inputs(family: Family, videos: list) -> dict[str, Any]:
    """What transformers' SmolVLM video processor returns for decoded videos, from our preprocessing (see
    hf_processor): `pixel_values` (videos, frames, 3, S, S) padded with empty frames to the longest, its pixel mask,
    and metadata whose timestamps are the sampled frames' (fps 1 and the times as indices: `timestamps` is
    indices / fps) and whose duration is the video's."""
    from transformers.video_utils import VideoMetadata

    inputs = [family.process(Modality.VIDEO, v, {}) for v in videos]
    metas = [family.meta(it.metadata) for it in inputs]
    most = max(m.tiles for m in metas)
    pixels = torch.zeros(len(inputs), most, *inputs[0].tensors["pixel_values"].shape[1:])
    mask = torch.zeros(len(inputs), most, *pixels.shape[-2:], dtype=torch.int64)
    for i, it in enumerate(inputs):
        pixels[i, : it.cost] = it.tensors["pixel_values"]
        mask[i, : it.cost] = 1
    return {
        "pixel_values": pixels,
        "pixel_attention_mask": mask,
        "video_metadata": [
            VideoMetadata(
                total_num_frames=m.tiles, fps=1.0, duration=m.duration_s, frames_indices=list(m.timestamps)
            )
            for m in metas
        ],
    }


def hf_processor(path: str, family: Family):
    """transformers' own `Idefics3Processor` / `SmolVLMProcessor` for this checkpoint (PIL image processor with the
    family's tile settings, its expansion); SmolVLM's video processor needs torchvision, so video pixels come from
    our preprocessing (`PrecomputedVideos`) while HF's processor writes the video's text from their metadata."""
    from transformers import (
        AutoTokenizer,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
        SmolVLMImageProcessorPil,
        SmolVLMProcessor,
    )

    from mmserve.testing.reference import PrecomputedVideos, allow_any_video_processor

    tokenizer = AutoTokenizer.from_pretrained(path)
    seq_len = _json(path, "processor_config.json").get("image_seq_len", family.tokens_per_tile)
    if family.model_type == "idefics3":
        return Idefics3Processor(
            image_processor=Idefics3ImageProcessorPil.from_pretrained(path, **family.overrides),
            tokenizer=tokenizer,
            image_seq_len=seq_len,
            chat_template=tokenizer.chat_template,
        )
    videos = PrecomputedVideos(lambda v: hf_video_inputs(family, v))
    with allow_any_video_processor():
        return SmolVLMProcessor(
            image_processor=SmolVLMImageProcessorPil.from_pretrained(path, **family.overrides),
            tokenizer=tokenizer,
            video_processor=videos,
            image_seq_len=seq_len,
            chat_template=tokenizer.chat_template,
        )
