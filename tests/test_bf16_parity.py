"""bf16, the CPU default for bf16 checkpoints (`--dtype auto` on AMX / AVX512-BF16), in every engine mode against
HF `generate` in bf16: batched decode (one attention call for requests of different lengths), chunked prefill
and a prefix-cached repeat give HF's greedy tokens. Logits are compared in fp32 only (tests/test_conformance.py):
bf16 rounding depends on the batch shape, so here tokens must be equal and logits close at bf16's precision."""

from __future__ import annotations

import pytest
import torch

from mmserve import LLM
from tests.engine_helpers import recorded_greedy_chat
from tests.families import FAMILIES
from tests.test_engine_parity import MAX_NEW, assert_idle_and_clean, make_llm, make_oracle

ARCH = "qwen2_vl"
SPEC = FAMILIES[ARCH]


@pytest.fixture(scope="module")
def oracle(tiny_qwen2_vl):
    return make_oracle(tiny_qwen2_vl, SPEC.mm_kwargs, dtype="bfloat16")


def bf16_llm(model_dir: str, **kwargs) -> LLM:
    llm = make_llm(model_dir, SPEC.mm_kwargs, dtype="bfloat16", **kwargs)
    assert llm.engine.pool.dtype == torch.bfloat16  # the KV cache follows the model's dtype
    return llm


def run(llm: LLM, oracle, cases) -> list:
    outputs, params, recorder = recorded_greedy_chat(llm, cases, MAX_NEW)
    for case, out, p in zip(cases, outputs, params, strict=True):
        ref = oracle(case)
        assert out.token_ids == ref.token_ids
        # bf16 keeps 8 bits of mantissa: logits of magnitude ~10 round in steps of 0.0625. The decode attention
        # (mmserve's CPU kernel) is SDPA's algorithm with its own summation order: 88% of its bf16 outputs are
        # SDPA's bits, the rest one bf16 step away, and this random tiny model grows that to ~0.3 in the
        # logits after a few steps (its bf16 logits are ~20 away from its fp32 ones, kernel or not).
        torch.testing.assert_close(recorder.logits_for(p), ref.logits, atol=0.5, rtol=0.02)
    return outputs


def test_bf16_batched_requests_of_different_lengths(tiny_qwen2_vl, oracle):
    llm = bf16_llm(tiny_qwen2_vl)
    cases = [SPEC.one(10 + i, "Describe the image." + " Be precise." * i, (40 + 8 * i, 48)) for i in range(5)]
    run(llm, oracle, cases + [SPEC.cases()["text"]])
    assert_idle_and_clean(llm)


def test_bf16_chunked_prefill_and_prefix_cached_repeat(tiny_qwen2_vl, oracle):
    llm = bf16_llm(tiny_qwen2_vl, max_num_batched_tokens=7)
    case = SPEC.two([30, 31], "What is there?")
    run(llm, oracle, [case])
    again = run(llm, oracle, [SPEC.two([30, 31], "What is there?")])[0]
    assert again.num_cached_tokens > 0
    assert_idle_and_clean(llm)
