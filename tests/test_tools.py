"""Tool calling pieces without a server: request validation, prompt rendering, tool/assistant messages,
Hermes output parsing and its streaming twin (mmserve.server.tools, mmserve.server.tool_parsers.hermes)."""

from __future__ import annotations

import json
import random

import pytest

from mmserve.multimodal.messages import parse_messages
from mmserve.server.protocol import APIError
from mmserve.server.tool_parsers import finish_reason_for
from mmserve.server.tool_parsers.hermes import HermesParser
from mmserve.server.tools import NO_PARAMETERS, parse_tools, render_chat, tool_grammar_tools
from mmserve.testing.tiny_models import make_tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time"}}
TOOLS = [WEATHER, CLOCK]

# A tools-aware template in the style of Qwen2.5's (the tiny models' Qwen-VL template knows no tools).
HERMES_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- else %}{{- 'You are Qwen.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n<tools>' }}{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}{{- '<|im_start|>assistant' }}"
    "{%- for tc in message.tool_calls %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' + tc.function.name + \'", "arguments": \' }}'
    "{{- tc.function.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}{{- '<|im_start|>assistant\\n' }}"
)


@pytest.fixture(scope="module")
def qwen_vl_tokenizer():
    return make_tokenizer("tiny")  # the tiny Qwen2-VL / Qwen2.5-VL checkpoints' tokenizer and template


@pytest.fixture(scope="module")
def hermes_tokenizer():
    return make_tokenizer("tiny", chat_template=HERMES_TEMPLATE)


# -- request validation ------------------------------------------------------------------------------


def _fn(**function) -> dict:
    return {"type": "function", "function": function}


BAD = [
    (dict(tools=None, tool_choice="auto"), "tool_choice requires tools"),
    (dict(tools=[], tool_choice=None), "tools must be a non-empty list"),
    (dict(tools={"a": 1}), "tools must be a non-empty list"),
    (dict(tools=["get_weather"]), "tools[0] must be an object"),
    (dict(tools=[{"type": "retrieval", "function": {"name": "a"}}]), "tools[0].type"),
    (dict(tools=[{"type": "function"}]), "tools[0].function must be an object"),
    (dict(tools=[{**WEATHER, "extra": 1}]), "tools[0]: 'extra'"),
    (dict(tools=[_fn(name="a", returns={})]), "tools[0].function: 'returns'"),
    (dict(tools=[_fn(name="get weather")]), "tools[0].function.name"),
    (dict(tools=[_fn(name="a" * 65)]), "tools[0].function.name"),
    (dict(tools=[_fn(name="")]), "tools[0].function.name"),
    (dict(tools=[CLOCK, _fn(name="get_time")]), "tools[1].function.name: 'get_time' is defined twice"),
    (dict(tools=[_fn(name="a", description=3)]), "tools[0].function.description"),
    (dict(tools=[_fn(name="a", strict="yes")]), "tools[0].function.strict"),
    (dict(tools=[_fn(name="a", parameters=[1])]), "tools[0].function.parameters must be a JSON schema"),
    (dict(tools=[_fn(name="a", parameters={"type": "objekt"})]), "tools[0].function.parameters"),
    (
        dict(tools=[_fn(name="a", parameters={"properties": {"x": {"minLength": -1}}})]),
        "tools[0].function.parameters['properties']['x']['minLength']",
    ),
    (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice must be"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "fly"}}), "unknown tool 'fly'"),
    (dict(tools=TOOLS, tool_choice={"type": "function"}), "tool_choice must be"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time", "x": 1}}), "'x'"),
    (dict(tools=TOOLS, tool_choice={"function": {"name": "get_time"}}), "tool_choice must be"),
    (dict(tools=TOOLS, tool_choice="auto", enable_auto=False), "--enable-auto-tool-choice"),
    (dict(tools=TOOLS, enable_auto=False), "--enable-auto-tool-choice"),  # "auto" is the default
    (dict(tools=TOOLS, tool_choice="required", parallel_tool_calls="yes"), "parallel_tool_calls"),
]


@pytest.mark.parametrize("kwargs,needle", BAD, ids=[needle for _, needle in BAD])
def test_bad_tool_fields_are_400s_naming_the_field(kwargs: dict, needle: str) -> None:
    args = {"tools": None, "tool_choice": None, "parallel_tool_calls": None, "enable_auto": True} | kwargs
    with pytest.raises(APIError) as err:
        parse_tools(**args)
    assert err.value.status == 400 and err.value.code == "invalid_parameter"
    assert needle in err.value.message


def test_tool_choices_and_grammar_tools() -> None:
    assert parse_tools(None, None, None, enable_auto=False) is None
    assert parse_tools(None, None, False, enable_auto=False) is None  # honoured trivially: no tools
    auto = parse_tools(TOOLS, None, None, enable_auto=True)
    assert (auto.choice, auto.named, auto.parallel, auto.tools) == ("auto", None, True, TOOLS)
    assert auto.parses_output and tool_grammar_tools(auto) is None
    none = parse_tools(TOOLS, "none", None, enable_auto=False)
    assert not none.parses_output and tool_grammar_tools(none) is None
    required = parse_tools(TOOLS, "required", False, enable_auto=False)
    assert required.choice == "required" and required.parallel is False
    schema = WEATHER["function"]["parameters"]
    assert tool_grammar_tools(required) == [("get_weather", schema), ("get_time", NO_PARAMETERS)]
    named = parse_tools(TOOLS, {"type": "function", "function": {"name": "get_time"}}, None, False)
    assert (named.choice, named.named) == (None, "get_time")
    assert tool_grammar_tools(named) == [("get_time", NO_PARAMETERS)]
    strict = _fn(name="s", strict=True, parameters={"type": "object"}, description=None)
    assert parse_tools([strict], "required", None, False).tools == [strict]


# -- messages ----------------------------------------------------------------------------------------

CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
CONVERSATION = [
    {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": "data:image/png;base64,AAAA"},
            {"type": "text", "text": "Weather where this photo was taken?"},
        ],
    },
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "10:42"}]},
]


