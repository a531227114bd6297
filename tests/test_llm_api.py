"""The offline `LLM` API in vLLM's shape (issue 14 item 7): constructor keywords, RequestOutput / CompletionOutput /
Logprob, n > 1, stop strings per choice, image_pil parts, whole-call prompt validation, and the README example."""

from __future__ import annotations

import base64
import io
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mmserve import LLM, SamplingParams
from mmserve.multimodal.messages import parse_messages
from mmserve.outputs import CompletionOutput, Logprob, RequestOutput

PROMPT = "a cat sat on the mat and the dog"


@pytest.fixture(scope="module")
def llm(tiny_qwen2_vl) -> LLM:
    return LLM(
        model=tiny_qwen2_vl, kv_cache_mb=8, max_num_batched_tokens=64, limit_mm_per_prompt={"image": 2}
    )


def random_image(seed: int) -> Image.Image:
    return Image.fromarray((np.random.RandomState(seed).rand(48, 64, 3) * 255).astype("uint8"))


def assert_clean(llm: LLM) -> None:
    assert not llm.engine.has_work and not llm.engine.requests and not llm.engine.groups
    llm.check_integrity()


def chat_with(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "Describe it."}]}]


def png_data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_n_choices_with_a_seed_are_reproducible(llm) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, n=3, seed=11)
    [a] = llm.generate(PROMPT, params)
    [b] = llm.generate(PROMPT, params)
    assert isinstance(a, RequestOutput) and a.finished and a.prompt == PROMPT
    assert [c.index for c in a.outputs] == [0, 1, 2] and all(
        isinstance(c, CompletionOutput) for c in a.outputs
    )
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1  # each choice its own stream
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in a.outputs)
    assert a.text == a.outputs[0].text and a.token_ids == a.outputs[0].token_ids  # the flat aliases
    assert a.request_id != b.request_id and a.prompt_token_ids == llm.get_tokenizer()(PROMPT)["input_ids"]
    # the LLM's seed makes unseeded requests reproducible from one LLM to the next
    unseeded = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    assert llm.generate(PROMPT, unseeded)[0].token_ids != llm.generate(PROMPT, unseeded)[0].token_ids
    assert_clean(llm)


def test_logprobs_are_vllm_dicts_holding_what_the_engine_reported(llm, monkeypatch) -> None:
    reported = {}
    real_step = llm.engine.step

    def step():
        outs = real_step()
        for out in outs:
            reported.setdefault(out.request.index, []).append(out.logprobs)
        return outs

    monkeypatch.setattr(llm.engine, "step", step)
    params = SamplingParams(
        temperature=1.0, max_tokens=6, ignore_eos=True, n=2, seed=3, logprobs=3, prompt_logprobs=2
    )
    [out] = llm.generate(PROMPT, params)
    tokenizer = llm.get_tokenizer()
    for choice in out.outputs:
        assert len(choice.logprobs) == len(choice.token_ids) == 6
        for token, position, engine_lp in zip(
            choice.token_ids, choice.logprobs, reported[choice.index], strict=True
        ):
            assert list(position)[0] == token and len(position) in (
                3,
                4,
            )  # the sampled token first, then the top 3
            assert all(isinstance(lp, Logprob) for lp in position.values())
            assert position[token].logprob == engine_lp.logprob and position[token].rank == engine_lp.rank
            top = sorted((lp for t, lp in position.items() if t in engine_lp.top_ids), key=lambda lp: lp.rank)
            assert [lp.rank for lp in top] == [1, 2, 3] and [
                lp.logprob for lp in top
            ] == engine_lp.top_logprobs
            assert position[token].decoded_token == tokenizer.decode([token])
        assert choice.cumulative_logprob == pytest.approx(
            sum(p[t].logprob for t, p in zip(choice.token_ids, choice.logprobs, strict=True))
        )
    prompt_ids = out.prompt_token_ids
    assert len(out.prompt_logprobs) == len(prompt_ids) and out.prompt_logprobs[0] is None
    assert all(prompt_ids[i] in lp and len(lp) in (2, 3) for i, lp in enumerate(out.prompt_logprobs) if i)
    plain = llm.generate(PROMPT, SamplingParams(max_tokens=2))[0]
    assert plain.outputs[0].logprobs is None and plain.outputs[0].cumulative_logprob is None
    assert plain.prompt_logprobs is None


