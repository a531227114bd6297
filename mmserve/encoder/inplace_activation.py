"""The Qwen-VL towers' MLP activation over its input, in row blocks (fp32 towers, and 16-bit ones without a table).

QuickGELU (`x * sigmoid(1.702 * x)`) is three element-wise ops, each writing a new tensor the size of the MLP's
hidden rows. Past glibc's largest mmap threshold (32 MB) every such tensor is a fresh mapping whose pages fault in
as they are written: for four 448² images in fp32 (4096 x 3072 rows, 50 MB) the three ops took 140 ms a layer
on the 2-core EPYC, a ninth of the whole tower, against about 10 ms for the same ops over cache-sized pieces
(docs/benchmarks.md 11). `InPlaceActivation` runs the activation on blocks of about 1 MB of rows and writes
each block's result over its input: no large allocation, every block's temporaries in cache.

Writing over the input is safe only where nothing else reads it: the activation of these MLPs is applied to the
output of a linear layer and only its result is used (`fc2(act(fc1(x)))`, `down(act(gate(x)) * up(x))`), so
only those parents' activations are replaced, and only QuickGELU and SiLU. In bf16 the results are the module's
bits: PyTorch's vectorized body and scalar loop agree on every bf16 value for these two (activation_table.
bf16_table checks it). In fp32 they disagree in the last bit on some values, and a whole-tensor call takes the
scalar loop at the end of each thread's piece while the blocks (whole rows) take the loop elsewhere: a few values
in a million are an ulp or two off HF's, as a GEMM blocked differently makes them (the packed fp32 GEMMs already do);
the fp32 parity tests hold HF's greedy tokens. Without mmserve's CPU kernels (`--disable-cpu-kernels`) the
tower keeps HF's modules.
"""

from __future__ import annotations

import torch

# (module, class) of the MLPs whose activation input is a fresh linear output, and the activation's attribute.
MLPS = {
    ("transformers.models.qwen2_vl.modeling_qwen2_vl", "VisionMlp"): "act",
    ("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", "Qwen2_5_VLMLP"): "act_fn",
}
BLOCK_BYTES = 1 << 20


def blockable(activation: torch.nn.Module) -> bool:
    """QuickGELU and SiLU: element-wise with one value per input wherever it sits (see the module docstring)."""
    from transformers import activations

    kinds = tuple(
        getattr(activations, n) for n in ("QuickGELUActivation", "SiLUActivation") if hasattr(activations, n)
    )
    return isinstance(activation, (*kinds, torch.nn.SiLU))


class InPlaceActivation(torch.nn.Module):
    """`activation(x)` written over `x` in row blocks; the module itself for inputs it cannot so handle."""

    def __init__(self, activation: torch.nn.Module) -> None:
        super().__init__()
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or not x.is_contiguous() or x.requires_grad or x.dim() == 0:
            return self.activation(x)
        rows = x.view(-1, x.shape[-1])
        step = max(1, BLOCK_BYTES // max(1, x.shape[-1] * x.element_size()))
        for block in rows.split(step):
            block.copy_(self.activation(block))
        return x


def block_activations(tower: torch.nn.Module, enabled: bool = True) -> int:
    """Replaces the activation of every MLP of `MLPS` under `tower` (QuickGELU / SiLU ones) with an
    InPlaceActivation, in place, if `enabled`; returns how many. Activations already replaced (bf16 tables) are
    left."""
    if not enabled:
        return 0
    done = 0
    for module in tower.modules():
        attr = MLPS.get((type(module).__module__, type(module).__name__))
        activation = getattr(module, attr, None) if attr else None
        if activation is not None and blockable(activation):
            setattr(module, attr, InPlaceActivation(activation))
            done += 1
    return done
