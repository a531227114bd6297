"""`--kv-cache-dtype fp8 | fp8_e4m3 | fp8_e5m2 | int8`: K and V rows stored in 8 bits, about half of bf16's bytes.

A decode step reads every K and V row of every running request; at 16 requests and beyond those reads are as
large as the weights, so an 8-bit cache halves what grows with the batch and the context, and the same
`--kv-cache-mb` holds about twice the tokens.

- fp8: as vLLM does without calibrated scales, the rows are stored unscaled (scale 1.0): each value rounded to
  the nearest fp8 (e4m3: 3 mantissa bits, up to +-448; e5m2: 2 bits, up to +-57344), saturating at the largest
  finite value rather than overflowing.
- int8: each row of one token and one KV head (head_dim values) gets its own scale, max |x| / 127, and its
  values round(x / scale) in [-127, 127]. The scale is stored in the row itself, as the fp32's four bytes after
  the codes: a row is head_dim + 4 bytes, so everything that moves rows as bytes (prefix cache, retraction,
  P/D handoff) moves the scales with them, and a dynamic scale per row needs no calibration. Seven bits of
  mantissa against the row's largest value: finer than e4m3's three bits wherever a row's values are
  within 16x of its largest, which is most rows.

Everything that reads the rows (the decode attention kernels, the prefill gather, the eager SDPA paths) widens
them back to the model's dtype as it loads them (int8: code x scale in fp32, then rounded to the model dtype);
the math after the load is the model dtype's. The rows written for a step are those every later step reads,
the step's own attention included, so HF `generate` over a cache that rounds K and V the same way
(mmserve.testing.reference, `kv_cache_dtype`) gives the same tokens.
"""

from __future__ import annotations

import torch

FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
STORED = {**FP8, "int8": torch.int8}
SCALE_BYTES = 4  # an int8 row's fp32 scale, after its codes


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's element type for `--kv-cache-dtype NAME` ("auto": the model's)."""
    return model_dtype if name == "auto" else STORED[name]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements a pool row of one token and one KV head holds: head_dim, and an int8 row's scale bytes."""
    return head_dim + SCALE_BYTES if dtype == torch.int8 else head_dim


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `x` (..., head_dim) as a pool of `dtype` holds them: unchanged for the pool's own dtype; fp8 rounded
    to the nearest value, saturated at the largest finite one (torch's cast alone gives e5m2 infinities); int8
    as codes and their row's scale, (..., head_dim + 4) bytes."""
    if x.dtype == dtype:
        return x
    if dtype == torch.int8:
        xf = x.float()
        scale = xf.abs().amax(-1, keepdim=True) / 127.0
        codes = torch.round(xf / torch.where(scale > 0, scale, 1.0)).clamp_(-127, 127).to(torch.int8)
        return torch.cat([codes, scale.view(torch.int8)], dim=-1)
    if not is_fp8(dtype):
        return x.to(dtype)
    top = torch.finfo(dtype).max
    return x.clamp(-top, top).to(dtype)


def from_cache(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Pool rows widened to `dtype`: what every reader of the pool computes with."""
    if rows.dtype != torch.int8:
        return rows.to(dtype)
    codes, scale = rows[..., :-SCALE_BYTES], rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)
    return (codes.float() * scale).to(dtype)


def round_trip(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What a row of `x` reads back as from a pool of `dtype`: the reference's K and V."""
    return from_cache(to_cache(x, dtype), x.dtype)
