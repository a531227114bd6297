"""Linear layers with weights packed once in oneDNN's layout (on a CPU: bf16/fp16, and fp32 where MKL is slow).

A plain bf16 `F.linear` on the CPU goes to oneDNN too, but hands it the weight in PyTorch's row-major layout,
so every call re-orders the whole weight into oneDNN's blocked layout before it multiplies: for a decode step,
which streams every weight of the model once, that is a second pass over memory. Packing each weight once at
load time (`torch.ops.mkldnn._reorder_linear_weight`, what Inductor's CPU freezing pass does) removes it.
Measured on a Xeon with AMX (bf16, the 169 linear layers of a Qwen2-0.5B-sized language model, benchmarks
7f): 1 row 84-116 ms against 119-163 ms, 16 rows 80-113 against 110-154, 64 rows 117-166 against 214-302, 300
rows 703-810 against 725-977; the results are bitwise equal to `F.linear`'s, so HF parity is unchanged.
fp32 (`--fp32-gemm`): on Intel CPUs MKL stays, the GEMM HF's own code runs (bitwise HF), which oneDNN's packed
one is not and which was faster at one row on that Xeon. On x86 CPUs of other makers MKL takes a
generic path for a few rows: on an AMD EPYC (AVX2) a 9728 x 896 fp32 GEMM took 16.7-18.2 ms at 16 rows in MKL
against 5.4 ms packed in oneDNN, 2.8 against 1.8 ms at one row, 281 against 251 ms at 1,024 (docs/benchmarks.md
7j). There `auto` packs fp32 too; the outputs then differ from MKL's in the last bits, as a different row count
already makes them, and the parity tests hold HF's greedy tokens with it (tests/test_packed_linear.py).
"""

from __future__ import annotations

import torch

from mmserve.config import check_fp32_gemm
from mmserve.cpu_info import cpu_vendor
from mmserve.models.swap import swap_modules

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
        # Owners' code reads `.weight.dtype` / `.device` of a layer it calls (Gemma 4's patch embedder casts its
        # input so): an empty tensor answers that; anything reading its values fails loudly, never silently.
        self.weight = torch.empty(0, dtype=weight.dtype, device=weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed {self.dtype}"


def fp32_in_onednn(fp32_gemm: str, vendor: str | None = None) -> bool:
    """Whether fp32 linear layers run packed in oneDNN (`--fp32-gemm`): "onednn" and "mkl" say so; "auto" packs
    on an x86 CPU not made by Intel when torch's fp32 GEMM is MKL's (the module docstring says why)."""
    check_fp32_gemm(fp32_gemm)
    if fp32_gemm != "auto":
        return fp32_gemm == "onednn"
    vendor = cpu_vendor() if vendor is None else vendor
    return vendor not in ("", "GenuineIntel") and torch.backends.mkl.is_available()


def can_pack(dtype: torch.dtype, device: torch.device, fp32_gemm: str = "auto") -> bool:
    """Packing applies on a CPU with oneDNN: for a 16-bit dtype the CPU computes natively (AMX/AVX512-BF16), and
    for fp32 where `fp32_in_onednn` says."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return fp32_in_onednn(fp32_gemm)
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if dtype == torch.float16:
        return torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return False


def pack_linears(module: torch.nn.Module) -> int:
    """Replaces every plain `torch.nn.Linear` under `module` with a PackedLinear, in place; returns how many.
    The plain weights are freed unless something else (a tied embedding) still holds them.

    Only modules of exactly that class are packed, and only those called as modules: a subclass can be read
    by its owner's code through `.weight` (`nn.MultiheadAttention` hands `out_proj.weight`, a
    `NonDynamicallyQuantizableLinear`, to its functional form, in SigLIP's pooling head)."""
    return swap_modules(module, lambda m: PackedLinear(m) if type(m) is torch.nn.Linear else None)
