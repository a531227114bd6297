"""Kit entries of Idefics3 and SmolVLM2 (`idefics3`, `smolvlm`): a SigLIP-like tower on 32 x 32 tiles
of 8 x 8 patches, pixel-shuffled by 2 into 4 tokens a tile; images resized to a longest edge of 96, so an
image is up to 3 x 3 tiles plus the global image; a Llama-style language model; the family's special
tokens (`<image>`, `<fake_token_around_image>`, `<global-img>`, `<row_i_col_j>` up to 6 x 6,
`<end_of_utterance>`, SmolVLM2's `<video>`) and SmolVLM's chat template
("User:<image>...<end_of_utterance>\\nAssistant:"); SmolVLM2's video processor config samples at most 3
frames, 2 a second."""

from __future__ import annotations

import json
import os

from mmserve.testing.kit_base import (
    QWEN_TOKENS,
    KitModel,
    finish_config,
    text_config,
    tiny_only,
    token_ids,
    train_tokenizer,
)

ROW_COL_TOKENS = tuple(f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6))
IDEFICS3_TOKENS = QWEN_TOKENS + (
    "<fake_token_around_image>",
    "<image>",
    "<global-img>",
    "<end_of_utterance>",
    "<video>",
    *ROW_COL_TOKENS,
)
# SmolVLM's template (transformers' `processing_smolvlm.DEFAULT_CHAT_TEMPLATE`), taking mmserve's part types
# too.
TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'] is string %}{{': ' + message['content']}}{% else %}"
    "{% if message['content'][0]['type'] in ('image', 'image_url') %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] in ('image', 'image_url') %}{{ '<image>' }}"
    "{% elif line['type'] in ('video', 'video_url') %}{{ '<video>' }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
TILE, PATCH, LONGEST_EDGE = 32, 8, 96
IMAGE_SEQ_LEN = (TILE // PATCH) ** 2 // 4  # pixel shuffle by 2


def idefics3_kit(arch: str, size: str) -> KitModel:
    from transformers import (
        Idefics3Config,
        Idefics3ImageProcessorPil,
        SmolVLMConfig,
        SmolVLMImageProcessorPil,
    )

    tiny_only(arch, size)
    tokenizer = train_tokenizer(384, IDEFICS3_TOKENS, TEMPLATE)
    ids = token_ids(tokenizer, IDEFICS3_TOKENS)
    text = text_config(size, tokenizer, None, model_type="llama", tie_word_embeddings=True)
    text["eos_token_id"] = ids["<end_of_utterance>"]
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=TILE,
        patch_size=PATCH,
        initializer_range=0.5,
    )
    config_cls = SmolVLMConfig if arch == "smolvlm" else Idefics3Config
    config = config_cls(
        text_config=text,
        vision_config=vision,
        scale_factor=2,
        image_token_id=ids["<image>"],
        tie_word_embeddings=True,
    )
    config = finish_config(config, tokenizer)
    config.eos_token_id = ids["<end_of_utterance>"]
    tokenizer.eos_token = "<end_of_utterance>"
    processor_cls = SmolVLMImageProcessorPil if arch == "smolvlm" else Idefics3ImageProcessorPil

    def save(out_dir: str) -> None:
        processor_cls(
            size={"longest_edge": LONGEST_EDGE}, max_image_size={"longest_edge": TILE}
        ).save_pretrained(out_dir)
        names = {"smolvlm": "SmolVLMProcessor", "idefics3": "Idefics3Processor"}
        _write_json(
            out_dir, "processor_config.json", {"processor_class": names[arch], "image_seq_len": IMAGE_SEQ_LEN}
        )
        if arch != "smolvlm":
            return
        # HF's video processor needs torchvision to be built, so its config is written as HF saves it
        # (SmolVLM2's `video_sampling` names the frame budget and the frames' longest edge).
        video = {
            "video_processor_type": "SmolVLMVideoProcessor",
            "processor_class": "SmolVLMProcessor",
            "do_resize": True,
            "size": {"longest_edge": 64},
            "max_image_size": {"longest_edge": TILE},
            "resample": 1,
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "do_convert_rgb": True,
            "do_pad": True,
            "do_sample_frames": True,
            "num_frames": 3,
            "fps": 2,
            "video_sampling": {"fps": 2, "max_frames": 3, "video_size": {"longest_edge": 64}},
        }
        _write_json(out_dir, "video_preprocessor_config.json", video)

    return KitModel(config, tokenizer, save)


def _write_json(out_dir: str, name: str, value: dict) -> None:
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(value, f, indent=2)