def test_tool_and_assistant_call_messages_reach_the_template_in_hf_shape() -> None:
    template, media = parse_messages(
        CONVERSATION + [{"role": "assistant", "content": "ok", "tool_calls": None}]
    )
    assert len(media) == 1
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
    }
    assert template[1:] == [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "call_1"},
        {"role": "tool", "content": "10:42", "tool_call_id": "call_2"},
        {"role": "assistant", "content": "ok"},
    ]


def _with_call(**function) -> dict:
    return {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": function}]}


BAD_MESSAGES = [
    ({"role": "tool", "content": "x"}, "messages[0].tool_call_id"),
    ({"role": "tool", "tool_call_id": "", "content": "x"}, "messages[0].tool_call_id"),
    ({"role": "tool", "tool_call_id": "c", "content": None}, "messages[0].content"),
    (
        {"role": "tool", "tool_call_id": "c", "content": [{"type": "image_url", "image_url": "x"}]},
        "text parts",
    ),
    ({"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "a", "x": 1}]}, "'x'"),
    ({"role": "user", "content": "x", "tool_call_id": "c"}, "messages[0]: 'tool_call_id'"),
    ({"role": "user", "content": "x", "tool_calls": []}, "messages[0]: 'tool_calls'"),
    ({"role": "assistant", "tool_calls": {"id": "c"}}, "messages[0].tool_calls must be a list"),
    ({"role": "assistant", "tool_calls": ["c"]}, "messages[0].tool_calls[0] must be an object"),
    ({"role": "assistant", "tool_calls": [{**CALL, "id": 7}]}, "messages[0].tool_calls[0].id"),
    ({"role": "assistant", "tool_calls": [{**CALL, "type": "code"}]}, "messages[0].tool_calls[0].type"),
    ({"role": "assistant", "tool_calls": [{**CALL, "extra": 1}]}, "'extra'"),
    ({"role": "assistant", "tool_calls": [{"id": "c"}]}, "messages[0].tool_calls[0].function"),
    (_with_call(name="", arguments="{}"), "tool_calls[0].function.name"),
    (_with_call(name="f", arguments="{bad"), "tool_calls[0].function.arguments"),
    (_with_call(name="f", arguments="[1]"), "tool_calls[0].function.arguments"),
    (_with_call(name="f", arguments={"a": 1}), "tool_calls[0].function.arguments"),
    (_with_call(name="f", arguments="{}", call_id="c"), "'call_id'"),
]


@pytest.mark.parametrize("message,needle", BAD_MESSAGES, ids=[n for _, n in BAD_MESSAGES])
def test_malformed_tool_messages_name_the_field(message: dict, needle: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_messages([message])
    assert needle in str(err.value)


# -- rendering ---------------------------------------------------------------------------------------


def test_tools_injected_for_templates_without_tools(qwen_vl_tokenizer) -> None:
    template, _ = parse_messages(CONVERSATION)
    text = render_chat(qwen_vl_tokenizer, template, TOOLS)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n\n")
    for tool in TOOLS:
        assert "\n" + json.dumps(tool) + "\n" in text
    assert (
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>'
        in text
    )
    assert "<|vision_start|><|image_pad|><|vision_end|>Weather where" in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        in text
    )
    responses = "<tool_response>\nsunny, 21 C\n</tool_response>\n<tool_response>\n10:42\n</tool_response>"
    assert f"<|im_start|>user\n{responses}<|im_end|>\n<|im_start|>assistant\n" in text
    assert text.count("<|im_start|>") == 5 and "<|im_start|>tool" not in text

    with_system = render_chat(
        qwen_vl_tokenizer, [{"role": "system", "content": "Be brief."}, *template], TOOLS
    )
    assert with_system.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n\n")
    assert with_system.count("# Tools") == 1
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}, *template]
    assert render_chat(qwen_vl_tokenizer, parts, TOOLS) == with_system

    no_tools = render_chat(qwen_vl_tokenizer, template, None)  # a follow-up without tools keeps the format
    assert "# Tools" not in no_tools and "<tool_response>\nsunny" in no_tools
    plain = [{"role": "user", "content": "hi"}]
    assert render_chat(qwen_vl_tokenizer, plain, None) == qwen_vl_tokenizer.apply_chat_template(
        plain, add_generation_prompt=True, tokenize=False
    )
    answer = [*plain, {"role": "assistant", "content": "Hel"}]
    continued = render_chat(
        qwen_vl_tokenizer, answer, TOOLS, add_generation_prompt=False, continue_final_message=True
    )
    assert "# Tools" in continued and continued.endswith("<|im_start|>assistant\nHel")


def test_tools_passed_to_templates_that_render_them(hermes_tokenizer) -> None:
    template, _ = parse_messages([{"role": "user", "content": "weather?"}, *CONVERSATION[1:3]])
    text = render_chat(hermes_tokenizer, template, TOOLS)
    assert text.startswith("<|im_start|>system\nYou are Qwen.\n\n# Tools\n<tools>\n")
    assert json.dumps(WEATHER) in text  # the template's own format, no injected section
    assert "You may call one or more functions" not in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    assert "# Tools" not in render_chat(hermes_tokenizer, template, None)


# -- output parsing ----------------------------------------------------------------------------------


def _block(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


TRICKY_ARGS = '{"q": "a \\"}\\" b </tool", "n": [1, {"x": "}]"}], "t": "東京", "e": {}}'
OUTPUTS = {
    "plain": ("The weather is nice.\n", "The weather is nice.\n", []),
    "one call": (_block("get_weather", '{"city": "Paris"}'), None, [("get_weather", '{"city": "Paris"}')]),
    "two calls": (
        _block("get_weather", '{"city": "Paris"}') + "\n" + _block("get_time", "{}") + "\n",
        None,
        [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")],
    ),
    "text then call": (
        "Let me check.\n\n" + _block("get_time", "{ }"),
        "Let me check.",
        [("get_time", "{ }")],
    ),
    "text around": (
        "  Sure:\n" + _block("get_time", "{}") + "\nDone <b>.  ",
        "  Sure:\n\nDone <b>.",
        [("get_time", "{}")],
    ),
    "tricky arguments": (_block("search", TRICKY_ARGS), None, [("search", TRICKY_ARGS)]),
    "arguments first": (
        '<tool_call>{"arguments": {"a": 1},\n "name": "f"}</tool_call>',
        None,
        [("f", '{"a": 1}')],
    ),
    "compact": ('<tool_call>{"name":"f","arguments":{"a":[1,2]}}</tool_call>', None, [("f", '{"a":[1,2]}')]),
    "unclosed last call": (
        _block("get_time", "{}") + _block("f", '{"x": 2}')[: -len("</tool_call>")],
        None,
        [("get_time", "{}"), ("f", '{"x": 2}')],
    ),
}
NOT_CALLS = {
    "invalid json": "<tool_call>\nnot json\n</tool_call>",
    "cut short": 'Hmm <tool_call>\n{"name": "f", "argu',
    "no arguments": '<tool_call>{"name": "f"}</tool_call>',
    "arguments not an object": '<tool_call>{"name": "f", "arguments": "{}"}</tool_call>',
    "duplicate key": '<tool_call>{"arguments": {}, "name": "f", "name": "g"}</tool_call>',
    "NaN": '<tool_call>{"arguments": {"x": NaN}, "name": "f"}</tool_call>',
    "trailing junk": '<tool_call>{"arguments": {}, "name": "f"} x</tool_call>',
    "tag-like text": "a <tool> b <tool_c> c </tool_call> <tool_call",
}
MIXED = (
    "Checking. " + NOT_CALLS["invalid json"] + " then " + _block("get_time", "{}"),
    "Checking. " + NOT_CALLS["invalid json"] + " then",
    [("get_time", "{}")],
)


def _expected() -> list[tuple[str, str, str | None, list[tuple[str, str]]]]:
    cases = [(name, *case) for name, case in OUTPUTS.items()]
    cases += [(name, text, text, []) for name, text in NOT_CALLS.items()]
    return cases + [("mixed", *MIXED)]


CASES = _expected()


@pytest.mark.parametrize("name,text,content,calls", CASES, ids=[c[0] for c in CASES])
def test_parse_tool_calls(name: str, text: str, content: str | None, calls: list) -> None:
    got_content, got_calls = HermesParser().parse(text)
    assert got_content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got_calls] == calls
    for call in got_calls:
        assert call["type"] == "function" and call["id"].startswith("call_") and len(call["id"]) > 10
        json.loads(call["function"]["arguments"])
    assert len({c["id"] for c in got_calls}) == len(got_calls)


def _stream(text: str, rng: random.Random) -> tuple[str | None, list[dict], HermesParser]:
    """Feeds `text` in random-size deltas; returns (content, calls as rebuilt from the deltas, parser)."""
    parser, deltas, pos = HermesParser(), [], 0
    while pos < len(text):
        step = rng.randint(1, 6)
        deltas += parser.feed(text[pos : pos + step])
        pos += step
    deltas += parser.finish()
    content, calls = [], []
    for delta in deltas:
        assert len(delta) == 1
        if "content" in delta:
            assert delta["content"]
            content.append(delta["content"])
            continue
        (call,) = delta["tool_calls"]
        if "id" in call:
            assert call["index"] == len(calls) and call["type"] == "function"
            assert call["function"]["arguments"] == ""
            calls.append({"id": call["id"], "name": call["function"]["name"], "arguments": ""})
        else:
            assert call["index"] == len(calls) - 1 and set(call) == {"index", "function"}
            calls[-1]["arguments"] += call["function"]["arguments"]
    return "".join(content) or None, calls, parser


@pytest.mark.parametrize("name,text,content,calls", CASES, ids=[c[0] for c in CASES])
def test_streamed_parse_equals_whole_parse(name: str, text: str, content: str | None, calls: list) -> None:
    rng = random.Random(name)
    for _ in range(30):
        got_content, got_calls, parser = _stream(text, rng)
        assert got_content == (content or None)
        assert [(c["name"], c["arguments"]) for c in got_calls] == calls
        assert [c["id"] for c in got_calls] == [c["id"] for c in parser.calls]
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in parser.calls] == calls
    one_piece = HermesParser()
    deltas = one_piece.feed(text) + one_piece.finish()
    assert "".join(d.get("content", "") for d in deltas) == (content or "")


def test_stream_holds_back_only_what_may_be_a_tag() -> None:
    parser = HermesParser()
    assert parser.feed("Hi <tool") == [{"content": "Hi"}]
    assert parser.feed("box> x <") == [{"content": " <toolbox> x"}]
    assert parser.feed("tool_call>") == []
    assert parser.feed('\n{"name": "f", "arguments": ') == []  # announced once the arguments begin
    announce, fragment = parser.feed('{"a')
    assert announce["tool_calls"][0]["function"] == {"name": "f", "arguments": ""}
    assert fragment == {"tool_calls": [{"index": 0, "function": {"arguments": '{"a'}}]}
    assert parser.feed('": "</tool_') == [{"tool_calls": [{"index": 0, "function": {"arguments": '": "'}}]}]
    assert parser.feed('x"}') == [{"tool_calls": [{"index": 0, "function": {"arguments": '</tool_x"}'}}]}]
    assert parser.feed("}\n</tool_call>\n") == []
    assert parser.finish() == [] and parser.calls[0]["function"]["arguments"] == '{"a": "</tool_x"}'


def test_finish_reason() -> None:
    assert finish_reason_for([{"id": "call_1"}], "stop") == "tool_calls"
    assert finish_reason_for([], "stop") == "stop"
    assert finish_reason_for([{"id": "call_1"}], "length") == "length"
    assert finish_reason_for([{"id": "call_1"}], "abort") == "abort"


def test_stream_sends_the_arguments_as_they_are_written() -> None:
    """Fed one character at a time, a call's arguments are all sent before its block closes (strings with
    braces, brackets and escaped quotes do not end the object early or late)."""
    parser, fragments = HermesParser(), []
    body = f'\n{{"name": "search", "arguments": {TRICKY_ARGS}}}\n'
    for char in "<tool_call>" + body:
        for delta in parser.feed(char):
            fragments.append(delta["tool_calls"][0]["function"]["arguments"])
            if len(fragments) > 1:  # the announcement comes first, then one fragment per character
                assert len(fragments[-1]) == 1 or fragments[-1].startswith("<")
    assert "".join(fragments) == TRICKY_ARGS
    assert parser.feed("</tool_call>") == [] and parser.finish() == []
