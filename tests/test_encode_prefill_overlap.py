"""Encode-prefill overlap: a request's text before its first item is prefilled while its media encode, then the
request reuses that KV without computing it again (nor counting it as a cache hit). Same greedy tokens as HF
in the engine (text prefill not started, partly or wholly done when the items arrive, chunked) and through
servers in monolithic and EPD modes."""

from __future__ import annotations

import httpx
import pytest

from mmserve.engine.request import text_prefill_id
from mmserve.multimodal.messages import parse_messages
from mmserve.sampling_params import SamplingParams
from mmserve.testing.probes import metric
from tests.engine_helpers import image_case, reference_text
from tests.test_engine_parity import MAX_NEW, assert_idle_and_clean, greedy, make_llm, make_oracle

SYSTEM = "You are a careful assistant. Look at every image closely, count what you see, then answer briefly."


@pytest.fixture(scope="module")
def oracle(tiny_qwen2_vl):
    return make_oracle(tiny_qwen2_vl)


def prompt_and_items(llm, case):
    template, media = parse_messages(case.messages)
    text = llm.tokenizer.apply_chat_template(template, add_generation_prompt=True, tokenize=False)
    return llm.tokenizer(text, add_special_tokens=False)["input_ids"], llm.encode(media)[0]


def record_chunk_starts(engine, req) -> list[int]:
    """From now on, the start of every chunk the scheduler gives `req` is appended to the returned list."""
    starts = []
    schedule = engine.scheduler.schedule

    def recording():
        chunks = schedule()
        starts.extend(c.start for c in chunks if c.request is req)
        return chunks

    engine.scheduler.schedule = recording
    return starts


def run(llm, request_id: str) -> list[int]:
    out = []
    for _ in range(200):  # bounded: a few prefill chunks and MAX_NEW decode steps
        if not llm.engine.has_work:
            break
        out += [o.token_id for o in llm.engine.step() if o.request_id == request_id]
    return out


@pytest.mark.parametrize("text_steps", [0, 2, 100], ids=["not-started", "half-done", "done"])
def test_text_prefilled_during_the_encode_is_reused_exactly(tiny_qwen2_vl, oracle, text_steps):
    llm = make_llm(tiny_qwen2_vl, max_num_batched_tokens=8)  # chunks end inside the text and the image
    case = image_case([95, 96], "What changed?", system=SYSTEM)
    ids, items = prompt_and_items(llm, case)
    engine = llm.engine
    assert engine.overlap.prefill_before("r", ids)
    for _ in range(text_steps):  # the encode takes this long
        assert engine.step() == []  # a text prefill samples nothing
    req = engine.add_request("r", ids, greedy(), items)
    text_len = ids.index(engine.family.placeholders[next(iter(engine.family.placeholders))])  # the image's
    if text_steps < 100:
        assert req not in engine.scheduler.waiting  # held until the text is in the prefix cache
    starts = record_chunk_starts(engine, req)
    assert run(llm, "r") == oracle(case).token_ids
    assert min(starts) >= text_len - 1  # the request computed none of the text again
    # ... and does not report its own text prefill as reuse of other requests' work (usage.cached_tokens)
    assert req.own_prefill_tokens == text_len and req.num_cached_tokens == 0
    assert text_prefill_id("r") not in engine.requests and not engine.overlap.prefilled
    assert_idle_and_clean(llm)


@pytest.mark.parametrize("text_steps", [1, 100], ids=["text-running", "text-done"])
def test_items_arriving_in_order_are_prefilled_in_stages(tiny_qwen2_vl, oracle, text_steps):
    llm = make_llm(tiny_qwen2_vl, max_num_batched_tokens=8)  # chunks end inside the text and the images
    case = image_case([101, 102, 103], "Which one is odd?", system=SYSTEM)
    ids, items = prompt_and_items(llm, case)
    engine = llm.engine
    assert engine.overlap.prefill_before("r", ids)  # its text, while the first image encodes
    for _ in range(text_steps):
        assert engine.step() == []
    assert engine.overlap.prefill_before("r", ids, items[:1])  # the first image is here
    assert engine.overlap.prefill_before(
        "r", ids, items[:2]
    )  # and the second (it replaces a stage still waiting)
    assert "r" in engine.overlap.waiting  # one stage at a time: this one follows the running one
    for _ in range(200):  # bounded: a few chunks per stage
        if not engine.has_work:
            break
        assert engine.step() == []
    req = engine.add_request("r", ids, greedy(), items)  # the third image: the request itself
    third = req.items[2].offset  # where the last image starts in the expanded prompt
    starts = record_chunk_starts(engine, req)
    assert run(llm, "r") == oracle(case).token_ids
    assert min(starts) >= third - 1  # the stages computed everything before the last image, once
    assert req.own_prefill_tokens == third and req.num_cached_tokens == 0
    assert engine.scheduler.stats.prefix_hit_tokens == 0  # a stage's reuse of the previous one is no hit
    assert engine.overlap.tokens == third and engine.overlap.stages == 3 - (text_steps == 1)
    assert not engine.overlap.waiting and not engine.overlap.prefilled
    assert_idle_and_clean(llm)


