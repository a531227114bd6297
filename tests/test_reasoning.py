"""Thinking models (mmserve.server.reasoning, `--reasoning-parser`): each parser on vLLM's own test cases, whole
and streamed; the structured-output deferral in the engine's grammar matcher; `reasoning_effort` and
`chat_template_kwargs` in the chat template; and end to end against a tiny Qwen3.5 with the real thinking chat
template: reasoning + content is the unparsed text, streaming equals non-streaming, a JSON schema constrains
the answer only, usage counts reasoning tokens, the Responses API returns a reasoning item."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from mmserve.engine.grammar import GrammarCompiler, apply_grammar_masks
from mmserve.sampling_params import SamplingParams, StructuredOutputs
from mmserve.server.protocol import ChatCompletionRequest
from mmserve.server.reasoning import REASONING_PARSERS, Phase, reasoning_parser
from mmserve.server.tools import render_chat
from mmserve.testing.kit_base import QWEN_TOKENS, train_tokenizer
from mmserve.testing.kit_qwen3 import THINK_TOKENS
from mmserve.testing.server_process import start_server
from mmserve.testing.tiny_models import build_tiny_model

GLM_TOKENS = ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>")


@pytest.fixture(scope="module")
def tokenizer():
    """A tiny byte-level BPE with Qwen's and GLM's special tokens and the think / tool-call tags as plain
    added tokens (as Qwen's and GLM's tokenizers have them)."""
    tok = train_tokenizer(384, QWEN_TOKENS + GLM_TOKENS, "{{ '' }}")
    tok.add_tokens(list(THINK_TOKENS))
    return tok


def _streamed(parser, text: str, deltas: list[str], **stream_args) -> tuple[str | None, str | None]:
    stream = parser.stream([], **stream_args)
    reasoning, content = "", ""
    for delta in deltas:
        r, c = stream.feed(delta)
        reasoning, content = reasoning + r, content + c
    r, c = stream.finish()
    return (reasoning + r) or None, (content + c) or None


def _check(parser, tokenizer, text: str, reasoning: str | None, content: str | None, **stream_args) -> None:
    """`text` split whole, streamed token by token (vLLM's tests' deltas) and character by character."""
    whole = parser.stream([], **stream_args).split(text)
    tokens = [tokenizer.convert_tokens_to_string([t]) for t in tokenizer.tokenize(text)]
    assert whole == (reasoning, content)
    assert _streamed(parser, text, tokens, **stream_args) == whole
    assert _streamed(parser, text, list(text), **stream_args) == whole


# vLLM's tests/reasoning cases as (output, reasoning, content). Where vLLM's whole and streamed results
# differ, the stream's is taken (both modes here agree): noted on the case.
TOOL_CALL_BODY = "<tool_call>\n<function=bash>\n<parameter=command>\ncat /etc/hosts\n</parameter>\n</function>\n</tool_call>"
QWEN3_CASES = {  # tests/reasoning/test_qwen3_reasoning_parser.py
    "without_start_token": (
        "This is a reasoning section</think>This is the rest",
        "This is a reasoning section",
        "This is the rest",
    ),
    "without_start_token_complete_reasoning": (
        "This is a reasoning section</think>",
        "This is a reasoning section",
        None,
    ),
    "with_think": (
        "<think>This is a reasoning section</think>This is the rest",
        "This is a reasoning section",
        "This is the rest",
    ),
    "without_think": ("This is the rest", "This is the rest", None),
    "complete_reasoning": ("<think>This is a reasoning section</think>", "This is a reasoning section", None),
    "multiline_reasoning": (
        "<think>This is a reasoning\nsection</think>This is the rest\nThat",
        "This is a reasoning\nsection",
        "This is the rest\nThat",
    ),
    "only_open_tag": ("<think>This is a reasoning section", "This is a reasoning section", None),
    "truncated_no_start_token": ("This is a reasoning section", "This is a reasoning section", None),
    "tool_call_no_think_end": (
        "I need to read the file.\n\n" + TOOL_CALL_BODY,
        "I need to read the file.\n\n",
        TOOL_CALL_BODY,
    ),
    "tool_call_with_think_no_end": (
        "<think>I need to read the file.\n\n" + TOOL_CALL_BODY,
        "I need to read the file.\n\n",
        TOOL_CALL_BODY,
    ),
    # test_reasoning_streaming_multi_token_deltas, as whole outputs
    "start_and_end_in_one_delta_no_content": ("<think>reasoning</think>", "reasoning", None),
}
DEEPSEEK_R1_CASES = {  # tests/reasoning/test_deepseekr1_reasoning_parser.py
    "simple_reasoning": (
        "This is a reasoning section</think>This is the rest",
        "This is a reasoning section",
        "This is the rest",
    ),
    "complete_reasoning": ("This is a reasoning section</think>", "This is a reasoning section", None),
    "no_content_token": ("This is content", "This is content", None),
    "multiple_lines": ("This\nThat</think>This is the rest\nThat", "This\nThat", "This is the rest\nThat"),
    # vLLM whole: reasoning "" (streamed: None)
    "shortest": ("</think>This is the rest", None, "This is the rest"),
    "reasoning_with_think": (
        "<think>This is a reasoning section</think>This is the rest",
        "This is a reasoning section",
        "This is the rest",
    ),
    "complete_reasoning_with_think": (
        "<think>This is a reasoning section</think>",
        "This is a reasoning section",
        None,
    ),
    "multiple_lines_with_think": (
        "<think>This\nThat</think>This is the rest\nThat",
        "This\nThat",
        "This is the rest\nThat",
    ),
    "think_no_end": ("<think>This is a reasoning section", "This is a reasoning section", None),
    "empty": ("", None, None),  # vLLM whole: reasoning "" (streamed: None)
    # vLLM's whole result; its stream keeps the "\n" before <think> as reasoning ("cannot handle" it)
    "new_line": (
        "\n<think>This is a reasoning section</think>\nThis is the rest",
        "This is a reasoning section",
        "\nThis is the rest",
    ),
}
GLM45_CASES = {  # tests/reasoning/test_glm4_moe_reasoning_parser.py
    "with_think": (
        "<think>This is a reasoning section</think>This is the rest",
        "This is a reasoning section",
        "This is the rest",
    ),
    "without_think": ("This is the rest", None, "This is the rest"),
    "complete_reasoning": ("<think>This is a reasoning section</think>", "This is a reasoning section", None),
    "multiline_reasoning": (
        "<think>This is a reasoning\nsection</think>This is the rest\nThat",
        "This is a reasoning\nsection",
        "This is the rest\nThat",
    ),
    "empty_think_block": ("<think></think>This is the rest", None, "This is the rest"),
    "empty_think_block_no_content": ("<think></think>", None, None),
    # vLLM whole: (None, the text as content): an unclosed block is reasoning cut short, as its stream says
    "only_open_tag": ("<think>This is a reasoning section", "This is a reasoning section", None),
}
CASES = [
    pytest.param(name, *case, id=f"{name}-{key}")
    for name, cases in (("qwen3", QWEN3_CASES), ("deepseek_r1", DEEPSEEK_R1_CASES), ("glm45", GLM45_CASES))
    for key, case in cases.items()
]


@pytest.mark.parametrize("name, text, reasoning, content", CASES)
def test_vllm_cases(tokenizer, name: str, text: str, reasoning: str | None, content: str | None) -> None:
    _check(reasoning_parser(name, tokenizer), tokenizer, text, reasoning, content)


def test_registry_and_missing_tags(tokenizer) -> None:
    assert sorted(REASONING_PARSERS) == ["deepseek_r1", "glm45", "qwen3"]
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        reasoning_parser("granite", tokenizer)
    plain = train_tokenizer(384, QWEN_TOKENS, "{{ '' }}")
    with pytest.raises(ValueError, match="no token <think> or </think>"):
        reasoning_parser("qwen3", plain)


def test_qwen3_thinking_disabled(tokenizer) -> None:
    """vLLM's test_reasoning_thinking_disabled: with enable_thinking false everything is content."""
    parser = reasoning_parser("qwen3", tokenizer)
    for text in ("This is plain content", "I need to read the file.\n\n" + TOOL_CALL_BODY):
        assert parser.stream([], {"enable_thinking": False}).split(text) == (None, text)


