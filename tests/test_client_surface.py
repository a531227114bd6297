"""What real clients of a vLLM server send (issue 37), through the official `openai` client and raw HTTP against
a real server: batched completions, echo with max_tokens 0, prompt logprobs against HF (text and image
prompts), return_token_ids / return_tokens_as_token_ids, assistant prefill and chat echo, template keys and
roles passed through, /invocations, model cards, continuous usage stats, content types."""

from __future__ import annotations

import base64
import io
import json

import httpx
import openai
import pytest
import torch

from mmserve.multimodal.items import Modality
from mmserve.testing.reference import HFReference
from tests.conftest import random_image

TEXTS = ["a cat sat on the mat", "the dog ran after the ball and", "one two three"]


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def ref(tiny_qwen2_vl):
    return HFReference(tiny_qwen2_vl)


def post(server, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60, **kwargs)


def sse(server, path: str, body: dict) -> list[dict]:
    events = []
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def hf_logprobs(ref, inputs) -> torch.Tensor:
    """HF's log-softmax over the prompt positions (row p predicts token p + 1)."""
    with torch.no_grad():
        logits = ref.model(**inputs).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def image_url(seed: int) -> str:
    buf = io.BytesIO()
    random_image(seed).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


# -- batched completions (lm-eval's loglikelihood requests) ----------------------------------------------------
def test_a_batch_of_prompts_answers_each_as_alone_under_vllms_indices(client, ref):
    ids = [ref.tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    alone = [
        client.completions.create(model="tiny", prompt=t, max_tokens=6, temperature=0).choices[0].text
        for t in TEXTS
    ]
    for prompt in (TEXTS, ids):
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, n=2)
        assert [c.index for c in out.choices] == list(range(6))
        assert [c.text for c in out.choices] == [t for t in alone for _ in range(2)]
        assert out.usage.prompt_tokens == sum(len(i) for i in ids) and out.usage.completion_tokens == 36


def test_a_streamed_batch_adds_up_to_the_whole_answer(server):
    body = {"prompt": TEXTS, "max_tokens": 5, "temperature": 0}
    whole = post(server, "/v1/completions", body).json()
    texts: dict[int, str] = {}
    events = sse(server, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    for ev in events:
        for c in ev["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}
    assert events[-1]["usage"] == whole["usage"]


def test_echo_with_max_tokens_zero_scores_the_prompt_as_hf_does(server, ref):
    """lm-eval's loglikelihood: echo, logprobs, max_tokens 0 (or 1, the last position dropped by the client)."""
    ids = [ref.tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS[:2]]
    body = {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}
    out = post(server, "/v1/completions", body).json()
    for prompt, choice in zip(ids, out["choices"], strict=True):
        lp = choice["logprobs"]
        assert choice["text"] == ref.tokenizer.decode(prompt) and len(lp["token_logprobs"]) == len(prompt)
        logp = hf_logprobs(ref, {"input_ids": torch.tensor([prompt])})
        assert lp["token_logprobs"][0] is None
        for pos in range(1, len(prompt)):
            assert abs(lp["token_logprobs"][pos] - logp[pos - 1, prompt[pos]].item()) < 1e-5  # fp32
    one = post(server, "/v1/completions", {**body, "max_tokens": 1}).json()
    assert [len(c["logprobs"]["tokens"]) for c in one["choices"]] == [len(p) + 1 for p in ids]


def test_prompt_logprobs_of_an_image_prompt_are_none_on_the_image(server, ref):
    """vLLM returns None for placeholder positions; the text positions equal HF's log-softmax."""
    image = random_image(371)
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": image_url(371)}},
                {"type": "text", "text": "Describe it."},
            ],
        }
    ]
    body = {"messages": messages, "max_tokens": 1, "prompt_logprobs": 0, "return_token_ids": True}
    out = post(server, "/v1/chat/completions", body).json()
    template = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]}]
    inputs = ref.inputs(template, [(Modality.IMAGE, image)])
    prompt = inputs["input_ids"][0].tolist()
    assert out["prompt_token_ids"] == prompt
    logp = hf_logprobs(ref, inputs)
    image_id = ref.model.config.image_token_id
    entries = out["prompt_logprobs"]
    assert len(entries) == len(prompt) and entries[0] is None
    for pos in range(1, len(prompt)):
        if prompt[pos] == image_id:
            assert entries[pos] is None, pos
        else:
            got = entries[pos][str(prompt[pos])]["logprob"]
            assert abs(got - logp[pos - 1, prompt[pos]].item()) < 1e-4, pos