def test_a_request_with_several_choices_reuses_its_stage_and_leaves_nothing_behind(tiny_qwen2_vl, oracle):
    llm = make_llm(tiny_qwen2_vl, max_num_batched_tokens=8)
    case = image_case([104], "Name it.", system=SYSTEM)
    ids, items = prompt_and_items(llm, case)
    engine = llm.engine
    assert engine.overlap.prefill_before("g", ids)
    engine.step()  # the text stage is under way when the request is added
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, n=2)
    first = engine.add_request("g", ids, params, items)
    text_len = ids.index(engine.family.placeholders[next(iter(engine.family.placeholders))])
    tokens = {0: [], 1: []}
    for _ in range(300):  # bounded: the stage, both choices' prefill and MAX_NEW decode steps
        if not engine.has_work:
            break
        for o in engine.step():
            if o.token_id is not None:
                tokens[o.request.index].append(o.token_id)
    assert tokens[0] == tokens[1] == oracle(case).token_ids
    assert first.own_prefill_tokens == text_len and first.num_cached_tokens == 0
    assert not engine.overlap.prefilled and not engine.overlap.waiting
    assert_idle_and_clean(llm)


def test_no_text_prefill_for_cached_or_short_text_and_abort_ends_it(tiny_qwen2_vl):
    llm = make_llm(tiny_qwen2_vl)
    engine = llm.engine
    ids, _ = prompt_and_items(llm, image_case([97], "Hi", system=SYSTEM + " Again."))
    image_id = engine.family.placeholders[next(iter(engine.family.placeholders))]
    assert not engine.overlap.prefill_before("short", ids[:5] + [image_id] + ids[-5:])  # 5 tokens of text
    assert engine.overlap.prefill_before("a", ids)
    engine.abort("a")  # the request went away while its media encoded: its text prefill goes too
    assert not engine.has_work and text_prefill_id("a") not in engine.requests
    assert engine.overlap.prefill_before("b", ids)
    run(llm, "b")
    assert not engine.overlap.prefill_before("c", ids)  # cached already: nothing to overlap
    assert_idle_and_clean(llm)


def test_disabled_prefix_cache_means_no_overlap(tiny_qwen2_vl):
    llm = make_llm(tiny_qwen2_vl, enable_prefix_caching=False)
    ids, _ = prompt_and_items(llm, image_case([98], "Hi", system=SYSTEM))
    assert not llm.engine.overlap.prefill_before("r", ids)


def chat(url: str, case) -> dict:
    body = {"messages": case.messages, "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def expected(tiny_qwen2_vl):
    return reference_text(tiny_qwen2_vl, MAX_NEW)


def test_monolithic_and_epd_servers_overlap_and_match_hf(shared_server, shared_secured_epd_process, expected):
    epd = shared_secured_epd_process.get()
    for url, seed in ((shared_server.url, 120), (epd.url, 121)):
        stages, tokens = (
            metric(url, f"encode_prefill_overlap_{what}_total") for what in ("stages", "tokens")
        )
        case = image_case([seed], "Describe it.", system=f"{SYSTEM} Session {seed}.")  # new to both caches
        answer, again = chat(url, case), chat(url, case)
        assert answer["choices"][0]["message"]["content"] == again["choices"][0]["message"]["content"]
        assert answer["choices"][0]["message"]["content"] == expected(case)
        # Its text was prefilled while the image encoded, which is not reuse of another request's work: at
        # most the template's first tokens were cached by other modules' requests on the shared server.
        first, second = (r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (answer, again))
        assert first < 20 and second > first + 40, (answer["usage"], again["usage"])
        assert metric(url, "encode_prefill_overlap_stages_total") >= stages + 1
        assert metric(url, "encode_prefill_overlap_tokens_total") >= tokens + 40
        # Several images: stages up to each next image as they arrive (whether a stage still runs when the
        # next image is here depends on timing; the answer may not).
        several = image_case(
            [seed + 10, seed + 11, seed + 12], "Compare them.", system=f"{SYSTEM} Set {seed}."
        )
        parts = metric(url, "embedding_parts_received_total")
        assert chat(url, several)["choices"][0]["message"]["content"] == expected(several)
        # EPD: each image is a part of its own, sent as soon as it is encoded, whichever encoder has it (two
        # encoders would otherwise get two parts); monolithic: the engine's own tower, no parts.
        assert metric(url, "embedding_parts_received_total") - parts == (3 if url == epd.url else 0)


def test_a_failed_text_prefill_releases_its_request(tiny_qwen2_vl, oracle):
    llm = make_llm(tiny_qwen2_vl, max_num_batched_tokens=8)
    case = image_case([99], "What is it?", system=SYSTEM)
    ids, items = prompt_and_items(llm, case)
    engine = llm.engine
    assert engine.overlap.prefill_before("r", ids)
    engine.step()
    req = engine.add_request("r", ids, greedy(), items)  # held behind its text prefill...
    engine.abort(text_prefill_id("r"), "error")  # ...which fails (as in a failed batch)
    assert req in engine.scheduler.waiting  # the request goes on and computes its text itself
    assert run(llm, "r") == oracle(case).token_ids
    assert_idle_and_clean(llm)