def test_constrained_output_ends_reasoning_at_the_end_tag_only(tokenizer) -> None:
    """With a deferred constraint the engine starts it at `</think>`: a `<tool_call>` before it stays in the
    reasoning, so the content is what the constraint made."""
    parser = reasoning_parser("qwen3", tokenizer)
    text = "plan <tool_call>x</tool_call> more</think>{}"
    _check(parser, tokenizer, text, "plan <tool_call>x</tool_call> more", "{}", implicit_ends=False)
    stream = parser.stream([], implicit_ends=False)
    stream.add_tokens(tokenizer(text)["input_ids"])
    assert stream.reasoning_tokens == tokenizer(text)["input_ids"].index(parser.end_id)


def test_prompt_decides_the_first_phase(tokenizer) -> None:
    """vLLM's glm45 `is_reasoning_end` prompts, and where each parser starts after a prompt."""
    glm = reasoning_parser("glm45", tokenizer)
    ids = lambda text: tokenizer(text)["input_ids"]  # noqa: E731
    head = "[gMASK]<sop><|system|>\nYou are a helpful assistant.<|user|>\nWhat is the capital of France?"
    turn = "<|assistant|>\n<think></think>\nThe capital of France is Paris.<|user|>\nWhat about Chile?"
    still = "<|assistant|>\n<think>The user is asking for the capital of"
    done = "<|assistant|>\n<think>The user is asking for the capital of France.</think>\nParis."
    for prompt, ended in ((head + still, False), (head + done, True), (head + turn + still, False)):
        assert glm.reasoning_ended(ids(prompt)) is ended
    assert glm.first_phase(ids(head + turn + still), None) is Phase.REASONING
    assert glm.first_phase(ids(head + "<|assistant|>"), None) is Phase.START
    qwen = reasoning_parser("qwen3", tokenizer)
    assistant = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert qwen.first_phase(ids(assistant + "<think>\n"), None) is Phase.REASONING
    assert qwen.first_phase(ids(assistant + "<think>\n\n</think>\n\n"), None) is Phase.CONTENT
    assert qwen.first_phase(ids(assistant), None) is Phase.START
    assert qwen.first_phase(ids(assistant), {"enable_thinking": False}) is Phase.CONTENT
    # a tool call example in the tools section is closed: it does not end the reasoning (an unclosed one does)
    tools = "<|im_start|>system\n<tool_call>\nexample\n</tool_call><|im_end|>\n"
    assert qwen.first_phase(ids(tools + assistant), None) is Phase.START
    assert qwen.reasoning_ended(ids(assistant + "<think>\nplan<tool_call>\n"))


