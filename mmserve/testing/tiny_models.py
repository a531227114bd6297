"""Offline model kit: random-weight checkpoints of every model family, with a real tokenizer.

Nothing here touches the network. A checkpoint is a config built from scratch, random weights, a byte-level
BPE tokenizer trained in milliseconds on a built-in corpus (with the family's special tokens and chat
template) and the family's preprocessor / feature-extractor configs, all saved with `save_pretrained` so
that plain transformers (`AutoModelForMultimodalLM`, `AutoTokenizer`, the family's PIL image processor or
feature extractor) and mmserve's loader read it like a downloaded model.

`KIT` has one entry per family of `mmserve.models.family.FAMILIES` (the CLI's `--arch` choices).

Sizes:
- `tiny`: well under 1 MB, for tests. `initializer_range=0.5` makes the model sensitive to positions and
  splices, so a wrong position id or a misplaced embedding row changes the greedy tokens.
- `small`: realistic proportions for CPU benchmarks (Qwen2-VL family): a Qwen2-0.5B-like LM with Qwen2-VL's
  real tokenizer (`qwen2_tokenizer.py`, 151,657 ids) and vocab_size 151,936 (embedding and untied lm_head
  rows; ids past the tokenizer decode to nothing, as in real Qwen2-VL), ~0.63 B; vision tower ~0.09 B.
"""

from __future__ import annotations

import json
import os
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


def train_tokenizer(vocab_size: int, special_tokens: tuple[str, ...], chat_template: str):
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
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(special_tokens[1:]),
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


def _ids(tokenizer, tokens: tuple[str, ...]) -> dict[str, int]:
    return {t: tokenizer.convert_tokens_to_ids(t) for t in tokens}


def _text_config(size: str, tokenizer, mrope_section: list[int] | None, **extra) -> dict:
    ids = _ids(tokenizer, QWEN_TOKENS)
    if size == "tiny":
        text = dict(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            initializer_range=0.5,
            max_position_embeddings=4096,
        )
        rope = {"rope_type": "default", "rope_theta": 10000.0}
    elif size == "small":
        # Qwen2-0.5B-like language model (24 layers, GQA 14/2).
        text = dict(
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            initializer_range=0.02,
            max_position_embeddings=32768,
        )
        rope = {"rope_type": "default", "rope_theta": 1000000.0}
    else:
        raise ValueError(f"unknown size {size!r}: expected 'tiny' or 'small'")
    if mrope_section is not None:
        # M-RoPE sections must cover half the head dim or the first forward crashes.
        rope["mrope_section"] = mrope_section if size == "tiny" else [8, 12, 12]
    text.update(
        rope_parameters=rope,
        # `small`: Qwen2-VL's logits width (lm_head rows), past its 151,657-id tokenizer.
        vocab_size=len(tokenizer) if size == "tiny" else QWEN2_VL_VOCAB_SIZE,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        **extra,
    )
    return text


def _finish(config, tokenizer):
    ids = _ids(tokenizer, QWEN_TOKENS)
    config.eos_token_id = ids["<|im_end|>"]
    config.pad_token_id = ids["<|endoftext|>"]
    return config


# -- kit entries: one per family ------------------------------------------------------------------------
def _qwen_vl(arch: str, size: str) -> KitModel:
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig

    from mmserve.models.qwen2_vl import make_image_processor

    tokenizer = make_tokenizer(size)
    ids = _ids(tokenizer, SPECIAL_TOKENS)
    text = _text_config(size, tokenizer, [2, 3, 3])
    width = 16 if size == "tiny" else 768
    vision = (
        dict(depth=2, num_heads=2, initializer_range=0.5)
        if size == "tiny"
        else dict(depth=12, num_heads=12, initializer_range=0.02)
    )  # ~ViT-B
    if arch == "qwen2_vl":
        vision.update(embed_dim=width, hidden_size=text["hidden_size"], mlp_ratio=4)
        config_cls = Qwen2VLConfig
    else:
        vision.update(
            hidden_size=width,
            out_hidden_size=text["hidden_size"],
            intermediate_size=width * 2,
            fullatt_block_indexes=[vision["depth"] - 1],
            window_size=112,
            tokens_per_second=2,
        )
        config_cls = Qwen2_5_VLConfig
    config = config_cls(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=(size == "tiny"),
    )
    return KitModel(
        _finish(config, tokenizer), tokenizer, lambda d: make_image_processor().save_pretrained(d)
    )


