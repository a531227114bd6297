"""How big each cache pool is: the KV pool and, for a hybrid model, the linear-attention state pool.

Each pool takes its flag (`--kv-cache-mb`, `--state-cache-mb`) when given; otherwise what `max_num_seqs`
requests need, capped at `kv_cache_memory_fraction` of the memory available now (a tiny model gets
megabytes, not gigabytes).
"""

from __future__ import annotations

import os

import torch

from mmserve.config import EngineConfig, ModelConfig
from mmserve.engine.cache.kv_pool import KVPool
from mmserve.engine.cache.state_pool import StatePool, state_bytes
from mmserve.models.layer_specs import LayerSpec, LinearStateSpec
from mmserve.models.loader import parse_dtype


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


def build_kv_pool(cfg: EngineConfig, model: ModelConfig, specs: tuple[LayerSpec, ...]) -> KVPool:
    """Room for `max_num_seqs` requests of `max_model_len` tokens each, unless `--kv-cache-mb` says."""
    dtype = parse_dtype(cfg.dtype)
    per_token = KVPool.bytes_per_token(specs, dtype)
    budget = _budget(cfg, cfg.kv_cache_mb, per_token * model.max_model_len * cfg.max_num_seqs)
    if budget < per_token:
        raise ValueError(f"KV cache budget of {budget} bytes holds no token ({per_token} bytes per token)")
    return KVPool.from_budget(budget, specs, dtype, torch.device(cfg.device))


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
