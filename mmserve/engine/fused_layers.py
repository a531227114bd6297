"""The Qwen2 decoder layer with fewer ops: what a decode step spends outside its GEMMs.

A decode step on a CPU streams every weight once (the GEMM floor); the rest of it was HF's layer code: about
75 small ops and ten module calls per layer, 5-20 us each, 24 layers deep. `FusedDecoderLayer` replaces each
HF layer of the Qwen2 shape (Qwen2-VL, Qwen2.5-VL, and the Qwen2 language models of LLaVA-OneVision and
Qwen2-Audio) in its model's `layers` list, so HF's text model still embeds, builds the rotary tables, and
applies the final norm. The layer computes what HF's computes, op for op, except:
- q, k and v are one GEMM, and gate and up another, over weights concatenated once at load;
- RoPE runs once over the q and k heads together, with `rotate_half(x) * sin` written as
  `roll(x) * sin'`, sin' being sin with its first half negated (built once per step): the same products;
- activations stay in rows (T, heads, dim) and go to the pool attention (`attention.attend`) directly.
In fp32 (MKL) the concatenated GEMMs are bitwise equal to the separate ones, so with the eager ops the layer's
output is bitwise HF's; in bf16 oneDNN may block a concatenated q/k/v GEMM differently at some row counts (64,
300), a last-bit difference of the same kind as batching rows already gives. `tests/test_fused_layers.py` holds
both. On a CPU the norms, RoPE and SiLU-and-mul run in mmserve's kernels when the step's metadata carries them
(`cpu_kernels.py`: one pass each, the same roundings; tests/test_cpu_kernels.py), and a pure decode step runs
every layer in one op (`DecodeStack`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mmserve.engine.layers.attention import AttentionMetadata, attend
from mmserve.engine.packed_linear import PackedLinear
from mmserve.models.layer_specs import AttentionSpec
from mmserve.quant.linear import QuantLinear, StackedLinear, concat_quantized

# HF decoder layers of exactly this shape: pre-norm RMSNorm, q/k/v with bias, no q/k norm, a SiLU-gated MLP.
FUSABLE_LAYERS = ("Qwen2DecoderLayer", "Qwen2VLDecoderLayer", "Qwen2_5_VLDecoderLayer")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's Qwen2 RMSNorm, the same ops in the same order (in fp32, back to the input dtype, then the weight)."""
    dtype = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    return weight * x.to(dtype)


def concat_linears(linears: list[torch.nn.Module]) -> torch.nn.Module:
    """One Linear whose output is the given layers' outputs side by side. Built on the meta device and given
    the concatenated weights: no random init or throw-away allocation (seconds a layer for a 7B model's MLP).
    Layers of a quantized checkpoint concatenate their codes (mmserve.quant.linear), or stay apart in one
    StackedLinear where their codes cannot share a layer."""
    if any(isinstance(m, QuantLinear) for m in linears):
        fused = concat_quantized(linears) if all(isinstance(m, QuantLinear) for m in linears) else None
        return fused if fused is not None else StackedLinear(linears)
    first = linears[0]
    bias = first.bias is not None
    width = sum(m.out_features for m in linears)
    out = torch.nn.Linear(first.in_features, width, bias=bias, device="meta")
    out.weight = torch.nn.Parameter(torch.cat([m.weight for m in linears]), requires_grad=False)
    if bias:
        out.bias = torch.nn.Parameter(torch.cat([m.bias for m in linears]), requires_grad=False)
    return out