QWEN3_NORM = dict(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3)


def _save_qwen3_processors(out_dir: str) -> None:
    from transformers import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    Qwen2VLImageProcessorPil(
        size={"shortest_edge": 32 * 32, "longest_edge": 256 * 32 * 32}, **QWEN3_NORM
    ).save_pretrained(out_dir)
    Qwen3VLVideoProcessor(
        size={"shortest_edge": 4 * 32 * 32, "longest_edge": 64 * 32 * 32}, **QWEN3_NORM
    ).save_pretrained(out_dir)


def _qwen3_vision(hidden: int, **extra) -> dict:
    """The tiny Qwen3-VL / Qwen3.5 tower: 16-pixel patches merged 2x2 into `hidden`-wide rows."""
    return dict(
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=hidden,
        num_position_embeddings=64,
        initializer_range=0.5,
        **extra,
    )


def _qwen_vl_ids(config_cls, tokenizer, text: dict, vision: dict, **extra):
    ids = _ids(tokenizer, SPECIAL_TOKENS)
    return config_cls(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        **extra,
    )


def _qwen3_vl(arch: str, size: str) -> KitModel:
    from transformers import Qwen3VLConfig, Qwen3VLMoeConfig

    _tiny_only(arch, size)
    tokenizer = make_tokenizer(size)
    # Three decoder layers and DeepStack into the first two: dropping the features or shifting them by a
    # layer changes the tokens (a negative control).
    text = _text_config(size, tokenizer, [2, 3, 3], head_dim=16, num_hidden_layers=3)
    text["rope_parameters"]["mrope_interleaved"] = True
    if arch == "qwen3_vl_moe":  # every layer a sparse MoE block: 4 experts, top 2 (a negative control flips k)
        text.update(moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1)
    vision = _qwen3_vision(text["hidden_size"], depth=3, deepstack_visual_indexes=[0, 1])
    config_cls = Qwen3VLMoeConfig if arch == "qwen3_vl_moe" else Qwen3VLConfig
    config = _qwen_vl_ids(config_cls, tokenizer, text, vision, tie_word_embeddings=True)

    def louder_deepstack(model) -> None:
        # With the random init, the decoder's residual stream dwarfs the DeepStack levels and the greedy tokens
        # hardly depend on them; scaled up, dropping or moving them changes the tokens (negative controls).
        import torch

        with torch.no_grad():
            for merger in model.model.visual.deepstack_merger_list:
                merger.linear_fc2.weight.mul_(4.0)

    return KitModel(_finish(config, tokenizer), tokenizer, _save_qwen3_processors, louder_deepstack)


# Qwen3.5's hybrid stack in miniature: Gated DeltaNet (linear attention with a conv window and a recurrent state)
# around one full-attention layer, whose gated attention rotates a quarter of its head (interleaved M-RoPE).
QWEN3_5_LAYERS = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]


def _qwen3_5(arch: str, size: str) -> KitModel:
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig

    tokenizer = make_tokenizer(size)
    if size == "tiny":
        text = _text_config(size, tokenizer, [2, 1, 1], head_dim=32, num_hidden_layers=4)
        text.update(
            layer_types=QWEN3_5_LAYERS,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
        )
        vision = _qwen3_vision(text["hidden_size"], depth=2)
    else:  # Qwen3.5-0.8B's language model (24 layers, 3 of 4 linear), Qwen2-VL's tokenizer
        text = _text_config(size, tokenizer, [11, 11, 10], head_dim=256, num_hidden_layers=24)
        text.update(
            hidden_size=1024,
            intermediate_size=3584,
            num_attention_heads=8,
            num_key_value_heads=2,
            layer_types=[("full_attention" if (i + 1) % 4 == 0 else "linear_attention") for i in range(24)],
            linear_num_key_heads=16,
            linear_num_value_heads=16,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
        )
        vision = dict(
            depth=12, hidden_size=768, intermediate_size=3072, num_heads=12, patch_size=16, spatial_merge_size=2,
            temporal_patch_size=2, out_hidden_size=1024, num_position_embeddings=2304, initializer_range=0.02,
        )  # fmt: skip
    text["rope_parameters"].update(mrope_interleaved=True, partial_rotary_factor=0.25)
    if arch == "qwen3_5_moe":  # a routed MoE block (4 experts, top 2) and a gated shared expert in every layer
        text.pop("intermediate_size")
        width = 24 if size == "tiny" else 512
        text.update(
            moe_intermediate_size=width, shared_expert_intermediate_size=width, num_experts=4, num_experts_per_tok=2
        )
    config_cls = Qwen3_5MoeConfig if arch == "qwen3_5_moe" else Qwen3_5Config
    config = _qwen_vl_ids(config_cls, tokenizer, text, vision, tie_word_embeddings=(size == "tiny"))
    return KitModel(_finish(config, tokenizer), tokenizer, _save_qwen3_processors, _long_memory)


