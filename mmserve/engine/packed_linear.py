"""Linear layers with their weights packed once into oneDNN's blocked layout (CPU, bf16/fp16).

A plain bf16 `F.linear` on the CPU goes to oneDNN too, but hands it the weight in PyTorch's row-major layout,
so every call re-orders the whole weight into oneDNN's blocked layout before it multiplies: for a decode step,
which streams every weight of the model once, that is a second pass over memory. Packing each weight once at
load time (`torch.ops.mkldnn._reorder_linear_weight`, what Inductor's CPU freezing pass does) removes it.
Measured here (bf16, the 169 linear layers of a Qwen2-0.5B-sized language model, `docs/benchmarks.md` 7f):
1 row 84-116 ms against 119-163 ms, 16 rows 80-113 against 110-154, 64 rows 117-166 against 214-302, 300
rows 703-810 against 725-977; the results are bitwise equal to `F.linear`'s, so HF parity is unchanged.
fp32 is left alone: there oneDNN's packed GEMM is not bitwise equal to MKL's and is slower at one row.
"""

from __future__ import annotations

import torch

PACKED_DTYPES = (torch.bfloat16, torch.float16)
# oneDNN picks its blocking for this many rows; measured best across 1-300 rows (decode to prefill chunks).
BATCH_HINT = 64


class PackedLinear(torch.nn.Module):
    """`torch.nn.Linear`'s forward over a weight packed once; same inputs, same (bitwise) outputs."""

    def __init__(self, linear: torch.nn.Linear, batch_hint: int = BATCH_HINT) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.dtype = weight.dtype
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed {self.dtype}"


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """Packing applies on a CPU with oneDNN, for a 16-bit dtype the CPU computes natively (AMX/AVX512-BF16)."""
    if device.type != "cpu" or dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return torch.ops.mkldnn._is_mkldnn_fp16_supported()


def pack_linears(module: torch.nn.Module) -> int:
    """Replaces every plain `torch.nn.Linear` under `module` with a PackedLinear, in place; returns how many.
    The plain weights are freed unless something else (a tied embedding) still holds them.

    Only modules of exactly that class are packed, and only those called as modules: a subclass can be read
    by its owner's code through `.weight` (`nn.MultiheadAttention` hands `out_proj.weight`, a
    `NonDynamicallyQuantizableLinear`, to its functional form, in SigLIP's pooling head)."""
    targets = [(name, child) for name, child in module.named_modules() if type(child) is torch.nn.Linear]
    for name, linear in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, attr, PackedLinear(linear))
    return len(targets)