# -- token ids for RL rollouts ----------------------------------------------------------------------------------
def test_return_token_ids_round_trips_through_tokenize_and_detokenize(server, ref):
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": image_url(372)}},
                {"type": "text", "text": "What is it?"},
            ],
        }
    ]
    body = {
        "messages": messages,
        "max_tokens": 7,
        "temperature": 0,
        "n": 2,
        "seed": 3,
        "return_token_ids": True,
    }
    out = post(server, "/v1/chat/completions", {**body, "temperature": 1.0}).json()
    tokens = post(server, "/tokenize", {"messages": messages}).json()["tokens"]
    assert out["prompt_token_ids"] == tokens
    for c in out["choices"]:
        assert ref.tokenizer.decode(c["token_ids"], skip_special_tokens=True) == c["message"]["content"]
        assert len(c["token_ids"]) == out["usage"]["completion_tokens"] / 2 or c["finish_reason"] == "stop"
    events = sse(server, "/v1/chat/completions", {**body, "temperature": 1.0})
    assert events[0]["prompt_token_ids"] == tokens
    streamed: dict[int, list[int]] = {}
    for ev in events:
        for c in ev["choices"]:
            streamed.setdefault(c["index"], []).extend(c.get("token_ids") or [])
    assert streamed == {c["index"]: c["token_ids"] for c in out["choices"]}
    comp = post(
        server, "/v1/completions", {"prompt": TEXTS[0], "max_tokens": 5, "return_token_ids": True}
    ).json()
    choice = comp["choices"][0]
    assert choice["prompt_token_ids"] == ref.tokenizer(TEXTS[0])["input_ids"]
    assert ref.tokenizer.decode(choice["token_ids"], skip_special_tokens=True) == choice["text"]


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(client):
    out = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": TEXTS[1]}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True},
    )
    choice = out.choices[0]
    assert [e.token for e in choice.logprobs.content] == [
        f"token_id:{t}" for t in choice.model_extra["token_ids"]
    ]
    assert all(t.token.startswith("token_id:") for e in choice.logprobs.content for t in e.top_logprobs)
    comp = client.completions.create(
        model="tiny",
        prompt=TEXTS[0],
        max_tokens=3,
        logprobs=1,
        temperature=0,
        extra_body={"return_tokens_as_token_ids": True},
    )
    assert all(t.startswith("token_id:") for t in comp.choices[0].logprobs.tokens)


# -- assistant prefill and what reaches the template ----------------------------------------------------------
def test_continue_final_message_continues_the_assistant_turn_and_echo_prepends_it(server, ref):
    messages = [{"role": "user", "content": "Count with me."}, {"role": "assistant", "content": "one two"}]
    body = {"messages": messages, "max_tokens": 5, "temperature": 0, "return_token_ids": True}
    prefill = {**body, "continue_final_message": True, "add_generation_prompt": False}
    out = post(server, "/v1/chat/completions", prefill).json()
    text = ref.tokenizer.apply_chat_template(messages, continue_final_message=True, tokenize=False)
    assert out["prompt_token_ids"] == ref.tokenizer(text, add_special_tokens=False)["input_ids"]
    closed = post(server, "/v1/chat/completions", {**body, "add_generation_prompt": False}).json()
    closed_text = ref.tokenizer.apply_chat_template(messages, tokenize=False)
    assert closed["prompt_token_ids"] == ref.tokenizer(closed_text, add_special_tokens=False)["input_ids"]
    echoed = post(server, "/v1/chat/completions", {**prefill, "echo": True}).json()
    assert echoed["choices"][0]["message"]["content"] == "one two" + out["choices"][0]["message"]["content"]
    events = sse(server, "/v1/chat/completions", {**prefill, "echo": True})
    streamed = "".join(c["delta"].get("content") or "" for ev in events for c in ev["choices"])
    assert streamed == echoed["choices"][0]["message"]["content"]
    both = post(server, "/v1/chat/completions", {**body, "continue_final_message": True})
    assert both.status_code == 400 and "add_generation_prompt" in both.json()["error"]["message"]


