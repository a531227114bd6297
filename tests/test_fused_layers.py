"""Fused decoder layers (mmserve.engine.fused_layers): every Qwen2-shaped family's layers are replaced, and the
engine's logits are bitwise those of the same engine running transformers' layer code, in fp32, over batches
that mix decodes of different lengths, chunked prefills and prefix-cache reuse; in bf16 the tokens are the
same and the logits within a bf16 rounding. Qwen3-VL's layers (q/k norms) stay HF's. The bitwise test runs the
eager ops (`cpu_kernels=False`); tests/test_cpu_kernels.py compares the kernels with them."""

from __future__ import annotations

import pytest
import torch

from mmserve.cli_args import engine_config_from_args
from mmserve.engine.fused_layers import FusedDecoderLayer, rms_norm
from mmserve.engine.packed_linear import PackedLinear, can_pack
from tests.families import FAMILIES
from tests.test_engine_parity import make_llm
from tests.test_packed_linear import logits_of

FUSED = ["qwen2_vl", "qwen2_5_vl", "llava_onevision", "qwen2_audio"]


def batch(spec):
    """Requests of different lengths, one repeated (a prefix-cache hit), and text only."""
    cases = [spec.one(30 + i, "Describe it." + " Be precise." * i) for i in range(3)]
    return [*cases, cases[1], spec.cases()["text"]]


def test_rms_norm_is_hf_rms_norm_bitwise():
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        norm = Qwen2RMSNorm(96, eps=1e-6).to(dtype)
        torch.nn.init.normal_(norm.weight)
        x = torch.randn(1, 7, 96, dtype=dtype) * 3
        assert torch.equal(rms_norm(x, norm.weight, norm.variance_epsilon), norm(x))


@pytest.mark.parametrize("arch", FUSED)
def test_fused_layers_are_bitwise_hf_layers_in_fp32(arch, tiny_model):
    spec, path = FAMILIES[arch], tiny_model(arch)
    # Small forwards: prompts are cut into several chunks and prefills share steps with decodes. The eager
    # ops on both sides: the CPU kernels' sums are not bitwise (tests/test_cpu_kernels.py holds them).
    options = dict(dtype="float32", max_num_batched_tokens=48, cpu_kernels=False)
    fused = make_llm(path, spec.mm_kwargs, **options)
    plain = make_llm(path, spec.mm_kwargs, fuse_layers=False, **options)
    layers = fused.engine.runner.language_model.layers
    assert fused.engine.runner.fused_layers == len(layers) == fused.engine.model_config.num_layers
    assert all(isinstance(layer, FusedDecoderLayer) for layer in layers)
    assert plain.engine.runner.fused_layers == 0
    assert not any(
        isinstance(layer, FusedDecoderLayer) for layer in plain.engine.runner.language_model.layers
    )

    tokens, logits = logits_of(fused, batch(spec))
    plain_tokens, plain_logits = logits_of(plain, batch(spec))
    assert tokens == plain_tokens
    for a, b in zip(logits, plain_logits, strict=True):
        assert torch.equal(a, b)
    assert fused.engine.scheduler.stats.prefix_hit_tokens > 0  # the repeated request reused its prompt


@pytest.mark.skipif(not can_pack(torch.bfloat16, torch.device("cpu")), reason="no native bf16 in oneDNN")
def test_fused_layers_in_bf16_keep_tokens_and_pack_the_fused_weights(tiny_qwen2_vl):
    spec = FAMILIES["qwen2_vl"]
    fused = make_llm(tiny_qwen2_vl, spec.mm_kwargs, dtype="bfloat16")
    plain = make_llm(tiny_qwen2_vl, spec.mm_kwargs, dtype="bfloat16", fuse_layers=False)
    runner = fused.engine.runner
    # q/k/v, o, gate/up and down: four packed GEMMs per layer instead of seven
    packed = [m for m in runner.language_model.modules() if isinstance(m, PackedLinear)]
    assert len(packed) == 4 * fused.engine.model_config.num_layers
    assert not any(isinstance(m, torch.nn.Linear) for m in runner.language_model.modules())
    tokens, logits = logits_of(fused, batch(spec))
    plain_tokens, plain_logits = logits_of(plain, batch(spec))
    assert tokens == plain_tokens
    for a, b in zip(logits, plain_logits, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=0.05)


def test_qwen3_vl_keeps_hf_layers(tiny_qwen3_vl):
    llm = make_llm(tiny_qwen3_vl, FAMILIES["qwen3_vl"].mm_kwargs)
    assert llm.engine.runner.fused_layers == 0
    assert not any(isinstance(m, FusedDecoderLayer) for m in llm.engine.runner.language_model.modules())


def test_disable_layer_fusion_flag(tiny_qwen2_vl):
    from mmserve.cli import build_parser

    args = build_parser().parse_args(["serve", tiny_qwen2_vl])
    assert engine_config_from_args(args).fuse_layers
    args = build_parser().parse_args(["serve", tiny_qwen2_vl, "--disable-layer-fusion"])
    assert not engine_config_from_args(args).fuse_layers


# -- Gemma 3 (mmserve.engine.fused_gemma) ----------------------------------------------------------------------
def test_gemma_norm_is_transformers_gemma3_rms_norm_bitwise(kernels):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    from mmserve.engine.fused_gemma import gemma_norm

    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        norm = Gemma3RMSNorm(96, eps=1e-6).to(dtype)
        torch.nn.init.normal_(norm.weight)
        x, residual = torch.randn(7, 96, dtype=dtype) * 3, torch.randn(7, 96, dtype=dtype)
        want = norm(x)
        assert torch.equal(gemma_norm(x, norm.weight, norm.eps), want)
        assert torch.equal(gemma_norm(x, norm.weight, norm.eps, residual), residual + want)
        # the kernel's sum of squares adds in another order than torch's mean: the last bit of the scale
        tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-2)
        torch.testing.assert_close(kernels.gemma_rms_norm(x, norm.weight, norm.eps), want, **tol)
        torch.testing.assert_close(kernels.gemma_rms_norm(x, norm.weight, norm.eps, residual), residual + want, **tol)
        heads = torch.randn(5, 12, 96, dtype=dtype)[:, 2:9]  # per-head rows with gaps between tokens
        torch.testing.assert_close(kernels.gemma_rms_norm(heads, norm.weight, norm.eps), norm(heads), **tol)


@pytest.mark.parametrize("cpu_kernels", [False, True], ids=["eager", "kernels"])
def test_fused_gemma3_layers_are_transformers_layers_in_fp32(tiny_model, cpu_kernels):
    """Bitwise with the eager ops; with the kernels (their sums in another order) the same tokens, the logits
    within rounding."""
    from mmserve.engine.fused_gemma import FusedGemmaLayer

    spec, path = FAMILIES["gemma3"], tiny_model("gemma3")
    # Chunks and decodes in one step, sliding windows and image blocks: the step's views over both pools.
    options = dict(dtype="float32", max_num_batched_tokens=48, cpu_kernels=cpu_kernels)
    fused = make_llm(path, spec.mm_kwargs, **options)
    plain = make_llm(path, spec.mm_kwargs, fuse_layers=False, **options)
    layers = fused.engine.runner.language_model.layers
    assert all(isinstance(layer, FusedGemmaLayer) for layer in layers) and fused.engine.runner.decode_stack is None
    tokens, logits = logits_of(fused, batch(spec))
    plain_tokens, plain_logits = logits_of(plain, batch(spec))
    assert tokens == plain_tokens
    for a, b in zip(logits, plain_logits, strict=True):
        if cpu_kernels:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=5e-4)
        else:
            assert torch.equal(a, b)
