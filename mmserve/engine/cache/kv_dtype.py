"""`--kv-cache-dtype fp8 | fp8_e4m3 | fp8_e5m2`: K and V rows stored in 8 bits, half of bf16's bytes.

A decode step reads every K and V row of every running request; at 16 requests and beyond those reads are as
large as the weights, so an 8-bit cache halves what grows with the batch and the context, and the same
`--kv-cache-mb` holds twice the tokens. As vLLM does without calibrated scales, the rows are stored unscaled
(scale 1.0): each value rounded to the nearest fp8 (e4m3: 3 mantissa bits, up to +-448; e5m2: 2 bits, up to
+-57344), saturating at the largest finite value rather than overflowing. Everything that reads the rows (the
decode attention kernel, the prefill gather, the eager SDPA paths) widens them back to the model's dtype as it
loads them; the math after the load is the model dtype's. The rows written for a step are those every later
step reads, the step's own attention included, so HF `generate` over a cache that rounds K and V the same way
(mmserve.testing.reference, `kv_cache_dtype`) gives the same tokens.
"""

from __future__ import annotations

import torch

FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's element type for `--kv-cache-dtype NAME` ("auto": the model's)."""
    return model_dtype if name == "auto" else FP8[name]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` in the pool's type: unchanged for a pool of its own dtype, else rounded to the nearest fp8 value,
    saturated at the largest finite one (torch's cast alone gives e5m2 infinities)."""
    if x.dtype == dtype or not is_fp8(dtype):
        return x.to(dtype)
    top = torch.finfo(dtype).max
    return x.clamp(-top, top).to(dtype)


def round_trip(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What a row of `x` reads back as from a pool of `dtype`: the reference's K and V."""
    return to_cache(x, dtype).to(x.dtype)
