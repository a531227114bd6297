"""The default KV budget: room for max_num_seqs requests of max_model_len tokens, capped by a memory fraction."""

from __future__ import annotations

import pytest
import torch

from mmserve.config import EngineConfig
from mmserve.engine.cache.budget import available_memory_bytes, build_kv_pools
from mmserve.engine.cache.kv_pool import KVPool, uniform_specs
from mmserve.models.loader import load_model_config


def specs(model):
    return uniform_specs(model.num_layers, model.num_kv_heads, model.head_dim)


def per_token(model) -> int:
    return KVPool.bytes_per_token(uniform_specs(model.num_layers, model.num_kv_heads, model.head_dim), torch.float32)


def test_default_pool_holds_max_num_seqs_requests_of_max_model_len(tiny_qwen2_vl):
    model = load_model_config(tiny_qwen2_vl, max_model_len=512)
    pool, _ = build_kv_pools(EngineConfig(model=tiny_qwen2_vl, max_model_len=512, max_num_seqs=4), model, specs(model))
    assert pool.num_slots == 4 * 512  # not a fifth of the machine's memory for a 1 MB model


def test_default_pool_is_capped_by_the_memory_fraction(tiny_qwen2_vl):
    import torch

    model = load_model_config(tiny_qwen2_vl)
    fraction = 4096 * per_token(model) / available_memory_bytes(torch.device("cpu"))  # ~4096 tokens' worth
    cfg = EngineConfig(model=tiny_qwen2_vl, max_num_seqs=64, kv_cache_memory_fraction=fraction)
    pool, _ = build_kv_pools(cfg, model, specs(model))
    assert pool.num_slots < 64 * model.max_model_len
    assert pool.num_slots == pytest.approx(4096, rel=0.2)  # free memory moves a little between the two reads


def test_explicit_budget_wins(tiny_qwen2_vl):
    model = load_model_config(tiny_qwen2_vl)
    pool, _ = build_kv_pools(EngineConfig(model=tiny_qwen2_vl, kv_cache_mb=1, max_num_seqs=1), model, specs(model))
    assert pool.num_slots == 2**20 // per_token(model)


def test_window_pool_plans_what_windows_read_and_both_pools_share_the_budget(tiny_model):
    """Gemma 3 (sliding layers, window 6): the KV pool plans every token of its full layers, the window pool only
    what windows can hold per request; an explicit budget holds both pools' bytes."""
    from dataclasses import replace

    from mmserve.engine.cache.budget import window_tokens
    from mmserve.models.family import load_family
    from mmserve.models.layer_specs import window_of

    path = tiny_model("gemma3")
    model = load_model_config(path, max_model_len=2048)
    layer_specs = load_family(path).layer_specs
    window = window_of(layer_specs)
    cfg = EngineConfig(model=path, max_model_len=2048, max_num_seqs=2, max_num_batched_tokens=64)
    pool, window_pool = build_kv_pools(cfg, model, layer_specs)
    assert pool.num_slots == 2 * 2048
    assert window_pool.num_slots == 2 * window_tokens(window, cfg) < pool.num_slots
    assert pool.token_bytes > 0 and window_pool.token_bytes > 0  # each pool holds only its own layers
    assert pool.token_bytes + window_pool.token_bytes == KVPool.bytes_per_token(layer_specs, torch.float32)

    for mb in (0.05, 1):  # a budget below the window rows' plan, and one above it
        pool, window_pool = build_kv_pools(replace(cfg, kv_cache_mb=mb), model, layer_specs)
        used = pool.num_slots * pool.token_bytes + window_pool.num_slots * window_pool.token_bytes
        assert used <= mb * 2**20
        assert window_pool.num_slots == min(pool.num_slots, 2 * window_tokens(window, cfg))
        assert used > mb * 2**20 - pool.token_bytes - window_pool.token_bytes  # nothing left unplanned
