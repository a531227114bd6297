"""Tool-call parsers in each family's own format (mmserve.server.tool_parsers): a call the family's real chat
template writes comes back exactly, whole and streamed token by token through mmserve's detokenizer; vLLM's
parser tests' outputs give the calls vLLM's parsers give; malformed output stays content and never raises;
the registry, the flag and each family's default."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest

from mmserve.config import ServerConfig
from mmserve.engine.detokenizer import IncrementalDetokenizer
from mmserve.models.family import FAMILIES, family_module
from mmserve.multimodal.messages import parse_messages
from mmserve.sampling_params import SamplingParams
from mmserve.server.app_state import AppState
from mmserve.server.tool_parsers import PARSERS, ToolParser, get_parser, resolve_tool_call_parser
from mmserve.server.tools import parse_tools, render_chat, template_renders_tools
from mmserve.testing.kit_glm4v import glm_tokenizer
from mmserve.testing.kit_mistral3 import mistral_tokenizer
from mmserve.testing.kit_qwen3 import qwen3_5_kit
from mmserve.testing.tiny_models import KIT


def _fn(name: str, properties: dict) -> dict:
    return {
        "type": "function",
        "function": {"name": name, "parameters": {"type": "object", "properties": properties}},
    }


TOOLS = [
    _fn(
        "get_weather",
        {"city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}},
    ),
    _fn("search", {"query": {"type": "string"}, "filters": {"type": "object"}}),
]
ARGUMENTS = [
    ("get_weather", {"city": "São Paulo", "days": 3, "metric": True}),
    ("search", {"query": 'a "quoted" <b>\nsecond line', "filters": {"lang": ["pt", "en"], "max": 2.5}}),
]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in São Paulo, and search the news?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": f"call{k}abcd", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
            for k, (n, a) in enumerate(ARGUMENTS)
        ],
    },
    {"role": "tool", "tool_call_id": "call0abcd", "content": "sunny, 21 C"},
    {"role": "tool", "tool_call_id": "call1abcd", "content": "no news"},
]


def _collect(deltas: list[dict]) -> tuple[str | None, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) rebuilt from stream deltas, checking their shape."""
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
            calls.append([call["function"]["name"], ""])
        else:
            assert call["index"] == len(calls) - 1 and set(call) == {"index", "function"}
            calls[-1][1] += call["function"]["arguments"]
    return "".join(content) or None, [tuple(c) for c in calls]


def _pairs(calls: list[dict]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def stream_text(
    parser: ToolParser, text: str, rng: random.Random
) -> tuple[str | None, list[tuple[str, str]]]:
    deltas, pos = [], 0
    while pos < len(text):
        step = rng.randint(1, 7)
        deltas += parser.feed(text[pos : pos + step])
        pos += step
    deltas += parser.finish()
    content, calls = _collect(deltas)
    assert calls == _pairs(parser.calls)
    return content, calls


# -- the families' real templates: what they write comes back ------------------------------------------------


def _qwen3_5_tokenizer():
    return qwen3_5_kit("qwen3_5", "tiny", thinking=True).tokenizer  # Qwen3.6's template, verbatim


# (parser, tokenizer, end of the assistant's turn in the rendered text: the EOS the engine stops on)
REAL_TEMPLATES = {
    "qwen3_coder": (_qwen3_5_tokenizer, "<|im_end|>"),
    "mistral": (lambda: mistral_tokenizer(tool_template=True), "</s>"),  # Ministral 3's template
    "glm45": (lambda: glm_tokenizer(tool_template=True), "<|observation|>"),  # zai-org's GLM-V template
}


def rendered_output(tokenizer, eos: str) -> tuple[str, str]:
    """(prompt, the assistant's calls as the template writes them): the conversation with its tool results
    rendered, cut where the generation prompt of the conversation before the calls ends and at the EOS."""
    template, _ = parse_messages(CONVERSATION)
    full = render_chat(tokenizer, template, TOOLS, add_generation_prompt=False)
    prompt = render_chat(tokenizer, template[:2], TOOLS, add_generation_prompt=True)
    assert full.startswith(prompt)
    output, eos_found, results = full[len(prompt) :].partition(eos)
    assert eos_found and "sunny, 21 C" in results and "no news" in results  # the tool-result turn rendered
    return prompt, output


@pytest.mark.parametrize("name", sorted(REAL_TEMPLATES))
def test_the_call_the_real_template_writes_comes_back(name: str) -> None:
    make_tokenizer, eos = REAL_TEMPLATES[name]
    tokenizer = make_tokenizer()
    assert template_renders_tools(tokenizer)
    prompt, output = rendered_output(tokenizer, eos)
    content, calls = get_parser(name)(TOOLS).parse(output)
    assert [(n, json.loads(a)) for n, a in _pairs(calls)] == ARGUMENTS
    if name != "mistral":  # XML formats: exactly vLLM's json.dumps of the typed values
        assert [a for _, a in _pairs(calls)] == [json.dumps(a, ensure_ascii=False) for _, a in ARGUMENTS]
    else:  # JSON arguments: as the model wrote them
        assert all(f"[TOOL_CALLS]{n}[ARGS]{a}" in output for n, a in _pairs(calls))
    ids = [c["id"] for c in calls]
    assert len(set(ids)) == 2
    if name == "mistral":  # mistral-common takes 9 letters and digits only
        assert all(len(i) == 9 and i.isalnum() for i in ids)

    # Streamed as the server does: each token through mmserve's detokenizer, the deltas into the parser.
    parser = get_parser(name)(TOOLS)
    params = SamplingParams(skip_special_tokens=not parser.needs_special_tokens)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, params, prompt_ids)
    deltas = []
    for token in tokenizer(output, add_special_tokens=False)["input_ids"]:
        deltas += parser.feed(detok.add(token))
    deltas += parser.feed(detok.finish()) + parser.finish()
    assert detok.text == output
    streamed_content, streamed_calls = _collect(deltas)
    assert (streamed_content, streamed_calls) == (content, _pairs(calls))
    assert len([d for d in deltas if "tool_calls" in d]) > 4  # announced, then fragments as written


