"""The offline kit's Qwen2.5-Omni / Qwen3-Omni entries: the full Omni checkpoint (thinker, and a tiny talker and
token2wav that mmserve never reads), Qwen-Omni's special tokens and chat template, and the processor files
HF's own `Qwen2_5OmniProcessor` loads (Qwen2-VL's PIL image processor, a Whisper feature extractor).

Tiny sizes: 4-second audio windows (400 mel frames, 16 bins; the audio tower attends in windows of
`2 * n_window` = 16 frames), a 2-layer vision tower of width 16, and `initializer_range=0.5` so that tokens
react to positions and media. `position_id_per_seconds` stays 25 and `seconds_per_chunk` 2, as published:
audio-in-video interleaves 2-second chunks (50 position ids each)."""

from __future__ import annotations

from mmserve.testing.kit_base import (
    _END,
    _SYSTEM,
    QWEN_TOKENS,
    KitModel,
    finish_config,
    text_config,
    tiny_only,
    token_ids,
    train_tokenizer,
)

# Qwen-Omni's names for its media tokens (the tokenizer's `image_token`, `audio_bos_token` ...).
OMNI_NAMED = {
    "image_token": "<|IMAGE|>",
    "audio_token": "<|AUDIO|>",
    "video_token": "<|VIDEO|>",
    "vision_bos_token": "<|vision_bos|>",
    "vision_eos_token": "<|vision_eos|>",
    "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>",
}
OMNI_TOKENS = QWEN_TOKENS + tuple(OMNI_NAMED.values())
# Qwen2.5-Omni's template: each item one placeholder wrapped in its begin / end tokens.
OMNI_TEMPLATE = (
    _SYSTEM + "{% if content['type'] in ('image', 'image_url') %}<|vision_bos|><|IMAGE|><|vision_eos|>"
    "{% elif content['type'] in ('video', 'video_url') %}<|vision_bos|><|VIDEO|><|vision_eos|>"
    "{% elif content['type'] in ('audio', 'input_audio', 'audio_url') %}<|audio_bos|><|AUDIO|><|audio_eos|>"
    + _END
)
AUDIO_WINDOW_S = 4
_TALKER_IDS = (
    "tts_text_start_token_id", "tts_text_end_token_id", "tts_text_pad_token_id", "tts_codec_start_token_id",
    "tts_codec_end_token_id", "tts_codec_pad_token_id", "tts_codec_mask_token_id", "vision_start_token_id",
    "vision_end_token_id", "audio_start_token_id", "audio_end_token_id",
)  # fmt: skip


def omni_tokenizer(size: str):
    tiny_only("qwen2_5_omni", size)
    return train_tokenizer(384, OMNI_TOKENS, OMNI_TEMPLATE, extra=OMNI_NAMED)


def _token_config(tokenizer) -> dict:
    ids = token_ids(tokenizer, OMNI_TOKENS)
    return dict(
        audio_token_index=ids["<|AUDIO|>"],
        image_token_index=ids["<|IMAGE|>"],
        video_token_index=ids["<|VIDEO|>"],
        audio_start_token_id=ids["<|audio_bos|>"],
        audio_end_token_id=ids["<|audio_eos|>"],
        vision_start_token_id=ids["<|vision_bos|>"],
        vision_end_token_id=ids["<|vision_eos|>"],
        user_token_id=ids["<|im_start|>"],
    )


def _audio_config(text_hidden: int) -> dict:
    return dict(
        num_mel_bins=16,
        encoder_layers=2,
        encoder_attention_heads=2,
        encoder_ffn_dim=64,
        d_model=32,
        max_source_positions=200,
        n_window=8,
        output_dim=text_hidden,
        initializer_range=0.5,
    )


def _vision_config(text_hidden: int) -> dict:
    return dict(
        depth=2,
        hidden_size=16,
        intermediate_size=32,
        num_heads=2,
        out_hidden_size=text_hidden,
        fullatt_block_indexes=[1],
        window_size=112,
        initializer_range=0.5,
    )


def save_omni_processors(out_dir: str) -> None:
    """One `preprocessor_config.json` holding the image processor's and the feature extractor's settings, as the
    published Omni checkpoints have it (each class reads its own keys)."""
    import json
    import os

    import torch
    from transformers import WhisperFeatureExtractor

    from mmserve.models.qwen2_vl import make_image_processor

    merged = json.loads(make_image_processor().to_json_string())
    fe = WhisperFeatureExtractor(
        feature_size=16, sampling_rate=16000, hop_length=160, chunk_length=AUDIO_WINDOW_S, n_fft=400
    )
    merged.update(json.loads(fe.to_json_string()))
    merged.pop("mel_filters", None)  # derived from the other settings when loaded
    merged["processor_class"] = "Qwen2_5OmniProcessor"
    with open(os.path.join(out_dir, "preprocessor_config.json"), "w") as f:
        json.dump(merged, f, indent=2)
    # transformers' Omni model reads its talker's speakers on every load (mmserve never does).
    torch.save({"Chelsie": {"bos_token": 0}}, os.path.join(out_dir, "spk_dict.pt"))