def test_reasoning_tokens(tokenizer) -> None:
    """vLLM's count: the output tokens of the reasoning, its think tags not counted."""
    parser = reasoning_parser("deepseek_r1", tokenizer)
    text = "<think>This is a reasoning section</think>This is the rest"
    ids = tokenizer(text)["input_ids"]
    stream = parser.stream([])
    for token in ids:  # one at a time, as a stream's messages come
        stream.add_tokens([token])
    assert stream.reasoning_tokens == ids.index(parser.end_id) - 1
    closed = parser.stream(tokenizer("<think>\n\n</think>\n\n")["input_ids"])
    closed.add_tokens(ids)
    assert closed.reasoning_tokens == 0


def test_constraint_deferred_past_reasoning(tokenizer) -> None:
    """`constrain` sets StructuredOutputs.after unless the prompt closed the reasoning; the engine's matcher
    then masks nothing until the output contains `after`, and the whole constraint after it."""
    parser = reasoning_parser("qwen3", tokenizer)
    schema = json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]})
    params = SamplingParams(structured=StructuredOutputs(json=schema))
    opened = tokenizer("<|im_start|>assistant\n<think>\n")["input_ids"]
    closed = tokenizer("<|im_start|>assistant\n<think>\n\n</think>\n\n")["input_ids"]
    assert parser.constrain(params, opened, None).structured.after == (parser.end_id,)
    assert parser.constrain(params, closed, None).structured.after == ()
    assert parser.constrain(SamplingParams(), opened, None).structured is None

    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [eos])
    deferred = compiler.matcher(parser.constrain(params, opened, None).structured)
    plain = compiler.matcher(params.structured)
    free = tokenizer("not json at all, {{ and <tool_call>")["input_ids"]
    for token in free:  # the reasoning: anything goes, EOS included
        logits = torch.zeros(2, len(tokenizer))
        apply_grammar_masks(logits, [deferred, plain])
        assert torch.isfinite(logits[0]).all() and not torch.isfinite(logits[1]).all()
        assert not deferred.terminated
        deferred.accept(token)
    deferred.accept(parser.end_id)
    for token in tokenizer('{"ok":true}')["input_ids"]:  # the answer: the schema, as without a parser
        logits = torch.zeros(2, len(tokenizer))
        apply_grammar_masks(logits, [deferred, plain])
        assert torch.equal(torch.isfinite(logits[0]), torch.isfinite(logits[1]))
        deferred.accept(token)
        plain.accept(token)
    assert deferred.terminated and plain.terminated