def test_mistral_markers_are_special_tokens_the_request_keeps() -> None:
    """Skipping special tokens (the default) would drop `[TOOL_CALLS]`: the mistral parser asks for them."""
    tokenizer = mistral_tokenizer(tool_template=True)
    _, output = rendered_output(tokenizer, "</s>")
    ids = tokenizer(output, add_special_tokens=False)["input_ids"]
    assert "[TOOL_CALLS]" not in tokenizer.decode(ids, skip_special_tokens=True)
    assert PARSERS["mistral"].needs_special_tokens and not PARSERS["qwen3_coder"].needs_special_tokens


@pytest.mark.parametrize("arch", ["gemma3", "gemma4", "internvl"])
def test_templates_without_tools_get_hermes(arch: str) -> None:
    """Gemma 3 / 4's and InternVL's templates (the kit's, as transformers writes them) render no tools: mmserve
    writes the tools, calls and results in the Hermes format, so hermes reads the output."""
    tokenizer = KIT[arch]("tiny").tokenizer
    assert not template_renders_tools(tokenizer)
    family = family_module(arch).Family
    assert family.tool_call_parser == "hermes"
    assert resolve_tool_call_parser(None, family, template_renders_tools(tokenizer)) == "hermes"
    template, _ = parse_messages(CONVERSATION)
    full = render_chat(tokenizer, template, TOOLS, add_generation_prompt=False)
    blocks = full[full.index("<tool_call>") : full.rindex("</tool_call>") + len("</tool_call>")]
    _, calls = get_parser("hermes")(TOOLS).parse(blocks)
    assert [(n, json.loads(a)) for n, a in _pairs(calls)] == ARGUMENTS
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in full


# -- vLLM's parser tests: the same outputs give the same calls ------------------------------------------------

