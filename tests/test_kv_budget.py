"""The default KV budget: room for max_num_seqs requests of max_model_len tokens, capped by a memory fraction."""

from __future__ import annotations

import pytest
import torch

from mmserve.config import EngineConfig
from mmserve.engine.cache.budget import available_memory_bytes, build_kv_pool
from mmserve.engine.cache.kv_pool import KVPool, uniform_specs
from mmserve.models.loader import load_model_config


def specs(model):
    return uniform_specs(model.num_layers, model.num_kv_heads, model.head_dim)


def per_token(model) -> int:
    return KVPool.bytes_per_token(uniform_specs(model.num_layers, model.num_kv_heads, model.head_dim), torch.float32)


def test_default_pool_holds_max_num_seqs_requests_of_max_model_len(tiny_qwen2_vl):
    model = load_model_config(tiny_qwen2_vl, max_model_len=512)
    pool = build_kv_pool(EngineConfig(model=tiny_qwen2_vl, max_model_len=512, max_num_seqs=4), model, specs(model))
    assert pool.num_slots == 4 * 512  # not a fifth of the machine's memory for a 1 MB model


def test_default_pool_is_capped_by_the_memory_fraction(tiny_qwen2_vl):
    import torch

    model = load_model_config(tiny_qwen2_vl)
    fraction = 4096 * per_token(model) / available_memory_bytes(torch.device("cpu"))  # ~4096 tokens' worth
    cfg = EngineConfig(model=tiny_qwen2_vl, max_num_seqs=64, kv_cache_memory_fraction=fraction)
    pool = build_kv_pool(cfg, model, specs(model))
    assert pool.num_slots < 64 * model.max_model_len
    assert pool.num_slots == pytest.approx(4096, rel=0.2)  # free memory moves a little between the two reads


def test_explicit_budget_wins(tiny_qwen2_vl):
    model = load_model_config(tiny_qwen2_vl)
    pool = build_kv_pool(EngineConfig(model=tiny_qwen2_vl, kv_cache_mb=1, max_num_seqs=1), model, specs(model))
    assert pool.num_slots == 2**20 // per_token(model)