def test_stop_string_ends_only_its_choice(llm) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, n=2, seed=5)
    full = llm.generate(PROMPT, params)[0].outputs
    text0, text1 = full[0].text, full[1].text
    start = next(
        i
        for i in range(1, len(text0) - 2)
        if "\ufffd" not in text0[i : i + 2] and text0[i : i + 2] not in text1
    )
    stop = text0[start : start + 2]
    out = llm.generate(
        PROMPT, SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, n=2, seed=5, stop=[stop])
    )
    first, second = out[0].outputs
    assert (
        first.text == text0[: text0.index(stop)]
        and first.finish_reason == "stop"
        and first.stop_reason == stop
    )
    assert len(first.token_ids) < 16 and full[0].token_ids[: len(first.token_ids)] == first.token_ids
    assert (
        second.token_ids == full[1].token_ids
        and second.finish_reason == "length"
        and second.stop_reason is None
    )
    assert_clean(llm)
    # a stop token id: its id is the stop_reason, in token_ids, not in the text
    stop_id = full[0].token_ids[3]
    [ended] = (
        llm.generate(PROMPT, SamplingParams(temperature=1.0, max_tokens=16, seed=5, stop_token_ids=[stop_id]))
        .pop()
        .outputs
    )
    assert ended.stop_reason == stop_id and ended.token_ids[-1] == stop_id and ended.finish_reason == "stop"


def test_image_pil_part_equals_the_same_image_as_a_data_url(llm) -> None:
    image = random_image(7)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    [pil] = llm.chat(chat_with({"type": "image_pil", "image_pil": image}), greedy)
    [url] = llm.chat(chat_with({"type": "image_url", "image_url": {"url": png_data_url(image)}}), greedy)
    assert pil.token_ids == url.token_ids and pil.prompt_token_ids == url.prompt_token_ids
    assert (
        url.num_cached_tokens == len(url.prompt_token_ids) - 1
    )  # same content hash: a full prefix-cache hit
    [other] = llm.chat(chat_with({"type": "image_pil", "image_pil": random_image(8)}), greedy)
    assert other.prompt_token_ids != pil.prompt_token_ids
    with pytest.raises(ValueError, match="PIL.Image"):
        llm.chat(chat_with({"type": "image_pil", "image_pil": "not an image"}), greedy)


def test_image_pil_is_refused_outside_the_python_api() -> None:
    # The server parses with the default: a JSON value in an image_pil part is a 400 saying what to send.
    with pytest.raises(ValueError, match=r"content\[0\].*offline Python API only.*image_url"):
        parse_messages(chat_with({"type": "image_pil", "image_pil": "aGVsbG8="}))


def test_a_bad_token_id_fails_the_call_before_anything_runs(llm, monkeypatch) -> None:
    vocab = llm.engine.model_config.vocab_size
    added, queries = [], llm.encoder.cache.stats.queries
    real_add = llm.engine.add_request
    monkeypatch.setattr(llm.engine, "add_request", lambda *a, **k: added.append(a) or real_add(*a, **k))
    tokenizer = llm.get_tokenizer()
    template = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]}]
    text = tokenizer.apply_chat_template(template, add_generation_prompt=True, tokenize=False)
    words = tokenizer(PROMPT)["input_ids"]
    good = {"prompt": text, "multi_modal_data": {"image": random_image(9)}}
    for bad_id in (vocab, 2**62 + 5, -1):
        with pytest.raises(ValueError, match=rf"prompt 1: token id {bad_id} is outside the vocabulary"):
            llm.generate([good, [*words, bad_id]], SamplingParams(max_tokens=4))
    # the good prompt was neither encoded nor queued
    assert not added and llm.encoder.cache.stats.queries == queries
    assert_clean(llm)
    assert llm.generate([good, words], SamplingParams(max_tokens=2))[1].finish_reason == "length"


