"""Quantized models in every engine mode against HF `generate` (fp32, and bf16 on one case each):

- quantize on load (`--quantization int8|int4`): HF runs the same checkpoint with each quantized weight replaced
  by its dequantized value (mmserve.testing.kit_quant.dequantized_reference), on Qwen2-VL and Gemma 3;
- each published format the kit writes (AWQ, GPTQ int4 / int8 with act-order, FP8 block-wise, compressed-tensors
  W4A16 / W8A8 / FP8-dynamic): HF runs the dense weights the format defines (the checkpoint's `reference/`).
Single requests, chunk budgets that cut items, a prefix-cached repeat and 8 concurrent requests give HF's greedy
tokens and logits; the pools are clean afterwards. EPD and P/D with a quantized model are in
tests/test_quantized_serving.py.
"""

from __future__ import annotations

import os

import pytest
import torch

from mmserve.quant.linear import QuantLinear
from mmserve.testing.kit_quant import FORMATS, dequantized_reference, quantize_checkpoint
from tests.engine_helpers import recorded_greedy_chat
from tests.families import FAMILIES
from tests.test_engine_parity import MAX_NEW, assert_idle_and_clean, make_llm, make_oracle, run_and_compare

QWEN = FAMILIES["qwen2_vl"]


@pytest.fixture(scope="module")
def on_load(tiny_model, tmp_path_factory):
    """(arch, method, head) -> (checkpoint, its HF oracle on the dequantized weights), built on first use."""
    made = {}

    def get(arch: str, method: str, head: bool = True, dtype: str = "float32"):
        key = (arch, method, head, dtype)
        if key not in made:
            ref_dir = str(tmp_path_factory.mktemp(f"dequantized-{arch}-{method}"))
            dequantized_reference(tiny_model(arch), ref_dir, method, head=head, dtype=dtype)
            made[key] = tiny_model(arch), make_oracle(ref_dir, FAMILIES[arch].mm_kwargs, dtype=dtype)
        return made[key]

    return get


@pytest.fixture(scope="module")
def formats(tiny_qwen2_vl, tmp_path_factory):
    """format -> (its checkpoint of the tiny Qwen2-VL, the HF oracle on the dense weights it defines)."""
    made = {}

    def get(fmt: str, dtype: str = "float32"):
        if (fmt, dtype) not in made:
            out = (made.get((fmt, "float32")) or [None])[0]
            out = out or quantize_checkpoint(tiny_qwen2_vl, str(tmp_path_factory.mktemp(f"fmt-{fmt}")), fmt)
            made[fmt, dtype] = out, make_oracle(os.path.join(out, "reference"), QWEN.mm_kwargs, dtype=dtype)
        return made[fmt, dtype]

    return get


def run_bf16(llm, oracle, cases) -> None:
    """bf16 against HF in bf16: greedy tokens equal up to a step where HF's two best logits tie at bf16's
    precision (one step of its 8-bit mantissa apart or less: the quantized GEMV's summation order, not
    oneDNN's, picks one of them); logits close up to there (tests/test_bf16_parity.py says how close)."""
    outputs, params, recorder = recorded_greedy_chat(llm, cases, MAX_NEW)
    for case, out, p in zip(cases, outputs, params, strict=True):
        ref = oracle(case)
        for step, (got, want) in enumerate(zip(out.token_ids, ref.token_ids, strict=True)):
            torch.testing.assert_close(recorder.logits_for(p)[step], ref.logits[step], atol=0.5, rtol=0.02)
            top = ref.logits[step].topk(2).values
            if got != want or top[0] - top[1] <= top[0].abs() * 2**-7:
                assert top[0] - top[1] <= top[0].abs() * 2**-7, (step, out.token_ids, ref.token_ids)
                break


