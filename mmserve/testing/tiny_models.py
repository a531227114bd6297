"""Offline model kit: random-weight Qwen2-VL / Qwen2.5-VL checkpoints with a real tokenizer.

Nothing here touches the network. A checkpoint is a config built from scratch, random weights, a byte-level
BPE tokenizer trained in milliseconds on a built-in corpus (with the Qwen2-VL special tokens and chat
template) and a PIL image processor config, all saved with `save_pretrained` so that plain transformers
and mmserve's loader read it like a downloaded model.

Sizes:
- `tiny`: well under 1 MB, for tests. `initializer_range=0.5` makes the model sensitive to positions and
  splices, so a wrong position id or a misplaced embedding row changes the greedy tokens.
- `small`: realistic proportions (LM ~0.37 B, vision tower ~0.09 B) for CPU benchmarks.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# The Qwen2-VL chat template: one <|image_pad|> / <|video_pad|> placeholder per item, wrapped in
# vision_start / vision_end; a default system prompt when none is given.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] in ('video', 'video_url') %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = [
    "Describe the image in one sentence.",
    "What is in this picture? There is a red square on a blue background.",
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "A cat sits on the mat and looks at the camera with green eyes.",
    "How many objects are in the photo? I count three apples and two oranges.",
    "You are a helpful assistant. Answer briefly and precisely.",
    "Compare the two images and tell me what changed between them.",
    "The video shows a person walking through a park in the morning.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Colors: red green blue yellow black white.",
]


@dataclass(frozen=True)
class TinyModelSpec:
    arch: str
    size: str
    seed: int = 0


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _text_and_vision_config(arch: str, size: str) -> tuple[dict, dict]:
    if size == "tiny":
        text = dict(
            hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, initializer_range=0.5, max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        )  # fmt: skip
        vision = dict(depth=2, num_heads=2, initializer_range=0.5)
        width = 16
    elif size == "small":
        # Qwen2-0.5B-like language model (24 layers, GQA 14/2) and a ~ViT-B vision tower.
        text = dict(
            hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
            num_key_value_heads=2, initializer_range=0.02, max_position_embeddings=32768,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [8, 12, 12]},
        )  # fmt: skip
        vision = dict(depth=12, num_heads=12, initializer_range=0.02)
        width = 768
    else:
        raise ValueError(f"unknown size {size!r}: expected 'tiny' or 'small'")
    if arch == "qwen2_vl":
        vision.update(embed_dim=width, hidden_size=text["hidden_size"], mlp_ratio=4)
    elif arch == "qwen2_5_vl":
        vision.update(
            hidden_size=width, out_hidden_size=text["hidden_size"], intermediate_size=width * 2,
            fullatt_block_indexes=[vision["depth"] - 1], window_size=112, tokens_per_second=2,
        )  # fmt: skip
    else:
        raise ValueError(f"unknown arch {arch!r}: expected 'qwen2_vl' or 'qwen2_5_vl'")
    return text, vision


def make_hf_config(arch: str, size: str, tokenizer):
    """The transformers config of a kit model whose special token ids come from `tokenizer`."""
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text, vision = _text_and_vision_config(arch, size)
    config_cls = Qwen2VLConfig if arch == "qwen2_vl" else Qwen2_5_VLConfig
    config = config_cls(
        text_config=dict(
            text, vocab_size=len(tokenizer), bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"]
        ),
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=(size == "tiny"),
    )
    config.eos_token_id = ids["<|im_end|>"]
    config.pad_token_id = ids["<|endoftext|>"]
    return config


def make_tokenizer(size: str):
    return _train_tokenizer(384 if size == "tiny" else 8192)


def build_tiny_model(out_dir: str, arch: str = "qwen2_vl", size: str = "tiny", seed: int = 0) -> str:
    """Build and save a random-weight checkpoint in `out_dir`; returns `out_dir`. Deterministic in `seed`."""
    import torch
    from transformers import AutoModelForImageTextToText

    from mmserve.multimodal.processors.qwen2_vl import make_image_processor

    tokenizer = make_tokenizer(size)
    config = make_hf_config(arch, size, tokenizer)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    make_image_processor().save_pretrained(out_dir)
    with open(os.path.join(out_dir, "mmserve_kit.json"), "w") as f:
        json.dump({"arch": arch, "size": size, "seed": seed}, f)
    return out_dir


def ensure_tiny_model(out_dir: str, arch: str = "qwen2_vl", size: str = "tiny", seed: int = 0) -> str:
    """Build the checkpoint unless `out_dir` already holds one made with the same spec."""
    marker = os.path.join(out_dir, "mmserve_kit.json")
    if os.path.exists(marker):
        with open(marker) as f:
            if json.load(f) == {"arch": arch, "size": size, "seed": seed}:
                return out_dir
    return build_tiny_model(out_dir, arch=arch, size=size, seed=seed)
