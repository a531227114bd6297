"""Whether a request can ever run on this engine: its context, its KV slots and, for models with sliding-window
layers, the window rows it holds at once. Refused requests get a ValueError (the API's 400) before anything is
queued."""

from __future__ import annotations

from mmserve.engine.cache.kv_pool import KVPool
from mmserve.engine.request import Request


def check_fits(max_model_len: int, pool: KVPool, prompt_len: int, max_tokens: int) -> None:
    """Raise ValueError if a request of this size can never run."""
    total = prompt_len + max_tokens
    if prompt_len >= max_model_len:
        raise ValueError(f"prompt has {prompt_len} tokens (images expanded), the model's context is {max_model_len}")
    if total > max_model_len:
        raise ValueError(
            f"prompt ({prompt_len} tokens, images expanded) + max_tokens ({max_tokens}) = {total} tokens exceeds "
            f"the model's context length of {max_model_len}"
        )
    if total > pool.num_slots:
        raise ValueError(
            f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {total} tokens exceeds the KV cache "
            f"capacity of {pool.num_slots} tokens; lower max_tokens or raise --kv-cache-mb"
        )


def check_window_fits(budget: int, window_pool: KVPool | None, window: int | None, req: Request) -> None:
    """Raise ValueError if a request can never hold the window rows it needs at once: its window, the rows it
    keeps for the prefix cache before where later requests resume, and its largest prefill chunk (a chunk of
    `budget` tokens, or a whole bidirectional block)."""
    if window_pool is None:
        return
    longest = max((b - a for a, b in req.blocks), default=0)
    keep = len(req.resume_points(0, req.prompt_len))
    need = min(req.max_len, (window - 1) * (1 + keep) + max(budget, longest))
    if need > window_pool.num_slots:
        raise ValueError(
            f"the request needs up to {need} sliding-window KV rows at once, the window cache holds "
            f"{window_pool.num_slots}; raise --kv-cache-mb"
        )
