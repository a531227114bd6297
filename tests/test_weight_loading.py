"""Weights load through transformers' own loading and conversion rules, only the half a process needs, and fail
loudly on anything that does not match: MoE checkpoints stored one tensor per expert (as Qwen3.5-MoE is
published) are fused at load exactly as `from_pretrained` fuses them."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mmserve.models.family import load_family
from mmserve.models.loader import load_model


def test_per_expert_checkpoints_are_fused_as_from_pretrained_fuses_them(tiny_model):
    model_dir = tiny_model("qwen3_5_moe")
    with safe_open(os.path.join(model_dir, "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
    assert any(".mlp.experts.0.gate_proj.weight" in k for k in keys)  # on disk: one tensor per expert
    lm = load_family(model_dir).load_language_model(torch.float32, "sdpa")
    hf = load_model(model_dir).model.language_model.state_dict()
    ours = lm.model.state_dict()
    assert set(ours) == set(hf)
    assert "layers.0.mlp.experts.gate_up_proj" in ours
    for key, value in hf.items():
        assert torch.equal(ours[key], value), key


def _edited(model_dir: str, out: str, edit) -> str:
    shutil.copytree(model_dir, out, ignore=shutil.ignore_patterns("model.safetensors"))
    tensors = load_file(os.path.join(model_dir, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(out, "model.safetensors"))
    return out


def test_the_language_model_loads_without_reading_the_tower_and_mismatches_fail(tiny_model, tmp_path):
    model_dir = tiny_model("qwen3_5")

    def no_tower(tensors):
        for key in [k for k in tensors if k.startswith("model.visual.")]:
            del tensors[key]

    lm_only = _edited(model_dir, str(tmp_path / "lm_only"), no_tower)
    load_family(lm_only).load_language_model(torch.float32, "sdpa")  # nothing of the tower is needed

    def drop_one(tensors):
        del tensors["model.language_model.layers.1.linear_attn.A_log"]

    missing = _edited(model_dir, str(tmp_path / "missing"), drop_one)
    with pytest.raises(ValueError, match=r"lacks 1 tensor.*layers\.1\.linear_attn\.A_log"):
        load_family(missing).load_language_model(torch.float32, "sdpa")

    def add_one(tensors):
        tensors["model.language_model.layers.0.linear_attn.extra.weight"] = torch.zeros(2)

    unexpected = _edited(model_dir, str(tmp_path / "unexpected"), add_one)
    with pytest.raises(ValueError, match=r"unexpected .*linear_attn\.extra\.weight"):
        load_family(unexpected).load_language_model(torch.float32, "sdpa")

    def wrong_shape(tensors):
        key = "model.language_model.layers.0.mlp.gate_proj.weight"
        tensors[key] = tensors[key][:-1].clone()

    mismatched = _edited(model_dir, str(tmp_path / "mismatched"), wrong_shape)
    with pytest.raises(ValueError, match=r"mismatched shapes"):
        load_family(mismatched).load_language_model(torch.float32, "sdpa")


def test_the_engine_lets_go_of_the_checkpoints_memory_map(tiny_model, tmp_path):
    """transformers' loading leaves parameters backed by the safetensors mmap; the runner copies whatever is still
    there once quantization is done, so no engine tensor keeps the file mapped (its pages out of the RSS)."""
    from mmserve.config import EngineConfig
    from mmserve.engine.engine import Engine
    from mmserve.models.weights import checkpoint_mappings, own_checkpoint_memory

    model_dir = str(tmp_path / "copy")
    shutil.copytree(tiny_model("qwen2_vl"), model_dir)  # a file of its own: no other test maps it
    lm = load_family(model_dir).load_language_model(torch.float32, "sdpa")
    assert checkpoint_mappings(), "the loader no longer maps the file: this test has nothing to check"
    held = own_checkpoint_memory(lm.model)
    assert held > 0 and own_checkpoint_memory(lm.model) == 0  # copied once; nothing in the mapping after
    del lm
    for quantization in (None, "int8"):
        engine = Engine(EngineConfig(model=model_dir, language_only=True, kv_cache_mb=4, quantization=quantization))
        runner = engine.runner
        assert own_checkpoint_memory(runner.language_model) == 0 and own_checkpoint_memory(runner.lm_head) == 0
