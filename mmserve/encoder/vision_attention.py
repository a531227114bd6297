"""The Qwen-VL towers' vision attention with its rotary embedding in one kernel (on a CPU with mmserve's kernels).

Qwen2-VL, Qwen2.5-VL and Qwen3-VL share one vision attention (transformers 5: `VisionAttention`,
`Qwen2_5_VLVisionAttention`, `Qwen3VLVisionAttention`, the same forward): the qkv GEMM, HF's
`apply_rotary_pos_emb_vision` over q and k, SDPA over each image's patches (`cu_seqlens`), the output GEMM.
The rotary function is about eight element-wise ops a layer over the whole (patches, heads, D) q and k; for a
448² image in bf16 they took 40 ms of a 287 ms tower on the 2-core Xeon. `FusedVisionAttention` is that forward
with the rotary in `vision_rope` (engine/csrc/vision_ops.cpp), HF's bits in fp32 and bf16, and everything
else as HF runs it, SDPA through transformers' own attention function. Towers loaded with another attention
implementation (FlashAttention on a GPU) keep HF's module.
"""

from __future__ import annotations

import torch

from mmserve.engine.cpu_kernels import CpuKernels
from mmserve.models.swap import swap_modules

# The vision attention classes whose forward FusedVisionAttention reproduces, by module and class name.
FUSABLE = {
    "transformers.models.qwen2_vl.modeling_qwen2_vl": "VisionAttention",
    "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl": "Qwen2_5_VLVisionAttention",
    "transformers.models.qwen3_vl.modeling_qwen3_vl": "Qwen3VLVisionAttention",
}


class FusedVisionAttention(torch.nn.Module):
    """HF's Qwen-VL vision attention over the same qkv and proj layers, RoPE in one kernel."""

    def __init__(self, attention: torch.nn.Module, kernels: CpuKernels) -> None:
        super().__init__()
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        self.qkv, self.proj = attention.qkv, attention.proj
        self.num_heads = attention.num_heads
        self.scaling = attention.scaling
        self.config = attention.config
        # What transformers' SDPA function reads off the module it is given.
        self.num_key_value_groups, self.is_causal, self.attention_dropout = 1, False, 0.0
        self.attend = ALL_ATTENTION_FUNCTIONS["sdpa"]
        self.rope = kernels.vision_rope

    def forward(
        self,
        hidden_states: torch.Tensor,
        cu_seqlens: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        max_seqlen: int | None = None,
        **kwargs,
    ) -> torch.Tensor:
        rows = hidden_states.shape[0]
        q, k, v = self.qkv(hidden_states).reshape(rows, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        cos, sin = position_embeddings
        q, k = self.rope(q, k, cos.float().contiguous(), sin.float().contiguous())
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # (1, heads, S, D)
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        outputs = [  # each image (or video frame group) attends within itself, as HF's non-flash path
            self.attend(
                self, qi, ki, vi, attention_mask=None, scaling=self.scaling, dropout=0.0, is_causal=False
            )[0]
            for qi, ki, vi in zip(q.split(lengths, 2), k.split(lengths, 2), v.split(lengths, 2), strict=True)
        ]
        out = torch.cat(outputs, dim=1).reshape(rows, -1).contiguous()
        return self.proj(out)


def fusable(module: torch.nn.Module) -> bool:
    cls = type(module)
    return FUSABLE.get(cls.__module__) == cls.__name__ and module.config._attn_implementation == "sdpa"


def fuse_vision_attention(tower: torch.nn.Module, kernels: CpuKernels | None) -> int:
    """Replaces every fusable vision attention under `tower` with a FusedVisionAttention, in place, given
    mmserve's CPU kernels (None: the tower is left as it is); returns how many."""
    if kernels is None:
        return 0
    return swap_modules(tower, lambda m: FusedVisionAttention(m, kernels) if fusable(m) else None)
