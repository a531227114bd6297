"""Offline model kit: random-weight checkpoints of every model family, with a real tokenizer.

Nothing here touches the network. A checkpoint is a config built from scratch, random weights, a byte-level
BPE tokenizer trained in milliseconds on a built-in corpus (with the family's special tokens and chat
template) and the family's preprocessor / feature-extractor configs, all saved with `save_pretrained` so
that plain transformers (`AutoModelForMultimodalLM`, `AutoTokenizer`, the family's PIL image processor or
feature extractor) and mmserve's loader read it like a downloaded model.

The entries of the Qwen3 generation (Qwen3-VL, Qwen3.5 and their MoE forms) are in `kit_qwen3.py`, the parts
every entry shares in `kit_base.py`. `KIT` has one entry per family of `mmserve.models.family.FAMILIES` (the
CLI's `--arch` choices).

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

from mmserve.testing.kit_base import (
    AUDIO_TEMPLATE,
    LLAVA_TEMPLATE,
    QWEN_TOKENS,
    KitModel,
    finish_config,
    make_tokenizer,
    qwen_vl_config,
    text_config,
    tiny_only,
    token_ids,
)
from mmserve.testing.kit_gemma import gemma3_kit, gemma4_kit
from mmserve.testing.kit_glm4v import glm4v_kit
from mmserve.testing.kit_idefics3 import idefics3_kit
from mmserve.testing.kit_internvl import internvl_kit
from mmserve.testing.kit_minicpmv4_6 import minicpmv4_6_kit
from mmserve.testing.kit_mistral3 import mistral3_kit
from mmserve.testing.kit_qwen3 import qwen3_5_kit, qwen3_vl_kit
from mmserve.testing.kit_qwen_omni import qwen2_5_omni_kit, qwen3_omni_moe_kit


# -- kit entries: one per family ------------------------------------------------------------------------
def _qwen_vl(arch: str, size: str) -> KitModel:
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig

    from mmserve.models.qwen2_vl import make_image_processor

    tokenizer = make_tokenizer(size)
    text = text_config(size, tokenizer, [2, 3, 3])
    width = {"tiny": 16, "small": 768, "2b": 1280, "7b": 1280}[size]
    vision = {
        "tiny": dict(depth=2, num_heads=2, initializer_range=0.5),
        "small": dict(depth=12, num_heads=12, initializer_range=0.02),  # ~ViT-B
        "2b": dict(depth=32, num_heads=16, initializer_range=0.02),  # Qwen2-VL-2B's tower (675 M)
        "7b": dict(depth=32, num_heads=16, initializer_range=0.02),  # Qwen2.5-VL-7B's tower
    }[size]
    if arch == "qwen2_vl":
        vision.update(embed_dim=width, hidden_size=text["hidden_size"], mlp_ratio=4)
        config_cls = Qwen2VLConfig
    else:
        vision.update(
            hidden_size=width,
            out_hidden_size=text["hidden_size"],
            intermediate_size=3420 if size == "7b" else width * 2,
            fullatt_block_indexes=[7, 15, 23, 31] if size == "7b" else [vision["depth"] - 1],
            window_size=112,
            tokens_per_second=2,
        )
        config_cls = Qwen2_5_VLConfig
    # Qwen2-VL-2B ties its embeddings, as the tiny models do
    config = qwen_vl_config(config_cls, tokenizer, text, vision, tie_word_embeddings=size in ("tiny", "2b"))
    return KitModel(
        finish_config(config, tokenizer), tokenizer, lambda d: make_image_processor().save_pretrained(d)
    )



# Sizes with one real checkpoint's shapes: Qwen2-VL-2B's and Qwen2.5-VL-7B's.
ONE_FAMILY_SIZES = {"2b": "qwen2_vl", "7b": "qwen2_5_vl"}

LLAVA_TOKENS = QWEN_TOKENS + ("<image>", "<video>")
LLAVA_PINPOINTS = [[32, 32], [32, 64], [64, 32], [64, 64], [32, 96], [96, 32]]


def _llava_onevision(size: str) -> KitModel:
    from transformers import LlavaOnevisionConfig, LlavaOnevisionImageProcessorPil

    tiny_only("llava_onevision", size)
    tokenizer = make_tokenizer(size, LLAVA_TOKENS, LLAVA_TEMPLATE)
    ids = token_ids(tokenizer, LLAVA_TOKENS)
    text = text_config(size, tokenizer, None, model_type="qwen2")
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

    return KitModel(finish_config(config, tokenizer), tokenizer, save)


AUDIO_TOKENS = QWEN_TOKENS + ("<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>")


def _qwen2_audio(size: str) -> KitModel:
    from transformers import Qwen2AudioConfig, WhisperFeatureExtractor

    tiny_only("qwen2_audio", size)
    tokenizer = make_tokenizer(size, AUDIO_TOKENS, AUDIO_TEMPLATE)
    ids = token_ids(tokenizer, AUDIO_TOKENS)
    text = text_config(size, tokenizer, None, model_type="qwen2")
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

    return KitModel(finish_config(config, tokenizer), tokenizer, save)


KIT: dict[str, Callable[[str], KitModel]] = {
    "qwen2_vl": lambda size: _qwen_vl("qwen2_vl", size),
    "qwen2_5_vl": lambda size: _qwen_vl("qwen2_5_vl", size),
    "qwen3_vl": lambda size: qwen3_vl_kit("qwen3_vl", size),
    "qwen3_vl_moe": lambda size: qwen3_vl_kit("qwen3_vl_moe", size),
    "qwen3_5": lambda size: qwen3_5_kit("qwen3_5", size),
    "qwen3_5_moe": lambda size: qwen3_5_kit("qwen3_5_moe", size),
    "llava_onevision": _llava_onevision,
    "qwen2_audio": _qwen2_audio,
    "qwen2_5_omni": qwen2_5_omni_kit,
    "qwen3_omni_moe": qwen3_omni_moe_kit,
    "gemma3": gemma3_kit,
    "gemma4": gemma4_kit,
    "idefics3": lambda size: idefics3_kit("idefics3", size),
    "smolvlm": lambda size: idefics3_kit("smolvlm", size),
    "mistral3": mistral3_kit,
    "internvl": internvl_kit,
    "minicpmv4_6": minicpmv4_6_kit,
    "glm4v": lambda size: glm4v_kit("glm4v", size),
    "glm4v_moe": lambda size: glm4v_kit("glm4v_moe", size),
}
# The families the kit also builds as thinking models (`thinking=True`: kit_qwen3.py).
THINKING_KIT: dict[str, Callable[[str], KitModel]] = {
    "qwen3_5": lambda size: qwen3_5_kit("qwen3_5", size, thinking=True),
    "qwen3_5_moe": lambda size: qwen3_5_kit("qwen3_5_moe", size, thinking=True),
}



def _write_json(out_dir: str, name: str, value: dict) -> None:
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(value, f, indent=2)


def make_hf_config(arch: str, size: str):
    """The transformers config of a kit model."""
    _check_size(arch, size)
    return KIT[arch](size).config


def _check_size(arch: str, size: str) -> None:
    if size in ONE_FAMILY_SIZES and arch != ONE_FAMILY_SIZES[size]:  # other kits would build `small` silently
        raise ValueError(f"the kit builds size {size!r} for {ONE_FAMILY_SIZES[size]} only (its real shapes)")


def build_tiny_model(
    out_dir: str,
    arch: str = "qwen2_vl",
    size: str = "tiny",
    seed: int = 0,
    edit_config: Callable[[object], None] | None = None,
    thinking: bool = False,
) -> str:
    """Build and save a random-weight checkpoint in `out_dir`; returns `out_dir`. Deterministic in `seed`.
    `edit_config` may change the HF config first (tests build "another model" of the same family).
    `thinking`: the family's thinking form (`THINKING_KIT`: its real thinking chat template and tags)."""
    import torch
    from transformers import AutoModelForMultimodalLM

    from mmserve.models.family import FAMILIES

    if arch not in KIT or arch not in FAMILIES:
        raise ValueError(f"unknown arch {arch!r}; the kit builds {sorted(KIT)}")
    _check_size(arch, size)
    if thinking and arch not in THINKING_KIT:
        raise ValueError(f"the kit builds a thinking model of {', '.join(THINKING_KIT)} only, not {arch!r}")
    kit = (THINKING_KIT if thinking else KIT)[arch](size)
    if edit_config is not None:
        edit_config(kit.config)
    torch.manual_seed(seed)
    # `7b` is made in bf16 directly: its fp32 weights (33 GB) would not fit the machines it is meant for.
    model = AutoModelForMultimodalLM.from_config(kit.config, dtype=torch.bfloat16 if size == "7b" else torch.float32)
    kit.edit_weights(model)
    model.generation_config.eos_token_id = kit.config.eos_token_id
    model.generation_config.pad_token_id = kit.config.pad_token_id
    os.makedirs(out_dir, exist_ok=True)
    if size in ("small", "2b"):  # stored in bf16 like published Qwen checkpoints: `--dtype auto` runs it in bf16 on AMX
        model = model.to(torch.bfloat16)
    model.save_pretrained(out_dir)
    kit.tokenizer.save_pretrained(out_dir)
    kit.save_processors(out_dir)
    _write_json(out_dir, "mmserve_kit.json", _spec(arch, size, seed, thinking))
    return out_dir


def _spec(arch: str, size: str, seed: int, thinking: bool) -> dict:
    return {"arch": arch, "size": size, "seed": seed, **({"thinking": True} if thinking else {})}


def ensure_tiny_model(
    out_dir: str, arch: str = "qwen2_vl", size: str = "tiny", seed: int = 0, thinking: bool = False
) -> str:
    """Build the checkpoint unless `out_dir` already holds one made with the same spec."""
    marker = os.path.join(out_dir, "mmserve_kit.json")
    if os.path.exists(marker):
        with open(marker) as f:
            if json.load(f) == _spec(arch, size, seed, thinking):
                return out_dir
    return build_tiny_model(out_dir, arch=arch, size=size, seed=seed, thinking=thinking)