class FusedDecoderLayer(torch.nn.Module):
    """A drop-in for one HF Qwen2-shaped decoder layer when it runs over our pool (`mm_attn`)."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        self.layer_idx = attn.layer_idx
        self.head_dim = attn.head_dim
        self.num_heads = attn.q_proj.out_features // attn.head_dim
        self.num_kv_heads = attn.k_proj.out_features // attn.head_dim
        self.scaling = attn.scaling
        self.input_norm = layer.input_layernorm.weight
        self.input_eps = layer.input_layernorm.variance_epsilon
        self.post_norm = layer.post_attention_layernorm.weight
        self.post_eps = layer.post_attention_layernorm.variance_epsilon
        self.qkv_proj = concat_linears([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o_proj = attn.o_proj
        self.gate_up_proj = concat_linears([mlp.gate_proj, mlp.up_proj])
        self.down_proj = mlp.down_proj
        self.intermediate = mlp.gate_proj.out_features

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, **kwargs) -> torch.Tensor:
        meta: AttentionMetadata = kwargs["mm_attn"]
        return self.layer_ops(hidden_states[0], meta, position_embeddings).unsqueeze(0)

    def layer_ops(self, x: torch.Tensor, meta: AttentionMetadata, position_embeddings) -> torch.Tensor:
        """The layer op by op over rows x (T, hidden): the CPU kernels where the step carries them, else the
        eager ops."""
        kernels = meta.kernels  # the same sums in one pass each (cpu_kernels.py), or the eager ops
        t, heads, kv_heads, dim = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        norm = kernels.rms_norm if kernels is not None else rms_norm
        qkv = self.qkv_proj(norm(x, self.input_norm, self.input_eps))  # (T, (H + 2 Hkv) D)
        qk = qkv[:, : (heads + kv_heads) * dim].view(t, heads + kv_heads, dim)
        cos, sin = rotary_rows(meta, position_embeddings, qk.dtype)
        if kernels is not None:
            kernels.rope_(qk, cos, sin)  # in place: qkv is this layer's own
        else:
            qk = qk * cos.unsqueeze(1) + qk.roll(dim // 2, -1) * sin.unsqueeze(1)  # (T, H + Hkv, D)
        value = qkv[:, (heads + kv_heads) * dim :].view(t, kv_heads, dim)
        out = attend(self.layer_idx, qk[:, :heads], qk[:, heads:], value, meta, self.scaling)  # (T, H, D)
        attn = self.o_proj(out.reshape(t, heads * dim))
        if kernels is not None:
            x, normed = kernels.add_rms_norm(x, attn, self.post_norm, self.post_eps)
        else:
            x = x + attn
            normed = rms_norm(x, self.post_norm, self.post_eps)
        gate_up = self.gate_up_proj(normed)  # (T, 2 I)
        if kernels is not None:
            act = kernels.silu_mul(gate_up)
        else:
            act = F.silu(gate_up[:, : self.intermediate]) * gate_up[:, self.intermediate :]
        return x + self.down_proj(act)


def rotary_rows(
    meta: AttentionMetadata, position_embeddings, dtype, kind: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's (cos, sin), each (1, T, D), as contiguous (T, D) rows of `dtype` with sin's first half negated:
    built by the first layer (of its `kind`, for models whose layer types rotate by their own bases) of a step
    and kept on the step's metadata for the others."""
    rows = meta.rotary.get(kind)
    if rows is None:
        cos, sin = position_embeddings
        half = sin.shape[-1] // 2
        signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        rows = meta.rotary[kind] = (cos[0].to(dtype).contiguous(), signed[0].to(dtype).contiguous())
    return rows


