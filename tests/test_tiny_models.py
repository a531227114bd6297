"""The offline model kit: every family loads with plain transformers (model, tokenizer, the family's PIL image
processor or feature extractor), stays tiny, has one placeholder per item in its template; `small`'s
proportions; the CLI builds every family of the table."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoModelForMultimodalLM, AutoTokenizer

from mmserve.models.family import FAMILIES
from mmserve.models.loader import load_model_config
from mmserve.models.resolve import resolve_model_path
from mmserve.testing.tiny_models import KIT, ensure_tiny_model, make_hf_config

ARCHS = sorted(KIT)
PLACEHOLDERS = {
    "qwen2_vl": "<|image_pad|>",
    "qwen2_5_vl": "<|image_pad|>",
    "qwen3_vl": "<|image_pad|>",
    "qwen3_vl_moe": "<|image_pad|>",
    "qwen3_5": "<|image_pad|>",
    "qwen3_5_moe": "<|image_pad|>",
    "llava_onevision": "<image>",
    "qwen2_audio": "<|AUDIO|>",
    "gemma3": "<start_of_image>",  # transformers' Gemma 3 processor expands its boi token
    "gemma4": "<|image|>",
    "qwen2_5_omni": "<|IMAGE|>",
    "qwen3_omni_moe": "<|IMAGE|>",
    "internvl": "<IMG_CONTEXT>",  # transformers' InternVL processor wraps it in <img> ... </img>
    "mistral3": "[IMG]",  # transformers' Pixtral processor expands it into the image's rows and breaks
    "idefics3": "<image>",  # transformers' Idefics3 / SmolVLM processors expand it into tiles and row markers
    "smolvlm": "<image>",
    "minicpmv4_6": "<|image_pad|>",  # transformers' MiniCPM-V 4.6 processor writes its id, overview and slices
    "glm4v": "<|image|>",  # transformers' GLM-4.1V processor expands it inside <|begin_of_image|> ... <|end_of_image|>
    "glm4v_moe": "<|image|>",
}
# Each kit's chat format after a user turn "hi" and the generation prompt
TURN_ENDS = {"gemma3": "hi<end_of_turn>\n<start_of_turn>model\n", "gemma4": "hi<end_of_turn>\n<start_of_turn>model\n"}
TURN_ENDS["mistral3"] = "hi[/INST]"  # Mistral's format has no generation prompt
TURN_ENDS["idefics3"] = TURN_ENDS["smolvlm"] = "hi<end_of_utterance>\nAssistant:"
TURN_ENDS["glm4v"] = TURN_ENDS["glm4v_moe"] = "hi<|assistant|>\n"
QWEN_TURN_END = "hi<|im_end|>\n<|im_start|>assistant\n"
# Gemma's kits draw 0.2 and make the branches louder instead (mmserve/testing/kit_gemma.py: louder_branches)
INIT_RANGE = {"gemma3": 0.2, "gemma4": 0.2}


def test_kit_covers_the_family_table():
    assert set(KIT) == set(FAMILIES)


@pytest.mark.parametrize("arch", ARCHS)
def test_loads_with_plain_transformers(arch, tiny_model):
    from transformers import AutoFeatureExtractor, AutoImageProcessor

    path = tiny_model(arch)
    model = AutoModelForMultimodalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    placeholder = tok.convert_tokens_to_ids(PLACEHOLDERS[arch])
    config = getattr(model.config, "thinker_config", model.config)  # Qwen-Omni: the thinker's
    ids = {getattr(config, n, None) for n in ("image_token_id", "audio_token_id", "boi_token_id", "boi_token_index")}
    assert placeholder in ids
    assert all(t < config.get_text_config().vocab_size for t in tok.all_special_ids)
    assert config.get_text_config().initializer_range == INIT_RANGE.get(arch, 0.5)
    if arch == "qwen2_audio":
        assert type(AutoFeatureExtractor.from_pretrained(path)).__name__ == "WhisperFeatureExtractor"
    else:
        assert type(AutoImageProcessor.from_pretrained(path, backend="pil")).__name__.endswith("Pil")
    # tiny: tests build it in ms (Gemma 4's has every feature at once: MoE, audio, per-layer embeddings)
    limit = 2_500_000 if arch == "gemma4" else 1_200_000
    assert os.path.getsize(os.path.join(path, "model.safetensors")) < limit


@pytest.mark.parametrize("arch", ARCHS)
def test_chat_template_has_one_placeholder_per_item(arch, tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model(arch))
    kind = "audio" if arch == "qwen2_audio" else "image"
    msgs = [{"role": "user", "content": [{"type": kind}, {"type": kind}, {"type": "text", "text": "hi"}]}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text.count(PLACEHOLDERS[arch]) == 2
    assert text.endswith(TURN_ENDS.get(arch, QWEN_TURN_END))


def test_tiny_is_well_under_one_megabyte(tiny_model_dir):
    weights = os.path.getsize(os.path.join(tiny_model_dir, "model.safetensors"))
    assert weights < 700_000


def test_qwen_template_system_prompt_and_round_trip(tiny_qwen2_vl):
    tok = AutoTokenizer.from_pretrained(tiny_qwen2_vl)
    msgs = [
        {
            "role": "user",
            "content": [{"type": "image_url"}, {"type": "image_url"}, {"type": "text", "text": "hi"}],
        }
    ]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text.count("<|image_pad|>") == 2
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n")
    assert text.endswith(QWEN_TURN_END)
    assert tok.decode(tok("hello world")["input_ids"]) == "hello world"


def test_model_config_from_hf(tiny_qwen2_vl):
    cfg = load_model_config(tiny_qwen2_vl)
    assert (cfg.model_type, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim) == ("qwen2_vl", 2, 2, 16)
    assert cfg.eos_token_ids


def test_seed_determinism_and_ensure_reuses(tmp_path):
    a = ensure_tiny_model(str(tmp_path / "a"), seed=3)
    mtime = os.path.getmtime(os.path.join(a, "model.safetensors"))
    assert ensure_tiny_model(a, seed=3) == a
    assert os.path.getmtime(os.path.join(a, "model.safetensors")) == mtime
    b = ensure_tiny_model(str(tmp_path / "b"), seed=3)
    ma = AutoModelForImageTextToText.from_pretrained(a)
    mb = AutoModelForImageTextToText.from_pretrained(b)
    assert all(
        torch.equal(x, y) for x, y in zip(ma.state_dict().values(), mb.state_dict().values(), strict=True)
    )


@pytest.mark.parametrize("arch,vision_range", [("qwen2_vl", (80e6, 130e6)), ("qwen2_5_vl", (70e6, 130e6))])
def test_small_has_realistic_proportions(arch, vision_range):
    config = make_hf_config(arch, "small")
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    lm = sum(p.numel() for p in model.model.language_model.parameters()) + model.lm_head.weight.numel()
    vision = sum(p.numel() for p in model.model.visual.parameters())
    # Qwen2-0.5B's layers with Qwen2-VL's 151,936-row embedding and untied lm_head (~0.27 B of the ~0.63 B).
    assert 0.55e9 <= lm <= 0.7e9
    text = config.text_config
    assert text.vocab_size == 151_936 and config.image_token_id == 151_655  # Qwen2-VL's ids
    # M-RoPE sections must cover half the head dim or the first forward crashes.
    assert sum(text.rope_parameters["mrope_section"]) * 2 == text.hidden_size // text.num_attention_heads
    assert vision_range[0] <= vision <= vision_range[1]


def test_2b_has_qwen2_vl_2b_shapes():
    """The bench-only `2b` size: Qwen2-VL-2B's language model and tower (random weights, never built here)."""
    config = make_hf_config("qwen2_vl", "2b")
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    text, vision = config.text_config, config.vision_config
    assert (text.hidden_size, text.intermediate_size, text.num_hidden_layers) == (1536, 8960, 28)
    assert (text.num_attention_heads, text.num_key_value_heads, text.vocab_size) == (12, 2, 151_936)
    assert sum(text.rope_parameters["mrope_section"]) * 2 == text.hidden_size // text.num_attention_heads
    assert (vision.depth, vision.embed_dim, vision.num_heads, vision.hidden_size) == (32, 1280, 16, 1536)
    assert config.tie_word_embeddings
    total = sum(p.numel() for p in model.parameters())  # tied: lm_head is the embedding
    assert 2.1e9 <= total <= 2.3e9, total
    for arch in ("qwen2_5_vl", "gemma3"):  # other kits would build their `small` under that name
        with pytest.raises(ValueError, match="for qwen2_vl only"):
            make_hf_config(arch, "2b")


def test_resolve_model_path(tiny_qwen2_vl):
    assert resolve_model_path(tiny_qwen2_vl) == os.path.abspath(tiny_qwen2_vl)
    with pytest.raises(FileNotFoundError):
        resolve_model_path("./no/such/dir")


def test_cli_make_tiny_model(tmp_path):
    out = tmp_path / "m"
    proc = subprocess.run(
        [sys.executable, "-m", "mmserve.cli", "make-tiny-model", "--arch", "qwen3_vl", "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert AutoModelForImageTextToText.from_pretrained(out).config.model_type == "qwen3_vl"
    helptext = subprocess.run(
        [sys.executable, "-m", "mmserve.cli", "make-tiny-model", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert all(arch in helptext for arch in FAMILIES)  # --arch choices come from the family table
