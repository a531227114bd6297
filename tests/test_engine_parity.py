"""Engine behaviour beyond the conformance suite (tests/test_conformance.py), on Qwen2-VL: prefix reuse stops
at a different image, retraction under KV pressure, requests that can never fit, abort. All in fp32 against
HF `generate`, and nothing leaks."""

from __future__ import annotations

import pytest
import torch

from mmserve import LLM, SamplingParams
from mmserve.testing.reference import HFReference
from tests.engine_helpers import RecordingSampler, image_case, reference

MAX_NEW = 10
MM_KWARGS = {"video_min_pixels": 56 * 56, "video_max_pixels": 112 * 112}


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


def make_oracle(model_dir: str, mm_kwargs: dict | None = None, dtype: str = "float32"):
    ref = HFReference(
        model_dir, dtype=dtype, mm_processor_kwargs=MM_KWARGS if mm_kwargs is None else mm_kwargs
    )
    return lambda case: reference(ref, case, MAX_NEW)


@pytest.fixture(scope="module")
def oracle_qwen2_vl(tiny_qwen2_vl):
    return make_oracle(tiny_qwen2_vl)


def make_llm(model_dir: str, mm_kwargs: dict | None = None, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_mb", 8)
    return LLM(model_dir, mm_processor_kwargs=MM_KWARGS if mm_kwargs is None else mm_kwargs, **kwargs)


def assert_idle_and_clean(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_work
    llm.check_integrity()
    # Everything still allocated belongs to the prefix cache; dropping it frees every slot (and every state).
    engine.scheduler.prefix_cache.reset()
    assert engine.pool.num_used == 0
    engine.pool.check_integrity()
    if engine.states is not None:
        assert engine.states.num_used == 0
        engine.states.check_integrity()
    if engine.window_pool is not None:
        assert engine.window_pool.num_used == 0
        engine.window_pool.check_integrity()


def run_and_compare(llm: LLM, oracle, cases, check_logits: bool = True, atol: float = 5e-4):
    recorder = RecordingSampler()
    llm.engine.sampler = recorder
    params = [greedy() for _ in cases]
    outputs = llm.chat([c.messages for c in cases], params)
    for case, out, p in zip(cases, outputs, params, strict=True):
        ref = oracle(case)
        assert out.token_ids == ref.token_ids
        assert out.finish_reason == "length"
        if check_logits:
            # fp32 GEMM rounding depends on the batch shape (notes/engine-on-hf-modules.md) and on the CPU's
            # kernels; the tiny model's logits are large (init range 0.5). Eight Qwen2.5-VL requests in one batch
            # differ by up to 2.9e-4 on some machines (tokens still equal), so 5e-4 absolute, 1e-5 relative.
            torch.testing.assert_close(recorder.logits_for(p), ref.logits, atol=atol, rtol=1e-5)
    return outputs


def test_same_text_different_image_is_not_reused_past_the_image(tiny_qwen2_vl, oracle_qwen2_vl):
    llm = make_llm(tiny_qwen2_vl)
    a = image_case([40], "Describe the image.")
    b = image_case([41], "Describe the image.")
    run_and_compare(llm, oracle_qwen2_vl, [a])
    out = run_and_compare(llm, oracle_qwen2_vl, [b])[0]
    image_start = min(i for i, t in enumerate(out.prompt_token_ids) if t >= 2**62)
    assert 0 < out.num_cached_tokens <= image_start  # the text before the image only
    assert_idle_and_clean(llm)


def test_kv_pressure_forces_retraction_and_outputs_stay_equal(tiny_qwen2_vl, oracle_qwen2_vl):
    # 512 bytes per token: 0.062 MB holds 126 tokens. Two 60-token prompts are admitted together and then
    # run out of room while decoding, so the newer one must be retracted and recomputed.
    llm = make_llm(tiny_qwen2_vl, kv_cache_mb=0.062, disable_prefix_cache=True)
    cases = [image_case([50 + i], "Describe the image in detail.") for i in range(6)]
    run_and_compare(llm, oracle_qwen2_vl, cases, check_logits=False)
    assert llm.engine.scheduler.stats.retractions > 0
    assert_idle_and_clean(llm)


def test_request_that_can_never_fit_gets_a_clear_error(tiny_qwen2_vl):
    llm = make_llm(tiny_qwen2_vl, kv_cache_mb=0.02)
    with pytest.raises(ValueError, match="exceeds the KV cache capacity"):
        llm.chat([image_case([1], "Describe the image.").messages], greedy())
    assert_idle_and_clean(llm)


def test_abort_frees_everything_at_once(tiny_qwen2_vl):
    llm = make_llm(tiny_qwen2_vl, max_num_batched_tokens=8)
    engine = llm.engine
    tok = llm.tokenizer
    ids = tok("Tell me a long story about images and caches.")["input_ids"]
    for i in range(3):
        engine.add_request(f"r{i}", ids, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), [])
    for _ in range(12):
        engine.step()
    assert engine.scheduler.running and engine.pool.num_used > 0
    for i in range(3):
        engine.abort(f"r{i}")
    assert_idle_and_clean(llm)
