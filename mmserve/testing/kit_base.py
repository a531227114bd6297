"""The offline model kit's common parts: the Qwen-style special tokens and chat templates, a byte-level BPE
tokenizer trained in milliseconds on a built-in corpus (or, for `small`, Qwen2-VL's real one), the Qwen2
text config of each size, and what a kit entry returns (`KitModel`). The entries are in `tiny_models.py`
(the 2024-25 families) and `kit_qwen3.py` (Qwen3-VL, Qwen3.5 and their MoE forms)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

QWEN_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
SPECIAL_TOKENS = QWEN_TOKENS + VISION_TOKENS  # the Qwen-VL families'
QWEN2_VL_VOCAB_SIZE = 151_936

_SYSTEM = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% set ns = namespace(audio=0) %}{% for content in message['content'] %}"
)
_END = (
    "{% elif content['type'] == 'text' %}{{ content['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The Qwen-VL template: one <|image_pad|> / <|video_pad|> placeholder per item, wrapped in vision_start /
# vision_end; a default system prompt when none is given.
CHAT_TEMPLATE = (
    _SYSTEM + "{% if content['type'] in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] in ('video', 'video_url') %}<|vision_start|><|video_pad|><|vision_end|>" + _END
)
# LLaVA-OneVision (Qwen2 chat format): "<image>\n" / "<video>\n" per item.
LLAVA_TEMPLATE = (
    _SYSTEM + "{% if content['type'] in ('image', 'image_url') %}<image>\n"
    "{% elif content['type'] in ('video', 'video_url') %}<video>\n" + _END
)
# Qwen2-Audio: "Audio N: <|audio_bos|><|AUDIO|><|audio_eos|>\n" per clip.
AUDIO_TEMPLATE = (
    _SYSTEM
    + "{% if content['type'] in ('audio', 'input_audio', 'audio_url') %}{% set ns.audio = ns.audio + 1 %}"
    "Audio {{ ns.audio }}: <|audio_bos|><|AUDIO|><|audio_eos|>\n" + _END
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
    "Audio 1: what sound is this? A bell rings for 1.5 seconds, then <0.5 seconds> of silence.",
]


@dataclass
class KitModel:
    """What a kit entry gives: the HF config (special token ids from `tokenizer`), the tokenizer, and a
    function saving the family's preprocessor / feature-extractor files into a directory."""

    config: object
    tokenizer: object
    save_processors: Callable[[str], None] = field(default=lambda out_dir: None)
    edit_weights: Callable[[object], None] = field(default=lambda model: None)  # after random init


def train_tokenizer(
    vocab_size: int,
    special_tokens: tuple[str, ...],
    chat_template: str,
    extra: dict[str, str] | None = None,
    eos_token: str = "<|im_end|>",
):
    """A byte-level BPE trained in milliseconds; `special_tokens[0]` pads. `extra`: named special tokens
    (`extra_special_tokens`: the tokenizer's `<name>` and `<name>_id`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    tok.add_special_tokens(list(special_tokens))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=eos_token,
        pad_token=special_tokens[0],
        additional_special_tokens=list(special_tokens[1:]),
        **({"extra_special_tokens": extra} if extra else {}),
    )
    fast.chat_template = chat_template
    return fast


def make_tokenizer(
    size: str, special_tokens: tuple[str, ...] = SPECIAL_TOKENS, chat_template: str = CHAT_TEMPLATE
):
    if size == "tiny":
        return train_tokenizer(384, special_tokens, chat_template)
    from mmserve.testing.qwen2_tokenizer import qwen2_tokenizer

    return qwen2_tokenizer(special_tokens, chat_template)


def token_ids(tokenizer, tokens: tuple[str, ...]) -> dict[str, int]:
    return {t: tokenizer.convert_tokens_to_ids(t) for t in tokens}


# The language model of each size: (hidden, intermediate, layers, heads, KV heads, init range, max positions,
# RoPE theta). small: Qwen2-0.5B-like (GQA 14/2); 2b: Qwen2-VL-2B's (GQA 12/2, head size 128), a compute-sized kit
# model for TTFT benchmarks against peers; 7b: Qwen2.5-VL-7B's (GQA 28/4, head size 128), a memory-sized kit model
# for bench runs (`--quantization int4` on a 24 GB machine). Neither 2b nor 7b is ever built by the tests.
TEXT_SIZES = {
    "tiny": (64, 96, 2, 4, 2, 0.5, 4096, 10000.0),
    "small": (896, 4864, 24, 14, 2, 0.02, 32768, 1000000.0),
    "2b": (1536, 8960, 28, 12, 2, 0.02, 32768, 1000000.0),
    "7b": (3584, 18944, 28, 28, 4, 0.02, 128000, 1000000.0),
}
SIZES = tuple(TEXT_SIZES)


def text_config(size: str, tokenizer, mrope_section: list[int] | None, **extra) -> dict:
    ids = token_ids(tokenizer, QWEN_TOKENS)
    if size not in TEXT_SIZES:
        raise ValueError(f"unknown size {size!r}: expected one of {', '.join(SIZES)}")
    hidden, intermediate, layers, heads, kv_heads, init, positions, theta = TEXT_SIZES[size]
    text = dict(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        initializer_range=init,
        max_position_embeddings=positions,
    )
    rope = {"rope_type": "default", "rope_theta": theta}
    if mrope_section is not None:
        # M-RoPE sections must cover half the head dim or the first forward crashes.
        rope["mrope_section"] = {
            "tiny": mrope_section,
            "small": [8, 12, 12],
            "2b": [16, 24, 24],
            "7b": [16, 24, 24],
        }[size]
    text.update(
        rope_parameters=rope,
        # `small`, `2b`: Qwen2-VL's logits width (lm_head rows), past its 151,657-id tokenizer; `7b`: Qwen2.5-VL-7B's.
        vocab_size={"tiny": len(tokenizer), "7b": 152064}.get(size, QWEN2_VL_VOCAB_SIZE),
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        **extra,
    )
    return text


def finish_config(config, tokenizer):
    ids = token_ids(tokenizer, QWEN_TOKENS)
    config.eos_token_id = ids["<|im_end|>"]
    config.pad_token_id = ids["<|endoftext|>"]
    return config


def qwen_vl_config(config_cls, tokenizer, text: dict, vision: dict, **extra):
    """A Qwen-VL family's config over `text` and `vision`, with its vision special tokens' ids."""
    ids = token_ids(tokenizer, SPECIAL_TOKENS)
    return config_cls(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        **extra,
    )


def tiny_only(arch: str, size: str) -> None:
    if size != "tiny":
        raise ValueError(f"the kit builds {arch} in size 'tiny' only")
