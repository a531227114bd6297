"""Quantized kit checkpoints (`mmserve make-tiny-model --quantization FORMAT`), offline, in the published layouts.

- `w4a16`, `w8a8`, `fp8-dynamic`: compressed-tensors checkpoints made by the compressed-tensors library itself
  (its quantization config applied to the model, weight scales from its own `calculate_qparams` over each
  layer's min/max, its `ModelCompressor` writing the tensors and the config): what llm-compressor writes.
- `awq`, `gptq`, `gptq-int8`, `fp8`: AutoAWQ's GEMM packing, GPTQ's v1 format (act-order: a random input
  order, `desc_act`), Qwen's block-wise FP8; written here to the published layout (their writers need a GPU
  or are archived).
Each quantizes the language model's linear layers and leaves the towers and `lm_head` alone, as the published
checkpoints do. Beside the checkpoint, `reference/` holds the same model with each quantized layer's dense
weight as the format defines it (computed from the codes, scales and zeros this writer chose, not read back
from the packed tensors): the oracle HF `generate` runs for the three layouts written here.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

FORMATS = ("awq", "gptq", "gptq-int8", "fp8", "w4a16", "w8a8", "fp8-dynamic")
CT_FORMATS = {"w4a16": "pack-quantized", "w8a8": "int-quantized", "fp8-dynamic": "float-quantized"}
LM_LAYERS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TOWER_WORDS = ("visual", "vision", "audio", "multi_modal_projector", "embed_vision", "embed_audio")


def is_lm_linear(key: str) -> bool:
    """A checkpoint key of a language-model decoder layer's linear weight (any layout of the families)."""
    parts = key.split(".")
    lm = key.endswith(".weight") and len(parts) > 2 and parts[-2] in LM_LAYERS and "layers" in parts
    return lm and not any(w in key for w in TOWER_WORDS)


def group_for(state: dict) -> int:
    """The largest of 128, 64, 32 that divides every quantized layer's input width (one group size per
    checkpoint, as the formats' configs have)."""
    widths = {w.shape[1] for key, w in state.items() if is_lm_linear(key)}
    return next(g for g in (128, 64, 32) if all(k % g == 0 for k in widths))