WEATHER = _fn(
    "get_current_weather",
    {"city": {"type": "string"}, "state": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
)
AREA = _fn(
    "calculate_area",
    {"shape": {"type": "string"}, "dimensions": {"type": "object"}, "precision": {"type": "integer"}},
)
TYPES = _fn(
    "test_types",
    {
        "int_param": {"type": "integer"},
        "float_param": {"type": "float"},
        "bool_param": {"type": "boolean"},
        "str_param": {"type": "string"},
        "obj_param": {"type": "object"},
    },
)
ANY_OF = _fn(
    "test_anyof",
    {
        "anyof_int": {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": 5},
        "anyof_str": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "anyof_array": {"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}]},
        "anyof_obj": {"anyOf": [{"type": "object"}, {"type": "null"}]},
        "type_as_array": {"type": ["integer", "null"]},
        "multi_non_null": {"anyOf": [{"type": "string"}, {"type": "integer"}, {"type": "null"}]},
    },
)
DALLAS = {"city": "Dallas", "state": "TX", "unit": "fahrenheit"}


def _qwen(name: str, params: dict[str, str]) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


_DALLAS_XML = _qwen("get_current_weather", DALLAS)
# tests/tool_parsers/test_qwen3coder_tool_parser.py (tools: get_current_weather, calculate_area)
QWEN3_CODER_CASES = [
    ([WEATHER, AREA], _DALLAS_XML, [("get_current_weather", DALLAS)]),
    (
        [WEATHER, AREA],
        "Sure! Let me check the weather for you." + _DALLAS_XML,
        [("get_current_weather", DALLAS)],
    ),
    (
        [WEATHER, AREA],
        _qwen(
            "calculate_area",
            {"shape": "rectangle", "dimensions": '{"width": 10, \n "height": 20}', "precision": "2"},
        ),
        [
            (
                "calculate_area",
                {"shape": "rectangle", "dimensions": {"width": 10, "height": 20}, "precision": 2},
            )
        ],
    ),
    (
        [WEATHER, AREA],
        _DALLAS_XML
        + "\n"
        + _qwen("get_current_weather", {"city": "Orlando", "state": "FL", "unit": "fahrenheit"}),
        [
            ("get_current_weather", DALLAS),
            ("get_current_weather", {"city": "Orlando", "state": "FL", "unit": "fahrenheit"}),
        ],
    ),
    (
        [WEATHER, AREA],
        "Let me calculate that area for you."
        + _qwen("calculate_area", {"shape": "circle", "dimensions": '{"radius": 15.5}', "precision": "3"}),
        [("calculate_area", {"shape": "circle", "dimensions": {"radius": 15.5}, "precision": 3})],
    ),
    (
        [TYPES],
        _qwen(
            "test_types",
            {
                "int_param": "42",
                "float_param": "3.14",
                "bool_param": "true",
                "str_param": "hello world",
                "obj_param": '{"key": "value"}',
            },
        ),
        [
            (
                "test_types",
                {
                    "int_param": 42,
                    "float_param": 3.14,
                    "bool_param": True,
                    "str_param": "hello world",
                    "obj_param": {"key": "value"},
                },
            )
        ],
    ),
    (
        [ANY_OF],
        _qwen(
            "test_anyof",
            {
                "anyof_int": "5",
                "anyof_str": "hello",
                "anyof_array": '["a", "b", "c"]',
                "anyof_obj": '{"key": "value"}',
                "type_as_array": "42",
                "multi_non_null": "some text",
            },
        ),
        [
            (
                "test_anyof",
                {
                    "anyof_int": 5,
                    "anyof_str": "hello",
                    "anyof_array": ["a", "b", "c"],
                    "anyof_obj": {"key": "value"},
                    "type_as_array": 42,
                    "multi_non_null": "some text",
                },
            )
        ],
    ),
    (  # a missing </parameter>: the next declared parameter ends the value
        [WEATHER, AREA],
        "Let me check the weather for you:\n<tool_call>\n<function=get_current_weather>\n<parameter=city>\nDallas\n"
        "<parameter=state>\nTX\n</parameter>\n<parameter=unit>\nfahrenheit\n</parameter>\n</function>\n</tool_call>",
        [("get_current_weather", DALLAS)],
    ),
    (  # values on the tag lines
        [_fn("greet", {"message": {"type": "string"}})],
        "<tool_call>\n<function=greet>\n<parameter=message>hello world</parameter>\n</function>\n</tool_call>",
        [("greet", {"message": "hello world"})],
    ),
    (  # a block without '>' after its name is not a call; the next one is
        [WEATHER, AREA],
        "<tool_call>\n<function=bad_func_no_gt\n</function>\n</tool_call>\n<tool_call>\n<function=get_current_weather>\n"
        "<parameter=city>Dallas</parameter>\n<parameter=state>TX</parameter>\n</function>\n</tool_call>",
        [("get_current_weather", {"city": "Dallas", "state": "TX"})],
    ),
    (
        [_fn("update_record", {"data": {"anyOf": [{"type": "object"}, {"type": "null"}]}})],
        '<tool_call>\n<function=update_record>\n<parameter=data>{"key": "value", "count": 42}</parameter>\n'
        "</function>\n</tool_call>",
        [("update_record", {"data": {"key": "value", "count": 42}})],
    ),
]


def _glm(name: str, pairs: dict[str, str], indent: str = "") -> str:
    body = "".join(
        f"{indent}<arg_key>{k}</arg_key>\n{indent}<arg_value>{v}</arg_value>\n" for k, v in pairs.items()
    )
    return f"<tool_call>{name}\n{body}{indent}</tool_call>"


GLM_WEATHER = [_fn("get_weather", {"city": {"type": "string"}})]
# tests/tool_parsers/test_glm4_moe_tool_parser.py (tools: get_weather with a string city)
GLM45_CASES = [
    (
        GLM_WEATHER,
        _glm("get_current_weather", {"city": "Dallas", "state": "TX", "unit": "fahrenheit"}, "    "),
        [("get_current_weather", DALLAS)],
    ),
    (
        GLM_WEATHER,
        _glm("get_current_weather", {"city": "Dallas", "state": "TX", "unit": "fahrenheit"}, "    ")
        + "\n    "
        + _glm("get_current_weather", {"city": "Orlando", "state": "FL", "unit": "fahrenheit"}, "    "),
        [
            ("get_current_weather", DALLAS),
            ("get_current_weather", {"city": "Orlando", "state": "FL", "unit": "fahrenheit"}),
        ],
    ),
    (
        GLM_WEATHER,
        "I'll help you check the weather. "
        + _glm("get_current_weather", {"city": "Seattle", "state": "WA", "unit": "celsius"}, "    "),
        [("get_current_weather", {"city": "Seattle", "state": "WA", "unit": "celsius"})],
    ),
    (
        GLM_WEATHER,
        "I will help you get the weather."
        + _glm("get_weather", {"city": "Beijing", "date": "2025-08-01"}, "    "),
        [("get_weather", {"city": "Beijing", "date": "2025-08-01"})],
    ),
    (
        GLM_WEATHER,
        "<think>I want to get the weather.</think>\n\nI will help you get the weather.\n"
        + _glm("get_weather", {"city": "Beijing", "date": "2025-08-01"}),
        [("get_weather", {"city": "Beijing", "date": "2025-08-01"})],
    ),
    (GLM_WEATHER, "<tool_call>get_current_time\n</tool_call>", [("get_current_time", {})]),
    (
        GLM_WEATHER,
        _glm("calculate", {"operation": "add", "a": "42", "b": "3.14", "enabled": "true"}),
        [("calculate", {"operation": "add", "a": 42, "b": 3.14, "enabled": True})],
    ),
    (
        [_fn("apply_diff", {"s": {"type": "string"}})],
        _glm("apply_diff", {"s": "    indented code    "}),
        [("apply_diff", {"s": "    indented code    "})],
    ),
    (
        GLM_WEATHER,
        _glm("send_message", {"greeting": "你好世界", "emoji": "🎉"}),
        [("send_message", {"greeting": "你好世界", "emoji": "🎉"})],
    ),
]

# tests/tool_parsers/test_mistral_tool_parser.py: before v11 (a JSON array) and v11+ (one marker per call)
MISTRAL_CASES = [
    (None, '[TOOL_CALLS][{"name": "add", "arguments":{"a": 3.5, "b": 4}}]', [("add", {"a": 3.5, "b": 4})]),
    (
        None,
        '[TOOL_CALLS] [{"name": "get_current_weather", "arguments":{"city": "San Francisco", "state": "CA", "unit": "celsius"}}]',
        [("get_current_weather", {"city": "San Francisco", "state": "CA", "unit": "celsius"})],
    ),
    (
        None,
        '[TOOL_CALLS] [{"arguments":{"city": "San Francisco", "state": "CA", "unit": "celsius"}, "name": "get_current_weather"}]',
        [("get_current_weather", {"city": "San Francisco", "state": "CA", "unit": "celsius"})],
    ),
    (
        None,
        '[TOOL_CALLS] [{"arguments":{"name": "John Doe"}, "name": "get_age"}]',
        [("get_age", {"name": "John Doe"})],
    ),
    (
        None,
        '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 3.5, "b": 4}}, {"name": "get_current_weather", '
        '"arguments":{"city": "San Francisco", "state": "CA", "unit": "celsius"}}]',
        [
            ("add", {"a": 3.5, "b": 4}),
            ("get_current_weather", {"city": "San Francisco", "state": "CA", "unit": "celsius"}),
        ],
    ),
    (None, 'Hello[TOOL_CALLS] [{"name": "add", "arguments":{"a": 1, "b": 2}}]', [("add", {"a": 1, "b": 2})]),
    (
        None,
        '[TOOL_CALLS] [{"name": "get_current_weather", "arguments":{"city": "Dallas", "state": "TX", "unit": "fahrenheit"}}]'
        "\nextra trailing data",
        [("get_current_weather", DALLAS)],
    ),
    (None, '[TOOL_CALLS]  [ {"name":"add" , "arguments" : {"a": 3, "b": 4} } ]', [("add", {"a": 3, "b": 4})]),
    (
        None,
        '[TOOL_CALLS] [{"name": "add", "arguments":{"a": "3", "b": "4"}}]',
        [("add", {"a": "3", "b": "4"})],
    ),
    (None, '[TOOL_CALLS]add_this_and_that{"a": 3.5, "b": 4}', [("add_this_and_that", {"a": 3.5, "b": 4})]),
    (
        None,
        '[TOOL_CALLS]get_current_weather{"city": "San Francisco", "state": "CA", "unit": "celsius"}',
        [("get_current_weather", {"city": "San Francisco", "state": "CA", "unit": "celsius"})],
    ),
    (
        None,
        '[TOOL_CALLS]add{"a": 3.5, "b": 4}[TOOL_CALLS]multiply{"a": 3, "b": 6}',
        [("add", {"a": 3.5, "b": 4}), ("multiply", {"a": 3, "b": 6})],
    ),
    (None, 'bla[TOOL_CALLS]add_this_and_that{"a": 3.5, "b": 4}', [("add_this_and_that", {"a": 3.5, "b": 4})]),
    (
        None,
        'hi{hi[TOOL_CALLS]bash{"command": "print(\\"hello world!\\")\\nre.compile(r\'{}\')"}',
        [("bash", {"command": "print(\"hello world!\")\nre.compile(r'{}')"})],
    ),
    (
        None,
        '[TOOL_CALLS]add[ARGS]{"a": 1}[TOOL_CALLS]sub[ARGS]{"b": 2}',
        [("add", {"a": 1}), ("sub", {"b": 2})],
    ),
]
VLLM_CASES = [("qwen3_coder", *c) for c in QWEN3_CODER_CASES]
VLLM_CASES += [("glm45", *c) for c in GLM45_CASES] + [("mistral", *c) for c in MISTRAL_CASES]


@pytest.mark.parametrize(
    "name,tools,text,expected", VLLM_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(VLLM_CASES)]
)
def test_calls_equal_vllms(name: str, tools: list | None, text: str, expected: list) -> None:
    content, calls = get_parser(name)(tools).parse(text)
    assert [(n, json.loads(a)) for n, a in _pairs(calls)] == expected
    if name != "mistral":  # vLLM writes json.dumps of the typed values; so do these parsers
        assert [a for _, a in _pairs(calls)] == [json.dumps(a, ensure_ascii=False) for _, a in expected]
    rng = random.Random(text)
    for _ in range(10):
        assert stream_text(get_parser(name)(tools), text, rng) == (content, _pairs(calls))


# -- malformed output stays content and never raises ----------------------------------------------------------

NOT_CALLS = {
    "qwen3_coder": [
        "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n",  # cut short
        "<tool_call>\nnot xml\n</tool_call>",
        "<tool_call>\n<function={{ tc.name }}>\n</function>\n</tool_call>",  # an unrendered template
        "<tool_call>\n<function=f>\nstray text\n</function>\n</tool_call>",
        "a <tool_c b <function=f> </tool_call>",
    ],
    "glm45": [
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Beijing</arg_value>",  # never closed
        "<tool_call>   ",
        "<tool_call></tool_call>",
        "<tool_call>get weather\n</tool_call>",
        "<tool_call>f\n<arg_key>incomplete_arg\n<arg_value>value</arg_value>\n</tool_call>",
    ],
    "mistral": [
        "[TOOL_CALLS] not json at all",
        "[TOOL_CALLS]toolname_no_args",
        'hi{hi[TOOL_CALLS]bash{"command": "print(\\"hello world!\\")\\nre.compile(r\'{}\')',  # cut short
        '[TOOL_CALLS]f{"a": NaN}',
        '[TOOL_CALLS]f{"a": 1, "a": 2}',
        '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}',  # the array never closed
        '[TOOL_CALLS]  junk [{"name": "add", "arguments":{"a": 1, "b": 2}}] trail',
    ],
}
MALFORMED = [(name, text) for name, texts in NOT_CALLS.items() for text in texts]


@pytest.mark.parametrize("name,text", MALFORMED, ids=[f"{n}-{i}" for i, (n, _) in enumerate(MALFORMED)])
def test_malformed_output_stays_content(name: str, text: str) -> None:
    assert get_parser(name)(TOOLS).parse(text) == (text, [])
    parser = get_parser(name)(TOOLS)
    for char in text:  # streamed, nothing raises
        parser.feed(char)
    parser.finish()
    _check_broken_calls(name, _pairs(parser.calls))


def _check_broken_calls(name: str, calls: list[tuple[str, str]]) -> None:
    """A call announced before its output broke stays a call with the arguments sent. The XML formats build
    the JSON themselves and close it; the JSON formats (mistral, hermes) sent the model's text as it came."""
    for _, arguments in calls:
        if name in ("qwen3_coder", "glm45"):
            assert isinstance(json.loads(arguments), dict)
        else:
            assert arguments.startswith("{")


@pytest.mark.parametrize("name", sorted(REAL_TEMPLATES))
def test_every_cut_and_random_chunking_is_handled(name: str) -> None:
    """Every prefix of a real output (a cut-short answer), whole and streamed: no exception, streamed content
    and calls equal the whole parse's unless a call was announced before the output broke off."""
    make_tokenizer, eos = REAL_TEMPLATES[name]
    _, output = rendered_output(make_tokenizer(), eos)
    rng = random.Random(name)
    for cut in range(len(output) + 1):
        text = output[:cut]
        content, calls = get_parser(name)(TOOLS).parse(text)
        assert (content, calls) == (text, []) or all(json.loads(a) is not None for _, a in _pairs(calls))
        streamed = stream_text(get_parser(name)(TOOLS), text, rng)
        if len(streamed[1]) == len(calls):
            assert streamed == (content or None, _pairs(calls))
        _check_broken_calls(name, streamed[1])


@pytest.mark.parametrize("name", ["qwen3_coder", "glm45"])
def test_string_values_stream_as_written(name: str) -> None:
    code = "def f(x):\n    return '</parameter>' + x  # </arg_value\n" * 40
    tools = [_fn("write", {"path": {"type": "string"}, "content": {"type": "string"}})]
    if name == "qwen3_coder":
        text = _qwen("write", {"path": "/a.py", "content": code})
    else:
        text = _glm("write", {"path": "/a.py", "content": code})
    parser, fragments = get_parser(name)(tools), []
    for line in text.splitlines(keepends=True):
        fragments += [
            d["tool_calls"][0]["function"]["arguments"] for d in parser.feed(line) if "tool_calls" in d
        ]
    parser.finish()
    assert len(fragments) > 40  # a fragment per line of the value, not one at its end
    assert json.loads("".join(fragments)) == {"path": "/a.py", "content": code}


def test_a_repeated_parameter_keeps_its_first_value() -> None:
    text = _qwen("f", {"a": "1"}).replace("</function>", "<parameter=a>\n2\n</parameter>\n</function>")
    (call,) = get_parser("qwen3_coder")(None).parse(text)[1]
    assert call["function"]["arguments"] == '{"a": "1"}'  # a second value would rewrite text already sent


# -- registry, flag and defaults ------------------------------------------------------------------------------

FAMILY_DEFAULTS = {"qwen3_5": "qwen3_coder", "qwen3_5_moe": "qwen3_coder", "minicpmv4_6": "qwen3_coder"}
FAMILY_DEFAULTS |= {"mistral3": "mistral", "glm4v": "glm45", "glm4v_moe": "glm45"}


def test_registry_flag_and_family_defaults() -> None:
    assert sorted(PARSERS) == ["glm45", "hermes", "mistral", "qwen3_coder"]
    for model_type in FAMILIES:
        family = family_module(model_type).Family
        assert family.tool_call_parser == FAMILY_DEFAULTS.get(model_type, "hermes"), model_type
        assert family.tool_call_parser in PARSERS
    mistral = family_module("mistral3").Family
    assert resolve_tool_call_parser(None, mistral, template_renders_tools=True) == "mistral"
    assert resolve_tool_call_parser(None, mistral, template_renders_tools=False) == "hermes"
    assert resolve_tool_call_parser("glm45", mistral, template_renders_tools=False) == "glm45"
    with pytest.raises(
        ValueError, match="tool_call_parser must be one of glm45, hermes, mistral, qwen3_coder"
    ):
        ServerConfig(tool_call_parser="llama3_json")
    with pytest.raises(ValueError, match="not 'x'"):
        get_parser("x")
    assert ServerConfig().tool_call_parser is None


def test_cli_flag_reads_the_registry(capsys) -> None:
    from mmserve.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve", "m", "--tool-call-parser", "glm45"]).tool_call_parser == "glm45"
    assert parser.parse_args(["serve", "m"]).tool_call_parser is None
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "m", "--tool-call-parser", "pythonic"])
    assert "invalid choice: 'pythonic'" in capsys.readouterr().err


