"""The towers' MLP activations over their input in row blocks: the module's bits, and only where that is safe."""

from __future__ import annotations

import pytest
import torch
from transformers.activations import ACT2FN

from mmserve.encoder.inplace_activation import InPlaceActivation, block_activations


@pytest.mark.parametrize("name", ["quick_gelu", "silu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,width", [(1, 7), (300, 3072), (1000, 1283)])
def test_blocks_give_the_modules_bits(name, dtype, rows, width):
    act = ACT2FN[name]
    x = torch.randn(rows, width, dtype=dtype) * 6
    x[0, :3] = torch.tensor([float("inf"), -float("inf"), float("nan")])
    expected = act(x)
    blocked = x.clone()
    out = InPlaceActivation(act)(blocked)
    assert out.data_ptr() == blocked.data_ptr()  # written over its input
    if dtype == torch.bfloat16:  # the module's bits: its body and scalar loop agree on every bf16 value
        assert torch.equal(out.view(torch.int16), expected.view(torch.int16))
        return
    # fp32: PyTorch's scalar loop and vectorized body differ in the last bit on some values, and a whole-tensor
    # call takes the scalar loop at the ends of its threads' pieces: a few values in a million, an ulp or two off
    bits, ref = out.view(torch.int32), expected.view(torch.int32)
    assert int((bits != ref).sum()) <= 8 and int((bits - ref).abs().max()) <= 4
    assert torch.equal(out.isnan(), expected.isnan())


def test_inputs_it_cannot_block_go_to_the_module():
    act = InPlaceActivation(ACT2FN["quick_gelu"])
    x = torch.randn(8, 6)[:, ::2]  # not contiguous
    kept = x.clone()
    assert torch.equal(act(x), ACT2FN["quick_gelu"](kept)) and torch.equal(x, kept)  # input untouched


def test_only_the_qwen_vl_mlps_activations_are_replaced():
    from transformers import Qwen2VLConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    vision = Qwen2VLConfig(
        vision_config=dict(depth=2, embed_dim=16, num_heads=2, hidden_size=32)
    ).vision_config
    tower = Qwen2VisionTransformerPretrainedModel(vision).eval()
    pixels = torch.randn(16, 3 * 2 * 14 * 14)
    grid = torch.tensor([[1, 4, 4]])
    with torch.no_grad():
        expected = tower(pixels, grid_thw=grid).pooler_output
    assert block_activations(tower) == 2  # the blocks' QuickGELUs; the merger's GELU (erf) is left
    assert isinstance(tower.blocks[0].mlp.act, InPlaceActivation)
    assert isinstance(tower.merger.mlp[1], torch.nn.GELU)
    with torch.no_grad():  # rows of 64: no scalar loop in either (see above)
        assert torch.equal(tower(pixels, grid_thw=grid).pooler_output, expected)
