"""Engine-level sampling features (issue 14): penalties, logit_bias, min_tokens, logprobs, prompt logprobs,
stop_reason and n > 1, checked against Hugging Face (fp32) where HF defines the same thing."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoTokenizer

from mmserve.config import EngineConfig
from mmserve.engine.engine import Engine
from mmserve.sampling_params import SamplingParams

PROMPT = "a cat sat on the mat and the dog"


@pytest.fixture(scope="module")
def engine(tiny_qwen2_vl) -> Engine:
    return Engine(EngineConfig(model=tiny_qwen2_vl, kv_cache_mb=8, max_num_batched_tokens=16))


@pytest.fixture(scope="module")
def hf(tiny_qwen2_vl):
    model = AutoModelForImageTextToText.from_pretrained(tiny_qwen2_vl, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_qwen2_vl)


def run(engine: Engine, prompt_ids: list[int], params: SamplingParams, rid: str = "r") -> dict:
    """Run one request to its end; the outputs of each choice, keyed by index."""
    engine.add_request(rid, prompt_ids, params, [])
    choices: dict[int, dict] = {}
    for _ in range(2000):
        if not engine.has_work:
            break
        for out in engine.step():
            c = choices.setdefault(
                out.request.index, {"ids": [], "logprobs": [], "prompt": None, "req": None}
            )
            c["ids"].append(out.token_id)
            c["logprobs"].append(out.logprobs)
            c["prompt"] = c["prompt"] or out.prompt_logprobs
            c["req"] = out.request
    assert not engine.has_work and not engine.requests and not engine.groups
    engine.check_integrity()
    return choices


def ids_of(hf, text: str = PROMPT) -> list[int]:
    return hf[1](text, add_special_tokens=False)["input_ids"]


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf[0](input_ids=torch.tensor([ids])).logits[0].float()


def test_repetition_penalty_equals_hf_generate(engine, hf) -> None:
    ids = ids_of(hf)
    with torch.no_grad():
        ref = (
            hf[0]
            .generate(
                torch.tensor([ids]),
                max_new_tokens=12,
                do_sample=False,
                repetition_penalty=1.8,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(ids) :]
            .tolist()
        )
    out = run(
        engine, ids, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.8)
    )
    assert out[0]["ids"] == ref


def test_logit_bias_forces_a_token_and_frequency_penalty_removes_repeats(engine, hf) -> None:
    ids = ids_of(hf)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = run(engine, ids, greedy)[0]["ids"]
    assert len(set(plain)) < len(plain), "the tiny model repeats itself greedily"
    target = next(t for t in range(5, 200) if t not in plain)
    biased = run(
        engine, ids, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={target: 100})
    )
    assert biased[0]["ids"] == [target] * 6
    penalised = run(
        engine,
        ids,
        SamplingParams(
            temperature=0, max_tokens=24, ignore_eos=True, frequency_penalty=2.0, presence_penalty=2.0
        ),
    )[0]["ids"]
    assert len(set(penalised)) > len(set(plain))


def test_min_tokens_masks_stop_ids_until_reached(engine, hf) -> None:
    ids = ids_of(hf)
    first = run(engine, ids, SamplingParams(temperature=0, max_tokens=1))[0]["ids"][0]
    stopped = run(engine, ids, SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[first]))[0]
    assert stopped["ids"] == [first] and stopped["req"].stop_reason == first
    delayed = run(
        engine, ids, SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[first], min_tokens=5)
    )[0]
    assert len(delayed["ids"]) >= 5 and first not in delayed["ids"][:5]


def test_logprobs_equal_log_softmax_of_hf_logits(engine, hf) -> None:
    ids = ids_of(hf)
    out = run(
        engine,
        ids,
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2),
    )[0]
    full = ids + out["ids"]
    ref = torch.log_softmax(hf_logits(hf, full), dim=-1)
    for step, lp in enumerate(out["logprobs"]):
        pos = len(ids) - 1 + step
        assert lp.token_id == full[pos + 1] and lp.rank == 1  # greedy: the top token
        assert abs(lp.logprob - ref[pos, lp.token_id].item()) < 1e-5
        top = torch.topk(ref[pos], 3)
        assert lp.top_ids == top.indices.tolist()
        assert torch.allclose(torch.tensor(lp.top_logprobs), top.values, atol=1e-5)
    prompt = out["prompt"]
    assert len(prompt) == len(ids) and prompt[0] is None
    for pos, lp in enumerate(prompt[1:]):
        assert lp.token_id == ids[pos + 1]
        assert abs(lp.logprob - ref[pos, ids[pos + 1]].item()) < 1e-5 and len(lp.top_ids) == 2


def test_n_choices_prefill_once_and_are_reproducible(engine, hf) -> None:
    ids = ids_of(hf)
    params = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, n=3, seed=7)
    a, b = run(engine, ids, params, "a"), run(engine, ids, params, "b")
    assert sorted(a) == [0, 1, 2]
    assert [a[i]["ids"] for i in range(3)] == [b[i]["ids"] for i in range(3)]
    assert len({tuple(a[i]["ids"]) for i in range(3)}) > 1  # each choice its own seed stream
    single = run(engine, ids, SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=8))
    assert single[0]["ids"] == a[1]["ids"]  # choice i uses seed + i
    # the siblings waited for the first choice's prompt and reused it (all but the last prompt token)
    assert [a[i]["req"].num_cached_tokens for i in (1, 2)] == [len(ids) - 1] * 2


def test_bad_token_ids_in_params_are_value_errors(engine, hf) -> None:
    vocab = engine.model_config.vocab_size
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request("bad", ids_of(hf), SamplingParams(logit_bias={vocab: 1.0}), [])
    with pytest.raises(ValueError, match="presence_penalty"):
        SamplingParams(presence_penalty=3.0)
    assert not engine.has_work


def test_random_json_schemas_with_the_tiny_model_always_validate(engine, hf) -> None:
    """20 random schemas, all in one batch of the random-weight model (greedy): every output validates."""
    import json
    import random

    import jsonschema

    from mmserve.sampling_params import StructuredOutputs
    from tests.test_grammar import random_schema

    rng = random.Random(14)
    schemas = [random_schema(rng) for _ in range(20)]
    ids = ids_of(hf)
    for i, schema in enumerate(schemas):
        spec = StructuredOutputs(json=json.dumps(schema))
        engine.add_request(f"s{i}", ids, SamplingParams(temperature=0, max_tokens=400, structured=spec), [])
    outputs: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    for _ in range(2000):
        if not engine.has_work:
            break
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out.token_id)
            if out.finish_reason:
                finish[out.request_id] = out.finish_reason
    engine.check_integrity()
    for i, schema in enumerate(schemas):
        assert finish[f"s{i}"] == "stop"
        text = hf[1].decode(outputs[f"s{i}"], skip_special_tokens=True)
        jsonschema.validate(json.loads(text), schema)
