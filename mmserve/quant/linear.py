"""The linear layer over a QuantizedWeight: the CPU kernels for a few rows, one dequantization and a GEMM for
many, the eager dequantization elsewhere.

A decode step (1-64 rows) streams every weight once: `quant_linear` (csrc/quant_linear.cpp) expands each
output row's codes in cache and dots it with the rows, so the step reads the codes' bytes, not bf16's. A
prefill chunk of hundreds of rows is compute-bound: `dequantize_weight` expands the whole weight once (in
parallel, into the activations' dtype) and oneDNN's GEMM (AMX in bf16) runs it; the expanded weight is freed
after the call, so memory stays the codes'. Without the kernels (`--disable-cpu-kernels`, another device, an
fp16 engine) the eager `QuantizedWeight.codes_dequantized` and `F.linear` give the same values more slowly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mmserve.quant.layout import KIND_CODES, QuantizedWeight

# Rows up to which the kernel beats dequantizing the weight for a GEMM (the `small` model's shapes, bf16,
# docs/benchmarks.md §10): on AMX tiles it expands the codes once whatever the rows and crosses over between 48
# and 96 rows; with AVX512-BF16's `vdpbf16ps` (or fp32 FMAs) its multiply costs per row, and 24 rows is the end.
GEMV_ROWS = 24
AMX_ROWS = 64


class QuantLinear(torch.nn.Module):
    """`torch.nn.Linear` over quantized weights; `kernels` (CpuKernels or None) is set once the engine knows."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.qweight = weight
        self.in_features = weight.in_features
        self.out_features = weight.out_features
        self.bias = None if bias is None else bias.detach().to(dtype)
        self.kind_code = KIND_CODES[weight.kind]
        self.kernels = None
        # Owners' code reads `.weight.dtype` / `.device` (as for PackedLinear): an empty tensor answers that,
        # and anything reading its values fails loudly.
        self.weight = torch.empty(0, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.qweight
        lead = x.shape[:-1]
        x = x.reshape(-1, self.in_features)
        if w.perm is not None:
            x = x.index_select(1, w.perm)
        kernels = self.kernels
        if kernels is not None and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16):
            x = x.contiguous()
            if x.shape[0] <= self.kernel_rows(x.dtype):
                y = kernels.quant_linear(x, w.data, w.scales, w.zeros, self.kind_code, w.group, self.bias)
            else:
                dense = kernels.dequantize_weight(
                    w.data, w.scales, w.zeros, self.kind_code, w.group, self.in_features, x.dtype
                )
                y = F.linear(x, dense, self.bias)
        else:
            y = F.linear(x, w.codes_dequantized(x.dtype), self.bias)
        return y.reshape(*lead, self.out_features)

    def kernel_rows(self, dtype: torch.dtype) -> int:
        """Rows of `dtype` up to which `quant_linear` runs them (beyond: dequantize and a GEMM); 0 without
        the kernels."""
        if self.kernels is None:
            return 0
        return AMX_ROWS if self.kernels.quant_linear_amx and dtype == torch.bfloat16 else GEMV_ROWS

    def extra_repr(self) -> str:
        w = self.qweight
        extras = ", act-order" if w.perm is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {w.kind} group {w.group}{extras}"


def concat_quantized(layers: list[QuantLinear]) -> QuantLinear | None:
    """One QuantLinear whose outputs are `layers`' side by side (q/k/v, gate/up), or None where their codes
    cannot share one layer (different kinds, groups or input orders)."""
    first = layers[0].qweight
    for m in layers[1:]:
        w = m.qweight
        same_perm = (w.perm is None and first.perm is None) or (
            w.perm is not None and first.perm is not None and torch.equal(w.perm, first.perm)
        )
        if (w.kind, w.group, w.zeros is None) != (first.kind, first.group, first.zeros is None):
            return None
        if not same_perm:
            return None
    cat = lambda attr: torch.cat([getattr(m.qweight, attr) for m in layers])  # noqa: E731
    zeros = None if first.zeros is None else cat("zeros")
    weight = QuantizedWeight(
        first.kind, cat("data"), cat("scales"), zeros, first.group, first.in_features, first.perm
    )
    biases = [m.bias for m in layers]
    dtype = layers[0].weight.dtype
    if all(b is None for b in biases):
        bias = None
    else:
        zero = lambda m: torch.zeros(m.out_features, dtype=dtype)  # noqa: E731
        bias = torch.cat([b if b is not None else zero(m) for b, m in zip(biases, layers, strict=True)])
    return QuantLinear(weight, bias, dtype)


class StackedLinear(torch.nn.Module):
    """Linear layers over one input with their outputs side by side: the fused q/k/v or gate/up of a checkpoint
    whose codes for them cannot share one layer (`concat_quantized`)."""

    def __init__(self, layers: list[torch.nn.Module]) -> None:
        super().__init__()
        self.parts = torch.nn.ModuleList(layers)
        self.in_features = layers[0].in_features
        self.out_features = sum(m.out_features for m in layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([m(x) for m in self.parts], dim=-1)


def attach_kernels(module: torch.nn.Module, kernels) -> int:
    """Gives every QuantLinear under `module` the engine's CPU kernels (or None); returns how many there are."""
    found = 0
    for m in module.modules():
        if isinstance(m, QuantLinear):
            m.kernels = kernels
            found += 1
    return found


def has_quantized(module: torch.nn.Module) -> bool:
    return any(isinstance(m, QuantLinear) for m in module.modules())


def weight_bytes(layer: torch.nn.Module) -> int:
    """The bytes a linear layer's weight streams per call: its codes and scales where quantized, else its
    dense weight's (a packed one's too: oneDNN's layout is the same size)."""
    if isinstance(layer, QuantLinear):
        return layer.qweight.nbytes
    return layer.out_features * layer.in_features * layer.weight.element_size()
