"""mmserve's layout of a quantized linear weight, the one every format is converted into at load.

A weight of N outputs and K inputs is N rows of codes, one fp32 scale per (row, group of `group` inputs) and,
for formats with zero points, one int8 zero per (row, group): the dequantized value is `(q - z) * s` in fp32
(`fp8(q) * s` for fp8 codes), exactly what the formats' own dequantization computes. Codes:
- int8: int8 (N, K);
- int4: uint8 (N, K / 2), values 0..15; in each run of 32 inputs byte j holds input j in its low nibble and input
  j + 16 in its high one, so the CPU kernel expands 16 bytes into two vectors of 16 in order
  (csrc/quant_linear.cpp);
- fp8: e4m3 codes (N, K) stored as uint8.
GPTQ's act-order checkpoints order their groups by a permutation of the inputs: the codes are stored in that
order (`perm`), and the layer gathers its input columns by it, which keeps every group contiguous.
Activations stay in the model's dtype (weight-only): checkpoints made for dynamic activation quantization
(compressed-tensors W8A8 and FP8-dynamic, Qwen's FP8) run as W8A16, as transformers runs them decompressed on a
CPU and vLLM's CPU backend runs FP8; their outputs equal transformers' on the same checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KIND_CODES = {"int8": 0, "int4": 1, "fp8": 2}


@dataclass(frozen=True)
class QuantizedWeight:
    kind: str  # "int8" | "int4" | "fp8"
    data: torch.Tensor
    scales: torch.Tensor  # float32 (N, K / group)
    zeros: torch.Tensor | None  # int8 (N, K / group), or None (symmetric)
    group: int
    in_features: int
    perm: torch.Tensor | None = None  # int64 (K,): code column j multiplies input perm[j]

    def __post_init__(self) -> None:
        check_layout(self, "weight")

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    @property
    def nbytes(self) -> int:
        parts = [self.data, self.scales] + [t for t in (self.zeros, self.perm) if t is not None]
        return sum(t.numel() * t.element_size() for t in parts)

    def codes_dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """(N, K) in code order (the eager path and the reference of the CPU kernel): fp32 values, then `dtype`."""
        expand = lambda t: t.float().repeat_interleave(self.group, dim=1)  # noqa: E731
        if self.kind == "fp8":
            values = self.data.view(torch.float8_e4m3fn).float() * expand(self.scales)
        else:
            q = unpack_int4(self.data) if self.kind == "int4" else self.data
            z = expand(self.zeros) if self.zeros is not None else 0.0
            values = (q.float() - z) * expand(self.scales)
        return values.to(dtype)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """(N, K) in the checkpoint's input order: the dense weight an oracle multiplies."""
        w = self.codes_dequantized(dtype)
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out


def check_layout(w: QuantizedWeight, name: str) -> None:
    """Raises ValueError naming `name` when the parts do not fit together."""
    if w.kind not in KIND_CODES:
        raise ValueError(f"{name}: unknown code kind {w.kind!r}")
    k, n, g = w.in_features, w.data.shape[0], w.group
    if g <= 0 or k % g:
        raise ValueError(f"{name}: group size {g} does not divide the {k} inputs")
    width = k // 2 if w.kind == "int4" else k
    if w.kind == "int4" and k % 32:
        raise ValueError(f"{name}: int4 codes need a multiple of 32 inputs, not {k}")
    if w.data.dim() != 2 or w.data.shape[1] != width or w.data.element_size() != 1:
        raise ValueError(f"{name}: codes of shape {tuple(w.data.shape)} do not fit {n} x {k} {w.kind}")
    if w.scales.dtype != torch.float32 or tuple(w.scales.shape) != (n, k // g):
        raise ValueError(
            f"{name}: scales {tuple(w.scales.shape)} {w.scales.dtype}, expected ({n}, {k // g}) float32"
        )
    if w.zeros is not None and (w.zeros.dtype != torch.int8 or w.zeros.shape != w.scales.shape):
        raise ValueError(
            f"{name}: zero points {tuple(w.zeros.shape)} {w.zeros.dtype}, expected int8 like the scales"
        )
    if w.perm is not None and (w.perm.dtype != torch.int64 or tuple(w.perm.shape) != (k,)):
        raise ValueError(f"{name}: input order of shape {tuple(w.perm.shape)}, expected ({k},)")


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """(N, K) values 0..15 -> (N, K / 2) uint8 in mmserve's int4 layout (the module docstring)."""
    n, k = q.shape
    runs = q.to(torch.uint8).reshape(n, k // 32, 2, 16)
    return (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_int4(data: torch.Tensor) -> torch.Tensor:
    """pack_int4's inverse: (N, K / 2) uint8 -> (N, K) uint8 values 0..15."""
    n, half = data.shape
    runs = data.reshape(n, half // 16, 1, 16)
    return torch.cat((runs & 0x0F, runs >> 4), dim=2).reshape(n, half * 2)
