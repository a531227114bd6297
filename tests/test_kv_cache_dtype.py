"""`--kv-cache-dtype fp8 | fp8_e4m3 | fp8_e5m2 | int8` against HF `generate` over a cache that rounds K and V
to fp8, or to int8 codes with a scale per (token, KV head) row, as it stores them (mmserve.testing.reference): every engine mode gives its greedy tokens and logits (fp32), with
the CPU kernels and without, on a full-attention family and a windowed one, beside quantized weights, in bf16
(tokens equal up to a tie), and through a P/D handoff, whose peers must agree on the cache's type. The
rounding changes HF's own tokens on these models, so an engine that kept its rows unrounded would fail here."""

from __future__ import annotations

import json
import time

import pytest
import torch

from mmserve.sampling_params import SamplingParams
from mmserve.testing.reference import HFReference
from mmserve.transport import messages as m
from tests.engine_helpers import reference
from tests.families import FAMILIES
from tests.test_engine_parity import MAX_NEW, assert_idle_and_clean, make_llm, run_and_compare
from tests.test_kv_handoff import PROMPTS, Pair, engine
from tests.test_kv_handoff import reference as one_engine
from tests.test_quantized_parity import run_bf16

QWEN = FAMILIES["qwen2_vl"]
# Logits: the tokens are equal, but an fp8 row is a rounding of an fp32 value whose last bits depend on the GEMM's
# blocking (as everywhere in fp32); where that value lies on a rounding boundary of fp8's 3-bit mantissa, the two
# round one fp8 step apart (6% of that element) and the logits move by up to ~1e-2 on these tiny models.
ATOL = 2e-2


@pytest.fixture(scope="module")
def oracles(tiny_model):
    """(arch, kv dtype, model dtype) -> the HF oracle with K and V rounded through that dtype."""
    made = {}

    def get(arch: str, kv: str, dtype: str = "float32"):
        if (arch, kv, dtype) not in made:
            spec = FAMILIES[arch]
            ref = HFReference(tiny_model(arch), dtype=dtype, mm_processor_kwargs=spec.mm_kwargs, kv_cache_dtype=kv)
            made[arch, kv, dtype] = lambda case: reference(ref, case, MAX_NEW)
        return made[arch, kv, dtype]

    return get


STORED = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8}


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2", "int8"])
def test_8bit_cache_every_mode(kv, tiny_qwen2_vl, oracles, oracle_qwen2_vl):
    oracle = oracles("qwen2_vl", kv)
    cases = list(QWEN.cases().values())
    # The rounding shows in HF's answers: a pool that kept bf16/fp32 rows would give the plain oracle's tokens.
    assert any(oracle(c).token_ids != oracle_qwen2_vl(c).token_ids for c in cases)
    llm = make_llm(tiny_qwen2_vl, QWEN.mm_kwargs, kv_cache_dtype=kv)
    assert llm.engine.pool.dtype == STORED[kv]
    assert llm.engine.runner.decode_stack is not None  # pure decode steps round their rows in the one op too
    run_and_compare(llm, oracle, cases, atol=ATOL)
    first = run_and_compare(llm, oracle, [QWEN.two([30, 31], "What is there?")], atol=ATOL)[0]
    again = run_and_compare(llm, oracle, [QWEN.two([30, 31], "What is there?")], atol=ATOL)[0]
    assert again.num_cached_tokens >= max(i for i, t in enumerate(first.prompt_token_ids) if t >= 2**62)
    eight = [QWEN.one(10 + i, "Describe the image." + " Be precise." * i, (40 + 8 * i, 48)) for i in range(7)]
    run_and_compare(llm, oracle, [*eight, QWEN.cases()["text"]], atol=ATOL)
    assert_idle_and_clean(llm)
    chunked = make_llm(tiny_qwen2_vl, QWEN.mm_kwargs, kv_cache_dtype=kv, max_num_batched_tokens=7)
    run_and_compare(chunked, oracle, [QWEN.two([20, 21]), QWEN.one(22, "What is it?")], atol=ATOL)
    assert_idle_and_clean(chunked)


