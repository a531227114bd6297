"""Qwen2-Audio: Whisper log-mel features, the audio encoder + projector, a plain Qwen2 language model.

Audio goes through the checkpoint's own feature extractor (transformers' `WhisperFeatureExtractor`): every
clip is padded with silence to the model's window (`chunk_length` seconds; the encoder only takes exactly
that many mel frames) and its valid mel frames are counted. A clip longer than the window is refused, never
truncated. The encoder attends only to the valid frames (a padding mask built as `Qwen2AudioModel.forward`
builds it), and a clip of `L` valid frames becomes `((L - 1) // 2 + 1 - 2) // 2 + 1` LM tokens (a stride-2
convolution, then a stride-2 average pool), the rows of the projected encoder output that HF keeps.

The language model is Qwen2 with 1-D RoPE: prompt positions are sequential, no rope delta, no extras.

Checkpoint keys come in two layouts: the original one of the published checkpoints (`audio_tower.`,
`multi_modal_projector.`, `language_model.model.`, `language_model.lm_head.`) and transformers 5's
(`model.audio_tower.`, `model.multi_modal_projector.`, `model.language_model.`, `lm_head.`); both are
accepted. With tied embeddings and no head in the checkpoint, the head shares the input embedding.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import msgspec
import numpy as np
import torch

from mmserve.models import weights
from mmserve.models.family import (
    CausalLM,
    EmbeddingMismatch,
    LanguageModel,
    check_tensors,
    expand_placeholders,
)
from mmserve.models.layer_specs import layer_specs_from_hf
from mmserve.multimodal.errors import MediaDecodeError, MediaTooLargeError, UnsupportedMediaError
from mmserve.multimodal.items import MAIN, ExpandedPrompt, ItemEmbedding, Modality, TowerInput

ENCODER_PREFIXES = ("model.audio_tower.", "audio_tower.")
PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")
FEATURES = "input_features"  # a TowerInput's padded log-mel window: (num_mel_bins, window_frames)
PROBE_SECONDS = 0.1


@dataclass(frozen=True)
class AudioPreprocessConfig:
    """The feature extractor's settings that change the features (all enter the content hash)."""

    feature_extractor: str  # class name: the mel filters and the log / clamp / scale recipe
    sampling_rate: int
    feature_size: int  # mel bins
    hop_length: int
    n_fft: int
    chunk_length: int  # seconds in the window
    n_samples: int  # samples in the window
    padding_value: float
    padding_side: str
    dither: float  # > 0 adds random noise: the same bytes then give different features


class AudioMeta(msgspec.Struct, frozen=True, array_like=True):
    """What travels with a Qwen2-Audio item: its valid mel frames (the rest of the window is padding)."""

    num_frames: int