class DecodeStack:
    """Every FusedDecoderLayer of a text model as one op for pure decode steps on the CPU kernels
    (csrc/decode_layers.cpp: the layers' kernels in the same order, bitwise `layer_ops`, without a Python call
    per op). Built once the weights are in their final form (packed or not): it holds them in flat lists."""

    def __init__(self, text_model: torch.nn.Module, kernels) -> None:
        layers: list[FusedDecoderLayer] = list(text_model.layers)
        first = layers[0]
        self.text_model = text_model
        self.packed = isinstance(first.qkv_proj, PackedLinear)  # pack_linears packs every one or none
        self.quantized = isinstance(first.qkv_proj, QuantLinear)  # quantized: every one (`stackable`)
        self.shape = (first.num_heads, first.num_kv_heads)
        self.scale = first.scaling
        self.weights, self.biases, self.eps = [], [], []
        self.codes, self.scales, self.zeros, self.kinds, self.groups = [], [], [], [], []
        for layer in layers:
            linears = (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
            self.biases += [m.bias for m in linears]
            self.eps += [layer.input_eps, layer.post_eps]
            if self.quantized:
                self.weights += [layer.input_norm, layer.post_norm]
                self.codes += [m.qweight.data for m in linears]
                self.scales += [m.qweight.scales for m in linears]
                self.zeros += [m.qweight.zeros for m in linears]
                self.kinds += [m.kind_code for m in linears]
                self.groups += [m.qweight.group for m in linears]
                continue
            qkv, o, gate_up, down = (m.packed if self.packed else m.weight for m in linears)
            self.weights += [layer.input_norm, qkv, o, layer.post_norm, gate_up, down]
        self.layer_ids = [layer.layer_idx for layer in layers]
        self.op = kernels.decode_layers_quant if self.quantized else kernels.decode_layers
        # quantized: as many rows as quant_linear serves (beyond, the Python layers dequantize for a GEMM)
        self.max_rows = first.qkv_proj.kernel_rows(first.input_norm.dtype) if self.quantized else None

    def takes(self, rows: int) -> bool:
        """Whether a pure decode step of `rows` rows runs here (quantized layers: as many as quant_linear
        serves better than a GEMM over the dequantized weights, which the Python layers then call)."""
        return self.max_rows is None or rows <= self.max_rows

    @staticmethod
    def stackable(layers: list[torch.nn.Module]) -> bool:
        """Whether the layers' linear layers are all dense, or all QuantLinear in input order (act-order codes
        gather their inputs first, which the op does not)."""
        linears = [m for layer in layers for m in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)]
        quantized = [m for m in linears if isinstance(m, QuantLinear)]
        if not quantized:
            return not any(isinstance(m, StackedLinear) for m in linears)
        return len(quantized) == len(linears) and all(m.qweight.perm is None for m in quantized)

    def __call__(self, inputs: torch.Tensor, position_ids, meta: AttentionMetadata) -> torch.Tensor:
        """(1, T, hidden): what the HF text model's forward returns for this step, computed as it computes it
        (its rotary tables, every layer, the final norm), without the rest of what it does per call: its
        decorators, and a causal mask that the pool attention never reads."""
        cos, sin = rotary_rows(meta, self.text_model.rotary_emb(inputs, position_ids), inputs.dtype)
        group = meta.decode
        caches = ([meta.k_cache[i] for i in self.layer_ids], [meta.v_cache[i] for i in self.layer_ids])
        step = (*caches, meta.new_slots, group.row_ids, group.slots, group.lengths, self.scale)
        if self.quantized:  # the norms as weights, each linear layer as its codes
            codes = (self.codes, self.scales, self.zeros, self.kinds, self.groups)
            hidden = self.op(inputs[0], self.weights, *codes, self.biases, self.eps, *self.shape, cos, sin, *step)
        else:
            hidden = self.op(inputs[0], self.weights, self.biases, self.eps, *self.shape, self.packed, cos, sin, *step)
        return self.text_model.norm(hidden.unsqueeze(0))


def fusable(layer: torch.nn.Module, spec) -> bool:
    """Whether one decoder layer runs as a FusedDecoderLayer: its kind is plain causal attention over the pool
    (no window, no item blocks, its own rows) and its code is one whose forward the fused layer reproduces."""
    return (
        isinstance(spec, AttentionSpec)
        and spec.window is None
        and not spec.bidirectional_items
        and spec.kv_source is None
        and type(layer).__name__ in FUSABLE_LAYERS
    )


def fuse_decoder_layers(text_model: torch.nn.Module, specs) -> int:
    """Replaces, layer by layer, every HF decoder layer of `text_model.layers` that is `fusable` with a
    FusedDecoderLayer, and every Gemma 3 layer (any attention kind: its views decide) with a FusedGemmaLayer
    (mmserve.engine.fused_gemma), in place (the separate q/k/v and gate/up weights are freed); returns how many.
    The other layers stay HF's, over the pool attention (and the state pool), so one layer of another kind leaves
    the fast path to the rest."""
    from mmserve.engine.fused_gemma import FUSABLE_GEMMA, FusedGemmaLayer

    layers = getattr(text_model, "layers", None)
    if layers is None:
        return 0
    done = 0
    for i, (layer, spec) in enumerate(zip(layers, specs, strict=True)):
        if fusable(layer, spec):
            layers[i] = FusedDecoderLayer(layer)
            done += 1
        elif isinstance(spec, AttentionSpec) and type(layer).__name__ in FUSABLE_GEMMA:
            layers[i] = FusedGemmaLayer(layer)
            done += 1
    return done
