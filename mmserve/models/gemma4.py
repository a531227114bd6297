"""Gemma 4 (`gemma4`): images and video through a ViT that pools patches into a variable number of soft tokens,
audio (E2B / E4B) through a conformer, and a language model of sliding-window layers around wider full ones.

- Images: transformers' `Gemma4ImageProcessorPil` resizes each image, aspect kept, to at most `max_soft_tokens`
  soft tokens (a setting of the content hash: `--mm-processor-kwargs '{"max_soft_tokens": 560}'`), patchified
  and padded to the patch budget with their (x, y) positions. Expansion `<|image>` + soft tokens + `<image|>`.
- Video: transformers' video processor needs torchvision, so each frame goes through the image processor's own
  resize / rescale / patchify with the video processor's settings (`video_preprocessor_config.json`: its patch
  budget, 70 soft tokens a frame by default); the frames are the ones mmserve's decoder samples. Expansion as
  transformers': every frame "mm:ss <|image>" + soft tokens + "<image|>", joined by spaces, its timestamp text
  tokenized with the prompt around it (`text_expansion`).
- Audio: transformers' `Gemma4AudioFeatureExtractor` (log-mel at 16 kHz, at most 30 s: longer clips get 413);
  `<|audio>` + one soft token per 40 ms + `<audio|>`.
- Language model: `layer_specs_from_hf` reads the per-layer head shapes (full layers' `global_head_dim`), KV
  sharing (the last `num_kv_shared_layers` read the rows of the last layer of their kind that writes them) and,
  with `use_bidirectional_attention == "vision"`, image and video blocks attended both ways on sliding layers
  only (transformers: "full attention: causal only"). Per-layer embeddings (E2B / E4B) are computed from the
  token ids with every media position mapped to `pad_token_id` (`token_inputs`), and the final logits are
  soft-capped (`final_logit_softcapping`). Mixture-of-experts layers (26B-A4B) are transformers' own.
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
from mmserve.multimodal.errors import MediaDecodeError, MediaTooLargeError, UnsupportedMediaError
from mmserve.multimodal.items import MAIN, ExpandedPrompt, ItemEmbedding, Modality, TowerInput

IMAGE_SETTINGS = (
    "patch_size",
    "max_soft_tokens",
    "pooling_kernel_size",
    "resample",
    "do_rescale",
    "rescale_factor",
    "do_normalize",
    "image_mean",
    "image_std",
)
MAX_AUDIO_SAMPLES = 480_000  # the feature extractor's window (30 s at 16 kHz); transformers truncates past it
AUDIO_MAX_TOKENS = 750  # transformers' `audio_seq_length`


# transformers' Gemma4VideoProcessor class defaults (the class itself needs torchvision, so they are written here)
VIDEO_DEFAULTS: dict[str, Any] = {
    "patch_size": 16,
    "max_soft_tokens": 70,
    "pooling_kernel_size": 3,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.0] * 3,
    "image_std": [1.0] * 3,
    "resample": 3,
}


class VisionMeta(msgspec.Struct, frozen=True, array_like=True):
    """An image or a video: soft tokens per frame, its frames (1 for an image), their time (s, videos) and the
    resized frame's (height, width)."""

    tokens_per_frame: int
    frames: int
    resized_hw: tuple[int, int]
    timestamps: tuple[float, ...] = ()


class AudioMeta(msgspec.Struct, frozen=True, array_like=True):
    tokens: int
    samples: int