def test_message_keys_custom_roles_and_template_kwargs_reach_the_template(server, ref):
    """The kit's template renders any role; `name` and unknown template variables are the template's to use."""
    messages = [
        {"role": "system", "content": "Be brief.", "name": "ops"},
        {"role": "ipython", "content": "42"},
        {"role": "user", "content": "hi", "name": "bob"},
    ]
    body = {
        "messages": messages,
        "max_tokens": 2,
        "return_token_ids": True,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    out = post(server, "/v1/chat/completions", body)
    assert out.status_code == 200, out.text
    text = ref.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert out.json()["prompt_token_ids"] == ref.tokenizer(text, add_special_tokens=False)["input_ids"]
    tokenized = post(
        server, "/tokenize", {"messages": messages, "chat_template_kwargs": {"enable_thinking": False}}
    )
    assert tokenized.json()["tokens"] == out.json()["prompt_token_ids"]
    calls = [{"id": "c1", "type": "function", "function": {"name": "now", "arguments": ""}}]
    history = [
        {"role": "user", "content": "time?"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "noon"},
    ]
    assert post(server, "/v1/chat/completions", {"messages": history, "max_tokens": 2}).status_code == 200


def test_modalities_prediction_and_stream_options(client, server):
    ok = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        modalities=["text"],
        prediction={"type": "content", "content": "hello there"},
    )
    assert ok.choices[0].message.content is not None
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "ignore_eos": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    events = sse(server, "/v1/chat/completions", body)
    with_choices = [ev for ev in events if ev["choices"]]
    assert with_choices and all("usage" in ev for ev in with_choices)
    done = [ev["usage"]["completion_tokens"] for ev in with_choices]
    assert done == sorted(done) and events[-1]["usage"]["completion_tokens"] == 4


# -- endpoints and cards ----------------------------------------------------------------------------------------
def test_invocations_routes_by_the_bodys_shape(server):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    comp = {"prompt": "hi", "max_tokens": 4, "temperature": 0}
    for path_body, obj in ((chat, "chat.completion"), (comp, "text_completion")):
        via = post(server, "/invocations", path_body).json()
        direct = post(
            server, "/v1/chat/completions" if "messages" in path_body else "/v1/completions", path_body
        ).json()
        assert via["object"] == obj and via["choices"][0] == direct["choices"][0]
    bad = post(server, "/invocations", {"input": "hi"})
    assert bad.status_code == 400 and "messages" in bad.json()["error"]["message"]


def test_model_cards_have_root_and_parent(server, tiny_qwen2_vl):
    card = httpx.get(server.url + "/v1/models/tiny", timeout=10).json()
    assert card["root"] == tiny_qwen2_vl and card["parent"] is None


def test_a_non_json_content_type_is_refused_not_parsed(server):
    raw = json.dumps({"prompt": "hi", "max_tokens": 2})
    r = httpx.post(
        server.url + "/v1/completions",
        content=raw,
        timeout=10,
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
    assert (
        httpx.post(server.url + "/v1/completions", content=raw, timeout=30).status_code == 200
    )  # no type: JSON


def test_logit_bias_names_every_bad_key(server):
    body = {"prompt": "hi", "max_tokens": 2, "logit_bias": {"x": 1, "5": 1, "-3": 2}}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 400 and "'x'" in r.text and "'-3'" in r.text and "'5'" not in r.text
