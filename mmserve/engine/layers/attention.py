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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from mmserve.engine.cpu_kernels import CpuKernels
    from mmserve.engine.layers.linear_state import StateMetadata

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
class DecodeGroup:
    """Every one-row query of a step, attended in one call."""

    rows: torch.Tensor | slice  # their query rows in the packed batch (a slice when consecutive)
    slots: torch.Tensor  # int64 (B, L): each row's KV slots, padded with slot 0 past its length
    mask: torch.Tensor | None  # bool (B, 1, 1, L), True where a slot is the row's; None if none is padded
    row_ids: torch.Tensor  # int64 (B,): the rows as ids (the CPU kernel's form of `rows`)
    lengths: torch.Tensor  # int64 (B,): each row's number of slots

    @staticmethod
    def make(rows: list[int], kv_slots: list[torch.Tensor], device: torch.device) -> DecodeGroup:
        lengths = torch.tensor([s.shape[0] for s in kv_slots])
        longest = int(lengths.max())
        if int(lengths.min()) == longest:
            slots, mask = torch.stack(kv_slots), None
        else:
            slots = torch.nn.utils.rnn.pad_sequence(kv_slots, batch_first=True)
            mask = (torch.arange(longest) < lengths.unsqueeze(1))[:, None, None, :].to(device)
        consecutive = rows == list(range(rows[0], rows[0] + len(rows)))
        row_ids = torch.tensor(rows, device=device)
        where = slice(rows[0], rows[0] + len(rows)) if consecutive else row_ids
        return DecodeGroup(where, slots.to(device), mask, row_ids, lengths.to(device))


@dataclass
class AttentionMetadata:
    k_cache: list[torch.Tensor | None]  # per layer (num_slots, num_kv_heads, head_dim); None: no rows
    v_cache: list[torch.Tensor]
    new_slots: torch.Tensor  # int64 (total_tokens,): slot of every packed token
    seqs: list[SeqAttention]  # the queries of more than one row (prefill chunks), each attended on its own
    decode: DecodeGroup | None = None  # the one-row queries
    num_rows: int = 0  # total packed query rows
    # this step's RoPE rows, built by the first fused layer for the others (fused_layers.rotary_rows)
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None
    kernels: CpuKernels | None = None  # mmserve's CPU kernels when the engine runs them (cpu_kernels.py)
    state: StateMetadata | None = None  # hybrid models: the linear layers' state slots (layers/linear_state.py)

    def __post_init__(self) -> None:
        # One gather per layer for all prefill chunks is much cheaper than one per request; each request then
        # reads its rows of the gathered block as a view. Offsets into that block:
        lengths = [s.kv_slots.shape[0] for s in self.seqs]
        self.kv_slots = torch.cat([s.kv_slots for s in self.seqs]) if self.seqs else None
        self.kv_offsets = [sum(lengths[:i]) for i in range(len(lengths))]

    @classmethod
    def build(
        cls, k_cache, v_cache, new_slots, seqs: list[SeqAttention], device, kernels: CpuKernels | None = None
    ) -> AttentionMetadata:
        """Split `seqs` (in row order) into the decode group and the chunks attended one by one."""
        ones = [s for s in seqs if s.q_len == 1]
        decode = (
            DecodeGroup.make([s.q_start for s in ones], [s.kv_slots for s in ones], device) if ones else None
        )
        rest = [s for s in seqs if s.q_len > 1]
        if torch.device(device).type != "cpu":  # slot ids and masks are built on the CPU
            rest = [
                SeqAttention(s.q_start, s.q_len, s.kv_slots.to(device), _to(s.mask, device)) for s in rest
            ]
        return cls(k_cache, v_cache, new_slots, rest, decode, sum(s.q_len for s in seqs), kernels=kernels)


def _to(mask: torch.Tensor | None, device) -> torch.Tensor | None:
    return None if mask is None else mask.to(device)


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
    (any strides); writes the new K/V into the pool and returns (T, H, D)."""
    k_cache, v_cache = meta.k_cache[layer], meta.v_cache[layer]
    group, kernels = meta.decode, meta.kernels  # the pool holds the model's dtype, which the kernels take
    if kernels is not None:
        kernels.store_kv_(k_cache, v_cache, meta.new_slots, key, value)
    else:
        k_cache.index_copy_(0, meta.new_slots, key.to(k_cache.dtype))
        v_cache.index_copy_(0, meta.new_slots, value.to(v_cache.dtype))
    if group is not None and kernels is None:
        decoded = _decode_attention(query, k_cache, v_cache, group, scaling)  # (B, H, 1, D)
        if not meta.seqs:  # a pure decode step, rows 0..B-1 in order: (B, H, 1, D) -> (B, H, D)
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
    if not meta.seqs:
        return out
    k_all = k_cache.index_select(0, meta.kv_slots).transpose(0, 1)  # (Hkv, sum kv, D)
    v_all = v_cache.index_select(0, meta.kv_slots).transpose(0, 1)
    for seq, offset in zip(meta.seqs, meta.kv_offsets, strict=True):
        q = query[seq.q_start : seq.q_start + seq.q_len].transpose(0, 1).unsqueeze(0)  # (1, H, q, D)
        kv_len = seq.kv_slots.shape[0]
        k = k_all[:, offset : offset + kv_len].unsqueeze(0)  # (1, Hkv, kv, D)
        v = v_all[:, offset : offset + kv_len].unsqueeze(0)
        causal = seq.mask is None  # fresh prefill: q == kv, top-left == bottom-right
        o = F.scaled_dot_product_attention(
            q,
            k.to(q.dtype),
            v.to(q.dtype),
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
    k = k_cache.index_select(0, flat).view(b, length, *k_cache.shape[1:]).transpose(1, 2)  # (B, Hkv, L, D)
    v = v_cache.index_select(0, flat).view(b, length, *v_cache.shape[1:]).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=group.mask, scale=scaling)
    return out.view(b, heads, 1, dim)


def register_attention() -> str:
    """Register `pool_attention` with transformers (idempotent) and return its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, pool_attention)
    return ATTENTION_NAME
