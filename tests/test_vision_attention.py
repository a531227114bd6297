"""The Qwen-VL towers' vision attention with RoPE in one kernel (encoder.vision_attention, csrc/vision_ops.cpp):
HF's bits in fp32 and bf16, for the kernel alone, for one attention over several images, and for the encoder's
embeddings of every Qwen-VL family; without the kernels the towers keep HF's module."""

from __future__ import annotations

import pytest
import torch

from mmserve.config import MediaConfig
from mmserve.encoder.runner import MediaInput, build_encoder
from mmserve.encoder.vision_attention import FusedVisionAttention, fuse_vision_attention
from mmserve.models.family import load_family
from mmserve.multimodal.items import Modality
from mmserve.multimodal.media import MediaRef
from tests.conftest import random_image
from tests.engine_helpers import png_bytes

QWEN_VL = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 80])
def test_vision_rope_is_hfs_function_bit_for_bit(kernels, dtype, dim):
    from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb_vision

    torch.manual_seed(dim)
    rows, heads = 37, 3
    qkv = (torch.randn(rows, 3, heads, dim) * 4).to(dtype)
    q, k, _ = qkv.permute(1, 0, 2, 3).unbind(0)  # strided views, as the attention makes them
    angles = torch.randn(rows, dim // 2) * 20
    emb = torch.cat((angles, angles), dim=-1)
    ref_q, ref_k = apply_rotary_pos_emb_vision(q, k, emb.cos(), emb.sin())
    out_q, out_k = kernels.vision_rope(q, k, emb.cos(), emb.sin())
    assert out_q.is_contiguous() and out_q.dtype == dtype
    assert torch.equal(out_q, ref_q) and torch.equal(out_k, ref_k)


def first_attention(tower: torch.nn.Module) -> tuple[str, torch.nn.Module]:
    return next((n, m) for n, m in tower.named_modules() if type(m).__name__.endswith("VisionAttention"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", QWEN_VL)
def test_one_attention_over_several_images_is_hfs(kernels, tiny_model, arch, dtype):
    tower = load_family(tiny_model(arch)).load_tower(dtype)
    _, hf = first_attention(tower)
    fused = FusedVisionAttention(hf, kernels)
    torch.manual_seed(1)
    rows, dim = 40, hf.qkv.in_features
    hidden = torch.randn(rows, dim).to(dtype)
    head_dim = dim // hf.num_heads
    angles = torch.randn(rows, head_dim // 2) * 10
    emb = torch.cat((angles, angles), dim=-1)
    cu_seqlens = torch.tensor([0, 16, 28, 40], dtype=torch.int32)  # three images of 16, 12 and 12 patches
    with torch.no_grad():
        ref = hf(hidden, cu_seqlens=cu_seqlens, position_embeddings=(emb.cos(), emb.sin()))
        out = fused(hidden, cu_seqlens=cu_seqlens, position_embeddings=(emb.cos(), emb.sin()))
    assert torch.equal(out, ref)


@pytest.mark.parametrize("arch", QWEN_VL)
def test_the_encoder_fuses_the_towers_attention_and_keeps_its_embeddings(tiny_model, arch, kernels):
    family = load_family(tiny_model(arch))
    fused = build_encoder(family, "bfloat16", "cpu", 64, MediaConfig())
    plain = build_encoder(family, "bfloat16", "cpu", 64, MediaConfig(), cpu_kernels=False)
    try:
        assert isinstance(first_attention(fused.tower)[1], FusedVisionAttention)
        assert not any(isinstance(m, FusedVisionAttention) for m in plain.tower.modules())
        item = MediaInput(Modality.IMAGE, MediaRef.from_bytes(png_bytes(random_image(3, 72, 56))))
        a, b = fused.encode(item), plain.encode(item)
        for name, tensor in a.tensors.items():  # Qwen3-VL's DeepStack levels too
            assert torch.equal(tensor, b.tensors[name]), name
    finally:
        fused.close()
        plain.close()


def test_without_kernels_or_with_another_attention_the_tower_keeps_hfs(tiny_model, kernels):
    tower = load_family(tiny_model("qwen2_vl")).load_tower(torch.float32)
    assert fuse_vision_attention(tower, None) == 0
    name, hf = first_attention(tower)
    hf.config._attn_implementation = "eager"  # (the config is the tower's: every block sees it)
    assert fuse_vision_attention(tower, kernels) == 0 and tower.get_submodule(name) is hf