def test_an_interrupted_call_leaves_nothing_in_the_engine(llm, monkeypatch) -> None:
    real_step, steps = llm.engine.step, []

    def step():
        steps.append(1)
        if len(steps) == 3:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(llm.engine, "step", step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([PROMPT, "the dog"], SamplingParams(max_tokens=8, ignore_eos=True, n=2))
    assert_clean(llm)


def test_limit_mm_per_prompt(llm) -> None:
    images = [random_image(20 + i) for i in range(3)]
    too_many = chat_with(*({"type": "image_pil", "image_pil": im} for im in images))
    with pytest.raises(
        ValueError, match=r"prompt 1: 3 image item\(s\); at most 2 allowed \(limit_mm_per_prompt\)"
    ):
        llm.chat(
            [chat_with({"type": "image_pil", "image_pil": images[0]}), too_many], SamplingParams(max_tokens=2)
        )
    assert_clean(llm)
    two = llm.chat(
        chat_with(*({"type": "image_pil", "image_pil": im} for im in images[:2])),
        SamplingParams(max_tokens=2),
    )
    assert two[0].finish_reason == "length"
    with pytest.raises(ValueError, match="unknown modality 'images'"):
        LLM("unused", limit_mm_per_prompt={"images": 1})


def test_constructor_refuses_unknown_keywords(tiny_qwen2_vl) -> None:
    with pytest.raises(
        TypeError, match=r"'bogus_option'.*'gpu_memory_utilization'.*kv_cache_memory_fraction"
    ):
        LLM(tiny_qwen2_vl, bogus_option=1, gpu_memory_utilization=0.9)
    with pytest.raises(TypeError, match="not both"):
        LLM(tiny_qwen2_vl, media=object(), allowed_local_media_path="/tmp")


def test_constructor_maps_vllm_keywords(llm, tiny_qwen2_vl) -> None:
    small = LLM(
        tiny_qwen2_vl,
        kv_cache_mb=2,
        dtype="float32",
        max_model_len=64,
        enable_prefix_caching=False,
        allowed_local_media_path="/tmp",
        allowed_media_domains=["example.com"],
        seed=1,
    )
    cfg = small.engine.cfg
    assert (cfg.dtype, cfg.max_model_len, cfg.disable_prefix_cache) == ("float32", 64, True)
    assert cfg.media.allowed_local_media_path == "/tmp" and cfg.media.allowed_media_domains == (
        "example.com",
    )
    assert small.get_tokenizer() is small.tokenizer and small.get_tokenizer()("a cat")["input_ids"]
    # the LLM's seed: two LLMs built alike sample alike
    again = LLM(tiny_qwen2_vl, kv_cache_mb=2, max_model_len=64, seed=1)
    unseeded = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    assert small.generate(PROMPT, unseeded)[0].token_ids == again.generate(PROMPT, unseeded)[0].token_ids


def test_use_tqdm_takes_a_progress_factory(llm) -> None:
    bars = []

    class Bar:
        def __init__(self, total, desc):
            self.total, self.done, self.closed = total, 0, False
            bars.append(self)

        def update(self, n=1):
            self.done += n

        def close(self):
            self.closed = True

    outs = llm.generate([PROMPT, "the dog", [5, 6, 7]], SamplingParams(max_tokens=3), use_tqdm=Bar)
    assert len(outs) == 3 and outs[2].prompt is None
    assert [(b.total, b.done, b.closed) for b in bars] == [(3, 3, True)]


def test_readme_python_example_runs(tiny_qwen2_vl, capsys) -> None:
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    section = readme[readme.index("## Python API (offline, vLLM-shaped)") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert '"models/tiny-qwen2-vl"' in code and ".outputs" in code and "n=" in code and "logprobs=" in code
    exec(compile(code.replace('"models/tiny-qwen2-vl"', repr(tiny_qwen2_vl)), "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert "Logprob(logprob=" in printed and printed.count("\n") >= 5
