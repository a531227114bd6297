"""Linear weights packed once into oneDNN's layout (bf16 on a CPU, the default): bitwise the same outputs as
`torch.nn.Linear` at every row count, applied to every linear layer of the language model and `lm_head`, and the
engine's logits equal to an unpacked engine's. `--disable-weight-packing` stays unpacked. fp32 is packed where
`--fp32-gemm` says (auto: on x86 CPUs not made by Intel): then every family keeps HF's greedy tokens, batched,
chunked and prefix-cached, and its logits within the fp32 parity tolerance."""

from __future__ import annotations

import pytest
import torch

from mmserve import SamplingParams
from mmserve.cli_args import engine_config_from_args
from mmserve.cpu_info import cpu_vendor
from mmserve.engine.packed_linear import PackedLinear, can_pack, fp32_in_onednn
from tests.engine_helpers import RecordingSampler
from tests.families import FAMILIES
from tests.test_engine_parity import MAX_NEW, assert_idle_and_clean, make_llm, make_oracle, run_and_compare

SPEC = FAMILIES["qwen2_vl"]
needs_bf16 = pytest.mark.skipif(
    not can_pack(torch.bfloat16, torch.device("cpu")), reason="this CPU has no native bf16 in oneDNN"
)


@needs_bf16
@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_is_bitwise_nn_linear(bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 200, bias=bias, dtype=torch.bfloat16)
    packed = PackedLinear(linear)
    with torch.no_grad():
        for shape in [(1, 96), (1, 1, 96), (7, 96), (1, 64, 96), (300, 96)]:
            x = torch.randn(*shape, dtype=torch.bfloat16)
            out = packed(x)
            assert out.shape == shape[:-1] + (200,)
            assert torch.equal(out, linear(x)), shape


def logits_of(llm, cases) -> list[torch.Tensor]:
    recorder = RecordingSampler()
    llm.engine.sampler = recorder
    params = [SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True) for _ in cases]
    outputs = llm.chat([c.messages for c in cases], params)
    return [out.token_ids for out in outputs], [recorder.logits_for(p) for p in params]


@needs_bf16
def test_engine_packs_every_linear_and_keeps_its_logits(tiny_qwen2_vl):
    packed = make_llm(tiny_qwen2_vl, SPEC.mm_kwargs, dtype="bfloat16")
    runner = packed.engine.runner
    assert runner.packed and isinstance(runner.lm_head, PackedLinear)
    modules = list(runner.language_model.modules())
    assert not any(isinstance(m, torch.nn.Linear) for m in modules)
    # per layer q/k/v, o, gate/up and down (fused layers, mmserve.engine.fused_layers)
    assert sum(isinstance(m, PackedLinear) for m in modules) == 4 * packed.engine.model_config.num_layers

    plain = make_llm(tiny_qwen2_vl, SPEC.mm_kwargs, dtype="bfloat16", pack_weights=False)
    assert not plain.engine.runner.packed
    assert any(isinstance(m, torch.nn.Linear) for m in plain.engine.runner.language_model.modules())
    # batched decode of different lengths and prefill chunks in one forward: same rows, same bits
    cases = [SPEC.one(10 + i, "Describe the image." + " Be precise." * i, (40 + 8 * i, 48)) for i in range(3)]
    cases.append(SPEC.cases()["text"])
    tokens, logits = logits_of(packed, cases)
    plain_tokens, plain_logits = logits_of(plain, cases)
    assert tokens == plain_tokens
    for a, b in zip(logits, plain_logits, strict=True):
        assert torch.equal(a, b)


def test_fp32_gemm_choice():
    mkl = torch.backends.mkl.is_available()
    assert fp32_in_onednn("auto", vendor="AuthenticAMD") == mkl  # MKL's generic path for few rows there
    assert fp32_in_onednn("auto", vendor="HygonGenuine") == mkl
    assert not fp32_in_onednn("auto", vendor="GenuineIntel")  # MKL's own: HF's GEMM, bitwise
    assert not fp32_in_onednn("auto", vendor="")  # not x86 (or no /proc/cpuinfo): torch's default
    assert fp32_in_onednn("onednn", vendor="GenuineIntel")
    assert not fp32_in_onednn("mkl", vendor="AuthenticAMD")
    assert fp32_in_onednn("auto") == fp32_in_onednn("auto", vendor=cpu_vendor())
    with pytest.raises(ValueError, match="fp32_gemm must be one of auto, mkl, onednn"):
        fp32_in_onednn("blas")
    cpu = torch.device("cpu")
    assert can_pack(torch.float32, cpu, "onednn") and not can_pack(torch.float32, cpu, "mkl")
    assert not can_pack(torch.float32, torch.device("meta"), "onednn")
    assert not can_pack(torch.bfloat16, torch.device("meta"))
    assert not can_pack(torch.int8, cpu, "onednn")


