"""Attention over our KV pool, plugged into transformers' language model through AttentionInterface.

The runner passes `mm_attn=AttentionMetadata(...)` to `language_model(...)`; HF forwards it unchanged to
this function for every layer. Per layer: write the new tokens' K/V into the pool at their slots, then
attend in two groups, both built once per step (not per layer):
- every one-row query (decodes, and a prefix hit's last prompt token) in ONE batched SDPA call: their slots
  padded to the longest into a `(B, L)` index, a key mask where lengths differ. One call instead of one per
  request per layer was the largest overhead of a decode step (24 layers x 64 requests = 1,536 calls).
- longer chunks (prefills) one SDPA call each, on views of one gather for all of them. Their causal masks are
  BOTTOM-RIGHT aligned: a chunk of q tokens at the end of kv cached tokens sees all earlier tokens (SDPA's
  `is_causal` is top-left, right only for q == kv).
Without `mm_attn` it falls back to HF's SDPA so the same model can still run `generate` as a reference.

An 8-bit pool (`--kv-cache-dtype`, mmserve.engine.cache.kv_dtype) gets the rows rounded to fp8, or as int8
codes with their row's scale, as they are written; every read widens them back to the query's dtype.

Layer kinds (`AttentionSpec`): the layers of a step are grouped into *views*, one per (pool, item blocks): a
view is where its layers write this step's K/V (slots of the KV pool, or of the window pool for sliding-window
layers) and what each query row reads. Masks are built as transformers builds them, from absolute positions:
key j is visible to query i iff (j <= i, or both lie in the same bidirectional block) and, for a window W,
j > i - W. A windowed view's decode rows read only their last W slots; its prefill chunks read from the first
position their first query can see. A layer that reads another's rows (`kv_source`) writes nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mmserve.engine.cache.kv_dtype import from_cache, is_fp8, to_cache
from mmserve.engine.layers.attention_metadata import (  # noqa: F401 (re-exported: the metadata of `attend`)
    AttentionMetadata,
    AttentionView,
    DecodeGroup,
    SeqAttention,
)

ATTENTION_NAME = "mmserve_pool"


def pool_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention interface: query (1, H, T, D), key/value (1, Hkv, T, D) with RoPE applied;
    returns (1, T, H, D): HF expects that layout, and the other one is silently wrong."""
    meta: AttentionMetadata | None = kwargs.get("mm_attn")
    if meta is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)  # fmt: skip
    rows = attend(
        module.layer_idx,
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        meta,
        scaling,
    )
    return rows.unsqueeze(0), None