def quantized_layers(llm) -> int:
    """How many QuantLinear layers the language model and its head have; none of its plain linear layers is left
    (they are all quantized, or packed for oneDNN)."""
    runner = llm.engine.runner
    assert not [m for m in runner.language_model.modules() if type(m) is torch.nn.Linear]
    layers = [m for m in runner.language_model.modules() if isinstance(m, QuantLinear)]
    return len(layers) + isinstance(runner.lm_head, QuantLinear)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantize_on_load_every_mode(method, on_load):
    model_dir, oracle = on_load("qwen2_vl", method)
    llm = make_llm(model_dir, QWEN.mm_kwargs, quantization=method)
    assert quantized_layers(llm) == 2 * 4 + 1  # qkv and gate/up fused, o and down; per layer, and the head
    assert llm.engine.runner.decode_stack.quantized  # pure decode steps: every layer in one op over the codes
    run_and_compare(llm, oracle, list(QWEN.cases().values()))
    first = run_and_compare(llm, oracle, [QWEN.two([30, 31], "What is there?")])[0]
    again = run_and_compare(llm, oracle, [QWEN.two([30, 31], "What is there?")])[0]
    assert again.num_cached_tokens >= max(i for i, t in enumerate(first.prompt_token_ids) if t >= 2**62)
    eight = [QWEN.one(10 + i, "Describe the image." + " Be precise." * i, (40 + 8 * i, 48)) for i in range(7)]
    run_and_compare(llm, oracle, [*eight, QWEN.cases()["text"]])
    assert_idle_and_clean(llm)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantize_on_load_chunked_prefill(method, on_load):
    model_dir, oracle = on_load("qwen2_vl", method)
    llm = make_llm(model_dir, QWEN.mm_kwargs, quantization=method, max_num_batched_tokens=7)
    run_and_compare(llm, oracle, [QWEN.two([20, 21]), QWEN.one(22, "What is it?")])
    assert_idle_and_clean(llm)


def test_quantize_on_load_eager_ops_and_unquantized_head(on_load):
    model_dir, oracle = on_load("qwen2_vl", "int4", head=False)
    llm = make_llm(model_dir, QWEN.mm_kwargs, quantization="int4", quantize_lm_head=False, cpu_kernels=False)
    assert quantized_layers(llm) == 2 * 4
    run_and_compare(llm, oracle, [QWEN.one(5), QWEN.cases()["text"]])
    assert_idle_and_clean(llm)


def test_quantize_on_load_windowed_family(on_load):
    """Gemma 3: sliding-window and global layers, bidirectional image attention, a tied head."""
    spec = FAMILIES["gemma3"]
    model_dir, oracle = on_load("gemma3", "int4")
    llm = make_llm(model_dir, spec.mm_kwargs, quantization="int4")
    run_and_compare(llm, oracle, list(spec.cases().values()))
    chunked = make_llm(model_dir, spec.mm_kwargs, quantization="int4", max_num_batched_tokens=7)
    run_and_compare(chunked, oracle, [spec.two([20, 21]), spec.one(22, "What is it?")])
    assert_idle_and_clean(llm)
    assert_idle_and_clean(chunked)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantize_on_load_bf16(method, on_load):
    model_dir, oracle = on_load("qwen2_vl", method, dtype="bfloat16")
    llm = make_llm(model_dir, QWEN.mm_kwargs, quantization=method, dtype="bfloat16")
    run_bf16(llm, oracle, [QWEN.one(10 + i, "Describe the image." + " Be precise." * i) for i in range(3)])
    assert_idle_and_clean(llm)


@pytest.mark.parametrize("fmt", FORMATS)
def test_published_format_every_mode(fmt, formats):
    checkpoint, oracle = formats(fmt)
    llm = make_llm(checkpoint, QWEN.mm_kwargs)
    # The formats leave lm_head alone, as the published checkpoints do. q/k/v (gate/up) whose codes have their
    # own input orders (the kit's gptq-int8 act-order is random per layer) stay apart in one StackedLinear.
    assert quantized_layers(llm) == 2 * (7 if fmt == "gptq-int8" else 4)
    # the decode stack takes codes in input order; act-order layers gather their inputs in Python first
    assert (llm.engine.runner.decode_stack is not None) == (fmt not in ("gptq", "gptq-int8"))
    run_and_compare(llm, oracle, [QWEN.cases()["text"], QWEN.two([1, 2])])
    again = run_and_compare(llm, oracle, [QWEN.two([1, 2])])[0]
    assert again.num_cached_tokens > 0
    run_and_compare(llm, oracle, [QWEN.one(10 + i, "Describe." + " More." * i, (40 + 8 * i, 48)) for i in range(8)])
    chunked = make_llm(checkpoint, QWEN.mm_kwargs, max_num_batched_tokens=7)
    run_and_compare(chunked, oracle, [QWEN.two([20, 21])])
    assert_idle_and_clean(llm)
    assert_idle_and_clean(chunked)


@pytest.mark.parametrize("fmt", FORMATS)
def test_published_format_bf16(fmt, formats):
    checkpoint, oracle = formats(fmt, "bfloat16")
    llm = make_llm(checkpoint, QWEN.mm_kwargs, dtype="bfloat16")
    run_bf16(llm, oracle, [QWEN.one(3), QWEN.cases()["text"]])
    assert_idle_and_clean(llm)
