"""The OpenAI request fields clients send (issue 14), through the official `openai` client against a real
server: each parameter changes the output the way its definition says; logprobs match HF; n is seeded."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
import torch

from mmserve.testing.reference import HFReference
from tests.engine_helpers import reference, text_case

TEXT = "a cat sat on the mat and the dog"


@pytest.fixture(scope="module")
def server(shared_server):
    """The plain server shared with other modules (tests/conftest.py); it has --enable-auto-tool-choice."""
    return shared_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def ref(tiny_qwen2_vl):
    return HFReference(tiny_qwen2_vl)


def chat(client, text: str = TEXT, **kwargs):
    kwargs.setdefault("max_tokens", 12)
    kwargs.setdefault("temperature", 0)
    extra = kwargs.pop("extra_body", {})
    return client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": text}],
        extra_body={"ignore_eos": True, **extra},
        **kwargs,
    )


def ids_of(out) -> list[str]:
    return [t.token for t in out.choices[0].logprobs.content]


def test_chat_logprobs_equal_log_softmax_of_hf_logits(client, ref) -> None:
    out = chat(client, logprobs=True, top_logprobs=3, max_tokens=8)
    expected = reference(ref, text_case(TEXT), 8)
    logp = torch.log_softmax(expected.logits, dim=-1)
    content = out.choices[0].logprobs.content
    assert len(content) == 8
    for step, entry in enumerate(content):
        token = expected.token_ids[step]
        assert entry.token == ref.tokenizer.decode([token])
        # fp32; the server's decode attention and norms (mmserve's CPU kernels) sum in another order than
        # PyTorch's ops, a last-bit difference that this random tiny model grows to ~1e-5 over 8 steps
        assert abs(entry.logprob - logp[step, token].item()) < 5e-5
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)


def test_completions_echo_with_logprobs_reports_the_prompt(client, ref) -> None:
    prompt_ids = ref.tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    out = client.completions.create(
        model="tiny", prompt=TEXT, max_tokens=3, temperature=0, logprobs=2, echo=True
    )
    choice = out.choices[0]
    assert choice.text.startswith(TEXT)
    lp = choice.logprobs
    assert len(lp.tokens) == len(prompt_ids) + 3 and lp.token_logprobs[0] is None
    with torch.no_grad():
        logits = ref.model(input_ids=torch.tensor([prompt_ids])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    for pos in range(1, len(prompt_ids)):
        assert abs(lp.token_logprobs[pos] - logp[pos - 1, prompt_ids[pos]].item()) < 1e-5
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_logit_bias_frequency_penalty_and_min_tokens(client, ref) -> None:
    plain = chat(client, max_tokens=24, logprobs=True)
    plain_tokens = ids_of(plain)
    assert len(set(plain_tokens)) < len(plain_tokens), "the tiny model repeats itself greedily"
    token = next(t for t in range(5, 200) if ref.tokenizer.decode([t]) not in plain_tokens)
    biased = chat(client, max_tokens=5, logit_bias={str(token): 100}, logprobs=True)
    assert ids_of(biased) == [ref.tokenizer.decode([token])] * 5
    penalised = chat(client, max_tokens=24, frequency_penalty=2.0, logprobs=True)
    assert len(set(ids_of(penalised))) > len(set(plain_tokens))
    first = reference(ref, text_case(TEXT), 1).token_ids[0]
    stopped = chat(client, extra_body={"stop_token_ids": [first], "ignore_eos": False})
    assert (
        stopped.choices[0].finish_reason == "stop" and stopped.choices[0].model_extra["stop_reason"] == first
    )
    assert stopped.usage.completion_tokens == 1
    delayed = chat(client, extra_body={"stop_token_ids": [first], "min_tokens": 6, "ignore_eos": False})
    assert delayed.usage.completion_tokens >= 6


def test_stop_string_reason_and_include_stop_str(client) -> None:
    text = chat(client).choices[0].message.content
    stop = text[3:6]
    out = chat(client, stop=[stop])
    assert out.choices[0].message.content == text[: text.index(stop)]
    assert out.choices[0].model_extra["stop_reason"] == stop
    kept = chat(client, stop=[stop], extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].message.content == text[: text.index(stop) + len(stop)]


def test_n_choices_with_a_seed_are_reproducible(client) -> None:
    a = chat(client, n=3, seed=11, temperature=1.0)
    b = chat(client, n=3, seed=11, temperature=1.0)
    texts = [c.message.content for c in sorted(a.choices, key=lambda c: c.index)]
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in sorted(b.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1
    assert a.usage.completion_tokens == 3 * 12
    streamed = chat(client, n=2, seed=11, temperature=1.0, stream=True)
    parts: dict[int, str] = {0: "", 1: ""}
    for chunk in streamed:
        for c in chunk.choices:
            parts[c.index] += c.delta.content or ""
    assert [parts[0], parts[1]] == texts[:2]


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def test_structured_outputs_always_parse(client, ref) -> None:
    out = chat(
        client,
        max_tokens=200,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "p", "schema": SCHEMA, "strict": True},
        },
    )
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
    # any object: its keys are unbounded strings a random-weight model may never close, so nudge it to close
    # them (the mask decides what is legal; the bias only which legal token wins)
    closers = {str(ref.tokenizer.convert_tokens_to_ids(t)): 8 for t in ['"', "}"]}
    obj = chat(client, max_tokens=200, response_format={"type": "json_object"}, logit_bias=closers)
    assert obj.choices[0].finish_reason == "stop", obj.choices[0].message.content
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    choice = chat(client, max_tokens=50, extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert choice.choices[0].message.content in {"yes", "no", "maybe"}
    assert choice.choices[0].finish_reason == "stop"
    regex = chat(client, max_tokens=50, extra_body={"guided_regex": "[0-9]{3}-[a-c]{2}"})
    assert re.fullmatch("[0-9]{3}-[a-c]{2}", regex.choices[0].message.content)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)
def test_tool_calls_required_and_named(client, stream, tool_choice) -> None:
    # one call: a random-weight model given "one or more" may go on calling until max_tokens
    kwargs = {
        "tools": [WEATHER, TIME],
        "tool_choice": tool_choice,
        "max_tokens": 200,
        "parallel_tool_calls": False,
    }
    if not stream:
        out = chat(client, "weather in Paris?", **kwargs)
        choice = out.choices[0]
        calls = choice.message.tool_calls
        finish = choice.finish_reason
    else:
        names, args, finish = {}, {}, None
        for chunk in chat(client, "weather in Paris?", stream=True, **kwargs):
            for c in chunk.choices:
                for d in c.delta.tool_calls or []:
                    if d.function.name:
                        names[d.index] = d.function.name
                    args[d.index] = args.get(d.index, "") + (d.function.arguments or "")
                finish = c.finish_reason or finish
        calls = [
            type("Call", (), {"function": type("F", (), {"name": names[i], "arguments": args[i]})})
            for i in sorted(names)
        ]
    assert calls and finish == "tool_calls"
    for call in calls:
        assert call.function.name in {"get_weather", "get_time"}
        arguments = json.loads(call.function.arguments)
        if call.function.name == "get_weather":
            jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    if isinstance(tool_choice, dict):
        assert [c.function.name for c in calls] == ["get_weather"]


def test_tool_round_trip(client) -> None:
    tools = [WEATHER]
    first = chat(client, "weather in Paris?", tools=tools, tool_choice="required", max_tokens=200)
    call = first.choices[0].message.tool_calls[0]
    messages = [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    answer = client.chat.completions.create(
        model="tiny",
        messages=messages,
        tools=tools,
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert answer.choices[0].finish_reason in {"length", "tool_calls", "stop"}
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"n": 17}, "n"),
        ({"n": 16, "max_tokens": 3000}, "n"),
        ({"min_tokens": 20, "max_tokens": 4}, "min_tokens"),
        ({"response_format": {"type": "no_such_type"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
            "response_format.json_schema.schema",
        ),
        ({"guided_regex": "("}, "guided_regex"),
        ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_json"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"suffix": "x"}, "suffix"),
    ],
)
def test_bad_new_fields_are_400_naming_the_field(server, body, field) -> None:
    payload = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body}
    r = httpx.post(server.url + "/v1/chat/completions", json=payload, timeout=30)
    assert r.status_code == 400, r.text
    assert re.search(rf"(^|\W){re.escape(field)}(\W|$)", r.json()["error"]["message"]), r.text


def test_responses_api_text_and_image(client) -> None:
    from tests.engine_helpers import image_case

    image = image_case([3], "x").messages[0]["content"][0]["image_url"]["url"]
    inputs = [
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "Describe."},
                {"type": "input_image", "image_url": image},
            ],
        }
    ]
    out = client.responses.create(model="tiny", input=inputs, max_output_tokens=6, temperature=0)
    chat_out = client.chat.completions.create(
        model="tiny",
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Describe."},
                    {"type": "image_url", "image_url": {"url": image}},
                ],
            }
        ],
        max_tokens=6,
        temperature=0,
    )
    assert out.output_text == chat_out.choices[0].message.content
    assert out.usage.input_tokens == chat_out.usage.prompt_tokens and out.usage.output_tokens <= 6
    events = list(
        client.responses.create(model="tiny", input=inputs, max_output_tokens=6, temperature=0, stream=True)
    )
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in {"response.completed", "response.incomplete"}
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == out.output_text
