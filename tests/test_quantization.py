"""Quantized weights below the engine: the CPU kernels against the dequantized weights, the published formats
read exactly (against the dense weights their writer chose, and compressed-tensors' own decompression), and
corrupt or unsupported checkpoints refused at load with the tensor or setting named."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from mmserve.models.family import load_family
from mmserve.models.loader import load_hf_config
from mmserve.quant.formats import read_format
from mmserve.quant.layout import KIND_CODES, QuantizedWeight, pack_int4, unpack_int4
from mmserve.quant.linear import AMX_ROWS, GEMV_ROWS, QuantLinear
from mmserve.quant.quantize import quantize_weight
from mmserve.testing.kit_quant import FORMATS, quantize_checkpoint


def fp8_weight(n: int, k: int, group: int) -> QuantizedWeight:
    codes = (torch.randn(n, k) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    return QuantizedWeight("fp8", codes.view(torch.uint8), torch.rand(n, k // group) + 0.01, None, group, k)


def weights(kind: str, n: int, k: int) -> QuantizedWeight:
    if kind == "fp8":
        return fp8_weight(n, k, 32)
    return quantize_weight(torch.randn(n, k) * 0.05, kind)


def test_int4_packing_round_trips():
    q = torch.randint(0, 16, (5, 96), dtype=torch.uint8)
    assert torch.equal(unpack_int4(pack_int4(q)), q)


@pytest.mark.parametrize("kind", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("shape", [(96, 64), (40, 96), (130, 256)])
def test_kernels_dequantize_exactly(kernels, kind, shape):
    torch.manual_seed(1)
    w = weights(kind, *shape)
    for dtype in (torch.float32, torch.bfloat16):
        got = kernels.dequantize_weight(w.data, w.scales, w.zeros, KIND_CODES[kind], w.group, shape[1], dtype)
        assert torch.equal(got, w.codes_dequantized(dtype))


@pytest.mark.parametrize("kind", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("rows", [1, 3, 9, 17, GEMV_ROWS + 7, AMX_ROWS + 5])
@pytest.mark.parametrize("shape", [(96, 64), (40, 96), (130, 256)])
def test_quant_linear_matches_the_dense_product(kernels, kind, rows, shape):
    torch.manual_seed(2)
    w = weights(kind, *shape)
    bias = torch.randn(shape[0])
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1.6e-2)):
        layer = QuantLinear(w, bias, dtype)
        x = torch.randn(rows, shape[1]).to(dtype)
        want = torch.nn.functional.linear(
            x.float(), w.codes_dequantized(dtype).float(), bias.to(dtype).float()
        )
        eager = layer(x).float()  # no kernels: the eager dequantization
        layer.kernels = kernels
        fast = layer(x).float()
        scale = want.abs().max()
        assert (eager - want).abs().max() <= tol * scale
        assert (fast - want).abs().max() <= tol * scale
        if dtype == torch.float32:
            assert not torch.equal(fast, torch.zeros_like(fast))


def test_quantize_on_load_error_is_small():
    torch.manual_seed(3)
    w = torch.randn(64, 256)
    for kind, bound in (("int8", 0.01), ("int4", 0.15)):
        q = quantize_weight(w, kind)
        rel = (q.dequantized(torch.float32) - w).norm() / w.norm()
        assert rel < bound, (kind, rel)
    assert quantize_weight(torch.randn(8, 48), "int4") is None  # no group size divides 48


@pytest.fixture(scope="module")
def quantized(tiny_qwen2_vl, tmp_path_factory):
    made = {}

    def get(fmt: str) -> str:
        if fmt not in made:
            made[fmt] = quantize_checkpoint(tiny_qwen2_vl, str(tmp_path_factory.mktemp(f"q-{fmt}")), fmt)
        return made[fmt]

    return get


def language_model(path: str):
    return load_family(path, load_hf_config(path), {}).load_language_model(torch.float32, "sdpa")


@pytest.mark.parametrize("fmt", FORMATS)
def test_formats_load_into_the_writers_dense_weights(quantized, fmt):
    """Every quantized layer of the checkpoint dequantizes to the dense weight of its reference (written from
    the codes the writer chose; for compressed-tensors, transformers' own decompressed load); the rest is
    untouched."""
    from transformers import AutoModelForMultimodalLM

    path = quantized(fmt)
    lm = language_model(path)
    reference = AutoModelForMultimodalLM.from_pretrained(os.path.join(path, "reference"), dtype=torch.float32)
    text = reference.model.language_model
    layers = [(n, m) for n, m in lm.model.named_modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 7 * len(text.layers)  # q, k, v, o, gate, up, down of every layer
    for name, layer in layers:
        assert torch.equal(layer.qweight.dequantized(torch.float32), text.get_submodule(name).weight), name
    assert type(lm.lm_head) is torch.nn.Linear  # left alone, as the checkpoint left it
    if fmt.startswith("gptq"):
        assert layers[0][1].qweight.perm is not None  # act-order


def rewrite(path: str, out: str, edit_tensors=None, edit_config=None) -> str:
    import shutil

    shutil.copytree(path, out)
    if edit_tensors is not None:
        state = load_file(os.path.join(out, "model.safetensors"))
        edit_tensors(state)
        save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    if edit_config is not None:
        config = json.load(open(os.path.join(out, "config.json")))
        edit_config(config["quantization_config"])
        json.dump(config, open(os.path.join(out, "config.json"), "w"))
    return out


def key_of(state: dict, suffix: str) -> str:
    return next(k for k in sorted(state) if k.endswith(suffix))


@pytest.mark.parametrize(
    ("fmt", "edit_tensors", "edit_config", "message"),
    [
        ("awq", lambda s: s.pop(key_of(s, "q_proj.scales")), None, "q_proj.scales is missing"),
        ("awq", None, lambda q: q.update(group_size=16), "scales has shape"),
        (
            "gptq",
            lambda s: s.update({key_of(s, "down_proj.g_idx"): s[key_of(s, "down_proj.g_idx")] * 0}),
            None,
            "g_idx does not give every group",
        ),
        (
            "w4a16",
            lambda s: s.update(
                {key_of(s, "up_proj.weight_packed"): s[key_of(s, "up_proj.weight_packed")][:, :1].contiguous()}
            ),
            None,
            "up_proj.weight_packed has shape",
        ),
        ("fp8", lambda s: s.pop(key_of(s, "o_proj.weight")), None, "o_proj.weight is missing"),
        ("awq", None, lambda q: q.update(version="exllama"), "AWQ version 'exllama'"),
        ("gptq", None, lambda q: q.update(bits=3), "GPTQ with 3 bits"),
        ("w8a8", None, lambda q: q.update(quant_method="bitsandbytes"), "quant_method 'bitsandbytes'"),
        ("fp8", None, lambda q: q.update(activation_scheme="static"), "activation_scheme 'static'"),
    ],
)
def test_corrupt_or_unsupported_checkpoints_fail_at_load_naming_it(
    quantized, tmp_path, fmt, edit_tensors, edit_config, message
):
    bad = rewrite(quantized(fmt), str(tmp_path / "bad"), edit_tensors, edit_config)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        language_model(bad)


def test_read_format_refuses_what_it_does_not_run():
    assert read_format(None) is None
    with pytest.raises(ValueError, match="compressed-tensors format 'marlin-24'"):
        read_format(
            {
                "quant_method": "compressed-tensors",
                "format": "marlin-24",
                "config_groups": {"g": {"weights": {"type": "int", "num_bits": 4, "strategy": "group"}}},
            }
        )
    with pytest.raises(ValueError, match="weight_block_size"):
        read_format({"quant_method": "fp8", "fmt": "e4m3"})


def test_cli_makes_a_quantized_tiny_model(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "awq"
    argv = ["make-tiny-model", "--arch", "qwen2_vl", "--quantization", "awq", "--out", str(out)]
    done = subprocess.run([sys.executable, "-m", "mmserve.cli", *argv], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert "(awq)" in done.stdout
    config = json.load(open(out / "config.json"))
    assert config["quantization_config"]["quant_method"] == "awq"
    assert any(k.endswith("q_proj.qweight") for k in load_file(out / "model.safetensors"))
    assert os.path.exists(out / "reference" / "model.safetensors")


def test_every_fp8_code_expands_to_its_value(kernels):
    """All 254 finite e4m3 codes, subnormals and signed zeros included, through the kernels' integer expansion:
    exactly torch's float8_e4m3fn values (times a scale of 1), in fp32 and bf16."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    data = codes.repeat(2, 1)[:, :224].contiguous()  # 2 rows of 224 codes (7 runs of 32)
    scales = torch.ones(2, 7)
    want = data.view(torch.float8_e4m3fn).float()
    for dtype in (torch.float32, torch.bfloat16):
        got = kernels.dequantize_weight(data, scales, None, KIND_CODES["fp8"], 32, 224, dtype)
        assert torch.equal(got.float(), want.to(dtype).float())
        x = torch.eye(224, dtype=dtype)[:3]  # rows picking single codes: the products are the values
        y = kernels.quant_linear(x, data, scales, None, KIND_CODES["fp8"], 32, None)
        assert torch.equal(y.float(), want[:, :3].t().to(dtype).float())
