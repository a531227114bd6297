"""`--quantization int8|int4`: quantize a bf16/fp32 checkpoint's linear layers as it loads (weight-only).

- int8: per output channel, symmetric (`q = round(w / s)`, s = max|w| / 127): half bf16's bytes.
- int4: per group of 128 inputs (64 or 32 where the width needs it), asymmetric with an integer zero point
  (`q = round(w / s) + z`, s = (max - min) / 15): AWQ's and GPTQ's storage, about a quarter of bf16's bytes.
The language model's linear layers and its `lm_head` are quantized (the head is a quarter of a sub-1B model's
bytes at a 152k vocabulary; `--quantization-keep-lm-head` keeps it); the embedding table stays (a decode step
reads one row of it), and so does the tower unless asked (`--quantize-tower`): it is compute-bound, so fewer
bytes buy it memory, not time. A layer whose width no group size divides stays in the model's dtype.
"""

from __future__ import annotations

import logging

import torch

from mmserve.models.swap import swap_modules
from mmserve.quant.layout import QuantizedWeight, pack_int4
from mmserve.quant.linear import QuantLinear

log = logging.getLogger(__name__)

METHODS = ("int8", "int4")
INT4_GROUPS = (128, 64, 32)


def quantize_weight(weight: torch.Tensor, method: str) -> QuantizedWeight | None:
    """`weight` (N, K) quantized by `method`, or None where no group size fits its width."""
    w = weight.detach().float()
    n, k = w.shape
    if method == "int8":
        scale = (w.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
        q = torch.round(w / scale).clamp(-128, 127).to(torch.int8)
        return QuantizedWeight("int8", q.contiguous(), scale.contiguous(), None, k, k)
    if method != "int4":
        raise ValueError(f"unknown quantization method {method!r}; expected one of {', '.join(METHODS)}")
    group = next((g for g in INT4_GROUPS if k % g == 0), None)
    if group is None:
        return None
    groups = w.reshape(n, k // group, group)
    low = groups.amin(dim=-1).clamp(max=0.0)  # 0 stays exactly representable (a zero point in range)
    high = groups.amax(dim=-1).clamp(min=0.0)
    scale = ((high - low) / 15.0).clamp(min=torch.finfo(torch.float32).tiny)
    zero = torch.round(-low / scale).clamp(0, 15)
    q = (torch.round(groups / scale.unsqueeze(-1)) + zero.unsqueeze(-1)).clamp(0, 15).reshape(n, k)
    return QuantizedWeight(
        "int4", pack_int4(q), scale.contiguous(), zero.to(torch.int8).contiguous(), group, k
    )


def quantize_linears(module: torch.nn.Module, method: str, dtype: torch.dtype) -> int:
    """Replaces every plain `torch.nn.Linear` under `module` (or `module` itself) with a QuantLinear of its
    weight, in place; returns how many. Layers no group size fits stay as they are."""
    kept = []

    def swap(m: torch.nn.Module):
        if type(m) is not torch.nn.Linear:
            return None
        weight = quantize_weight(m.weight, method)
        if weight is None:
            kept.append(f"{m.out_features}x{m.in_features}")
            return None
        return QuantLinear(weight, m.bias, dtype)

    done = swap_modules(module, swap)
    if kept:
        log.info(
            "kept %d linear layer(s) unquantized (no %s group size fits): %s", len(kept), method, kept[:4]
        )
    return done


def quantize_head(head: torch.nn.Module, method: str, dtype: torch.dtype) -> torch.nn.Module:
    """The `lm_head` quantized (a QuantLinear), or the head as it is where it is not a plain Linear or no group
    fits."""
    if type(head) is not torch.nn.Linear:
        return head
    weight = quantize_weight(head.weight, method)
    return head if weight is None else QuantLinear(weight, head.bias, dtype)