def test_reasoning_effort_reaches_the_template() -> None:
    body = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}],
        chat_template_kwargs={"enable_thinking": True, "reasoning_effort": "low"},
        reasoning_effort="high",
    )
    assert body.template_kwargs == {"enable_thinking": True, "reasoning_effort": "high"}  # the field wins
    assert ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]).template_kwargs is None
    with pytest.raises(ValueError, match="reasoning_effort"):
        ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], reasoning_effort="extreme")
    tokenizer = train_tokenizer(
        384, QWEN_TOKENS, "effort={{ reasoning_effort }} thinking={{ enable_thinking }}"
    )
    messages = [{"role": "user", "content": "hi"}]
    assert (
        render_chat(tokenizer, messages, None, template_kwargs=body.template_kwargs)
        == "effort=high thinking=True"
    )


# -- end to end: a tiny Qwen3.5 with Qwen's real thinking template ---------------------------------------
MESSAGES = [{"role": "user", "content": "What is in this picture?"}]
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory) -> str:
    return build_tiny_model(
        str(tmp_path_factory.mktemp("tiny_qwen3_5_thinking")), arch="qwen3_5", thinking=True
    )


@pytest.fixture(scope="module")
def server(thinking_model, tmp_path_factory):
    logs = str(tmp_path_factory.mktemp("reasoning-server"))
    handle = start_server(thinking_model, "--kv-cache-mb", "16", "--reasoning-parser", "qwen3", log_dir=logs)
    yield handle
    assert handle.stop() in (None, 0)


@pytest.fixture(scope="module")
def tags(thinking_model) -> dict[str, int]:
    tokenizer = AutoTokenizer.from_pretrained(thinking_model)
    return {tag: tokenizer.convert_tokens_to_ids(tag) for tag in THINK_TOKENS}


def _chat(server, **body) -> dict:
    answer = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": "tiny", "messages": MESSAGES, "temperature": 0, **body},
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    return answer.json()


def _stream(server, **body) -> tuple[str | None, str | None, dict]:
    """The streamed answer's reasoning and content (deltas joined) and its final usage."""
    reasoning, content, usage = [], [], None
    request = {"model": "tiny", "messages": MESSAGES, "temperature": 0, "stream": True, **body}
    request["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=request, timeout=60) as answer:
        for line in answer.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                delta = choice["delta"]
                assert delta.get("reasoning") == delta.get("reasoning_content")
                reasoning.append(delta.get("reasoning") or "")
                content.append(delta.get("content") or "")
    return "".join(reasoning) or None, "".join(content) or None, usage


@pytest.fixture(scope="module")
def bias(server, tags) -> dict[str, float]:
    """A logit_bias on `</think>` that makes the random-weight model close its reasoning mid-answer, with no
    other tag before it (the greedy tokens are fixed by the seed; this finds the bias, not hard-codes it)."""
    end = tags["</think>"]
    for value in (4.5, 5.0, 5.5, 6.0, 7.0, 8.0):
        answer = _chat(server, max_tokens=24, logit_bias={str(end): value}, return_token_ids=True)
        ids = answer["choices"][0]["token_ids"]
        first_tag = next((i for i, t in enumerate(ids) if t in tags.values()), None)
        if first_tag is not None and 0 < first_tag < len(ids) - 2 and ids[first_tag] == end:
            return {str(end): value}
    raise AssertionError("no bias closes the tiny model's reasoning mid-answer")


@pytest.mark.parametrize("enable_thinking", [None, True, False])
def test_template_kwargs_render_as_the_tokenizer_does(server, thinking_model, enable_thinking) -> None:
    tokenizer = AutoTokenizer.from_pretrained(thinking_model)
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    expected = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, **kwargs)
    assert expected.endswith("<think>\n\n</think>\n\n" if enable_thinking is False else "<think>\n")
    extra = {"chat_template_kwargs": kwargs} if kwargs else {}
    answer = _chat(server, max_tokens=2, return_token_ids=True, **extra)
    assert answer["prompt_token_ids"] == tokenizer(expected, add_special_tokens=False)["input_ids"]