class Tower(torch.nn.Module):
    """transformers' vision and audio towers with their embedders (module names as in the checkpoint)."""

    def __init__(self, parts: dict[str, torch.nn.Module | None]) -> None:
        super().__init__()
        for name, module in parts.items():
            setattr(self, name, module)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def vision(self, pixels: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(frames, patches, patch pixels) -> every frame's soft tokens (sum, hidden), padding dropped, as
        `Gemma4Model.get_image_features`."""
        hidden = self.vision_tower(pixel_values=pixels, pixel_position_ids=positions).last_hidden_state
        return self.embed_vision(inputs_embeds=hidden)

    def audio(self, features: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
        out = self.audio_tower(features, mask, return_dict=True)
        rows = self.embed_audio(inputs_embeds=out.last_hidden_state)
        return [r[m] for r, m in zip(rows, out.attention_mask, strict=True)]


class Family(CausalLM):
    """Gemma 4 (see module docstring)."""

    position_rows = 1
    extra_dims: dict[str, int] = {}

    def __init__(self, path: str, hf_config, mm_processor_kwargs: Mapping[str, Any]) -> None:
        unknown = set(mm_processor_kwargs) - {"max_soft_tokens"}
        if unknown:
            raise ValueError(
                f"unknown mm processor settings {sorted(unknown)}; Gemma 4 takes ['max_soft_tokens']"
            )
        self.path = path
        self.hf_config = hf_config
        self.model_type = hf_config.model_type
        self.overrides = dict(mm_processor_kwargs)
        text = hf_config.get_text_config()
        if text.use_bidirectional_attention == "all":
            raise ValueError(
                "a Gemma 4 text model with bidirectional attention everywhere is not a generator"
            )
        vision_both_ways = text.use_bidirectional_attention == "vision"
        self.hidden_size = text.hidden_size
        both_ways = frozenset({"sliding_attention"}) if vision_both_ways else frozenset()
        self.layer_specs = layer_specs_from_hf(text, bidirectional=both_ways)
        self.bidirectional_modalities = (
            frozenset({Modality.IMAGE, Modality.VIDEO}) if vision_both_ways else frozenset()
        )
        self.logit_softcap = text.final_logit_softcapping
        self.per_layer_inputs = bool(text.hidden_size_per_layer_input)
        self.pad_token_id = text.pad_token_id
        modalities = set()
        if hf_config.vision_config is not None:
            modalities |= {Modality.IMAGE, Modality.VIDEO}
        if hf_config.audio_config is not None:
            modalities.add(Modality.AUDIO)
        self.modalities = frozenset(modalities)
        self.placeholders = {
            m: tid
            for m, tid in (
                (Modality.IMAGE, hf_config.image_token_id),
                (Modality.VIDEO, hf_config.video_token_id),
                (Modality.AUDIO, hf_config.audio_token_id),
            )
            if m in modalities
        }
        self.soft_tokens = self.placeholders  # the chat template's placeholder is the soft token itself
        self.audio_sample_rate_hz = 16_000 if Modality.AUDIO in modalities else None
        media = (hf_config.image_token_id, hf_config.video_token_id, hf_config.audio_token_id)
        self.media_ids = torch.tensor([t for t in media if t is not None], dtype=torch.int64)

    # -- processor ------------------------------------------------------------------------------------
    @cached_property
    def image_processor(self):
        from transformers import Gemma4ImageProcessorPil

        return Gemma4ImageProcessorPil.from_pretrained(self.path, **self.overrides)

    @cached_property
    def video_settings(self) -> dict[str, Any]:
        """The video processor's settings (its class defaults, then the checkpoint's: `processor_config.json`'s
        "video_processor", else `video_preprocessor_config.json`): read here, since transformers' class needs
        torchvision."""
        settings = dict(VIDEO_DEFAULTS)
        raw = _json(self.path, "processor_config.json").get("video_processor")
        if raw is None:
            raw = _json(self.path, "video_preprocessor_config.json")
        settings.update({k: raw[k] for k in settings if raw.get(k) is not None})
        return settings

    @cached_property
    def feature_extractor(self):
        from transformers import Gemma4AudioFeatureExtractor

        return Gemma4AudioFeatureExtractor.from_pretrained(self.path)

    def hash_settings(self, modality: Modality, settings: Mapping[str, Any]) -> dict[str, Any]:
        if settings:
            raise UnsupportedMediaError(f"unknown item settings {sorted(settings)} for this model")
        if modality == Modality.AUDIO:
            fe = self.feature_extractor
            return {k: plain_setting(v) for k, v in sorted(fe.to_dict().items()) if not k.startswith("_")}
        if modality == Modality.VIDEO:
            return dict(self.video_settings)
        return {k: plain_setting(getattr(self.image_processor, k, None)) for k in IMAGE_SETTINGS}

    def vision_meta(self, metadata: bytes) -> VisionMeta:
        return msgspec.msgpack.decode(metadata, type=VisionMeta)

    def audio_meta(self, metadata: bytes) -> AudioMeta:
        return msgspec.msgpack.decode(metadata, type=AudioMeta)

    def num_tokens(self, modality: Modality, metadata: bytes) -> int:
        if modality == Modality.AUDIO:
            return self.audio_meta(metadata).tokens
        meta = self.vision_meta(metadata)
        return meta.tokens_per_frame * meta.frames

    def input_pixels(self, modality: Modality, metadata: bytes) -> int:
        if modality == Modality.AUDIO:
            return 0
        meta = self.vision_meta(metadata)
        return meta.frames * meta.resized_hw[0] * meta.resized_hw[1]

    def check_item(self, item: ItemEmbedding) -> None:
        try:
            rows = self.num_tokens(item.modality, item.metadata)
        except msgspec.DecodeError as e:
            raise EmbeddingMismatch(
                f"{item.modality.value} embedding has no valid Gemma 4 metadata: {e}"
            ) from e
        if rows < 1:
            raise EmbeddingMismatch(f"{item.modality.value} embedding has invalid Gemma 4 metadata")
        check_tensors(self, item, rows)

    def precomputed_metadata(self, modality: Modality, fields, settings: Mapping[str, Any]) -> bytes:
        """Images: the rows are the soft tokens (no field). Videos: `video_timestamps`, the seconds of every
        frame (its rows split evenly among them). Audio: the rows are its tokens."""
        if modality == Modality.AUDIO:
            return msgspec.msgpack.encode(AudioMeta(fields.rows, fields.rows * 640))
        if modality == Modality.IMAGE:
            return msgspec.msgpack.encode(VisionMeta(fields.rows, 1, (0, 0)))
        count = fields.ints("num_frames_per_video", 1, "the video's frame count")[0]
        if count < 1 or fields.rows % count:
            raise fields.invalid(f"a video of {count} frames cannot have {fields.rows} rows")
        times = fields.floats("video_timestamps", count, "seconds of every frame")
        if not all(0 <= t <= 1e6 for t in times):
            raise fields.invalid(f"'video_timestamps' {list(times)} must lie in [0, 1e6] seconds")
        return msgspec.msgpack.encode(VisionMeta(fields.rows // count, count, (0, 0), tuple(times)))

    def precomputed_fields(self, modality: Modality, metadata: bytes) -> dict[str, torch.Tensor]:
        if modality != Modality.VIDEO:
            return {}
        meta = self.vision_meta(metadata)
        return {
            "num_frames_per_video": torch.tensor([meta.frames]),
            "video_timestamps": torch.tensor(meta.timestamps, dtype=torch.float64),
        }

    def process(self, modality: Modality, media: Any, settings: Mapping[str, Any]) -> TowerInput:
        if settings:
            raise UnsupportedMediaError(f"unknown item settings {sorted(settings)} for this model")
        if modality not in self.modalities:
            raise UnsupportedMediaError(f"{modality.value} input is not supported by this model")
        if modality == Modality.AUDIO:
            return self.process_audio(media)
        if modality == Modality.IMAGE:
            return self.vision_input(Modality.IMAGE, [media], {})
        frames = [Image.fromarray(f) for f in media.frames]
        if not frames:
            raise MediaDecodeError("video has no frames")
        return self.vision_input(Modality.VIDEO, frames, self.video_settings, tuple(media.timestamps_s))

    def vision_input(self, modality, images, settings, timestamps=()) -> TowerInput:
        """Frames through the image processor (`settings` override its own: the video processor's)."""
        try:
            out = self.image_processor(images=images, return_tensors="pt", **settings)
        except ValueError as e:
            raise MediaDecodeError(f"{modality.value} cannot be preprocessed: {e}") from e
        tokens = [int(n) for n in out["num_soft_tokens_per_image"]]
        positions = out["image_position_ids"]
        hw = (int(positions[0, :, 1].max()) + 1, int(positions[0, :, 0].max()) + 1)
        patch = settings.get("patch_size", self.image_processor.patch_size)
        meta = VisionMeta(tokens[0], len(images), (hw[0] * patch, hw[1] * patch), timestamps)
        tensors = {"pixel_values": out["pixel_values"], "position_ids": positions}
        return TowerInput(
            modality, tensors, msgspec.msgpack.encode(meta), tokens[0] * len(images), len(images)
        )

    def process_audio(self, samples: np.ndarray) -> TowerInput:
        if samples.shape[0] > MAX_AUDIO_SAMPLES:
            raise MediaTooLargeError(
                f"audio clip is {samples.shape[0] / 16_000:.1f} s; this model takes at most "
                f"{MAX_AUDIO_SAMPLES / 16_000:.0f} s per clip"
            )
        out = self.feature_extractor([samples], return_tensors="pt")  # its unbatched path mislays the axes
        mask = out["input_features_mask"][0]
        for _ in range(2):  # transformers' processor: the two stride-2 convolutions of the audio tower
            t_out = (len(mask) + 2 - 3) // 2 + 1
            mask = mask[::2][:t_out]
        tokens = min(int(mask.sum()), AUDIO_MAX_TOKENS)
        if tokens < 1:
            raise MediaDecodeError("audio clip is too short for this model")
        meta = msgspec.msgpack.encode(AudioMeta(tokens, samples.shape[0]))
        tensors = {"input_features": out["input_features"], "input_features_mask": out["input_features_mask"]}
        return TowerInput(Modality.AUDIO, tensors, meta, tokens, 1)

    def probe_item(self) -> tuple[Modality, Any]:
        if Modality.IMAGE in self.modalities:
            return Modality.IMAGE, Image.new("RGB", (32, 32), (128, 128, 128))
        return Modality.AUDIO, np.zeros(8_000, dtype=np.float32)

    # -- prompt ---------------------------------------------------------------------------------------
    def render(self, item) -> str:
        """transformers' `Gemma4Processor.replace_{image,video,audio}_token` for this item."""
        tok = self.tokenizer
        if item.modality == Modality.AUDIO:
            return f"{tok.boa_token}{tok.audio_token * self.audio_meta(item.metadata).tokens}{tok.eoa_token}"
        meta = self.vision_meta(item.metadata)
        if item.modality == Modality.IMAGE:
            return f"{tok.boi_token}{tok.image_token * meta.tokens_per_frame}{tok.eoi_token}"
        video = tok.convert_ids_to_tokens(self.placeholders[Modality.VIDEO])
        frame = f"{tok.boi_token}{video * meta.tokens_per_frame}{tok.eoi_token}"
        return " ".join(f"{int(t // 60):02d}:{int(t % 60):02d} {frame}" for t in meta.timestamps)

    def runs(self, item) -> list[int]:
        """Its runs of soft tokens in `render`'s text: one per image, video frame or audio clip."""
        if item.modality == Modality.AUDIO:
            return [self.audio_meta(item.metadata).tokens]
        meta = self.vision_meta(item.metadata)
        return [meta.tokens_per_frame] * meta.frames

    def expand(self, token_ids: list[int], items: list[Any]) -> ExpandedPrompt:
        args = (self.placeholders, self.render, self.runs, self.soft_tokens)
        return expand_by_text(self.tokenizer, token_ids, items, *args)

    def bidirectional_blocks(self, expanded: ExpandedPrompt) -> list[tuple[int, int]]:
        return item_runs(expanded, self.bidirectional_modalities)

    remaps_ids = True

    def embed_ids(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Media placeholder tokens (a model may generate one) are looked up as `pad_token_id`, as
        `Gemma4Model.forward` looks up every position holding one."""
        return torch.where(
            torch.isin(token_ids, self.media_ids.to(token_ids.device)), self.pad_token_id, token_ids
        )

    def token_inputs(self, language_model: torch.nn.Module, token_ids: torch.Tensor) -> dict[str, Any]:
        """Per-layer embeddings (E2B / E4B) of the packed rows' token ids, every media token (a pad value here,
        its placeholder in transformers) looked up as `pad_token_id`, as `Gemma4Model.forward` does; the text
        model adds the projection of the rows' embeddings itself."""
        if not self.per_layer_inputs:
            return {}
        vocab = language_model.config.vocab_size_per_layer_input
        ids = torch.where(token_ids >= vocab, self.pad_token_id, token_ids)
        return {"per_layer_inputs": language_model.get_per_layer_inputs(ids, None)}

    # -- weights and forward --------------------------------------------------------------------------
    def load_language_model(self, dtype: torch.dtype, attn_implementation: str) -> LanguageModel:
        return weights.load_nested_language_model(self.path, self.hf_config, dtype, attn_implementation)

    def load_tower(self, dtype: torch.dtype) -> torch.nn.Module:
        names = []
        if self.hf_config.vision_config is not None:
            names += [("vision_tower", "sdpa"), ("embed_vision", None)]
        if self.hf_config.audio_config is not None:
            names += [("audio_tower", "eager"), ("embed_audio", None)]  # its own attention: no SDPA form
        parts = {f"model.{name}": attn for name, attn in names}
        model = weights.load_tower_parts(self.path, self.hf_config, dtype, parts)
        return Tower({name: getattr(model.model, name) for name, _ in names}).eval()

    def encode(self, tower: torch.nn.Module, batch: list[TowerInput]) -> list[dict[str, torch.Tensor]]:
        device = next(tower.parameters()).device
        out: list[torch.Tensor | None] = [None] * len(batch)
        # Frames of equal patch budgets go through the ViT together (as transformers batches a request's images)
        groups: dict[tuple, list[int]] = {}
        for i, it in enumerate(batch):
            key = ("audio",) if it.modality == Modality.AUDIO else tuple(it.tensors["pixel_values"].shape[1:])
            groups.setdefault(key, []).append(i)
        for key, members in groups.items():
            if key == ("audio",):
                for i in members:  # one clip at a time: its padding never shifts another's convolutions
                    t = batch[i].tensors
                    feats = t["input_features"].to(device, tower.dtype)
                    out[i] = tower.audio(feats, t["input_features_mask"].to(device))[0]
                continue
            pixels = torch.cat([batch[i].tensors["pixel_values"] for i in members]).to(device, tower.dtype)
            positions = torch.cat([batch[i].tensors["position_ids"] for i in members]).to(device)
            rows = tower.vision(pixels, positions)
            for i, part in zip(
                members, torch.split(rows, [batch[i].num_tokens for i in members]), strict=True
            ):
                out[i] = part
        return [{MAIN: rows.clone()} for rows in out]


def _json(path: str, name: str) -> dict:
    file = os.path.join(path, name)
    if not os.path.exists(file):
        return {}
    with open(file) as f:
        return json.load(f)


def hf_video_inputs(family: Family, videos: list) -> dict[str, Any]:
    """What transformers' Gemma 4 video processor returns for decoded videos, from our preprocessing (see
    hf_processor): patches, positions, frame and soft-token counts, and metadata whose timestamps are the
    frames'."""
    from transformers.video_utils import VideoMetadata

    inputs = [family.process(Modality.VIDEO, v, {}) for v in videos]
    metas = [family.vision_meta(it.metadata) for it in inputs]
    return {
        "pixel_values_videos": torch.cat([it.tensors["pixel_values"] for it in inputs]),
        "video_position_ids": torch.cat([it.tensors["position_ids"] for it in inputs]),
        "num_frames_per_video": [m.frames for m in metas],
        "num_soft_tokens_per_video": [m.tokens_per_frame for m in metas],
        "video_metadata": [
            VideoMetadata(
                total_num_frames=m.frames, fps=1000.0, frames_indices=[round(t * 1000) for t in m.timestamps]
            )
            for m in metas
        ],
    }


def hf_processor(path: str, family: Family):
    """transformers' own `Gemma4Processor` (image processor, feature extractor, expansion); its video processor
    needs torchvision, so video pixels come from our preprocessing (`PrecomputedVideos`)."""
    from transformers import (
        AutoTokenizer,
        Gemma4AudioFeatureExtractor,
        Gemma4ImageProcessorPil,
        Gemma4Processor,
    )

    from mmserve.testing.reference import PrecomputedVideos, allow_any_video_processor

    tokenizer = AutoTokenizer.from_pretrained(path)
    videos = PrecomputedVideos(lambda v: hf_video_inputs(family, v))
    extractor = (
        Gemma4AudioFeatureExtractor.from_pretrained(path) if Modality.AUDIO in family.modalities else None
    )
    with allow_any_video_processor():
        return Gemma4Processor(
            feature_extractor=extractor,
            image_processor=Gemma4ImageProcessorPil.from_pretrained(path, **family.overrides),
            tokenizer=tokenizer,
            video_processor=videos,
            chat_template=tokenizer.chat_template,
            image_seq_length=family.image_processor.max_soft_tokens,
        )
