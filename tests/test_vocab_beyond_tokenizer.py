"""Logits wider than the tokenizer (real Qwen2-VL: 151,936 rows, 151,657 tokenizer ids; the kit's `small`
size too): ids past the tokenizer decode to nothing, in streamed text, logprobs and structured outputs."""

from __future__ import annotations

import json

import pytest

from mmserve import LLM, SamplingParams
from mmserve.engine.detokenizer import IncrementalDetokenizer
from mmserve.logprobs import TokenLogprobs
from mmserve.sampling_params import StructuredOutputs
from mmserve.server.logprob_format import TokenStrings, chat_logprobs
from mmserve.testing.tiny_models import build_tiny_model, make_tokenizer

EXTRA_ROWS = 64  # lm_head rows past the tokenizer


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer("tiny")


@pytest.mark.parametrize("skip_special", [True, False])
def test_detokenizer_streams_around_ids_past_the_tokenizer(tok, skip_special: bool) -> None:
    ids = tok("héllo wörld ✓ 日本 <|im_end|>")["input_ids"]
    beyond = [len(tok), len(tok) + EXTRA_ROWS - 1]
    # One past-the-end id at the start, one inside a multi-byte character, one at the end.
    mixed = [beyond[0], *ids[:2], beyond[1], *ids[2:], beyond[0]]
    params = SamplingParams(skip_special_tokens=skip_special, stop=["zz"])
    det = IncrementalDetokenizer(tok, params, prompt_token_ids=tok("hi")["input_ids"])
    deltas = [det.add(t) for t in mixed]
    deltas.append(det.finish())
    expected = tok.decode(ids, skip_special_tokens=skip_special)
    assert "".join(deltas) == det.text == expected == tok.decode(mixed, skip_special_tokens=skip_special)
    assert deltas[0] == "" and not any("\ufffd" in d for d in deltas)


def test_logprob_strings_of_ids_past_the_tokenizer(tok) -> None:
    strings = TokenStrings(tok)
    known = tok("ok")["input_ids"][0]
    entry = TokenLogprobs(
        token_id=len(tok), logprob=-0.5, rank=1, top_ids=[len(tok), known], top_logprobs=[-0.5, -1.0]
    )
    [item] = chat_logprobs(strings, [entry])["content"]
    assert item["token"] == "" and item["bytes"] == [] and item["logprob"] == -0.5
    assert [t["token"] for t in item["top_logprobs"]] == ["", tok.decode([known])] != ["", ""]


@pytest.fixture(scope="module")
def wide_llm(tmp_path_factory) -> LLM:
    """The tiny Qwen2-VL with EXTRA_ROWS embedding / lm_head rows past its tokenizer."""

    def widen(config) -> None:
        config.text_config.vocab_size += EXTRA_ROWS

    model_dir = build_tiny_model(str(tmp_path_factory.mktemp("wide")), edit_config=widen)
    return LLM(model=model_dir, kv_cache_mb=8)


def test_sampled_ids_past_the_tokenizer_decode_to_nothing(wide_llm) -> None:
    tok = wide_llm.get_tokenizer()
    assert wide_llm.engine.model_config.vocab_size == len(tok) + EXTRA_ROWS
    beyond = len(tok) + EXTRA_ROWS - 1
    [plain] = wide_llm.generate("a cat", SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    # A bias large enough to pick the last row at every step, sampled at temperature 1.
    params = SamplingParams(
        temperature=1.0, seed=1, max_tokens=6, ignore_eos=True, logprobs=2, logit_bias={beyond: 30.0}
    )
    [out] = wide_llm.generate("a cat", params)
    choice = out.outputs[0]
    assert choice.token_ids == [beyond] * 6
    assert choice.text == ""
    assert all(lp[beyond].decoded_token == "" for lp in choice.logprobs)
    assert plain.outputs[0].text == tok.decode(plain.outputs[0].token_ids, skip_special_tokens=True) != ""


def test_json_schema_never_samples_past_the_tokenizer(wide_llm) -> None:
    tok = wide_llm.get_tokenizer()
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "maximum": 99}},
        "required": ["n"],
        "additionalProperties": False,
    }
    params = SamplingParams(
        temperature=1.0,
        seed=3,
        max_tokens=32,
        # Even a huge bias on the extra rows cannot get one past the grammar's mask.
        logit_bias={len(tok) + i: 100.0 for i in range(EXTRA_ROWS)},
        structured=StructuredOutputs(json=json.dumps(schema)),
    )
    [out] = wide_llm.generate("json:", params)
    choice = out.outputs[0]
    assert max(choice.token_ids) < len(tok)
    assert choice.finish_reason == "stop" and set(json.loads(choice.text)) == {"n"}


def test_prompt_ids_past_the_tokenizer_are_valid_model_input(wide_llm) -> None:
    """The engine's prompt check takes the embedding's size, not the tokenizer's, as the vocabulary."""
    tok = wide_llm.get_tokenizer()
    beyond = len(tok) + EXTRA_ROWS - 1
    prompt = {"prompt_token_ids": [*tok("a cat")["input_ids"], beyond]}
    [out] = wide_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match=f"token id {beyond + 1} is outside the vocabulary"):
        wide_llm.engine.add_request("past", [beyond + 1], SamplingParams(max_tokens=1), [])
