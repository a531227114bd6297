"""Offline kit entry for MiniCPM-V 4.6 (`minicpmv4_6`): Qwen3.5's hybrid language model in miniature (Gated
DeltaNet around one full-attention layer, slow decays so the state matters) under a NaViT-style ViT whose
window-attention merger sits after its middle layer, then the 2x2 merger. 4-pixel patches and a 32-pixel slice
resolution: a 64 x 48 image becomes a 32 x 32 overview and a 2 x 2 grid of 32 x 32 slices, 4 tokens each."""

from __future__ import annotations

from mmserve.testing.kit_base import (
    QWEN_TOKENS,
    KitModel,
    finish_config,
    text_config,
    tiny_only,
    token_ids,
    train_tokenizer,
)
from mmserve.testing.kit_qwen3 import QWEN3_5_LAYERS, _long_memory

# The tokenizer's named media tokens, as MiniCPM-V 4.6's tokenizer config names them (the processor reads them).
MEDIA_TOKENS = {
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "image_start_token": "<image>",
    "image_end_token": "</image>",
    "slice_start_token": "<slice>",
    "slice_end_token": "</slice>",
    "image_id_start_token": "<image_id>",
    "image_id_end_token": "</image_id>",
}
TOKENS = QWEN_TOKENS + tuple(MEDIA_TOKENS.values())
# Qwen chat format; one bare <|image_pad|> / <|video_pad|> per item (the processor writes the rest around it).
TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] in ('image', 'image_url') %}<|image_pad|>"
    "{% elif content['type'] in ('video', 'video_url') %}<|video_pad|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PATCH = 4
SLICE_RESOLUTION = 32


def minicpmv4_6_kit(size: str) -> KitModel:
    from transformers import MiniCPMV4_6Config

    tiny_only("minicpmv4_6", size)
    tokenizer = train_tokenizer(384, TOKENS, TEMPLATE, extra=dict(MEDIA_TOKENS))
    ids = token_ids(tokenizer, TOKENS)
    text = text_config(
        size, tokenizer, [2, 1, 1], head_dim=32, num_hidden_layers=4, model_type="qwen3_5_text"
    )
    text.update(
        layer_types=QWEN3_5_LAYERS,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
    )
    text["rope_parameters"].update(mrope_interleaved=True, partial_rotary_factor=0.25)
    # Three ViT layers, the window-attention merger after the middle one (`insert_layer_id`).
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        image_size=SLICE_RESOLUTION,
        patch_size=PATCH,
        initializer_range=0.5,
    )
    config = MiniCPMV4_6Config(
        text_config=text,
        vision_config=vision,
        insert_layer_id=1,
        image_size=SLICE_RESOLUTION,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        tie_word_embeddings=True,
        initializer_range=0.5,
    )

    def save(out_dir: str) -> None:
        from transformers import MiniCPMV4_6ImageProcessorPil
        from transformers.models.minicpmv4_6.video_processing_minicpmv4_6 import MiniCPMV4_6VideoProcessor

        common = dict(patch_size=PATCH, scale_resolution=SLICE_RESOLUTION)
        MiniCPMV4_6ImageProcessorPil(**common).save_pretrained(out_dir)
        # Frames slice into at most 2 (a 64 x 48 frame: overview + 1 x 2 slices), images into 9.
        MiniCPMV4_6VideoProcessor(**common, max_slice_nums=2, do_sample_frames=False).save_pretrained(out_dir)

    return KitModel(finish_config(config, tokenizer), tokenizer, save, _long_memory)
