"""Gemma 3's decoder layer with fewer ops: what a Gemma 3 decode step spends outside its GEMMs.

transformers' `Gemma3DecoderLayer` normalizes six times a layer (before attention, q and k per head, after
attention, before and after the MLP; each `Gemma3RMSNorm` about seven ops: x to float, square, mean, rsqrt,
multiply, times `1 + w` in float, back to the dtype), rotates q and k with `rotate_half`, and calls ten modules.
`FusedGemmaLayer` replaces each such layer in its text model's `layers` list, so transformers' text model still
embeds (scaled), builds both rotary tables (local and global bases) and applies the final norm. It computes what
transformers' layer computes, op for op, except:
- q, k and v are one GEMM, and gate and up another, over weights concatenated once at load;
- each norm is one pass (`gemma_rms_norm`, csrc/gemma_ops.cpp: the same roundings), the post-norms adding the
  residual in the same pass, where the step carries mmserve's CPU kernels; the eager ops otherwise;
- RoPE is `x * cos + roll(x) * sin'` (sin' with its first half negated), in place by the `rope_` kernel: the same
  products as `rotate_half`'s;
- attention goes to the pool attention (`attention.attend`) in rows, for every layer kind Gemma 3 has (sliding
  windows, image blocks): the step's views decide.
fp32 (MKL) concatenated GEMMs are bitwise the separate ones; tests/test_fused_layers.py holds the layer against
transformers'.
"""

from __future__ import annotations

import torch

from mmserve.engine.fused_layers import concat_linears, rotary_rows
from mmserve.engine.layers.attention import AttentionMetadata, attend

FUSABLE_GEMMA = ("Gemma3DecoderLayer",)


def gemma_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """transformers' Gemma3RMSNorm, the same ops in the same order (then `residual +` it, in the dtype)."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = (h * (1.0 + weight.float())).to(dtype)
    return h if residual is None else residual + h


class FusedGemmaLayer(torch.nn.Module):
    """A drop-in for one transformers Gemma 3 decoder layer when it runs over our pool (`mm_attn`)."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        self.layer_idx, self.layer_type = attn.layer_idx, attn.layer_type
        self.head_dim = attn.head_dim
        self.num_heads = attn.q_proj.out_features // attn.head_dim
        self.num_kv_heads = attn.k_proj.out_features // attn.head_dim
        self.scaling = attn.scaling
        self.qkv_proj = concat_linears([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o_proj = attn.o_proj
        self.gate_up_proj = concat_linears([mlp.gate_proj, mlp.up_proj])
        self.down_proj = mlp.down_proj
        self.act_fn = mlp.act_fn
        self.intermediate = mlp.gate_proj.out_features
        norms = {
            "input": layer.input_layernorm,
            "q": attn.q_norm,
            "k": attn.k_norm,
            "post_attention": layer.post_attention_layernorm,
            "pre_mlp": layer.pre_feedforward_layernorm,
            "post_mlp": layer.post_feedforward_layernorm,
        }
        self.norm_weights = {name: m.weight for name, m in norms.items()}
        self.eps = {name: m.eps for name, m in norms.items()}

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, **kwargs) -> torch.Tensor:
        meta: AttentionMetadata = kwargs["mm_attn"]
        return self.layer_ops(hidden_states[0], meta, position_embeddings).unsqueeze(0)

    def norm(self, meta, name: str, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if meta.kernels is not None:
            return meta.kernels.gemma_rms_norm(x, self.norm_weights[name], self.eps[name], residual)
        return gemma_norm(x, self.norm_weights[name], self.eps[name], residual)

    def layer_ops(self, x: torch.Tensor, meta: AttentionMetadata, position_embeddings) -> torch.Tensor:
        """The layer op by op over rows x (T, hidden)."""
        t, heads, kv_heads, dim = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(self.norm(meta, "input", x))  # (T, (H + 2 Hkv) D)
        q = self.norm(meta, "q", qkv[:, : heads * dim].view(t, heads, dim))  # (T, H, D), its own storage
        k = self.norm(meta, "k", qkv[:, heads * dim : (heads + kv_heads) * dim].view(t, kv_heads, dim))
        value = qkv[:, (heads + kv_heads) * dim :].view(t, kv_heads, dim)
        cos, sin = rotary_rows(meta, position_embeddings, q.dtype, self.layer_type)
        if meta.kernels is not None:
            meta.kernels.rope_(q, cos, sin)
            meta.kernels.rope_(k, cos, sin)
        else:
            q = q * cos.unsqueeze(1) + q.roll(dim // 2, -1) * sin.unsqueeze(1)
            k = k * cos.unsqueeze(1) + k.roll(dim // 2, -1) * sin.unsqueeze(1)
        out = attend(self.layer_idx, q, k, value, meta, self.scaling)  # (T, H, D)
        x = self.norm(meta, "post_attention", self.o_proj(out.reshape(t, heads * dim)), x)
        gate_up = self.gate_up_proj(self.norm(meta, "pre_mlp", x))  # (T, 2 I)
        act = self.act_fn(gate_up[:, : self.intermediate]) * gate_up[:, self.intermediate :]
        return self.norm(meta, "post_mlp", self.down_proj(act), x)