def attend(layer: int, query, key, value, meta: AttentionMetadata, scaling: float | None) -> torch.Tensor:
    """One layer's attention over the pool, in rows: query (T, H, D), key/value (T, Hkv, D) with RoPE applied
    (any strides); writes the new K/V into the pool (unless the layer reads another's) and returns (T, H, D)."""
    k_cache, v_cache = meta.k_cache[layer], meta.v_cache[layer]
    view = meta.views[meta.view_of[layer]]
    rows_k, rows_v = (
        key,
        value,
    )  # as computed (the writes below may convert `key` / `value` to the pool's type)
    group, kernels = view.decode, meta.kernels  # the pool holds the model's dtype, which the kernels take
    if not meta.writes[layer]:
        pass  # a layer sharing another's K/V: that layer wrote this step's rows already
    elif kernels is not None:  # an int8 pool's rows are quantized by the kernel, others' converted here
        stored = k_cache.dtype
        if stored != torch.int8:
            key, value = to_cache(key, stored), to_cache(value, stored)
        kernels.store_kv_(k_cache, v_cache, view.new_slots, key, value)
    else:
        for cache, rows in ((k_cache, key), (v_cache, value)):
            rows = to_cache(rows, cache.dtype)
            if is_fp8(cache.dtype):  # torch copies fp8 rows on a CPU only as bytes
                cache, rows = cache.view(torch.uint8), rows.view(torch.uint8)
            cache.index_copy_(0, view.new_slots, rows)
    if group is not None and kernels is None:
        decoded = _decode_attention(query, k_cache, v_cache, group, scaling)  # (B, H, 1, D)
        if not view.seqs:  # a pure decode step, rows 0..B-1 in order: (B, H, 1, D) -> (B, H, D)
            return decoded.view(meta.num_rows, decoded.shape[1], decoded.shape[3])
    out = query.new_empty(meta.num_rows, query.shape[1], query.shape[2])
    if group is not None and kernels is not None:
        # each decode row straight out of the pool into its row of `out`: no gather, no copy
        scale = query.shape[2] ** -0.5 if scaling is None else scaling
        kernels.decode_attention_(
            out, query, group.row_ids, k_cache, v_cache, group.slots, group.lengths, scale
        )
    elif group is not None:
        out[group.rows] = decoded[:, :, 0]
    if not view.seqs:
        return out
    # A chunk whose keys are exactly its own rows (a fresh prompt's first chunk) reads them from `key` / `value`
    # as they are, when the pool holds them unchanged (its dtype is the model's): the same values as the pool's
    # rows, without a gather. The others read the pool, in one gather for all of them.
    own = k_cache.dtype == query.dtype and meta.writes[layer]
    fresh = [own and seq.kv_slots.shape[0] == seq.q_len for seq in view.seqs]
    if not all(fresh):
        # (Hkv, sum of kv lengths, D)
        k_all = from_cache(k_cache.index_select(0, view.kv_slots), query.dtype).transpose(0, 1)
        v_all = from_cache(v_cache.index_select(0, view.kv_slots), query.dtype).transpose(0, 1)
    for seq, offset, is_fresh in zip(view.seqs, view.kv_offsets, fresh, strict=True):
        rows = slice(seq.q_start, seq.q_start + seq.q_len)
        q = query[rows].transpose(0, 1).unsqueeze(0)  # (1, H, q, D)
        if is_fresh:
            k, v = rows_k[rows].transpose(0, 1).unsqueeze(0), rows_v[rows].transpose(0, 1).unsqueeze(0)
        else:
            kv_len = seq.kv_slots.shape[0]
            k = k_all[:, offset : offset + kv_len].unsqueeze(0)  # (1, Hkv, kv, D)
            v = v_all[:, offset : offset + kv_len].unsqueeze(0)
        causal = seq.mask is None  # fresh prefill: q == kv, top-left == bottom-right
        o = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=seq.mask,
            is_causal=causal,
            scale=scaling,
            enable_gqa=True,
        )
        out[seq.q_start : seq.q_start + seq.q_len] = o[0].transpose(0, 1)  # (1, H, q, D) -> rows (q, H, D)
    return out


def _decode_attention(query, k_cache, v_cache, group: DecodeGroup, scaling) -> torch.Tensor:
    """(B, H, 1, D): each one-row query (rows of query (T, H, D)) against its own slots, in one call.

    The G query heads that share a KV head go in as G query rows of that head (B, Hkv, G, D) rather than as
    G heads with `enable_gqa`: SDPA's CPU kernel then reads each KV head once instead of G times, 1.5-2.4x
    faster here (one row's result differs from the GQA call's in the last bit, as any re-blocking does)."""
    b, length = group.slots.shape
    heads, dim = query.shape[1], query.shape[2]
    kv_heads = k_cache.shape[1]
    q = query[group.rows]  # (B, H, D)
    q = q.view(b, kv_heads, heads // kv_heads, dim)  # head h reads KV head h // G (repeat_interleave order)
    flat = group.slots.view(-1)
    k = from_cache(k_cache.index_select(0, flat), q.dtype).view(b, length, kv_heads, dim).transpose(1, 2)
    v = from_cache(v_cache.index_select(0, flat), q.dtype).view(b, length, kv_heads, dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, scale=scaling)  # k, v: (B, Hkv, L, D)
    return out.view(b, heads, 1, dim)


def register_attention() -> str:
    """Register `pool_attention` with transformers (idempotent) and return its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, pool_attention)
    return ATTENTION_NAME
