"""The published quantized checkpoint formats, read into mmserve's layout (layout.py).

Each format names its tensors per quantized linear layer (`<module>.<name>`) and how they decode:
- AWQ (`quant_method: awq`, AutoAWQ's GEMM packing): `qweight` int32 (K, N/8) and `qzeros` int32 (K/g, N/8),
  eight 4-bit values per word along the outputs in AWQ's interleaved order (0, 2, 4, 6, 1, 3, 5, 7), `scales`
  (K/g, N); w = (q - z) * s.
- GPTQ (`quant_method: gptq`, AutoGPTQ / GPTQModel `gptq` and `gptq_v2` formats): `qweight` int32 (K*b/32, N)
  packed along the inputs, `qzeros` int32 (K/g, N*b/32) along the outputs (stored as z - 1 in the v1 format),
  `scales` (K/g, N), `g_idx` (K,) the group of each input (act-order checkpoints permute it); 4 or 8 bits.
- FP8 (`quant_method: fp8`, Qwen's and DeepSeek's block-wise checkpoints): `weight` float8_e4m3fn (N, K) and
  `weight_scale_inv` (ceil(N/bn), ceil(K/bk)), the multiplier of each block.
- compressed-tensors (`quant_method: compressed-tensors`): `int-quantized` / `naive-quantized` (`weight` int8,
  `weight_scale` per channel or group), `pack-quantized` (`weight_packed` int32 (N, K*b/32) along the inputs,
  values offset by 2^(b-1), `weight_scale`, optional `weight_zero_point` packed along the outputs) and
  `float-quantized` (`weight` float8_e4m3fn, `weight_scale` per tensor or channel). Dynamic input activations
  (W8A8, FP8-dynamic) run unquantized (layout.py says why).
Which layers are quantized is read from the tensors themselves (a layer with the format's scale tensor), so
every `ignore` / `modules_to_not_convert` list is honoured as the checkpoint's writer applied it. A format or a
setting mmserve does not run is refused when the checkpoint loads, naming it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmserve.quant.layout import QuantizedWeight, pack_int4

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # output j of a word's slot i is AWQ_ORDER[i]


@dataclass(frozen=True)
class CheckpointFormat:
    """What a checkpoint's `quantization_config` says, checked: the tensors a quantized layer has and how
    they decode."""

    method: str  # awq | gptq | fp8 | compressed-tensors
    marker: str  # the tensor whose presence marks a quantized layer
    names: tuple[str, ...]  # every tensor name of a quantized layer (besides its bias)
    bits: int = 4
    group: int = 128  # -1: one group over all inputs
    gptq_v1_zeros: bool = True
    block: tuple[int, int] | None = None
    ct_format: str = ""
    ct_weights: dict | None = None


def refuse(what: str) -> ValueError:
    return ValueError(f"quantized checkpoint: {what} is not supported by mmserve")


def read_format(config) -> CheckpointFormat | None:
    """The checkpoint's quantization format from its `quantization_config` (a dict or transformers' object),
    None for an unquantized checkpoint. Raises ValueError naming a format or setting mmserve does not run."""
    if config is None:
        return None
    q = config if isinstance(config, dict) else config.to_dict()
    method = str(q.get("quant_method", "")).lower()
    if method == "awq":
        version = str(q.get("version", "gemm")).lower()
        if version != "gemm" or q.get("bits", 4) != 4 or not q.get("zero_point", True):
            raise refuse(f"AWQ version {version!r}, {q.get('bits')} bits, zero_point={q.get('zero_point')}")
        return CheckpointFormat(
            "awq", "qweight", ("qweight", "qzeros", "scales"), 4, int(q.get("group_size", 128))
        )
    if method == "gptq":
        bits, fmt = int(q.get("bits", 4)), str(q.get("checkpoint_format", "gptq")).lower()
        if bits not in (4, 8) or fmt not in ("gptq", "gptq_v2"):
            raise refuse(f"GPTQ with {bits} bits in the {fmt!r} format (4 or 8 bits, gptq or gptq_v2 run)")
        names = ("qweight", "qzeros", "scales", "g_idx")
        return CheckpointFormat("gptq", "qweight", names, bits, int(q.get("group_size", 128)), fmt == "gptq")
    if method == "fp8":
        block = q.get("weight_block_size")
        if q.get("fmt", "e4m3") != "e4m3" or block is None or len(block) != 2:
            raise refuse(f"FP8 format {q.get('fmt')!r} with weight_block_size {block}")
        if q.get("activation_scheme", "dynamic") != "dynamic":
            raise refuse(f"FP8 activation_scheme {q.get('activation_scheme')!r} (static input scales)")
        return CheckpointFormat("fp8", "weight_scale_inv", ("weight", "weight_scale_inv"), block=tuple(block))
    if method == "compressed-tensors":
        return _compressed_tensors(q)
    raise refuse(f"quant_method {method!r} (AWQ, GPTQ, FP8 and compressed-tensors run)")


def _compressed_tensors(q: dict) -> CheckpointFormat:
    groups = q.get("config_groups") or {}
    if len(groups) != 1:
        raise refuse(f"compressed-tensors with {len(groups)} config groups (one runs)")
    (group,) = groups.values()
    fmt = group.get("format") or q.get("format")
    w, a = group.get("weights") or {}, group.get("input_activations")
    if q.get("sparsity_config") or q.get("transform_config") or q.get("kv_cache_scheme"):
        raise refuse("compressed-tensors sparsity, transforms or a quantized KV cache")
    kind, bits, strategy = w.get("type"), int(w.get("num_bits", 0)), w.get("strategy")
    if w.get("dynamic") or w.get("actorder") not in (None, "static", "weight"):
        raise refuse(f"compressed-tensors weights dynamic={w.get('dynamic')} actorder={w.get('actorder')}")
    ok = {
        "pack-quantized": kind == "int" and bits in (4, 8) and strategy in ("channel", "group"),
        "int-quantized": kind == "int" and bits == 8 and strategy in ("channel", "group", "tensor"),
        "naive-quantized": kind == "int" and bits == 8 and strategy in ("channel", "group", "tensor"),
        "float-quantized": kind == "float"
        and bits == 8
        and strategy in ("channel", "tensor", "block", "group"),
    }
    if not ok.get(fmt, False):
        raise refuse(f"compressed-tensors format {fmt!r} with {kind} {bits}-bit {strategy} weights")
    if a is not None and (not a.get("dynamic") or a.get("num_bits") != 8):
        raise refuse(f"compressed-tensors input activations {a} (dynamic 8-bit ones run, weight-only)")
    marker = "weight_packed" if fmt == "pack-quantized" else "weight_scale"
    data = "weight_packed" if fmt == "pack-quantized" else "weight"
    names = (data, "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")
    group_size = int(w.get("group_size") or -1)
    return CheckpointFormat(
        "compressed-tensors", marker, names, bits, group_size, ct_format=fmt, ct_weights=w
    )


def unpack_words(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words holding 32/bits values each (value i at bits [i*bits, (i+1)*bits)), unpacked along `dim`."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    w = words.to(torch.int32).unsqueeze(-1) >> shifts  # (..., per)
    values = (w & ((1 << bits) - 1)).to(torch.uint8)
    if dim == 1:
        return values.reshape(words.shape[0], words.shape[1] * per)
    return values.permute(0, 2, 1).reshape(words.shape[0] * per, words.shape[1])


def _need(tensors: dict[str, torch.Tensor], name: str, module: str) -> torch.Tensor:
    if name not in tensors:
        raise ValueError(f"quantized checkpoint: {module}.{name} is missing")
    return tensors[name]


def _shape(t: torch.Tensor, shape: tuple[int, ...], name: str) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"quantized checkpoint: {name} has shape {tuple(t.shape)}, expected {shape}")


def to_layout(
    fmt: CheckpointFormat, tensors: dict[str, torch.Tensor], module: str, shape: tuple[int, int]
) -> QuantizedWeight:
    """One quantized layer's tensors (`name -> tensor`, names of `fmt.names`) as a QuantizedWeight of the
    layer's (out, in) `shape`. Raises ValueError naming the tensor that is missing or does not fit."""
    n, k = shape
    if fmt.method in ("awq", "gptq"):
        return _awq_gptq(fmt, tensors, module, n, k)
    if fmt.method == "fp8":
        weight, scale = _need(tensors, "weight", module), _need(tensors, "weight_scale_inv", module)
        bn, bk = fmt.block
        _shape(weight, (n, k), f"{module}.weight")
        _shape(scale, (-(-n // bn), -(-k // bk)), f"{module}.weight_scale_inv")
        if weight.dtype != torch.float8_e4m3fn or k % bk:
            raise ValueError(
                f"quantized checkpoint: {module}.weight must be float8_e4m3fn with {bk} | {k} inputs"
            )
        scales = scale.float().repeat_interleave(bn, dim=0)[:n].contiguous()
        return QuantizedWeight("fp8", weight.view(torch.uint8).contiguous(), scales, None, bk, k)
    return _compressed(fmt, tensors, module, n, k)


def _awq_gptq(
    fmt: CheckpointFormat, t: dict[str, torch.Tensor], module: str, n: int, k: int
) -> QuantizedWeight:
    bits, group = fmt.bits, (fmt.group if fmt.group > 0 else k)
    qweight, qzeros, scales = (_need(t, name, module) for name in ("qweight", "qzeros", "scales"))
    if k % group:
        raise ValueError(f"quantized checkpoint: group size {group} does not divide {module}'s {k} inputs")
    groups, per = k // group, 32 // bits
    _shape(scales, (groups, n), f"{module}.scales")
    if fmt.method == "awq":
        _shape(qweight, (k, n // 8), f"{module}.qweight")
        _shape(qzeros, (groups, n // 8), f"{module}.qzeros")
        order = torch.tensor([c * 8 + AWQ_ORDER.index(j) for c in range(n // 8) for j in range(8)])
        q = unpack_words(qweight, 4, 1)[:, order].t()  # (N, K)
        z = unpack_words(qzeros, 4, 1)[:, order].t().to(torch.int16)  # (N, groups)
        perm = None
    else:
        _shape(qweight, (k // per, n), f"{module}.qweight")
        _shape(qzeros, (groups, n // per), f"{module}.qzeros")
        q = unpack_words(qweight, bits, 0).t()  # (N, K)
        z = unpack_words(qzeros, bits, 1).t().to(torch.int16) + (1 if fmt.gptq_v1_zeros else 0)
        q, z, scales, perm = _gptq_order(t.get("g_idx"), q, z, scales, group, module)
    kind = "int4" if bits == 4 else "int8"
    if kind == "int8":  # unsigned 8-bit codes and zeros, shifted into int8 by 128 (the same differences)
        q, z = (q.to(torch.int16) - 128).to(torch.int8), z - 128
    if int(z.min()) < -128 or int(z.max()) > 127:
        raise ValueError(f"quantized checkpoint: {module}.qzeros holds zero points out of range")
    data = pack_int4(q) if kind == "int4" else q.contiguous()
    return QuantizedWeight(
        kind, data, scales.float().t().contiguous(), z.to(torch.int8).contiguous(), group, k, perm
    )


def _gptq_order(g_idx, q, z, scales, group: int, module: str):
    """GPTQ's inputs in group order: act-order checkpoints give input i to group g_idx[i] in any order; the
    codes are reordered so each group's inputs are contiguous, and the layer gathers its inputs the same way."""
    k = q.shape[1]
    trivial = torch.arange(k) // group
    if g_idx is None or torch.equal(g_idx.long(), trivial):
        return q, z, scales, None
    g = g_idx.long()
    _shape(g, (k,), f"{module}.g_idx")
    if (
        int(g.min()) < 0
        or int(g.max()) >= k // group
        or torch.bincount(g, minlength=k // group).ne(group).any()
    ):
        raise ValueError(f"quantized checkpoint: {module}.g_idx does not give every group {group} inputs")
    perm = torch.argsort(g, stable=True)
    return q[:, perm].contiguous(), z, scales, perm


def _compressed(
    fmt: CheckpointFormat, t: dict[str, torch.Tensor], module: str, n: int, k: int
) -> QuantizedWeight:
    w = fmt.ct_weights
    strategy = w.get("strategy")
    scale = _need(t, "weight_scale", module).float()
    group = k if strategy in ("channel", "tensor") else int(w.get("group_size") or 0)
    if strategy == "block":
        bn, bk = w.get("block_structure") or (0, 0)
        group = bk
    if group <= 0 or k % group:
        raise ValueError(f"quantized checkpoint: group size {group} does not divide {module}'s {k} inputs")
    if strategy == "tensor":
        scales = scale.reshape(1, 1).expand(n, 1)
    elif strategy == "block":
        _shape(scale, (-(-n // bn), k // bk), f"{module}.weight_scale")
        scales = scale.repeat_interleave(bn, dim=0)[:n]
    else:
        _shape(scale, (n, k // group), f"{module}.weight_scale")
        scales = scale
    scales = scales.contiguous()
    zeros = None
    if not w.get("symmetric", True):
        zp = _need(t, "weight_zero_point", module)
        zeros = unpack_words(zp, fmt.bits, 0)[:n] if fmt.ct_format == "pack-quantized" else zp
        zeros = zeros.to(torch.int16)
        _shape(zeros, tuple(scales.shape), f"{module}.weight_zero_point")
    if "weight_g_idx" in t:
        raise refuse(f"compressed-tensors activation ordering ({module}.weight_g_idx)")
    if fmt.ct_format == "float-quantized":
        weight = _need(t, "weight", module)
        _shape(weight, (n, k), f"{module}.weight")
        if weight.dtype != torch.float8_e4m3fn:
            raise ValueError(
                f"quantized checkpoint: {module}.weight must be float8_e4m3fn, not {weight.dtype}"
            )
        return QuantizedWeight("fp8", weight.view(torch.uint8).contiguous(), scales, None, group, k)
    if fmt.ct_format == "pack-quantized":
        packed = _need(t, "weight_packed", module)
        if "weight_shape" in t and tuple(int(v) for v in t["weight_shape"].tolist()) != (n, k):
            raise ValueError(f"quantized checkpoint: {module}.weight_shape is not ({n}, {k})")
        _shape(packed, (n, k * fmt.bits // 32), f"{module}.weight_packed")
        # Codes and packed zero points are unsigned: the signed value plus 2^(bits-1), so their difference is
        # the signed one's; a symmetric layer's zero is that offset.
        codes = unpack_words(packed, fmt.bits, 1)
        offset = 1 << (fmt.bits - 1)
        zeros = zeros if zeros is not None else torch.full(scales.shape, offset, dtype=torch.int16)
        if fmt.bits == 8:
            codes, zeros = (codes.to(torch.int16) - 128).to(torch.int8), zeros - 128
            return QuantizedWeight("int8", codes, scales, zeros.to(torch.int8), group, k)
        return QuantizedWeight("int4", pack_int4(codes), scales, zeros.to(torch.int8), group, k)
    weight = _need(t, "weight", module)
    _shape(weight, (n, k), f"{module}.weight")
    if weight.dtype != torch.int8:
        raise ValueError(f"quantized checkpoint: {module}.weight must be int8, not {weight.dtype}")
    zeros = None if zeros is None else zeros.to(torch.int8)
    return QuantizedWeight("int8", weight.contiguous(), scales, zeros, group, k)