@pytest.mark.parametrize("bias", [True, False])
def test_fp32_packed_linear_is_nn_linear_within_rounding(bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 200, bias=bias)
    packed = PackedLinear(linear)
    with torch.no_grad():
        for shape in [(1, 96), (1, 1, 96), (7, 96), (1, 64, 96), (300, 96)]:
            x = torch.randn(*shape)
            out = packed(x)
            assert out.shape == shape[:-1] + (200,) and out.dtype == torch.float32
            torch.testing.assert_close(out, linear(x), atol=1e-5, rtol=1e-5)


def test_fp32_mkl_is_not_packed(tiny_qwen2_vl):
    llm = make_llm(tiny_qwen2_vl, SPEC.mm_kwargs, dtype="float32", fp32_gemm="mkl")
    assert not llm.engine.runner.packed
    assert not any(isinstance(m, PackedLinear) for m in llm.encoder.tower.modules())


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_fp32_in_onednn_keeps_hf_greedy_tokens(arch, tiny_model):
    """What `--fp32-gemm auto` runs on an AMD CPU, on any CPU: the language model, `lm_head` and the tower all
    packed; concurrent requests in prefill chunks of 7 tokens, then a prefix-cached repeat, give HF's tokens."""
    spec = FAMILIES[arch]
    llm = make_llm(
        tiny_model(arch), spec.mm_kwargs, dtype="float32", fp32_gemm="onednn", max_num_batched_tokens=7
    )
    runner = llm.engine.runner
    assert runner.packed and isinstance(runner.lm_head, PackedLinear)
    assert not any(type(m) is torch.nn.Linear for m in runner.language_model.modules())
    assert any(isinstance(m, PackedLinear) for m in llm.encoder.tower.modules())
    oracle = make_oracle(tiny_model(arch), spec.mm_kwargs)
    run_and_compare(llm, oracle, [spec.two([50, 51]), spec.one(52, "What is it?"), spec.cases()["text"]])
    again = run_and_compare(llm, oracle, [spec.two([50, 51])])[0]
    assert again.num_cached_tokens > 0
    assert_idle_and_clean(llm)


def test_disable_weight_packing_flag(tiny_qwen2_vl):
    from mmserve.cli import build_parser

    args = build_parser().parse_args(["serve", tiny_qwen2_vl, "--dtype", "bfloat16"])
    assert engine_config_from_args(args).pack_weights
    args = build_parser().parse_args(
        ["serve", tiny_qwen2_vl, "--dtype", "bfloat16", "--disable-weight-packing"]
    )
    assert not engine_config_from_args(args).pack_weights


def test_fp32_gemm_flag(tiny_qwen2_vl):
    from mmserve.cli import build_parser
    from mmserve.config import EncoderConfig, EngineConfig

    args = build_parser().parse_args(["serve", tiny_qwen2_vl])
    assert engine_config_from_args(args).fp32_gemm == "auto"
    args = build_parser().parse_args(["serve", tiny_qwen2_vl, "--fp32-gemm", "onednn"])
    assert engine_config_from_args(args).fp32_gemm == "onednn"
    assert build_parser().parse_args(["encoder", tiny_qwen2_vl, "--fp32-gemm", "mkl"]).fp32_gemm == "mkl"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", tiny_qwen2_vl, "--fp32-gemm", "blas"])
    for config in (EngineConfig, EncoderConfig):
        with pytest.raises(ValueError, match="fp32_gemm"):
            config(model=tiny_qwen2_vl, fp32_gemm="blas")


@needs_bf16
@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_encoder_packs_the_tower_and_keeps_its_embeddings(arch, tiny_model):
    """Every family's tower runs packed (SigLIP's pooling head reads `out_proj.weight` itself: not packed)."""
    from mmserve.config import MediaConfig
    from mmserve.encoder.runner import MediaInput, build_encoder
    from mmserve.models.family import load_family
    from mmserve.multimodal.items import MAIN, Modality
    from mmserve.multimodal.media import MediaRef
    from tests.conftest import random_image
    from tests.engine_helpers import png_bytes, wav_bytes

    family = load_family(tiny_model(arch))
    packed = build_encoder(family, "bfloat16", "cpu", 64, MediaConfig())
    plain = build_encoder(family, "bfloat16", "cpu", 64, MediaConfig(), pack_weights=False)
    try:
        assert not any(type(m) is torch.nn.Linear for m in packed.tower.modules())
        assert any(isinstance(m, PackedLinear) for m in packed.tower.modules())
        assert any(isinstance(m, torch.nn.Linear) for m in plain.tower.modules())
        if arch == "qwen2_audio":
            item = MediaInput(Modality.AUDIO, MediaRef.from_bytes(wav_bytes(5, 0.6)))
        else:
            item = MediaInput(Modality.IMAGE, MediaRef.from_bytes(png_bytes(random_image(3))))
        a, b = packed.encode(item), plain.encode(item)
        assert a.tensors[MAIN].dtype == torch.bfloat16
        for name, tensor in a.tensors.items():  # Qwen3-VL's DeepStack levels too
            assert torch.equal(tensor, b.tensors[name]), name
    finally:
        packed.close()
        plain.close()