def num_audio_tokens(num_frames: int) -> int:
    """LM tokens of a clip with `num_frames` valid mel frames (HF's processor and encoder lengths)."""
    return ((num_frames - 1) // 2 + 1 - 2) // 2 + 1


def load_feature_extractor(path: str):
    from transformers import AutoFeatureExtractor

    return AutoFeatureExtractor.from_pretrained(path)


class AudioTower(torch.nn.Module):
    """`audio_tower` (Qwen2AudioEncoder) + `multi_modal_projector`, named as in the checkpoint."""

    def __init__(self, encoder: torch.nn.Module, projector: torch.nn.Module) -> None:
        super().__init__()
        self.audio_tower = encoder
        self.multi_modal_projector = projector

    def forward(self, input_features: torch.Tensor, num_frames: torch.Tensor) -> torch.Tensor:
        """input_features (B, mel, window_frames), num_frames (B,) valid frames -> (B, window_tokens, hidden).

        The padding mask is `Qwen2AudioModel.forward`'s: over the first convolution's output length.
        """
        from transformers.masking_utils import create_bidirectional_mask

        encoder = self.audio_tower
        conv_lengths, _ = encoder._get_feat_extract_output_lengths(num_frames)
        batch_size, _, window_frames = input_features.shape
        max_len = (window_frames - 2) // 2 + 1
        mask_2d = (torch.arange(max_len, device=num_frames.device)[None, :] < conv_lengths[:, None]).long()
        dummy = torch.zeros(batch_size, max_len, 1, dtype=encoder.dtype, device=input_features.device)
        mask = create_bidirectional_mask(config=encoder.config, inputs_embeds=dummy, attention_mask=mask_2d)
        hidden = encoder(input_features, attention_mask=mask).last_hidden_state  # (B, window_tokens, d_model)
        return self.multi_modal_projector(hidden)


class Family(CausalLM):
    """Qwen2-Audio (see module docstring)."""

    modalities = frozenset({Modality.AUDIO})
    position_rows = 1
    extra_dims: dict[str, int] = {}

    def __init__(self, path: str, hf_config, mm_processor_kwargs: Mapping[str, Any]) -> None:
        if mm_processor_kwargs:
            raise ValueError(
                f"unknown mm processor settings {sorted(mm_processor_kwargs)}: qwen2_audio takes "
                "its settings from the checkpoint's preprocessor_config.json"
            )
        self.path = path
        self.hf_config = hf_config
        self.model_type = hf_config.model_type
        self.feature_extractor = load_feature_extractor(path)
        fe = self.feature_extractor
        self.cfg = AudioPreprocessConfig(
            feature_extractor=type(fe).__name__,
            sampling_rate=fe.sampling_rate,
            feature_size=fe.feature_size,
            hop_length=fe.hop_length,
            n_fft=fe.n_fft,
            chunk_length=fe.chunk_length,
            n_samples=fe.n_samples,
            padding_value=fe.padding_value,
            padding_side=fe.padding_side,
            dither=fe.dither,
        )
        audio = hf_config.audio_config
        window_frames = audio.max_source_positions * 2  # the encoder's two stride-2 stages
        if fe.nb_max_frames != window_frames or fe.feature_size != audio.num_mel_bins:
            raise ValueError(
                f"{path}: the feature extractor gives {fe.feature_size} x {fe.nb_max_frames} mel "
                f"frames; the audio encoder takes {audio.num_mel_bins} x {window_frames}"
            )
        self.audio_sample_rate_hz = int(fe.sampling_rate)
        self.placeholders = {Modality.AUDIO: hf_config.audio_token_id}
        self.hidden_size = hf_config.get_text_config().hidden_size
        self.layer_specs = layer_specs_from_hf(hf_config.get_text_config())

    # -- processor ------------------------------------------------------------------------------------
    def hash_settings(self, modality: Modality, settings: Mapping[str, Any]) -> dict[str, Any]:
        if settings:
            raise UnsupportedMediaError(f"unknown item settings {sorted(settings)} for this model")
        return asdict(self.cfg)

    def meta(self, metadata: bytes) -> AudioMeta:
        return msgspec.msgpack.decode(metadata, type=AudioMeta)

    def input_pixels(self, modality: Modality, metadata: bytes) -> int:
        return 0

    def check_item(self, item: ItemEmbedding) -> None:
        try:
            num_frames = self.meta(item.metadata).num_frames
        except msgspec.DecodeError as e:
            raise EmbeddingMismatch(f"audio embedding has no valid Qwen2-Audio metadata: {e}") from e
        check_tensors(self, item, num_audio_tokens(num_frames))

    def precomputed_metadata(self, modality: Modality, fields, settings: Mapping[str, Any]) -> bytes:
        """`audio_feature_lengths`: the clip's valid mel frames (HF's feature attention mask summed), within
        the model's window and long enough for one token."""
        if settings:
            raise UnsupportedMediaError(f"unknown item settings {sorted(settings)} for this model")
        (num_frames,) = fields.ints("audio_feature_lengths", 1, "valid mel frames")
        window = self.feature_extractor.nb_max_frames
        if num_frames > window or num_audio_tokens(num_frames) < 1:
            raise fields.invalid(
                f"'audio_feature_lengths' is {num_frames}; this model takes 3 to {window} mel frames "
                f"(a {self.cfg.chunk_length} s window)"
            )
        return msgspec.msgpack.encode(AudioMeta(num_frames))

    def precomputed_fields(self, modality: Modality, metadata: bytes) -> dict[str, torch.Tensor]:
        return {"audio_feature_lengths": torch.tensor([self.meta(metadata).num_frames])}

    def process(self, modality: Modality, media: Any, settings: Mapping[str, Any]) -> TowerInput:
        """Tower input for float32 mono samples at `audio_sample_rate_hz`: the padded log-mel window and
        its valid frames. Raises MediaTooLargeError beyond the window, MediaDecodeError for no audio."""
        if settings:
            raise UnsupportedMediaError(f"unknown item settings {sorted(settings)} for this model")
        if modality != Modality.AUDIO:
            raise UnsupportedMediaError(f"{modality.value} input is not supported by this model")
        samples = np.asarray(media, dtype=np.float32)
        if samples.ndim != 1:
            raise MediaDecodeError(f"audio must be mono samples, got an array of shape {samples.shape}")
        if samples.size == 0:
            raise MediaDecodeError("audio has no samples")
        if not np.isfinite(samples).all():
            raise MediaDecodeError("audio samples are not finite numbers")
        rate, window_s = self.cfg.sampling_rate, self.cfg.chunk_length
        if samples.size > self.cfg.n_samples:
            raise MediaTooLargeError(
                f"audio lasts {samples.size / rate:.2f} s; this model takes clips of at most {window_s} s"
            )
        out = self.feature_extractor(
            samples, sampling_rate=rate, padding="max_length", return_attention_mask=True, return_tensors="pt"
        )
        num_frames = int(out["attention_mask"][0].sum())
        num_tokens = num_audio_tokens(num_frames)
        if num_tokens < 1:
            raise MediaDecodeError(
                f"audio lasts {samples.size / rate * 1000:.0f} ms, too short for this model "
                f"(it needs {3 * self.cfg.hop_length / rate * 1000:.0f} ms or more)"
            )
        features = out[FEATURES][0]  # (mel, window_frames)
        meta = msgspec.msgpack.encode(AudioMeta(num_frames))
        return TowerInput(Modality.AUDIO, {FEATURES: features}, meta, num_tokens, cost=features.shape[-1])

    def probe_item(self) -> tuple[Modality, Any]:
        return Modality.AUDIO, np.zeros(int(PROBE_SECONDS * self.audio_sample_rate_hz), dtype=np.float32)

    # -- prompt ---------------------------------------------------------------------------------------
    def expand(self, token_ids: list[int], items: list[Any]) -> ExpandedPrompt:
        return expand_placeholders(token_ids, items, self.placeholders)

    # -- weights and forward --------------------------------------------------------------------------
    def load_language_model(self, dtype: torch.dtype, attn_implementation: str) -> LanguageModel:
        return weights.load_nested_language_model(self.path, self.hf_config, dtype, attn_implementation)

    def load_tower(self, dtype: torch.dtype) -> torch.nn.Module:
        from transformers.models.qwen2_audio.modeling_qwen2_audio import (
            Qwen2AudioEncoder,
            Qwen2AudioMultiModalProjector,
        )

        encoder = weights.build_empty(self.hf_config.audio_config, dtype, "sdpa", Qwen2AudioEncoder)
        projector = Qwen2AudioMultiModalProjector(self.hf_config).to(dtype)
        for module, prefixes, what in (
            (encoder, ENCODER_PREFIXES, "audio tower"),
            (projector, PROJECTOR_PREFIXES, "audio projector"),
        ):
            weights.load_into(module, dict(weights.iter_prefixed(self.path, prefixes)), what)
        return AudioTower(encoder, projector).eval()

    def encode(self, tower: torch.nn.Module, batch: list[TowerInput]) -> list[dict[str, torch.Tensor]]:
        param = next(tower.parameters())
        features = torch.stack([it.tensors[FEATURES] for it in batch]).to(param.device, param.dtype)
        num_frames = torch.tensor([self.meta(it.metadata).num_frames for it in batch], device=param.device)
        projected = tower(features, num_frames)  # (B, window_tokens, hidden)
        # Independent storage per item: each lives on in the cache on its own.
        return [{MAIN: projected[i, : it.num_tokens].clone()} for i, it in enumerate(batch)]


def hf_processor(path: str, family: Family):
    """Hugging Face's own processor class for this checkpoint (the parity oracle's preprocessing): the
    feature extractor and HF's placeholder expansion."""
    from transformers import AutoTokenizer, Qwen2AudioProcessor

    tokenizer = AutoTokenizer.from_pretrained(path)
    return Qwen2AudioProcessor(
        feature_extractor=load_feature_extractor(path),
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
    )