@pytest.fixture(scope="module")
def oracle_qwen2_vl(tiny_qwen2_vl):
    ref = HFReference(tiny_qwen2_vl, mm_processor_kwargs=QWEN.mm_kwargs)
    return lambda case: reference(ref, case, MAX_NEW)


@pytest.mark.parametrize("kv", ["fp8_e4m3", "int8"])
def test_8bit_cache_on_the_eager_ops(kv, tiny_qwen2_vl, oracles):
    llm = make_llm(tiny_qwen2_vl, QWEN.mm_kwargs, kv_cache_dtype=kv, cpu_kernels=False)
    run_and_compare(llm, oracles("qwen2_vl", kv), [QWEN.two([1, 2]), QWEN.cases()["text"]], atol=ATOL)
    assert_idle_and_clean(llm)


@pytest.mark.parametrize("kv", ["fp8_e4m3", "int8"])
def test_8bit_cache_of_a_windowed_family(kv, tiny_model, oracles):
    """Gemma 3: sliding layers in the window pool (8-bit too), image blocks attended both ways."""
    spec = FAMILIES["gemma3"]
    oracle = oracles("gemma3", kv)
    llm = make_llm(tiny_model("gemma3"), spec.mm_kwargs, kv_cache_dtype=kv)
    assert llm.engine.window_pool.dtype == STORED[kv]
    run_and_compare(llm, oracle, list(spec.cases().values()), atol=ATOL)
    chunked = make_llm(tiny_model("gemma3"), spec.mm_kwargs, kv_cache_dtype=kv, max_num_batched_tokens=7)
    run_and_compare(chunked, oracle, [spec.two([20, 21]), spec.one(22, "What is it?")], atol=ATOL)
    assert_idle_and_clean(llm)
    assert_idle_and_clean(chunked)


@pytest.mark.parametrize("kv", ["fp8_e4m3", "int8"])
def test_8bit_cache_in_bf16(kv, tiny_qwen2_vl, oracles):
    llm = make_llm(tiny_qwen2_vl, QWEN.mm_kwargs, kv_cache_dtype=kv, dtype="bfloat16")
    run_bf16(llm, oracles("qwen2_vl", kv, "bfloat16"), [QWEN.one(10 + i, "Describe." * (i + 1)) for i in range(4)])
    assert_idle_and_clean(llm)


def test_8bit_cache_holds_more_tokens_in_the_same_budget(tiny_qwen2_vl):
    plain = make_llm(tiny_qwen2_vl, QWEN.mm_kwargs, kv_cache_mb=4)
    fp8 = make_llm(tiny_qwen2_vl, QWEN.mm_kwargs, kv_cache_mb=4, kv_cache_dtype="fp8_e5m2")
    int8 = make_llm(tiny_qwen2_vl, QWEN.mm_kwargs, kv_cache_mb=4, kv_cache_dtype="int8")
    assert fp8.engine.kv_bytes_per_token * 4 == plain.engine.kv_bytes_per_token  # fp32 rows: 4 bytes, fp8: 1
    assert fp8.engine.pool.num_slots >= 4 * plain.engine.pool.num_slots - 4
    pool = plain.engine.pool
    dim, rows = pool.groups[0].head_dim, pool.token_bytes // (4 * pool.groups[0].head_dim)  # rows a token has
    assert int8.engine.kv_bytes_per_token == rows * (dim + 4)  # int8: a byte a value and a 4-byte scale a row


@pytest.mark.parametrize("kv", ["fp8_e4m3", "int8"])
def test_8bit_cache_beside_quantized_weights(kv, tiny_qwen2_vl, tmp_path):
    from mmserve.testing.kit_quant import dequantized_reference

    ref_dir = dequantized_reference(tiny_qwen2_vl, str(tmp_path / "ref"), "int4")
    ref = HFReference(ref_dir, mm_processor_kwargs=QWEN.mm_kwargs, kv_cache_dtype=kv)
    llm = make_llm(tiny_qwen2_vl, QWEN.mm_kwargs, kv_cache_dtype=kv, quantization="int4")
    run_and_compare(llm, lambda case: reference(ref, case, MAX_NEW), [QWEN.two([3, 4]), QWEN.one(5)], atol=ATOL)
    assert_idle_and_clean(llm)


