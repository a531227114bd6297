"""`mmserve bench kv-memory`: the KV bytes one long request holds, with the sliding-window layers' rows freed behind
their window, beside what it would hold with every layer keeping every token's rows.

One request of `--prompt-tokens` text tokens (and `--output-tokens` decoded) runs through an in-process engine
(language side only), alone, so the pools hold only its rows (and what the prefix cache keeps of them). The bench
reads the window pool's rows in use at every forward (a prefill chunk's rows all taken) and after it (the rows
behind the window freed): the peak, and the most held while decoding; and the bytes the same request takes when
every layer keeps every token's rows (the one pool mmserve had before windows).

`--shape gemma3-4b` builds, offline, a checkpoint with Gemma 3 4B's attention geometry (34 layers, 5 sliding
to 1 full, 4 KV heads x 256, window 1024) and a narrow residual stream and MLP: KV bytes depend on the attention
geometry alone, and the prefill of 8k tokens then takes seconds, not minutes.
"""

from __future__ import annotations

import os
import random
import tempfile
from dataclasses import asdict, dataclass

from mmserve.config import EngineConfig
from mmserve.engine.cache.kv_pool import KVPool
from mmserve.engine.engine import Engine
from mmserve.sampling_params import SamplingParams

# Gemma 3 4B's attention: what its KV holds per token (the rest narrowed; see the module docstring).
GEMMA3_4B = dict(
    num_hidden_layers=34,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    query_pre_attn_scalar=256,
    sliding_window=1024,
    hidden_size=256,
    intermediate_size=256,
    max_position_embeddings=16_384,
    layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(34)],
)
SHAPES = {"gemma3-4b": ("gemma3", GEMMA3_4B)}


@dataclass
class KvMemory:
    prompt_tokens: int
    output_tokens: int
    window: int
    all_rows_bytes: int  # every KV layer keeping every token's rows (no window pool)
    full_bytes: int  # the full-attention layers' rows: every token
    row_bytes: int  # one window row (every sliding layer's K and V of one token)
    window_peak_rows: int  # window rows in use at most (during a prefill chunk's forward)
    decode_rows: int  # window rows in use at most while decoding
    cache_window_rows: int  # window rows the prefix cache holds after the request

    @property
    def window_peak_bytes(self) -> int:
        return self.window_peak_rows * self.row_bytes

    @property
    def decode_bytes(self) -> int:
        return self.decode_rows * self.row_bytes

    @property
    def peak_bytes(self) -> int:  # full + window peak
        return self.full_bytes + self.window_peak_bytes

    @property
    def ratio(self) -> float:
        return self.all_rows_bytes / self.peak_bytes


def build_shape(shape: str, out_dir: str) -> str:
    from mmserve.testing.tiny_models import build_tiny_model

    arch, text = SHAPES[shape]

    def edit(config) -> None:
        for key, value in text.items():
            setattr(config.text_config, key, value)

    return build_tiny_model(out_dir, arch, "tiny", edit_config=edit)


def measure(model: str, dtype: str, prompt_tokens: int, output_tokens: int, budget: int) -> KvMemory:
    total = prompt_tokens + output_tokens
    cfg = EngineConfig(
        model=model,
        dtype=dtype,
        language_only=True,
        max_num_seqs=1,
        max_num_batched_tokens=budget,
        max_model_len=total + 1,
        kv_cache_mb=None,
    )
    engine = Engine(cfg)
    if engine.window_pool is None:
        raise ValueError("the model has no sliding-window layers")
    vocab = min(engine.model_config.vocab_size, 300)
    rng = random.Random(0)
    prompt = [rng.randrange(10, vocab) for _ in range(prompt_tokens)]
    engine.add_request(
        "r", prompt, SamplingParams(temperature=0, max_tokens=output_tokens, ignore_eos=True), []
    )
    rows = engine.window_pool
    seen = {"peak": 0, "decode": 0}
    forward = engine.runner.forward

    def counted(chunks, *args):
        seen["peak"] = max(seen["peak"], rows.num_used)
        if all(c.start >= c.request.prompt_len for c in chunks):
            seen["decode"] = max(seen["decode"], rows.num_used)
        return forward(chunks, *args)

    engine.runner.forward = counted
    while engine.has_work:
        engine.step()
    every = KVPool.bytes_per_token(engine.family.layer_specs, engine.pool.dtype)  # all layers' rows, one pool
    return KvMemory(
        prompt_tokens,
        output_tokens,
        engine.window,
        all_rows_bytes=total * every,
        full_bytes=total * engine.pool.token_bytes,
        row_bytes=rows.token_bytes,
        window_peak_rows=seen["peak"],
        decode_rows=seen["decode"],
        cache_window_rows=engine.scheduler.prefix_cache.window_rows,
    )


def run(
    model: str | None, shape: str | None, dtype: str, prompt_tokens: int, output_tokens: int, budget: int
):
    if shape is None:
        return measure(model, dtype, prompt_tokens, output_tokens, budget)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_shape(shape, os.path.join(tmp, shape))
        return measure(path, dtype, prompt_tokens, output_tokens, budget)


def report(m: KvMemory, dtype: str) -> str:
    mib = 2**20
    return "\n".join(
        [
            f"one request: {m.prompt_tokens} prompt + {m.output_tokens} output tokens, {dtype}, window {m.window}",
            f"  every layer keeps every token's rows:  {m.all_rows_bytes / mib:8.1f} MiB",
            f"  full-attention layers (every token):   {m.full_bytes / mib:8.1f} MiB",
            f"  sliding layers (rows held, at most):   {m.window_peak_bytes / mib:8.1f} MiB ({m.window_peak_rows} rows)",
            f"  held at most:                          {m.peak_bytes / mib:8.1f} MiB ({m.ratio:.2f}x less)",
            f"  sliding layers while decoding:         {m.decode_bytes / mib:8.1f} MiB ({m.decode_rows} rows)",
            f"  window rows the prefix cache keeps afterwards: {m.cache_window_rows}",
        ]
    )


def as_json(m: KvMemory) -> dict:
    derived = ("window_peak_bytes", "decode_bytes", "peak_bytes", "ratio")
    return {**asdict(m), **{name: getattr(m, name) for name in derived}}
