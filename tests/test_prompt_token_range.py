"""A prompt token id outside the model's vocabulary (negative, past the embedding, a media pad value), or an
empty prompt, is refused by `Engine.add_request` with a ValueError, and a valid request beside it completes
with its exact tokens: one bad request must never reach the batch it would fail."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from mmserve.config import EngineConfig
from mmserve.engine.engine import Engine
from mmserve.multimodal.items import PAD_BASE
from mmserve.sampling_params import SamplingParams

MAX_STEPS = 500


@pytest.fixture(scope="module")
def engine(tiny_qwen2_vl) -> Engine:
    return Engine(EngineConfig(model=tiny_qwen2_vl, kv_cache_mb=8, max_num_batched_tokens=64))


@pytest.fixture(scope="module")
def good_ids(tiny_qwen2_vl) -> list[int]:
    return AutoTokenizer.from_pretrained(tiny_qwen2_vl)("a cat sat on the mat", add_special_tokens=False)[
        "input_ids"
    ]


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def run_all(engine: Engine) -> dict[str, list[int]]:
    """Step until the engine is idle; the tokens of each request."""
    tokens: dict[str, list[int]] = {}
    for _ in range(MAX_STEPS):
        if not engine.has_work:
            break
        for out in engine.step():
            tokens.setdefault(out.request_id, []).append(out.token_id)
    assert not engine.has_work and not engine.requests
    engine.check_integrity()
    return tokens


@pytest.mark.parametrize("kind", ["negative", "vocab_size", "pad_value", "int64_max"])
def test_out_of_range_prompt_id_is_refused_and_its_batch_mate_completes(engine, good_ids, kind) -> None:
    vocab = engine.model_config.vocab_size
    bad_id = {"negative": -1, "vocab_size": vocab, "pad_value": PAD_BASE + 5, "int64_max": 2**63 - 1}[kind]
    alone = run_all_of(engine, {"alone": good_ids})["alone"]
    engine.add_request("good", good_ids, greedy(), [])
    with pytest.raises(ValueError, match=rf"token id {bad_id} is outside the vocabulary \[0, {vocab}\)"):
        engine.add_request("bad", [*good_ids[:3], bad_id, *good_ids[3:]], greedy(), [])
    assert "bad" not in engine.requests
    tokens = run_all(engine)
    assert tokens == {"good": alone} and len(alone) == 8


def test_an_empty_prompt_is_refused_and_its_batch_mate_completes(engine, good_ids) -> None:
    alone = run_all_of(engine, {"alone": good_ids})["alone"]
    engine.add_request("good", good_ids, greedy(), [])
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request("empty", [], greedy(), [])
    assert run_all(engine) == {"good": alone}


def test_the_ends_of_the_vocabulary_are_valid_prompt_tokens(engine, good_ids) -> None:
    vocab = engine.model_config.vocab_size
    last = next(t for t in range(vocab - 1, 0, -1) if t not in engine.placeholder_ids)  # not a media token
    assert last >= vocab - 8
    tokens = run_all_of(engine, {"edge": [0, *good_ids, last]})
    assert len(tokens["edge"]) == 8


def run_all_of(engine: Engine, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, greedy(), [])
    return run_all(engine)