@pytest.mark.parametrize("backend,kv", [("zmq", "fp8"), ("mooncake", "fp8"), ("zmq", "int8"), ("mooncake", "int8")])
def test_8bit_rows_travel_in_a_handoff(tiny_qwen2_vl, backend, kv):
    eight = {"kv_cache_dtype": kv}
    params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True) for _ in PROMPTS]
    expected = one_engine(tiny_qwen2_vl, PROMPTS, params, **eight)  # itself held to HF above
    assert expected != one_engine(tiny_qwen2_vl, PROMPTS, params)  # the rows' rounding shows in the tokens
    pair = Pair(tiny_qwen2_vl, p_kw={**eight, "max_num_batched_tokens": 16}, d_kw=eight)
    try:
        rooms = [pair.submit(p, s, backend) for p, s in zip(PROMPTS, params, strict=True)]
        pair.pump(pair.settled)
        assert [pair.tokens(r) for r in rooms] == expected
        fp32 = engine(tiny_qwen2_vl, "null").transfer.kv_bytes(1)
        dim = pair.p.pool.groups[0].head_dim  # fp32 rows: 4 bytes a value; fp8: 1; int8: 1, and 4 a row
        assert pair.p.transfer.kv_bytes(1) == (fp32 // 4 if kv == "fp8" else fp32 // 4 // dim * (dim + 4))
        pair.check()
    finally:
        pair.close()


@pytest.mark.parametrize("kv,name", [("fp8", "float8_e4m3fn"), ("int8", "int8")])
def test_peers_with_different_cache_types_are_refused_naming_them(tiny_qwen2_vl, kv, name):
    pair = Pair(tiny_qwen2_vl, p_kw={"kv_cache_dtype": kv})
    try:
        pair.submit(PROMPTS[1], SamplingParams(max_tokens=3, temperature=0))
        deadline = time.monotonic() + 30
        failures = []
        while not failures:
            assert time.monotonic() < deadline
            for out in pair.p.step() if pair.p.has_work else []:
                pair.ph.start(out)
            failures = [x for x in pair.ph.drain() if isinstance(x, m.ErrorMsg)]
            pair.dh.drain()
            time.sleep(0.001)
        assert failures[0].failure.code == "kv_layout_mismatch"
        assert name in failures[0].failure.message and "float32" in failures[0].failure.message
    finally:
        pair.close()


def test_bench_kv_moves_8bit_rows(tiny_qwen2_vl, tmp_path):
    """`mmserve bench kv --kv-cache-dtype int8`: both engines keep int8 rows, so a handoff moves a quarter of the
    fp32 rows' bytes and the rows' scales, over every backend (fp8's bytes: test_8bit_rows_travel_in_a_handoff)."""
    from tests.test_bench_cli import run_cli

    sizes = {}
    for kv in ("auto", "int8"):
        out = tmp_path / f"{kv}.json"
        args = ["--prompt-lens", "32", "--repeats", "1", "--kv-cache-mb", "4", "--kv-cache-dtype", kv]
        done = run_cli("bench", "kv", "--model", tiny_qwen2_vl, *args, "--json", str(out))
        assert done.returncode == 0, done.stderr[-3000:]
        (row,) = json.loads(out.read_text())
        assert row["zmq_ms"] > 0 and row["mooncake_ms"] > 0
        sizes[kv] = row["kv_mb"]
    dim = 16  # the tiny model's head size: an fp32 row is 4 x 16 bytes, an int8 row 16 + 4
    assert sizes["int8"] == pytest.approx(sizes["auto"] / (4 * dim) * (dim + 4), rel=1e-3)
