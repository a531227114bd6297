"""Patch embeddings written as convolutions, run as the GEMM they are (16-bit towers).

Qwen2-VL, Qwen2.5-VL and Qwen3-VL embed their patches with an `nn.Conv3d` whose kernel is the whole patch
(stride = kernel, no padding): each of the N inputs (N, C, t, p, p) is one window, so the convolution is a
(N, C*t*p*p) x (C*t*p*p, D) matrix product. PyTorch's CPU convolution does not see that. In bf16, the 1,024
patches of a 448² image took oneDNN's convolution 68 ms on the 2-core Xeon, against 1.4 ms for the same
product as a GEMM (fp32: 36 ms against 5.7; docs/benchmarks.md 7m): a sixth of the whole tower.

The GEMM sums in its own order, so its outputs are not the convolution's bits: in bf16 about one output in
6,000 is one bf16 step away (random weights and inputs). Towers in 16-bit dtypes use it: their parity with HF
is its greedy tokens, their logits only close, as the decode attention already makes them. fp32 towers keep the
convolution, HF's own kernel, bit for bit. An input that is not one window (SigLIP's whole image, whose convolution oneDNN
runs well: 1.9 ms for a 384² image in bf16) goes to the convolution itself.
"""

from __future__ import annotations

import torch

from mmserve.models.swap import swap_modules

CONVS = (torch.nn.Conv2d, torch.nn.Conv3d)


class PatchLinear(torch.nn.Module):
    """A convolution over single windows as a linear layer over the flattened window; other inputs go to the
    convolution itself. `weight` is the convolution's (model code reads its dtype)."""

    def __init__(self, conv: torch.nn.Conv2d | torch.nn.Conv3d) -> None:
        super().__init__()
        self.conv = conv
        self.window = tuple(conv.kernel_size)
        out_channels = conv.out_channels
        self.linear = torch.nn.Linear(
            conv.weight[0].numel(), out_channels, bias=conv.bias is not None, device=conv.weight.device
        ).to(conv.weight.dtype)
        with torch.no_grad():  # (D, C, *k) -> (D, C * prod(k)): the row-major order of one flattened window
            self.linear.weight.copy_(conv.weight.reshape(out_channels, -1))
            if conv.bias is not None:
                self.linear.bias.copy_(conv.bias)

    @property
    def weight(self) -> torch.Tensor:
        return self.conv.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tuple(x.shape[2:]) != self.window:
            return self.conv(x)
        # (N, D): what the convolution gives as (N, D, 1, ..., 1)
        out = self.linear(x.reshape(x.shape[0], -1))
        return out.view(x.shape[0], -1, *([1] * len(self.window)))


def single_window(conv: torch.nn.Module) -> bool:
    """A convolution that reads non-overlapping whole windows: stride = kernel, no padding, dilation or groups."""
    return (
        type(conv) in CONVS
        and tuple(conv.stride) == tuple(conv.kernel_size)
        and conv.padding in ("valid", (0,) * len(conv.kernel_size))
        and all(d == 1 for d in conv.dilation)
        and conv.groups == 1
    )


def linearize_patch_convs(tower: torch.nn.Module, dtype: torch.dtype) -> int:
    """Replaces every single-window convolution under `tower` with a PatchLinear, in place, if `dtype` is a
    16-bit one (the module docstring says why not fp32); returns how many. Run it before packing the linear
    layers, so the new ones are packed too."""
    if dtype not in (torch.bfloat16, torch.float16):
        return 0
    return swap_modules(tower, lambda m: PatchLinear(m) if single_window(m) else None)
