"""Qwen2.5-Omni's and Qwen3-Omni's thinkers (text output): images, videos, audio and audio-in-video, TMRoPE.

The checkpoint is the whole Omni model (thinker, and talker / token2wav or code2wav); only the thinker's tensors
are read (`thinker.` keys, through transformers' loading rules): its vision tower (Qwen2.5-VL's; Qwen3-Omni's
has DeepStack), its Whisper-style audio encoder and its language model (Qwen2; Qwen3-Omni: Qwen3 MoE).

Items:
- image / video: Qwen2-VL's preprocessing (`qwen2_vl.Family`); an item's grid sits at the current position,
  its temporal index scaled by `position_id_per_seconds` (25 a second; Qwen3-Omni 13, kept as float positions:
  a video whose grid step is not a whole number of ids is refused), and the next position is the grid's
  largest id plus one.
- audio: the checkpoint's Whisper feature extractor (clips over its `chunk_length` are refused, never
  truncated); the encoder sees only the valid mel frames, and a clip of `L` frames becomes `((L - 1) // 2 + 1 -
  2) // 2 + 1` tokens (Qwen3-Omni: 13 a window of `2 * n_window` frames, plus the rest's) at sequential
  positions. Every clip is featurized alone (HF's Qwen3-Omni processor pads a call's clips together: see
  tests/test_family_qwen_omni.py).
- audio-in-video (the item setting `use_audio_in_video`, from `--mm-processor-kwargs '{"use_audio_in_video":
  true}'` or a request's `mm_processor_kwargs`): ONE video item whose embedding rows are its video rows and its
  own audio track's rows interleaved in prompt order, exactly as transformers' processor lays out
  `<|audio_bos|> ... <|audio_eos|>` inside the template's `<|vision_bos|> ... <|vision_eos|>`: Qwen2.5-Omni in
  2-second chunks (`seconds_per_chunk`: a video chunk, then an audio chunk), Qwen3-Omni row by row by time. Its
  content hash covers the video's bytes (audio track included) and the setting, so the pair has one identity:
  no cache can hold the one without the other. Its positions are `get_rope_index`'s: the two begin marks (one
  position; Qwen3-Omni two), the video grid and the audio ids from the next position (time-aligned), the two end
  marks after the largest. A video without an audio track, or a placeholder not wrapped in the vision begin /
  end marks, is refused (400). DeepStack levels (Qwen3-Omni) are zero on audio rows: adding them changes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

import msgspec
import numpy as np
import torch

from mmserve.models import qwen2_vl, weights
from mmserve.models.family import EmbeddingMismatch, LanguageModel, check_tensors, expand_placeholders
from mmserve.models.layer_specs import layer_specs_from_hf
from mmserve.models.omni_interleave import chunk_bounds, time_sorted_runs
from mmserve.models.qwen2_audio import AudioPreprocessConfig, num_audio_tokens
from mmserve.models.qwen2_vl import VisionPreprocessConfig, finish_positions
from mmserve.models.qwen3_vl import DEEPSTACK
from mmserve.multimodal.errors import MediaDecodeError, MediaTooLargeError, UnsupportedMediaError
from mmserve.multimodal.items import MAIN, ExpandedPrompt, ItemEmbedding, Modality, TowerInput

AUDIO_IN_VIDEO = "use_audio_in_video"
FEATURES = "input_features"  # (mel, valid frames): only the clip's valid frames travel
PIXELS = "pixel_values"


class OmniMeta(msgspec.Struct, frozen=True, array_like=True):
    """A Qwen-Omni item: the vision grid (t, h, w) before merging (zeros for audio), seconds per temporal grid
    step (videos), and the valid mel frames of its audio (audio, audio-in-video; else 0)."""

    grid_thw: tuple[int, int, int] = (0, 0, 0)
    second_per_grid_t: float = 1.0
    audio_frames: int = 0


class Family(qwen2_vl.Family):
    """Qwen2.5-Omni's and Qwen3-Omni's thinkers (see module docstring)."""

    modalities = frozenset({Modality.IMAGE, Modality.VIDEO, Modality.AUDIO})
    default_preprocess = VisionPreprocessConfig()

    def __init__(self, path: str, hf_config, mm_processor_kwargs: Mapping[str, Any]) -> None:
        kwargs = dict(mm_processor_kwargs)
        self.audio_in_video = bool(kwargs.pop(AUDIO_IN_VIDEO, False))
        self.omni_config = hf_config
        thinker = hf_config.thinker_config
        super().__init__(path, thinker, kwargs)
        self.model_type = hf_config.model_type
        self.layer_specs = layer_specs_from_hf(thinker.get_text_config())
        self.placeholders[Modality.AUDIO] = thinker.audio_token_id
        self.audio_start_id, self.audio_end_id = thinker.audio_start_token_id, thinker.audio_end_token_id
        self.vision_start_id = thinker.vision_start_token_id
        self.vision_end_id = thinker.vision_end_token_id
        self.ids_per_second = thinker.position_id_per_seconds
        self.ids_per_chunk = int(thinker.position_id_per_seconds * getattr(thinker, "seconds_per_chunk", 2))
        self.tokens_per_second = None  # Qwen2.5-VL's rule does not apply: positions are Omni's own
        # Qwen3-Omni: DeepStack levels (zero rows for audio: adding them changes nothing), audio windows of
        # `2 * n_window` mel frames, time-sorted audio-in-video, begin / end marks at consecutive positions.
        self.qwen3 = self.model_type == "qwen3_omni_moe"
        levels = len(thinker.vision_config.deepstack_visual_indexes) if self.qwen3 else 0
        self.extra_dims = {DEEPSTACK.format(k): thinker.vision_config.out_hidden_size for k in range(levels)}
        self.n_window = thinker.audio_config.n_window
        from transformers import AutoFeatureExtractor

        fe = self.feature_extractor = AutoFeatureExtractor.from_pretrained(path)
        self.audio_cfg = AudioPreprocessConfig(
            type(fe).__name__, fe.sampling_rate, fe.feature_size, fe.hop_length, fe.n_fft, fe.chunk_length,
            fe.n_samples, fe.padding_value, fe.padding_side, fe.dither,
        )  # fmt: skip
        self.audio_sample_rate_hz = int(fe.sampling_rate)

    # -- processor ------------------------------------------------------------------------------------
    def item_settings(self, modalities: Sequence[Modality]) -> list[dict[str, Any]]:
        return self.request_item_settings(modalities, {})

    def request_item_settings(self, modalities: Sequence[Modality], kwargs: Mapping[str, Any]):
        """Per-item settings of a request whose `mm_processor_kwargs` are `kwargs` (they override the server's):
        `use_audio_in_video` marks every video of the request. Raises ValueError for anything else."""
        unknown = set(kwargs) - {AUDIO_IN_VIDEO}
        if unknown:
            raise ValueError(
                f"unknown mm_processor_kwargs {sorted(unknown)}; this model takes {AUDIO_IN_VIDEO!r}"
            )
        value = kwargs.get(AUDIO_IN_VIDEO, self.audio_in_video)
        if not isinstance(value, bool):
            raise ValueError(f"mm_processor_kwargs {AUDIO_IN_VIDEO!r} must be true or false, not {value!r}")
        if kwargs.get(AUDIO_IN_VIDEO) and Modality.VIDEO not in modalities:
            raise ValueError(f"mm_processor_kwargs {AUDIO_IN_VIDEO!r} is set but the request has no video")
        return [{AUDIO_IN_VIDEO: True} if value and m == Modality.VIDEO else {} for m in modalities]

    def video_audio_rate_hz(self, settings: Mapping[str, Any]) -> int | None:
        """The rate to decode a video's audio track at, for an item with `settings` (None: frames only)."""
        return self.audio_sample_rate_hz if settings.get(AUDIO_IN_VIDEO) else None

    def _check_settings(self, modality: Modality, settings: Mapping[str, Any]) -> bool:
        allowed = {AUDIO_IN_VIDEO} if modality == Modality.VIDEO else set()
        if set(settings) - allowed or settings.get(AUDIO_IN_VIDEO, True) is not True:
            raise UnsupportedMediaError(
                f"unknown item settings {dict(settings)} for this model's {modality.value}"
            )
        return bool(settings)

    def hash_settings(self, modality: Modality, settings: Mapping[str, Any]) -> dict[str, Any]:
        av = self._check_settings(modality, settings)
        out = {} if modality == Modality.AUDIO else super().hash_settings(modality, {})
        if modality == Modality.AUDIO or av:
            out["audio"] = asdict(self.audio_cfg)
            out["chunk"] = [self.ids_per_second, self.ids_per_chunk]
        return out

    def meta(self, metadata: bytes) -> OmniMeta:
        return msgspec.msgpack.decode(metadata, type=OmniMeta)

    def vision_tokens(self, meta: OmniMeta) -> int:
        return self.num_tokens(meta.grid_thw) if meta.grid_thw[0] else 0

    def audio_tokens(self, frames: int) -> int:
        """LM tokens of `frames` valid mel frames: Qwen2.5-Omni's two stride-2 stages; Qwen3-Omni's windows of
        `2 * n_window` frames (13 tokens each, as transformers counts them) and the rest's three stages."""
        if not self.qwen3:
            return num_audio_tokens(frames)
        window = self.n_window * 2
        rest = (frames % window - 1) // 2 + 1
        return ((rest - 1) // 2 + 1 - 1) // 2 + 1 + (frames // window) * 13

    def item_tokens(self, meta: OmniMeta) -> int:
        return self.vision_tokens(meta) + (self.audio_tokens(meta.audio_frames) if meta.audio_frames else 0)

    def input_pixels(self, modality: Modality, metadata: bytes) -> int:
        return 0 if modality == Modality.AUDIO else super().input_pixels(modality, metadata)

    def check_item(self, item: ItemEmbedding) -> None:
        try:
            meta = self.meta(item.metadata)
        except msgspec.DecodeError as e:
            raise EmbeddingMismatch(
                f"{item.modality.value} embedding has no valid Qwen-Omni metadata: {e}"
            ) from e
        vision, audio = meta.grid_thw[0] > 0, meta.audio_frames > 0
        shape_ok = {
            Modality.IMAGE: vision and not audio,
            Modality.VIDEO: vision,
            Modality.AUDIO: audio and not vision,
        }
        if not shape_ok[item.modality] or min(*meta.grid_thw, meta.audio_frames) < 0:
            raise EmbeddingMismatch(
                f"{item.modality.value} embedding has impossible Qwen-Omni metadata {meta}"
            )
        check_tensors(self, item, self.item_tokens(meta))

    def precomputed_metadata(self, modality: Modality, fields, settings: Mapping[str, Any]) -> bytes:
        """Images and videos: the grid (`image_grid_thw` / `video_grid_thw`), for a video `second_per_grid_t`
        (default 1.0); audio: `audio_feature_lengths` (valid mel frames). Audio-in-video items cannot be
        precomputed (their rows interleave two towers' outputs)."""
        if self._check_settings(modality, settings):
            raise fields.invalid(f"{AUDIO_IN_VIDEO!r} items cannot be sent as precomputed embeddings")
        if modality == Modality.AUDIO:
            (frames,) = fields.ints("audio_feature_lengths", 1, "valid mel frames")
            window = self.feature_extractor.nb_max_frames
            if frames > window or frames < 1 or self.audio_tokens(frames) < 1:
                raise fields.invalid(f"'audio_feature_lengths' is {frames}; this model takes 3 to {window}")
            return msgspec.msgpack.encode(OmniMeta(audio_frames=frames))
        grid = self.precomputed_grid(modality, fields)
        seconds = 1.0
        if modality == Modality.VIDEO:
            (seconds,) = fields.floats("second_per_grid_t", 1, "seconds per temporal grid step", (1.0,))
            if not 0 < seconds <= 3600:
                raise fields.invalid(f"'second_per_grid_t' is {seconds}; it must be in (0, 3600]")
        return msgspec.msgpack.encode(OmniMeta(grid, seconds))

    def precomputed_fields(self, modality: Modality, metadata: bytes) -> dict[str, torch.Tensor]:
        meta = self.meta(metadata)
        if modality == Modality.AUDIO:
            return {"audio_feature_lengths": torch.tensor([meta.audio_frames])}
        out = {f"{modality.value}_grid_thw": torch.tensor(meta.grid_thw)}
        if modality == Modality.VIDEO:
            out["second_per_grid_t"] = torch.tensor([meta.second_per_grid_t])
        return out

    def process(self, modality: Modality, media: Any, settings: Mapping[str, Any]) -> TowerInput:
        av = self._check_settings(modality, settings)
        if modality == Modality.AUDIO:
            features, frames = self.audio_features(media)
            meta = OmniMeta(audio_frames=frames)
            return TowerInput(modality, {FEATURES: features}, msgspec.msgpack.encode(meta), self.item_tokens(meta),
                              cost=frames)  # fmt: skip
        vision = super().process(modality, media, {})
        old = super().meta(vision.metadata)
        meta = OmniMeta(old.grid_thw, old.second_per_grid_t)
        tensors = dict(vision.tensors)
        if av:
            if getattr(media, "audio", None) is None:
                raise MediaDecodeError(f"video has no audio track, which {AUDIO_IN_VIDEO!r} needs")
            tensors[FEATURES], frames = self.audio_features(media.audio)
            meta = OmniMeta(old.grid_thw, old.second_per_grid_t, frames)
        step = meta.second_per_grid_t * self.ids_per_second
        if self.qwen3 and modality == Modality.VIDEO and abs(step - round(step)) > 1e-6:
            raise MediaDecodeError(
                f"video frames {meta.second_per_grid_t / 2:.3f} s apart give fractional position ids ({step:.3f} a "
                f"grid step at {self.ids_per_second} a second), which this server cannot represent; sample the "
                "video at an fps that makes them whole (e.g. --video-fps 2)"
            )
        cost = vision.cost + meta.audio_frames
        return TowerInput(modality, tensors, msgspec.msgpack.encode(meta), self.item_tokens(meta), cost=cost)

    def audio_features(self, samples: Any) -> tuple[torch.Tensor, int]:
        """Float32 mono samples -> the valid log-mel frames (mel, L) of the model's window and L. Raises
        MediaTooLargeError beyond the window, MediaDecodeError for no or too little audio."""
        samples = np.asarray(samples, dtype=np.float32)
        if samples.ndim != 1 or samples.size == 0 or not np.isfinite(samples).all():
            raise MediaDecodeError("audio must be non-empty finite mono samples")
        rate, window_s = self.audio_cfg.sampling_rate, self.audio_cfg.chunk_length
        if samples.size > self.audio_cfg.n_samples:
            raise MediaTooLargeError(
                f"audio lasts {samples.size / rate:.2f} s; this model takes clips of at most {window_s} s"
            )
        # Qwen2.5-Omni's processor pads every clip to the window; Qwen3-Omni's to the longest clip of the call
        # (one clip here: none).
        padding = "longest" if self.qwen3 else "max_length"
        out = self.feature_extractor(
            samples, sampling_rate=rate, padding=padding, return_attention_mask=True, return_tensors="pt"
        )
        frames = int(out["attention_mask"][0].sum())
        if self.audio_tokens(frames) < 1:
            raise MediaDecodeError(
                f"audio lasts {samples.size / rate * 1000:.0f} ms, too short for this model"
            )
        return out[FEATURES][0, :, :frames].contiguous(), frames

    # -- prompt ---------------------------------------------------------------------------------------
    def interleave(self, meta: OmniMeta) -> list[tuple[str, int, int]]:
        """An audio-in-video item's rows in prompt order: ("video" | "audio", start, end) runs of each tower's
        rows, as transformers' processor and `get_rope_index` order them: Qwen2.5-Omni chunk by chunk (video
        first), Qwen3-Omni row by row by time (a video row first on a tie)."""
        video_t = self.vision_grid(meta, Modality.VIDEO)[0].tolist()
        audio_t = range(self.audio_tokens(meta.audio_frames))
        if self.qwen3:
            return time_sorted_runs(video_t, audio_t)
        video, audio = chunk_bounds(video_t, self.ids_per_chunk), chunk_bounds(audio_t, self.ids_per_chunk)
        runs = []
        for j in range(max(len(video), len(audio))):
            runs += [("video", *video[j])] if j < len(video) else []
            runs += [("audio", *audio[j])] if j < len(audio) else []
        return runs

    def vision_grid(self, meta: OmniMeta, modality: Modality) -> torch.Tensor:
        """Positions (3, tokens) of a vision grid from 0: t scaled to position ids (25 per second)."""
        t, h, w = meta.grid_thw
        m = self.spatial_merge_size
        seconds = meta.second_per_grid_t if modality == Modality.VIDEO else 1.0
        times = torch.arange(t) * float(seconds) * self.ids_per_second
        # Qwen2.5-Omni floors the times; Qwen3-Omni keeps them as float positions, which are whole numbers when
        # a grid step is a whole number of ids (`process` refuses the other videos).
        pt = times.long()
        grid = torch.stack(torch.meshgrid(pt, torch.arange(h // m), torch.arange(w // m), indexing="ij"))
        return grid.reshape(3, -1)

    def expand(self, token_ids: list[int], items: list[Any]) -> ExpandedPrompt:
        def render(item, placeholder: int) -> tuple[list[int], list[int]]:
            meta = self.meta(item.metadata)
            if item.modality != Modality.VIDEO or not meta.audio_frames:
                return [item.pad_value] * item.num_tokens, [placeholder] * item.num_tokens
            theirs = [self.audio_start_id]
            for kind, lo, hi in self.interleave(meta):
                theirs += [placeholder if kind == "video" else self.placeholders[Modality.AUDIO]] * (hi - lo)
            theirs.append(self.audio_end_id)
            return [self.audio_start_id, *[item.pad_value] * item.num_tokens, self.audio_end_id], theirs

        expanded = expand_placeholders(token_ids, items, self.placeholders, render)
        ids = expanded.token_ids
        for item in expanded.items:
            if item.modality == Modality.VIDEO and self.meta(item.metadata).audio_frames:
                before = ids[item.offset - 1] if item.offset > 0 else None
                after = ids[item.end] if item.end < len(ids) else None
                if (before, after) != (self.vision_start_id, self.vision_end_id):
                    raise ValueError(
                        f"an audio-in-video placeholder must sit between {self.vision_start_id} (<|vision_bos|>) "
                        f"and {self.vision_end_id} (<|vision_eos|>), as the chat template puts it"
                    )
        return expanded

    def positions(self, expanded: ExpandedPrompt) -> tuple[torch.Tensor, int]:
        """TMRoPE positions (3, L) and the rope delta, as transformers' `get_rope_index` (see module docstring)."""
        segments: list[torch.Tensor] = []
        cursor, pos = 0, 0
        for item in sorted(expanded.items, key=lambda it: it.offset):
            meta = self.meta(item.metadata)
            av = item.modality == Modality.VIDEO and meta.audio_frames > 0
            text_end = item.offset - 1 if av else item.offset  # the marks before an audio-in-video item
            if text_end > cursor:
                segments.append(torch.arange(text_end - cursor).view(1, -1).expand(3, -1) + pos)
                pos += text_end - cursor
            if item.modality == Modality.AUDIO:
                rows = torch.arange(item.num_tokens).view(1, -1).expand(3, -1)
            elif not av:
                rows = self.vision_grid(meta, item.modality)
            else:
                segments.append(self.av_marks(pos))  # <|vision_bos|><|audio_bos|>
                pos = int(segments[-1].max()) + 1
                rows = self.av_rows(meta)
            segments.append(rows + pos)
            pos += int(rows.max()) + 1
            cursor = item.end
            if av:
                segments.append(self.av_marks(pos))  # <|audio_eos|><|vision_eos|>
                pos, cursor = int(segments[-1].max()) + 1, item.end + 1
        return finish_positions(segments, cursor, pos, len(expanded.token_ids))

    def av_marks(self, pos: int) -> torch.Tensor:
        """Positions (3, 2) of the two begin (or end) marks around an audio-in-video item: Qwen2.5-Omni puts both
        at one position, Qwen3-Omni at two consecutive ones."""
        return torch.arange(2).view(1, -1).expand(3, -1) * int(self.qwen3) + pos

    def av_rows(self, meta: OmniMeta) -> torch.Tensor:
        """Positions (3, rows) of an audio-in-video item's rows from 0, in its interleaved order."""
        video = self.vision_grid(meta, Modality.VIDEO)
        audio = torch.arange(self.audio_tokens(meta.audio_frames)).view(1, -1).expand(3, -1)
        parts = {"video": video, "audio": audio}
        return torch.cat([parts[kind][:, lo:hi] for kind, lo, hi in self.interleave(meta)], dim=1)

    # -- weights and forward --------------------------------------------------------------------------
    def load_language_model(self, dtype: torch.dtype, attn_implementation: str) -> LanguageModel:
        text_path = "thinker.model.language_model"
        model, missing = weights.load_parts(
            self.path, self.omni_config, dtype, {text_path: attn_implementation, "thinker.lm_head": None}
        )
        text_model, lm_head = model.get_submodule(text_path), model.thinker.lm_head
        if "thinker.lm_head.weight" in missing and weights.tied_embeddings(self.hf_config):
            lm_head.weight = text_model.get_input_embeddings().weight
            missing.discard("thinker.lm_head.weight")
        if missing:
            raise ValueError(f"{self.path}: the checkpoint lacks the thinker's {sorted(missing)[:5]}")
        return LanguageModel(text_model.eval(), lm_head.eval())

    def load_tower(self, dtype: torch.dtype) -> torch.nn.Module:
        parts = {"thinker.model.visual": "sdpa", "thinker.model.audio_tower": "sdpa"}
        model, missing = weights.load_parts(self.path, self.omni_config, dtype, parts)
        if missing:
            raise ValueError(f"{self.path}: the checkpoint lacks the thinker's towers' {sorted(missing)[:5]}")
        tower = torch.nn.Module()
        tower.visual, tower.audio_tower = model.thinker.model.visual, model.thinker.model.audio_tower
        return tower.eval()

    def encode(self, tower: torch.nn.Module, batch: list[TowerInput]) -> list[dict[str, torch.Tensor]]:
        """Both towers once over the batch (pixels of every image and video, mel frames of every clip and
        audio track), then each item's rows: audio-in-video items interleaved (`interleave`); DeepStack levels
        row-aligned, zero on audio rows."""
        param = next(tower.parameters())
        metas = [self.meta(it.metadata) for it in batch]
        seen = [i for i, it in enumerate(batch) if PIXELS in it.tensors]
        heard = [i for i, it in enumerate(batch) if FEATURES in it.tensors]
        # item index -> {"video": {MAIN: rows, extras...}, "audio": {MAIN: rows, extras...}}
        parts: dict[int, dict[str, dict[str, torch.Tensor]]] = {i: {} for i in range(len(batch))}
        if seen:
            pixels = torch.cat([batch[i].tensors[PIXELS] for i in seen]).to(param.device, tower.visual.dtype)
            grid = torch.tensor([metas[i].grid_thw for i in seen], device=param.device)
            out = tower.visual(pixels, grid_thw=grid)
            sizes = [self.vision_tokens(metas[i]) for i in seen]
            levels = [torch.split(f, sizes) for f in (getattr(out, "deepstack_features", None) or [])]
            for j, (i, rows) in enumerate(zip(seen, torch.split(out.pooler_output, sizes), strict=True)):
                parts[i]["video"] = {
                    MAIN: rows,
                    **{DEEPSTACK.format(k): lv[j] for k, lv in enumerate(levels)},
                }
        if heard:
            features = torch.cat([batch[i].tensors[FEATURES] for i in heard], dim=1)
            features = features.to(param.device, param.dtype)  # (mel, all valid frames)
            lengths = torch.tensor([metas[i].audio_frames for i in heard], device=param.device)
            extra = (
                {}
                if self.qwen3
                else {"aftercnn_lens": tower.audio_tower._get_feat_extract_output_lengths(lengths)[0]}
            )
            out = tower.audio_tower(features, feature_lens=lengths, **extra).last_hidden_state
            sizes = [self.audio_tokens(metas[i].audio_frames) for i in heard]
            for i, rows in zip(heard, torch.split(out, sizes), strict=True):
                zeros = {name: rows.new_zeros(rows.shape[0], dim) for name, dim in self.extra_dims.items()}
                parts[i]["audio"] = {MAIN: rows, **zeros}
        items = []
        for i in range(len(batch)):
            runs = self.interleave(metas[i]) if len(parts[i]) == 2 else [(k, 0, None) for k in parts[i]]
            # own storage (cat copies): each item lives on in the cache on its own
            items.append(
                {
                    name: torch.cat([parts[i][kind][name][lo:hi] for kind, lo, hi in runs])
                    for name in (MAIN, *self.extra_dims)
                }
            )
        return items

    def lm_inputs(
        self, num_tokens: int, positions: torch.Tensor, rows: dict[str, torch.Tensor]
    ) -> dict[str, Any]:
        """Qwen3-Omni's DeepStack: as Qwen3-VL's (audio rows carry zero levels)."""
        mask = torch.zeros(1, num_tokens, dtype=torch.bool, device=positions.device)
        mask[0, positions] = True
        return {"visual_pos_masks": mask, "deepstack_visual_embeds": [rows[name] for name in self.extra_dims]}


def hf_generation_model(model):
    """The part of HF's Omni model that `generate`s text, for the parity oracle: the thinker."""
    return model.thinker


def hf_processor(path: str, family: Family):
    """Hugging Face's own `Qwen2_5OmniProcessor` for this checkpoint (the parity oracle's preprocessing): the
    PIL image processor, the Whisper feature extractor and HF's expansion (audio-in-video interleaving
    included). HF's video processors need torchvision, so video pixels come from our preprocessing
    (`PrecomputedVideos`, checked separately against the image processor)."""
    from transformers import (
        AutoFeatureExtractor,
        AutoTokenizer,
        Qwen2_5OmniProcessor,
        Qwen2VLImageProcessorPil,
        Qwen3OmniMoeProcessor,
    )

    from mmserve.testing.reference import PrecomputedVideos, allow_any_video_processor

    def videos(decoded: list) -> dict:
        plain = [qwen2_vl.Family.process(family, Modality.VIDEO, v, {}) for v in decoded]
        return {
            "pixel_values_videos": torch.cat([p.tensors[PIXELS] for p in plain]),
            "video_grid_thw": torch.tensor(
                [qwen2_vl.Family.meta(family, p.metadata).grid_thw for p in plain]
            ),
        }

    tokenizer = AutoTokenizer.from_pretrained(path)
    video_processor = PrecomputedVideos(
        videos, merge_size=family.cfg.merge_size, temporal_patch_size=family.cfg.temporal_patch_size
    )
    cls = Qwen3OmniMoeProcessor if family.qwen3 else Qwen2_5OmniProcessor
    with allow_any_video_processor():
        processor = cls(
            image_processor=Qwen2VLImageProcessorPil.from_pretrained(path),
            video_processor=video_processor,
            feature_extractor=AutoFeatureExtractor.from_pretrained(path),
            tokenizer=tokenizer,
            chat_template=tokenizer.chat_template,
        )
    # HF's Omni processors take the frames' sampling rate as an argument (default 2 fps for Qwen2.5-Omni, 1 for
    # Qwen3-Omni): the oracle passes the rate mmserve samples videos at.
    from mmserve.config import MediaConfig

    processor.videos_kwargs = {**cls.videos_kwargs, "fps": MediaConfig().video_fps}
    return processor
