"""The towers' MLP activations in bf16 by table (on a CPU with mmserve's kernels).

In bf16 an element-wise activation is a function of one 16-bit value, so all its outputs fit in a table of
65,536 entries. The table here is the activation module's own output for every bf16 value, computed once, so
looking an input up gives the module's bits; `bf16_lookup` (engine/csrc/vision_ops.cpp) does it with one
gather per 16 elements. It pays where the activation is several ops: Qwen2-VL's QuickGELU (`x * sigmoid(1.702
* x)`, three ops rounding to bf16 each) took 29 ms of a 448² image's 250 ms tower on the 2-core Xeon. SiLU
(Qwen2.5-VL's gated MLP) gets one too; the GELUs (Qwen3-VL, SigLIP, Qwen2-Audio) have no table that is their
bits (`bf16_table` says why) and stay as they are. Other dtypes, devices and layouts call the module itself.
"""

from __future__ import annotations

import torch

from mmserve.engine.cpu_kernels import CpuKernels
from mmserve.models.swap import swap_modules

# transformers' names of element-wise activations (those of this transformers that exist are used).
HF_ACTIVATIONS = (
    "QuickGELUActivation",
    "GELUTanh",
    "PytorchGELUTanh",
    "NewGELUActivation",
    "GELUActivation",
    "SiLUActivation",
)


def elementwise_activations() -> tuple[type, ...]:
    from transformers import activations

    found = tuple(getattr(activations, name) for name in HF_ACTIVATIONS if hasattr(activations, name))
    return (*found, torch.nn.SiLU, torch.nn.GELU)


def bf16_table(activation: torch.nn.Module) -> torch.Tensor | None:
    """(65536,) int32: the bf16 bits of `activation` of each bf16 value (low 16 bits; indexed by the input's), or
    None if the module's bits depend on where a value sits in its tensor.

    PyTorch's element-wise CPU kernels run a vectorized body and a scalar loop for what is left of each thread's
    piece, and the two need not agree: GELU with tanh gives -0 for -5.125 in the body and -1.5e-7 in the
    scalar loop (4 such values; 660 for GELU with erf). Such a module has no one table of its bits. QuickGELU
    and SiLU agree on every value (NaN inputs give NaN either way), so their table is the module's bits for
    an input anywhere in any tensor."""
    values = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    strided = torch.empty(2 * values.numel(), dtype=torch.bfloat16)[::2]  # not contiguous: the scalar loop
    strided.copy_(values)
    with torch.no_grad():
        body, scalar = activation(values), activation(strided)
    same = (body.view(torch.int16) == scalar.view(torch.int16)) | (body.isnan() & scalar.isnan())
    if not bool(same.all()):
        return None
    return body.view(torch.int16).to(torch.int32) & 0xFFFF


class TableActivation(torch.nn.Module):
    """`activation` by table for contiguous bf16 CPU inputs, the module itself for anything else."""

    def __init__(self, activation: torch.nn.Module, table: torch.Tensor, kernels: CpuKernels) -> None:
        super().__init__()
        self.activation = activation
        self.table = table
        self.lookup = kernels.bf16_lookup

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or x.device.type != "cpu" or not x.is_contiguous():
            return self.activation(x)
        return self.lookup(x, self.table)


def tabulate_activations(tower: torch.nn.Module, dtype: torch.dtype, kernels: CpuKernels | None) -> int:
    """Replaces every element-wise activation module under a bf16 `tower` with a TableActivation, in place,
    given mmserve's CPU kernels (otherwise the tower is left as it is); returns how many. One table per kind
    and settings of activation, shared by its modules."""
    if kernels is None or dtype != torch.bfloat16:
        return 0
    kinds = elementwise_activations()
    tables: dict[str, torch.Tensor | None] = {}

    def tabled(module: torch.nn.Module) -> TableActivation | None:
        if type(module) not in kinds:
            return None
        key = f"{type(module).__qualname__}({module.extra_repr()})"  # nn.GELU's `approximate`, say
        if key not in tables:
            tables[key] = bf16_table(module)
        table = tables[key]  # None: no table has its bits (bf16_table says why)
        return None if table is None else TableActivation(module, table, kernels)

    return swap_modules(tower, tabled)
