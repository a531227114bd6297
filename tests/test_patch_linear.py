"""Patch convolutions as GEMMs in 16-bit towers (encoder.patch_linear): the convolution's outputs within a bf16
step, its shape and weight dtype; other inputs, other convolutions and fp32 towers keep the convolution. End to
end, the bf16 parity tests (tests/test_bf16_parity.py, the bf16 EPD ones) run the tiny towers with it against HF's
convolution."""

from __future__ import annotations

import pytest
import torch

from mmserve.config import MediaConfig
from mmserve.encoder.patch_linear import PatchLinear, linearize_patch_convs
from mmserve.encoder.runner import build_encoder
from mmserve.models.family import load_family


class Tower(torch.nn.Module):
    def __init__(self, conv: torch.nn.Module) -> None:
        super().__init__()
        self.embed = torch.nn.Sequential(conv)


def qwen_patch_conv(bias: bool) -> torch.nn.Conv3d:  # Qwen2-VL's: 3 channels, 2 frames, 14 x 14 pixels
    return torch.nn.Conv3d(
        3, 64, kernel_size=(2, 14, 14), stride=(2, 14, 14), bias=bias, dtype=torch.bfloat16
    )


@pytest.mark.parametrize("bias", [False, True])
def test_single_windows_as_a_gemm_give_the_convolutions_outputs(bias):
    torch.manual_seed(0)
    conv = qwen_patch_conv(bias)
    tower = Tower(conv)
    assert linearize_patch_convs(tower, torch.bfloat16) == 1
    patch = tower.embed[0]
    assert isinstance(patch, PatchLinear) and patch.weight.dtype == torch.bfloat16
    x = torch.randn(300, 3, 2, 14, 14, dtype=torch.bfloat16)
    with torch.no_grad():
        out, ref = patch(x), conv(x)
        assert out.shape == ref.shape == (300, 64, 1, 1, 1)
        assert out.view(-1, 64).shape == (300, 64)  # what Qwen's PatchEmbed does with it
        step = ref.float().abs().clamp(min=1e-3) * 2**-7  # one bf16 step at each output's magnitude
        assert ((out.float() - ref.float()).abs() <= step).all()
        wider = torch.randn(2, 3, 2, 28, 28, dtype=torch.bfloat16)  # several windows: the convolution itself
        assert torch.equal(patch(wider), conv(wider))


def test_fp32_towers_and_other_convolutions_keep_theirs():
    conv = qwen_patch_conv(False).float()
    tower = Tower(conv)
    assert linearize_patch_convs(tower, torch.float32) == 0 and tower.embed[0] is conv
    for other in (
        torch.nn.Conv2d(3, 8, kernel_size=3, stride=1, padding=1),  # overlapping windows
        torch.nn.Conv2d(3, 8, kernel_size=2, stride=2, groups=1, dilation=2),
        torch.nn.Conv1d(3, 8, kernel_size=2, stride=2),  # not a patch embedding's kind
    ):
        tower = Tower(other.to(torch.bfloat16))
        assert linearize_patch_convs(tower, torch.bfloat16) == 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_encoder_runs_qwens_patch_embedding_as_a_gemm_in_bf16(tiny_qwen2_vl, dtype):
    family = load_family(tiny_qwen2_vl)
    encoder = build_encoder(family, dtype, "cpu", 1.0, MediaConfig())
    try:
        proj = encoder.tower.get_submodule("patch_embed.proj")
        assert isinstance(proj, PatchLinear) == (dtype == "bfloat16")
        assert isinstance(proj, torch.nn.Conv3d) == (dtype == "float32")
    finally:
        encoder.close()