def test_constrained_requests_are_read_as_hermes() -> None:
    """tool_choice "required" / a named function is enforced by a Hermes-shaped grammar
    (mmserve.engine.grammar.tool_call_grammar), whatever the model's own format."""
    state = SimpleNamespace(tool_call_parser="mistral")
    auto = parse_tools(TOOLS, "auto", None, enable_auto=True)
    required = parse_tools(TOOLS, "required", None, enable_auto=False)
    named = parse_tools(TOOLS, {"type": "function", "function": {"name": "search"}}, None, enable_auto=False)
    assert AppState.tool_parser_class(state, auto) is PARSERS["mistral"]
    assert AppState.tool_parser_class(state, required) is PARSERS["hermes"]
    assert AppState.tool_parser_class(state, named) is PARSERS["hermes"]
    assert AppState.tool_parser_class(state, parse_tools(TOOLS, "none", None, False)) is None
    assert AppState.tool_parser_class(state, None) is None
    factory = AppState.tool_parser_for(
        SimpleNamespace(tool_call_parser="qwen3_coder", tool_parser_class=lambda t: PARSERS["qwen3_coder"]),
        auto,
    )
    assert isinstance(factory(), PARSERS["qwen3_coder"]) and factory().tools == TOOLS


# -- end to end: a Mistral 3 server with --tool-call-parser mistral ------------------------------------------


