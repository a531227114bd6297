"""How big each cache pool is: the KV pool, for a model with sliding-window layers their window pool, and for a
hybrid model the linear-attention state pool.

Each pool takes its flag (`--kv-cache-mb`, `--state-cache-mb`) when given; otherwise what `max_num_seqs`
requests need, capped at `kv_cache_memory_fraction` of the memory available now (a tiny model gets
megabytes, not gigabytes). The KV budget covers both KV pools: every token's rows of the full-attention layers,
and of the sliding layers at most what windows read (`window_tokens` a request).
"""

from __future__ import annotations

import os

import torch

from mmserve.config import EngineConfig, ModelConfig
from mmserve.engine.cache.kv_dtype import kv_cache_dtype
from mmserve.engine.cache.kv_pool import KVPool
from mmserve.engine.cache.state_pool import StatePool, state_bytes
from mmserve.models.layer_specs import AttentionSpec, LayerSpec, LinearStateSpec, window_of
from mmserve.models.loader import parse_dtype


def window_tokens(window: int, cfg: EngineConfig) -> int:
    """Window-pool rows to plan per request at most: its window and one prefill chunk, and three more windows kept
    for the prefix cache (around an item and before the prompt's end) or held by it."""
    return 4 * window + cfg.max_num_batched_tokens


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _budget(cfg: EngineConfig, flag_mb: float | None, needed: int) -> int:
    """`flag_mb` in bytes if given; else `needed`, capped at the configured share of available memory."""
    if flag_mb is not None:
        return int(flag_mb * 1024 * 1024)
    cap = int(available_memory_bytes(torch.device(cfg.device)) * cfg.kv_cache_memory_fraction)
    return min(cap, needed)


def kv_layers_by_pool(specs: tuple[LayerSpec, ...]) -> tuple[frozenset[int], frozenset[int]]:
    """(layers of the KV pool, layers of the window pool): sliding-window layers and those reading their rows go
    to the window pool."""
    windowed = frozenset(
        i for i, s in enumerate(specs) if isinstance(s, AttentionSpec) and s.window is not None
    )
    return frozenset(range(len(specs))) - windowed, windowed


def build_kv_pools(
    cfg: EngineConfig, model: ModelConfig, specs: tuple[LayerSpec, ...]
) -> tuple[KVPool, KVPool | None]:
    """(KV pool, window pool or None): room for `max_num_seqs` requests of `max_model_len` tokens each, unless
    `--kv-cache-mb` says. The window pool gets a row for every token the KV pool holds, up to `window_tokens`
    per request (short requests are all window; long ones keep only a window's worth)."""
    dtype, device = kv_cache_dtype(cfg.kv_cache_dtype, parse_dtype(cfg.dtype)), torch.device(cfg.device)
    full_layers, window_layers = kv_layers_by_pool(specs)
    window = window_of(specs)
    per_token = KVPool.bytes_per_token(specs, dtype, full_layers)
    per_row = KVPool.bytes_per_token(specs, dtype, window_layers) if window else 0
    tokens = model.max_model_len * cfg.max_num_seqs
    most_rows = window_tokens(window, cfg) * cfg.max_num_seqs if window else 0
    budget = _budget(cfg, cfg.kv_cache_mb, per_token * tokens + per_row * min(tokens, most_rows))
    if budget < per_token + per_row:
        raise ValueError(f"KV cache budget of {budget} bytes holds no token ({per_token + per_row} bytes per token)")
    if not window:
        return KVPool.from_budget(budget, specs, dtype, device, full_layers), None
    num_tokens = budget // (per_token + per_row)  # a window row for every token ...
    if num_tokens > most_rows:  # ... up to the rows requests can hold: the rest of the budget is tokens
        num_tokens = (budget - per_row * most_rows) // per_token if per_token else tokens
    rows = min(num_tokens, most_rows)
    return KVPool(num_tokens, specs, dtype, device, full_layers), KVPool(rows, specs, dtype, device, window_layers)


def build_state_pool(cfg: EngineConfig, specs: tuple[LayerSpec, ...]) -> StatePool | None:
    """The linear-attention layers' state pool (None for a model without them): one running state and one
    checkpoint per `max_num_seqs` request, unless `--state-cache-mb` says; at least one state."""
    linear = {i: s for i, s in enumerate(specs) if isinstance(s, LinearStateSpec)}
    if not linear:
        return None
    dtype = parse_dtype(cfg.dtype)
    per_state = state_bytes(linear, dtype)
    budget = _budget(cfg, cfg.state_cache_mb, per_state * 2 * cfg.max_num_seqs)
    if cfg.state_cache_mb is None:
        budget = max(per_state, budget)
    return StatePool.from_budget(budget, linear, dtype, torch.device(cfg.device))
