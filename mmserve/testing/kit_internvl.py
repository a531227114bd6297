"""Offline kit entry for InternVL 3 / 3.5 in transformers' format (`internvl`): a tiny InternViT (32-pixel tiles in
4-pixel patches: 8 x 8 patches, 16 tokens per tile after the 0.5 pixel shuffle), its LayerNorm-MLP projector and a
Qwen2 decoder (InternVL 3's; 3.5 swaps in Qwen3, which changes nothing for serving). The tokenizer carries
InternVL's `<img>`, `</img>`, `<IMG_CONTEXT>` and `<video>` as the named tokens `InternVLProcessor` reads
(`start_image_token`, `end_image_token`, `context_image_token`, `video_token`); the chat template is the one
transformers' conversion script writes (`<IMG_CONTEXT>\\n` per image, `<video>\\n` per video) after the kit's default
system prompt. Tiling is on by default (`InternVLProcessor`'s `crop_to_patches`), at most 6 tiles (+ a thumbnail)."""

from __future__ import annotations

import json
import os

from mmserve.testing.kit_base import (
    _SYSTEM,
    QWEN_TOKENS,
    KitModel,
    finish_config,
    text_config,
    tiny_only,
    train_tokenizer,
)

INTERNVL_TOKENS = QWEN_TOKENS + ("<img>", "</img>", "<IMG_CONTEXT>", "<video>")
# The names transformers' InternVLProcessor reads from the tokenizer.
NAMED_TOKENS = {
    "start_image_token": "<img>",
    "end_image_token": "</img>",
    "context_image_token": "<IMG_CONTEXT>",
    "video_token": "<video>",
}
INTERNVL_TEMPLATE = (
    _SYSTEM + "{% if content['type'] in ('image', 'image_url') %}<IMG_CONTEXT>\n"
    "{% elif content['type'] in ('video', 'video_url') %}<video>\n"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TILE = 32  # pixels per tile side (the vision tower's image_size)
PATCH = 4
MAX_TILES = 6
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def make_internvl_tokenizer():
    return train_tokenizer(384, INTERNVL_TOKENS, INTERNVL_TEMPLATE, extra=NAMED_TOKENS)


def internvl_kit(size: str) -> KitModel:
    from transformers import GotOcr2ImageProcessorPil, InternVLConfig

    tiny_only("internvl", size)
    tokenizer = make_internvl_tokenizer()
    text = text_config(size, tokenizer, None, model_type="qwen2")
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=TILE,
        patch_size=PATCH,
        initializer_range=0.5,
    )
    seq = (TILE // PATCH) ** 2 // 4  # tokens per tile after the 0.5 pixel shuffle
    config = InternVLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>"),
        image_seq_length=seq,
        downsample_ratio=0.5,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        tie_word_embeddings=True,
    )

    def save(out_dir: str) -> None:
        # As published InternVL checkpoints: crop_to_patches off here, on in the processor's defaults.
        GotOcr2ImageProcessorPil(
            size={"height": TILE, "width": TILE}, crop_to_patches=False, min_patches=1, max_patches=MAX_TILES
        ).save_pretrained(out_dir)
        # HF's video processor needs torchvision to be built, so write its config as HF saves it.
        video = {
            "video_processor_type": "InternVLVideoProcessor",
            "size": {"height": TILE, "width": TILE},
            "do_resize": True,
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": CLIP_MEAN,
            "image_std": CLIP_STD,
            "resample": 3,
            "do_convert_rgb": True,
            "do_sample_frames": False,
        }
        processor = {"processor_class": "InternVLProcessor", "image_seq_length": seq}
        for name, value in [("video_preprocessor_config.json", video), ("processor_config.json", processor)]:
            with open(os.path.join(out_dir, name), "w") as f:
                json.dump(value, f, indent=2)

    return KitModel(finish_config(config, tokenizer), tokenizer, save)