def quantize_checkpoint(src: str, out: str, fmt: str, seed: int = 0) -> str:
    """Writes `src` (a kit checkpoint) quantized in `fmt` to `out` (with the dense oracle in `out/reference`)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantization format {fmt!r}; the kit writes {', '.join(FORMATS)}")
    if fmt in CT_FORMATS:
        return _compressed_tensors(src, out, fmt)
    os.makedirs(out, exist_ok=True)
    _copy_missing(src, out)
    state = load_file(os.path.join(src, "model.safetensors"))
    dense = dict(state)
    gen = torch.Generator().manual_seed(seed)
    group = group_for(state)
    quantized = {}
    for key, w in state.items():
        if not is_lm_linear(key):
            quantized[key] = w
            continue
        layer = key.removesuffix(".weight")
        tensors, dense[key] = WRITERS[fmt](w.float(), _shared_order(key, seed) if fmt == "gptq" else gen, group)
        dense[key] = dense[key].to(w.dtype)
        quantized.update({f"{layer}.{name}": t for name, t in tensors.items()})
    save_file(quantized, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    config = json.load(open(os.path.join(src, "config.json")))
    config["quantization_config"] = quant_config(fmt, group)
    _write_json(out, "config.json", config)
    ref = os.path.join(out, "reference")
    os.makedirs(ref, exist_ok=True)
    _copy_missing(src, ref)
    save_file(dense, os.path.join(ref, "model.safetensors"), metadata={"format": "pt"})
    return out


def dequantized_reference(
    src: str, out: str, method: str, head: bool = True, tower: bool = False, dtype: str = "float32"
) -> str:
    """`src` with every weight `--quantization METHOD` quantizes replaced by its dequantized value: the language
    model's linear layers, `lm_head` unless `head` is False (untied from the embedding it shared, which stays),
    the tower's linear layers with `tower`. The oracle HF `generate` runs for quantize-on-load. The engine
    quantizes the weights as loaded in its `dtype` (bf16: already rounded), so the reference does too."""
    from transformers import AutoModelForMultimodalLM

    from mmserve.quant.quantize import quantize_weight

    model = AutoModelForMultimodalLM.from_pretrained(src, dtype=torch.float32)

    def dequantize(layer: torch.nn.Linear) -> None:
        q = quantize_weight(layer.weight.to(getattr(torch, dtype)), method)
        if q is not None:
            layer.weight = torch.nn.Parameter(q.dequantized(torch.float32), requires_grad=False)

    for name, m in model.named_modules():
        in_tower = any(w in name for w in TOWER_WORDS)
        if type(m) is torch.nn.Linear and (is_lm_linear(name + ".weight") or (tower and in_tower)):
            dequantize(m)
    if head:
        for cfg in (model.config, getattr(model.config, "text_config", None)):
            if cfg is not None:
                cfg.tie_word_embeddings = False  # the head gets its own (quantized) copy of a shared table
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone(), requires_grad=False)
        dequantize(model.lm_head)
    model.save_pretrained(out)
    _copy_missing(src, out)
    return out


def _shared_order(key: str, seed: int) -> torch.Generator:
    """One generator per input a layer reads: GPTQ orders a layer's inputs by its Hessian, which q/k/v (and
    gate/up) share, so their act-orders are one (`gptq`); `gptq-int8` draws one per layer instead, so that the
    path for codes that cannot share a layer is exercised too."""
    shared = key.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
    return torch.Generator().manual_seed(seed + sum(shared.encode()) * 7919)


def _write_json(out: str, name: str, value: dict) -> None:
    with open(os.path.join(out, name), "w") as f:
        json.dump(value, f, indent=2)


def _int_codes(w: torch.Tensor, bits: int, group: int, symmetric: bool):
    """Per (output, group) scale (fp16, as AutoAWQ and GPTQ store them) and zero, and unsigned codes (N, K)."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    top = (1 << bits) - 1
    if symmetric:
        scale = (g.abs().amax(-1) * 2 / top).clamp(min=1e-8).half()
        zero = torch.full(scale.shape, (top + 1) // 2)
    else:
        low, high = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = ((high - low) / top).clamp(min=1e-8).half()
        zero = torch.round(-low / scale.float()).clamp(0, top).long()
    q = (torch.round(g / scale.float().unsqueeze(-1)) + zero.unsqueeze(-1)).clamp(0, top).long()
    dense = ((q - zero.unsqueeze(-1)).float() * scale.float().unsqueeze(-1)).reshape(n, k)
    return q.reshape(n, k), zero, scale, dense


def _pack_words(values: torch.Tensor, bits: int, dim: int, order=None) -> torch.Tensor:
    """values (R, C) unsigned packed into int32 words along `dim`, value i of a word at bits [i*b, (i+1)*b)
    (AWQ: slot i holds the value at position order[i] of its eight)."""
    per = 32 // bits
    v = values.long() if dim == 1 else values.long().t()
    v = v.reshape(v.shape[0], -1, per)
    if order is not None:
        v = v[:, :, list(order)]
    words = sum(v[:, :, i] << (bits * i) for i in range(per))
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return (words if dim == 1 else words.t()).contiguous()


def _awq(w: torch.Tensor, gen, group: int):
    from mmserve.quant.formats import AWQ_ORDER

    q, zero, scale, dense = _int_codes(w, 4, group, symmetric=False)
    tensors = {
        "qweight": _pack_words(q.t(), 4, 1, AWQ_ORDER),  # (K, N / 8)
        "qzeros": _pack_words(zero.t(), 4, 1, AWQ_ORDER),  # (K / g, N / 8)
        "scales": scale.t().contiguous(),  # (K / g, N)
    }
    return tensors, dense


def _gptq(bits: int):
    def write(w: torch.Tensor, gen, group: int):
        n, k = w.shape
        order = torch.randperm(k, generator=gen)  # act-order: group j holds inputs order[j*g:(j+1)*g]
        q, zero, scale, dense_perm = _int_codes(w[:, order], bits, group, symmetric=True)
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[order] = (torch.arange(k) // group).to(torch.int32)
        codes = torch.empty_like(q)
        codes[:, order] = q
        dense = torch.empty_like(dense_perm)
        dense[:, order] = dense_perm
        tensors = {
            "qweight": _pack_words(codes.t(), bits, 0),  # (K * b / 32, N), along the inputs
            "qzeros": _pack_words(zero.t() - 1, bits, 1),  # (K / g, N * b / 32), stored as z - 1 (v1)
            "scales": scale.t().contiguous(),
            "g_idx": g_idx,
        }
        return tensors, dense

    return write


def _fp8(w: torch.Tensor, gen, group: int):
    n, k = w.shape
    bn, bk = FP8_BLOCK
    rows, cols = -(-n // bn), k // bk
    scale = torch.empty(rows, cols)
    for i in range(rows):
        for j in range(cols):
            scale[i, j] = (w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk].abs().amax() / 448.0).clamp(
                min=1e-8
            )
    full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)
    codes = (w / full).clamp(-448, 448).to(torch.float8_e4m3fn)
    return {"weight": codes, "weight_scale_inv": scale}, codes.float() * full


FP8_BLOCK = (32, 32)  # the tiny models' widths; Qwen's checkpoints use 128 x 128
WRITERS = {"awq": _awq, "gptq": _gptq(4), "gptq-int8": _gptq(8), "fp8": _fp8}


def quant_config(fmt: str, group: int) -> dict:
    """The `quantization_config` each format's own tools write."""
    if fmt == "awq":
        return dict(
            quant_method="awq",
            bits=4,
            group_size=group,
            zero_point=True,
            version="gemm",
            modules_to_not_convert=["visual", "lm_head"],
        )
    if fmt in ("gptq", "gptq-int8"):
        bits = 4 if fmt == "gptq" else 8
        return dict(
            quant_method="gptq",
            bits=bits,
            group_size=group,
            desc_act=True,
            sym=True,
            checkpoint_format="gptq",
        )
    return dict(
        quant_method="fp8",
        fmt="e4m3",
        activation_scheme="dynamic",
        weight_block_size=list(FP8_BLOCK),
        modules_to_not_convert=["visual", "lm_head"],
    )


def _compressed_tensors(src: str, out: str, fmt: str) -> str:
    """A compressed-tensors checkpoint made by the library (module docstring); `reference/` is the model as
    transformers loads that checkpoint through compressed-tensors, decompressed (`run_compressed=False`)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForMultimodalLM, CompressedTensorsConfig

    model = AutoModelForMultimodalLM.from_pretrained(src, dtype=torch.float32)
    state = load_file(os.path.join(src, "model.safetensors"))
    if fmt == "w4a16":
        weights = QuantizationArgs(
            num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_for(state)
        )
        inputs = None
    elif fmt == "w8a8":
        weights = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
        inputs = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
    else:
        weights = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="channel")
        inputs = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    ignore = [n for n in names if not is_lm_linear(n + ".weight")]
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=inputs)
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=ignore, format=CT_FORMATS[fmt])
    apply_quantization_config(model, config)
    for m in model.modules():
        if hasattr(m, "weight_scale"):  # the weights' own min / max per channel or group (an observer's job)
            w = m.weight.data
            rows = (
                w.reshape(w.shape[0], -1, weights.group_size)
                if weights.strategy == "group"
                else w.unsqueeze(1)
            )
            scale, zero = calculate_qparams(rows.amin(-1), rows.amax(-1), weights)
            m.weight_scale.data.copy_(scale.reshape(m.weight_scale.shape))
            if hasattr(m, "weight_zero_point"):
                m.weight_zero_point.data.copy_(zero.reshape(m.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=CT_FORMATS[fmt])
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    _copy_missing(src, out)
    loaded = AutoModelForMultimodalLM.from_pretrained(
        out, dtype=torch.float32, quantization_config=CompressedTensorsConfig(run_compressed=False)
    )
    reference = AutoModelForMultimodalLM.from_pretrained(src, dtype=torch.float32)
    decompressed = dict(loaded.named_modules())
    for name, m in reference.named_modules():
        if isinstance(m, torch.nn.Linear) and is_lm_linear(name + ".weight"):
            m.weight.data.copy_(decompressed[name].weight.data)
    ref = os.path.join(out, "reference")
    reference.save_pretrained(ref)
    _copy_missing(src, ref)
    return out


def _copy_missing(src: str, out: str) -> None:
    """The files of `src` besides its weights (config, tokenizer, processors) that `out` lacks."""
    for name in os.listdir(src):
        path = os.path.join(src, name)
        weights = name.endswith(".safetensors") or name == "model.safetensors.index.json"
        if os.path.isfile(path) and not weights and not os.path.exists(os.path.join(out, name)):
            shutil.copy(path, os.path.join(out, name))
