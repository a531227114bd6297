"""IncrementalDetokenizer: streamed deltas, multi-byte characters, stop strings, special tokens."""

from __future__ import annotations

import pytest

from mmserve.engine.detokenizer import IncrementalDetokenizer
from mmserve.sampling_params import SamplingParams
from mmserve.testing.tiny_models import make_tokenizer


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer("tiny")


def _stream(
    tok, ids: list[int], params: SamplingParams, prompt: list[int] | None = None
) -> tuple[IncrementalDetokenizer, list[str]]:
    det = IncrementalDetokenizer(tok, params, prompt_token_ids=prompt)
    deltas = [det.add(i) for i in ids]
    deltas.append(det.finish())
    return det, deltas


@pytest.mark.parametrize(
    "text",
    [
        "The quick brown fox jumps over the lazy dog.",
        "héllo wörld ✓ 日本",
        "emoji 🙂🚀 and ünïcödé, 漢字かな交じり文",
        "  leading spaces, trailing\n\nnewlines  ",
        "",
    ],
)
def test_deltas_concatenate_to_full_decode(tok, text: str) -> None:
    ids = tok(text)["input_ids"]
    det, deltas = _stream(tok, ids, SamplingParams())
    expected = tok.decode(ids, skip_special_tokens=True)
    assert "".join(deltas) == expected == det.text
    assert not any("\ufffd" in d for d in deltas)
    assert not det.stopped and det.matched_stop is None


def test_prompt_context_does_not_leak_into_output(tok) -> None:
    prompt = tok("<|im_start|>user\nhi 日<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    ids = tok("本 wörld ✓")["input_ids"]
    for skip in (True, False):
        det, deltas = _stream(tok, ids, SamplingParams(skip_special_tokens=skip), prompt)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)


def test_incomplete_trailing_character_released_on_finish(tok) -> None:
    ids = tok("ok ✓")["input_ids"][:-1]  # cut inside the 3-byte character
    det, deltas = _stream(tok, ids, SamplingParams())
    assert "".join(deltas) == tok.decode(ids)
    assert deltas[-1].endswith("\ufffd")


def test_stop_string_in_middle_truncates_before_it(tok) -> None:
    ids = tok("The quick brown fox jumps over the lazy dog.")["input_ids"]
    det = IncrementalDetokenizer(tok, SamplingParams(stop=["fox", "never"]))
    deltas = []
    for i in ids:
        deltas.append(det.add(i))
        assert "f" not in deltas[-1]
        if det.stopped:
            break
    assert det.stopped and det.matched_stop == "fox"
    assert det.text == "".join(deltas) == "The quick brown "
    assert det.add(ids[-1]) == "" and det.finish() == ""
    assert det.text == "The quick brown "


def test_stop_string_spanning_tokens(tok) -> None:
    text = "A cat sits on the mat and looks at the camera"
    ids = tok(text)["input_ids"]
    stop = "on the mat"
    assert not any(stop in tok.decode([i]) for i in ids)  # really spans several tokens
    det = IncrementalDetokenizer(tok, SamplingParams(stop=stop))
    released = ""
    for i in ids:
        released += det.add(i)
        # At no step has any part of the stop string been released.
        assert "A cat sits ".startswith(released)
    assert det.stopped and det.matched_stop == stop
    assert released == det.text == "A cat sits "


def test_earliest_stop_string_wins(tok) -> None:
    ids = tok("The quick brown fox jumps over the lazy dog.")["input_ids"]
    det, _ = _stream(tok, ids, SamplingParams(stop=["lazy", "quick", "brown fox"]))
    assert det.matched_stop == "quick" and det.text == "The "


def test_include_stop_str_in_output(tok) -> None:
    ids = tok("The quick brown fox jumps over the lazy dog.")["input_ids"]
    det, deltas = _stream(tok, ids, SamplingParams(stop="brown fox", include_stop_str_in_output=True))
    assert det.stopped
    assert "".join(deltas) == det.text == "The quick brown fox"


def test_multibyte_stop_string(tok) -> None:
    ids = tok("héllo wörld ✓ 日本 after")["input_ids"]
    det, deltas = _stream(tok, ids, SamplingParams(stop="✓ 日"))
    assert det.matched_stop == "✓ 日"
    assert "".join(deltas) == det.text == "héllo wörld "


def test_held_back_prefix_released_when_not_a_stop(tok) -> None:
    text = "the fox jumps, the dog sleeps"
    ids = tok(text)["input_ids"]
    det, deltas = _stream(tok, ids, SamplingParams(stop=["fox!", "sleepsX"]))
    assert not det.stopped
    assert "".join(deltas) == det.text == text
    # The trailing "sleeps" could still have become "sleepsX", so only finish() releases it.
    assert deltas[-1].endswith("sleeps")


def test_stop_not_held_beyond_prefix(tok) -> None:
    ids = tok("The quick brown fox")["input_ids"]
    det = IncrementalDetokenizer(tok, SamplingParams(stop="zzzzzzzzzz"))
    released = "".join(det.add(i) for i in ids)
    assert released == "The quick brown fox"  # nothing looks like a stop prefix, nothing held


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_skipped_or_kept(tok, skip: bool) -> None:
    ids = tok("hello world<|im_end|>\n<|endoftext|>")["input_ids"]
    det, deltas = _stream(tok, ids, SamplingParams(skip_special_tokens=skip))
    expected = tok.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) == det.text == expected
    assert ("<|im_end|>" in det.text) is not skip


def test_stop_string_across_special_token_kept(tok) -> None:
    ids = tok("done<|im_end|>more")["input_ids"]
    det, deltas = _stream(tok, ids, SamplingParams(skip_special_tokens=False, stop="<|im_end|>"))
    assert det.matched_stop == "<|im_end|>"
    assert "".join(deltas) == det.text == "done"