def qwen2_5_omni_kit(size: str) -> KitModel:
    from transformers import Qwen2_5OmniConfig

    tokenizer = omni_tokenizer(size)
    text = text_config(size, tokenizer, [2, 3, 3])
    hidden = text["hidden_size"]
    thinker = dict(
        text_config=text,
        audio_config=_audio_config(hidden),
        vision_config=_vision_config(hidden),
        initializer_range=0.5,
        **_token_config(tokenizer),
    )
    # A talker and token2wav as small as they build: mmserve serves the thinker and must not read them.
    talker = dict(
        vocab_size=64, embedding_size=hidden, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        # its own small vocabulary's ids (the published ones lie past it)
        **{name: 60 + i % 4 for i, name in enumerate(_TALKER_IDS)},
    )  # fmt: skip
    token2wav = dict(
        dit_config=dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, head_dim=8, emb_dim=8,
                        enc_emb_dim=8, enc_dim=8, enc_channels=[8, 8, 8, 8, 24], enc_attention_channels=8,
                        enc_se_channels=8, look_ahead_layers=[0], look_backward_layers=[0], num_embeds=64),
        bigvgan_config=dict(upsample_initial_channel=8, resblock_kernel_sizes=[3], resblock_dilation_sizes=[[1, 3, 5]],
                            upsample_rates=[2], upsample_kernel_sizes=[4]),
    )  # fmt: skip
    config = Qwen2_5OmniConfig(thinker_config=thinker, talker_config=talker, token2wav_config=token2wav)
    finish_config(config.thinker_config, tokenizer)
    return KitModel(finish_config(config, tokenizer), tokenizer, save_omni_processors)


def save_qwen3_omni_processors(out_dir: str) -> None:
    """Qwen3-Omni's: 16-pixel patches normalized around 0.5, a Whisper feature extractor (one merged file)."""
    import json
    import os

    from transformers import WhisperFeatureExtractor

    from mmserve.models.qwen2_vl import VisionPreprocessConfig, make_image_processor

    vision = VisionPreprocessConfig(patch_size=16, image_mean=(0.5,) * 3, image_std=(0.5,) * 3)
    merged = json.loads(make_image_processor(vision).to_json_string())
    fe = WhisperFeatureExtractor(
        feature_size=16, sampling_rate=16000, hop_length=160, chunk_length=AUDIO_WINDOW_S, n_fft=400
    )
    merged.update(json.loads(fe.to_json_string()))
    merged.pop("mel_filters", None)
    merged["processor_class"] = "Qwen3OmniMoeProcessor"
    with open(os.path.join(out_dir, "preprocessor_config.json"), "w") as f:
        json.dump(merged, f, indent=2)


def qwen3_omni_moe_kit(size: str) -> KitModel:
    """The thinker only (`enable_audio_output` off: its talker and code2wav are not built). A MoE language model
    (4 experts, top 2), DeepStack from the first two of three vision layers into the first two decoder layers,
    and an audio tower with Qwen3-Omni's window of 100 mel frames (13 tokens a full second)."""
    from transformers import Qwen3OmniMoeConfig

    tokenizer = omni_tokenizer(size)
    text = text_config(size, tokenizer, [2, 3, 3], head_dim=16, num_hidden_layers=3)
    text["rope_parameters"]["mrope_interleaved"] = True
    text.update(moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1)
    hidden = text["hidden_size"]
    ids = _token_config(tokenizer)
    thinker = dict(
        text_config=text,
        audio_config=dict(
            num_mel_bins=16, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32,
            max_source_positions=200, n_window=50, n_window_infer=200, downsample_hidden_size=8,
            output_dim=hidden, initializer_range=0.5,
        ),
        vision_config=dict(
            depth=3, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=16, spatial_merge_size=2,
            temporal_patch_size=2, out_hidden_size=hidden, num_position_embeddings=64,
            deepstack_visual_indexes=[0, 1], initializer_range=0.5,
        ),
        position_id_per_seconds=13,
        audio_token_id=ids["audio_token_index"],
        image_token_id=ids["image_token_index"],
        video_token_id=ids["video_token_index"],
        audio_start_token_id=ids["audio_start_token_id"],
        audio_end_token_id=ids["audio_end_token_id"],
        vision_start_token_id=ids["vision_start_token_id"],
        vision_end_token_id=ids["vision_end_token_id"],
        user_token_id=ids["user_token_id"],
        initializer_range=0.5,
    )  # fmt: skip
    config = Qwen3OmniMoeConfig(thinker_config=thinker, enable_audio_output=False)
    finish_config(config.thinker_config, tokenizer)

    def louder_deepstack(model) -> None:
        # As Qwen3-VL's kit: scaled up, the DeepStack levels change the greedy tokens.
        import torch

        with torch.no_grad():
            for merger in model.thinker.model.visual.deepstack_merger_list:
                merger.mlp[2].weight.mul_(4.0)

    return KitModel(finish_config(config, tokenizer), tokenizer, save_qwen3_omni_processors, louder_deepstack)