def _long_memory(model) -> None:
    """Slow decays for the Gated DeltaNet layers. transformers draws A from U(0, 16): a tiny model's recurrent
    state then forgets a token within one step (decay e^-10), and nothing but the last few tokens (the conv
    window) reaches the output; with A in [0.02, 0.2] the state carries the whole prompt, so a state dropped,
    stale or not carried over changes the tokens (the negative controls)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "A_log") and hasattr(module, "dt_bias"):
                a = torch.empty(module.A_log.shape).uniform_(0.02, 0.2, generator=generator)
                module.A_log.copy_(a.log())
                module.dt_bias.zero_()


LLAVA_TOKENS = QWEN_TOKENS + ("<image>", "<video>")
LLAVA_PINPOINTS = [[32, 32], [32, 64], [64, 32], [64, 64], [32, 96], [96, 32]]


def _llava_onevision(size: str) -> KitModel:
    from transformers import LlavaOnevisionConfig, LlavaOnevisionImageProcessorPil

    _tiny_only("llava_onevision", size)
    tokenizer = make_tokenizer(size, LLAVA_TOKENS, LLAVA_TEMPLATE)
    ids = _ids(tokenizer, LLAVA_TOKENS)
    text = _text_config(size, tokenizer, None, model_type="qwen2")
    # SigLIP tiles of 32x32 pixels in 8x8 patches: 16 tokens per tile.
    vision = dict(
        model_type="siglip_vision_model",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
    )
    config = LlavaOnevisionConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<image>"],
        video_token_id=ids["<video>"],
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
        image_grid_pinpoints=LLAVA_PINPOINTS,
        vision_aspect_ratio="anyres_max_9",
        tie_word_embeddings=True,
    )

    def save(out_dir: str) -> None:
        LlavaOnevisionImageProcessorPil(
            size={"height": 32, "width": 32},
            image_grid_pinpoints=LLAVA_PINPOINTS,
            crop_size={"height": 32, "width": 32},
        ).save_pretrained(out_dir)
        # HF's video processor needs torchvision to be built, so write its config as HF saves it.
        video = {
            "video_processor_type": "LlavaOnevisionVideoProcessor",
            "size": {"height": 32, "width": 32},
            "do_resize": True,
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": [0.48145466, 0.4578275, 0.40821073],
            "image_std": [0.26862954, 0.26130258, 0.27577711],
            "resample": 3,
            "do_convert_rgb": True,
            "do_sample_frames": False,
        }
        _write_json(out_dir, "video_preprocessor_config.json", video)
        _write_json(
            out_dir,
            "processor_config.json",
            {
                "processor_class": "LlavaOnevisionProcessor",
                "num_image_tokens": 16,
                "vision_feature_select_strategy": "full",
                "vision_aspect_ratio": "anyres_max_9",
            },
        )

    return KitModel(_finish(config, tokenizer), tokenizer, save)


AUDIO_TOKENS = QWEN_TOKENS + ("<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>")


def _qwen2_audio(size: str) -> KitModel:
    from transformers import Qwen2AudioConfig, WhisperFeatureExtractor

    _tiny_only("qwen2_audio", size)
    tokenizer = make_tokenizer(size, AUDIO_TOKENS, AUDIO_TEMPLATE)
    ids = _ids(tokenizer, AUDIO_TOKENS)
    text = _text_config(size, tokenizer, None, model_type="qwen2")
    # 16 mel bins, 2-second windows (200 frames at a 10 ms hop): one second of audio is 25 LM tokens.
    audio = dict(
        d_model=32,
        encoder_layers=2,
        encoder_attention_heads=2,
        encoder_ffn_dim=64,
        num_mel_bins=16,
        max_source_positions=100,
        initializer_range=0.5,
    )
    config = Qwen2AudioConfig(
        text_config=text, audio_config=audio, audio_token_index=ids["<|AUDIO|>"], tie_word_embeddings=True
    )

    def save(out_dir: str) -> None:
        WhisperFeatureExtractor(
            feature_size=16, sampling_rate=16000, hop_length=160, chunk_length=2, n_fft=400
        ).save_pretrained(out_dir)

    return KitModel(_finish(config, tokenizer), tokenizer, save)


KIT: dict[str, Callable[[str], KitModel]] = {
    "qwen2_vl": lambda size: _qwen_vl("qwen2_vl", size),
    "qwen2_5_vl": lambda size: _qwen_vl("qwen2_5_vl", size),
    "qwen3_vl": lambda size: _qwen3_vl("qwen3_vl", size),
    "qwen3_vl_moe": lambda size: _qwen3_vl("qwen3_vl_moe", size),
    "qwen3_5": lambda size: _qwen3_5("qwen3_5", size),
    "qwen3_5_moe": lambda size: _qwen3_5("qwen3_5_moe", size),
    "llava_onevision": _llava_onevision,
    "qwen2_audio": _qwen2_audio,
}


def _tiny_only(arch: str, size: str) -> None:
    if size != "tiny":
        raise ValueError(f"the kit builds {arch} in size 'tiny' only")


def _write_json(out_dir: str, name: str, value: dict) -> None:
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(value, f, indent=2)


def make_hf_config(arch: str, size: str):
    """The transformers config of a kit model."""
    return KIT[arch](size).config


def build_tiny_model(
    out_dir: str,
    arch: str = "qwen2_vl",
    size: str = "tiny",
    seed: int = 0,
    edit_config: Callable[[object], None] | None = None,
) -> str:
    """Build and save a random-weight checkpoint in `out_dir`; returns `out_dir`. Deterministic in `seed`.
    `edit_config` may change the HF config first (tests build "another model" of the same family)."""
    import torch
    from transformers import AutoModelForMultimodalLM

    from mmserve.models.family import FAMILIES

    if arch not in KIT or arch not in FAMILIES:
        raise ValueError(f"unknown arch {arch!r}; the kit builds {sorted(KIT)}")
    kit = KIT[arch](size)
    if edit_config is not None:
        edit_config(kit.config)
    torch.manual_seed(seed)
    model = AutoModelForMultimodalLM.from_config(kit.config, dtype=torch.float32)
    kit.edit_weights(model)
    model.generation_config.eos_token_id = kit.config.eos_token_id
    model.generation_config.pad_token_id = kit.config.pad_token_id
    os.makedirs(out_dir, exist_ok=True)
    if (
        size == "small"
    ):  # stored in bf16 like published Qwen checkpoints: `--dtype auto` runs it in bf16 on AMX
        model = model.to(torch.bfloat16)
    model.save_pretrained(out_dir)
    kit.tokenizer.save_pretrained(out_dir)
    kit.save_processors(out_dir)
    _write_json(out_dir, "mmserve_kit.json", {"arch": arch, "size": size, "seed": seed})
    return out_dir


def ensure_tiny_model(out_dir: str, arch: str = "qwen2_vl", size: str = "tiny", seed: int = 0) -> str:
    """Build the checkpoint unless `out_dir` already holds one made with the same spec."""
    marker = os.path.join(out_dir, "mmserve_kit.json")
    if os.path.exists(marker):
        with open(marker) as f:
            if json.load(f) == {"arch": arch, "size": size, "seed": seed}:
                return out_dir
    return build_tiny_model(out_dir, arch=arch, size=size, seed=seed)