def test_reasoning_and_content_are_the_unparsed_text(server, bias, tags) -> None:
    chat = _chat(server, max_tokens=24, logit_bias=bias, return_token_ids=True)
    choice = chat["choices"][0]
    message = choice["message"]
    raw = httpx.post(  # the same prompt through /v1/completions, which no reasoning parser touches
        server.url + "/v1/completions",
        json={
            "model": "tiny",
            "prompt": chat["prompt_token_ids"],
            "max_tokens": 24,
            "temperature": 0,
            "logit_bias": bias,
            "return_token_ids": True,
        },
        timeout=60,
    ).json()["choices"][0]
    assert raw["token_ids"] == choice["token_ids"]
    assert message["reasoning"] and message["content"]
    assert message["reasoning_content"] == message["reasoning"]
    # the one `</think>` that ends the reasoning is the only text the split removes
    assert message["reasoning"] + "</think>" + message["content"] == raw["text"]
    reasoning_tokens = raw["token_ids"].index(tags["</think>"])  # those before `</think>` (not counted)
    assert chat["usage"]["completion_tokens_details"] == {"reasoning_tokens": reasoning_tokens}
    streamed_reasoning, streamed_content, usage = _stream(server, max_tokens=24, logit_bias=bias)
    assert (streamed_reasoning, streamed_content) == (message["reasoning"], message["content"])
    assert usage["completion_tokens_details"] == {"reasoning_tokens": reasoning_tokens}


def test_thinking_off_is_all_content(server) -> None:
    chat = _chat(server, max_tokens=8, chat_template_kwargs={"enable_thinking": False})
    message = chat["choices"][0]["message"]
    assert message["reasoning"] is None and message["content"]
    assert chat["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}


def test_json_schema_applies_to_the_answer_only(server, bias) -> None:
    free = _chat(server, max_tokens=24, logit_bias=bias)["choices"][0]["message"]
    body = dict(
        max_tokens=64,
        logit_bias=bias,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}},
    )
    message = _chat(server, **body)["choices"][0]["message"]
    assert message["reasoning"] == free["reasoning"]  # the grammar did not touch the reasoning
    jsonschema.validate(json.loads(message["content"]), SCHEMA)
    assert _stream(server, **body)[:2] == (message["reasoning"], message["content"])
    # with the reasoning closed by the template, the constraint starts at the first token
    closed = _chat(server, **body, chat_template_kwargs={"enable_thinking": False})["choices"][0]["message"]
    assert closed["reasoning"] is None
    jsonschema.validate(json.loads(closed["content"]), SCHEMA)


def test_bad_reasoning_effort_is_a_400(server) -> None:
    answer = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": "tiny", "messages": MESSAGES, "reasoning_effort": "extreme"},
        timeout=60,
    )
    assert answer.status_code == 400 and "reasoning_effort" in answer.text
    assert _chat(server, max_tokens=2, reasoning_effort="low")["choices"][0]["finish_reason"] == "length"


def test_responses_api_reasoning_item(server) -> None:
    """The reasoning item comes before the message item; its text is the chat answer's reasoning (the
    Responses API has no logit_bias: the tiny model's unbiased 24 tokens are all reasoning)."""
    request = {"model": "tiny", "input": MESSAGES[0]["content"], "max_output_tokens": 24, "temperature": 0}
    chat = _chat(server, max_tokens=24)
    expected = chat["choices"][0]["message"]
    out = httpx.post(server.url + "/v1/responses", json=request, timeout=60).json()
    reasoning, answer = out["output"]
    assert (
        reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_") and reasoning["summary"] == []
    )
    assert reasoning["content"] == [{"type": "reasoning_text", "text": expected["reasoning"]}]
    assert answer["type"] == "message" and answer["content"][0]["text"] == (expected["content"] or "")
    assert out["usage"]["output_tokens_details"] == chat["usage"]["completion_tokens_details"]
    events = []
    with httpx.stream(
        "POST", server.url + "/v1/responses", json={**request, "stream": True}, timeout=60
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    kinds = [e["type"] for e in events]
    streamed = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert streamed == expected["reasoning"]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.done")
    final = events[-1]["response"]["output"]
    assert [item["type"] for item in final] == ["reasoning", "message"]
    assert final[0]["content"] == reasoning["content"] and final[1]["content"] == answer["content"]