@pytest.fixture(scope="module")
def mistral_server(tiny_model, tmp_path_factory):
    from mmserve.testing.server_process import start_server

    logs = str(tmp_path_factory.mktemp("mistral_tools_logs"))
    args = ("--tool-call-parser", "mistral", "--enable-auto-tool-choice", "--kv-cache-mb", "8")
    handle = start_server(tiny_model("mistral3"), *args, log_dir=logs)
    yield handle
    handle.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_mistral_server_reads_constrained_calls_as_hermes_and_auto_as_mistral(mistral_server, stream) -> None:
    """A named tool_choice's output is the Hermes-shaped grammar's, read as hermes though the flag says mistral;
    "auto" goes through the mistral parser (the random model writes no call: its text is the content)."""
    import openai

    client = openai.OpenAI(base_url=mistral_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "weather?"}]
    named = {"type": "function", "function": {"name": "get_time"}}
    # Arguments the grammar leaves little room in: the random model writes them within max_tokens.
    get_time = {"type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"]}
    get_time["additionalProperties"] = False
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": get_time}}, *TOOLS]
    kwargs = {"model": "tiny", "messages": messages, "tools": tools, "max_tokens": 300, "temperature": 0}
    if not stream:
        choice = client.chat.completions.create(tool_choice=named, **kwargs).choices[0]
        assert choice.message.tool_calls, choice
        (call,) = choice.message.tool_calls
        name, arguments, finish = call.function.name, call.function.arguments, choice.finish_reason
        assert len(call.id) > 9  # hermes' call ids, not Mistral's 9 characters
    else:
        name, arguments, finish = None, "", None
        for chunk in client.chat.completions.create(tool_choice=named, stream=True, **kwargs):
            for c in chunk.choices:
                for d in c.delta.tool_calls or []:
                    name = d.function.name or name
                    arguments += d.function.arguments or ""
                finish = c.finish_reason or finish
    assert (name, finish) == ("get_time", "tool_calls")
    assert isinstance(json.loads(arguments), dict)
    auto = client.chat.completions.create(**{**kwargs, "max_tokens": 8}).choices[0]  # tool_choice "auto"
    assert auto.message.tool_calls is None and isinstance(auto.message.content, str)
