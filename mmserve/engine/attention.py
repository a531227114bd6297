"""Attention over our KV pool, plugged into transformers' language model through AttentionInterface.

The runner passes `mm_attn=AttentionMetadata(...)` to `language_model(...)`; HF forwards it unchanged to
this function for every layer. Per layer: write the new tokens' K/V into the pool at their slots, then,
per request, gather its slots and run SDPA. Causal masks are BOTTOM-RIGHT aligned: a chunk of q tokens at
the end of kv cached tokens sees all earlier tokens (SDPA's `is_causal` is top-left, right only for q == kv).
Without `mm_attn` it falls back to HF's SDPA so the same model can still run `generate` as a reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

ATTENTION_NAME = "mmserve_pool"


@dataclass
class SeqAttention:
    q_start: int  # first query row of this request in the packed batch
    q_len: int
    kv_slots: torch.Tensor  # int64 (kv_len,): the request's slots, this step's included
    mask: torch.Tensor | None  # bool (q_len, kv_len) bottom-right causal, None for decode / fresh prefill

    @staticmethod
    def make(q_start: int, q_len: int, kv_slots: torch.Tensor) -> SeqAttention:
        kv_len = kv_slots.shape[0]
        mask = None
        if 1 < q_len < kv_len:
            mask = torch.ones(q_len, kv_len, dtype=torch.bool).tril(diagonal=kv_len - q_len)
        return SeqAttention(q_start, q_len, kv_slots, mask)


@dataclass
class AttentionMetadata:
    k_cache: list[torch.Tensor]  # per layer (num_slots, num_kv_heads, head_dim)
    v_cache: list[torch.Tensor]
    new_slots: torch.Tensor  # int64 (total_tokens,): slot of every packed token
    seqs: list[SeqAttention]

    def __post_init__(self) -> None:
        # One gather per layer for the whole batch is much cheaper than one per request; each request then
        # reads its rows of the gathered block as a view. Offsets into that block:
        self.kv_slots = torch.cat([s.kv_slots for s in self.seqs])
        lengths = [s.kv_slots.shape[0] for s in self.seqs]
        self.kv_offsets = [sum(lengths[:i]) for i in range(len(lengths))]


def pool_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    meta: AttentionMetadata | None = kwargs.get("mm_attn")
    if meta is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)  # fmt: skip
    layer = module.layer_idx
    k_cache, v_cache = meta.k_cache[layer], meta.v_cache[layer]
    # query (1, H, T, D); key/value (1, Hkv, T, D) with RoPE applied -> pool rows (T, Hkv, D)
    k_cache.index_copy_(0, meta.new_slots, key[0].transpose(0, 1).to(k_cache.dtype))
    v_cache.index_copy_(0, meta.new_slots, value[0].transpose(0, 1).to(v_cache.dtype))
    k_all = k_cache.index_select(0, meta.kv_slots).transpose(0, 1)  # (Hkv, sum kv, D)
    v_all = v_cache.index_select(0, meta.kv_slots).transpose(0, 1)
    outputs = []
    for seq, offset in zip(meta.seqs, meta.kv_offsets, strict=True):
        q = query[:, :, seq.q_start : seq.q_start + seq.q_len]
        kv_len = seq.kv_slots.shape[0]
        k = k_all[:, offset : offset + kv_len].unsqueeze(0)  # (1, Hkv, kv, D)
        v = v_all[:, offset : offset + kv_len].unsqueeze(0)
        causal = seq.mask is None and seq.q_len > 1  # fresh prefill: q == kv, top-left == bottom-right
        out = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=seq.mask,
                                             is_causal=causal, scale=scaling, enable_gqa=True)  # fmt: skip
        outputs.append(out)
    # (1, H, T, D) -> (1, T, H, D): HF expects the transposed layout; the other one is silently wrong.
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


def register_attention() -> str:
    """Register `pool_attention` with transformers (idempotent) and return its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, pool_attention)
    return ATTENTION_NAME
