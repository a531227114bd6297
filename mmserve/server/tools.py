"""Tool calling, request side: validating `tools` / `tool_choice` and rendering tools into the prompt.

Like vLLM's `--enable-auto-tool-choice --tool-call-parser NAME`: a chat template that renders tools gets them;
for one that does not, the model is told about the tools in the Hermes format Qwen models are trained on.
The output's calls are parsed back in the model's format (mmserve.server.tool_parsers). `tool_choice` semantics:

| choice              | tools in prompt | output constrained to           | output parsed for calls |
|---------------------|-----------------|---------------------------------|-------------------------|
| "none"              | yes (as vLLM)   | nothing                         | no                      |
| "auto" (the default | yes             | nothing                         | yes                     |
|  when tools given)  |                 |                                 |                         |
| "required"          | yes             | one or more calls of any tool   | yes                     |
| {"function": name}  | yes             | exactly one call of that tool   | yes                     |

"auto" needs the server flag --enable-auto-tool-choice (vLLM's rule: without it a request with tools and no
tool_choice is a 400). Validation errors are APIError(400, message naming the field, "invalid_parameter").
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import jsonschema

from mmserve.server.protocol import APIError

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_CHOICES = ("none", "auto", "required")
# OpenAI: a function without `parameters` takes an empty parameter list.
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
# The default system prompt of the Qwen-VL chat templates, kept when the tools section forms the system message.
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."
TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call>"
)


@dataclass(frozen=True)
class ToolRequest:
    """A request's validated tool settings. Exactly one of `choice` / `named` is set."""

    tools: list[dict[str, Any]]  # as the client sent them (OpenAI shape), for the chat template
    choice: str | None  # "none" | "auto" | "required"; None when a function is named
    named: str | None  # the function tool_choice names
    parallel: bool  # parallel_tool_calls: more than one call allowed in one answer

    @property
    def parses_output(self) -> bool:
        """Whether the model's output is parsed for tool calls (everything but tool_choice "none")."""
        return self.choice != "none"

    def parameters(self, name: str) -> dict[str, Any]:
        function = next(t["function"] for t in self.tools if t["function"]["name"] == name)
        return function.get("parameters") or NO_PARAMETERS


def _bad(message: str) -> APIError:
    return APIError(400, message, "invalid_parameter")


def _only(obj: dict[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise _bad(f"{where}: {', '.join(map(repr, unknown))} not supported by this server")


def _check_tool(tool: Any, where: str) -> str:
    """Checks one OpenAI tool definition; returns its function name."""
    if not isinstance(tool, dict):
        raise _bad(f"{where} must be an object")
    _only(tool, {"type", "function"}, where)
    if tool.get("type") != "function":
        raise _bad(f"{where}.type must be 'function', got {tool.get('type')!r}")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise _bad(f"{where}.function must be an object")
    where = f"{where}.function"
    _only(function, {"name", "description", "parameters", "strict"}, where)
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise _bad(f"{where}.name must be 1-64 characters of a-z, A-Z, 0-9, '_' or '-', got {name!r}")
    if not isinstance(function.get("description", ""), str | None):
        raise _bad(f"{where}.description must be a string")
    if not isinstance(function.get("strict", False), bool | None):
        raise _bad(f"{where}.strict must be a boolean")
    parameters = function.get("parameters")
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise _bad(f"{where}.parameters must be a JSON schema object")
        try:
            jsonschema.Draft202012Validator.check_schema(parameters)
        except jsonschema.SchemaError as e:
            path = "".join(f"[{p!r}]" for p in e.path)
            raise _bad(f"{where}.parameters{path} is not a valid JSON schema: {e.message}") from e
    return name


def parse_tools(
    tools: Any, tool_choice: Any, parallel_tool_calls: Any, enable_auto: bool
) -> ToolRequest | None:
    """Validates the request fields `tools`, `tool_choice`, `parallel_tool_calls` (None: absent).
    Returns None when the request uses no tools. Raises APIError 400 naming the field."""
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise _bad("parallel_tool_calls must be a boolean")
    if tools is None:
        if tool_choice is not None:
            raise _bad("tool_choice requires tools")
        return None  # parallel_tool_calls without tools is honoured trivially (no call can be made)
    if not isinstance(tools, list) or not tools:
        raise _bad("tools must be a non-empty list")
    names: list[str] = []
    for i, tool in enumerate(tools):
        name = _check_tool(tool, f"tools[{i}]")
        if name in names:
            raise _bad(f"tools[{i}].function.name: {name!r} is defined twice")
        names.append(name)
    choice, named = "auto" if tool_choice is None else tool_choice, None
    if isinstance(choice, dict):
        _only(choice, {"type", "function"}, "tool_choice")
        function = choice.get("function")
        if choice.get("type") != "function" or not isinstance(function, dict):
            raise _bad(
                'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
            )
        _only(function, {"name"}, "tool_choice.function")
        named, choice = function.get("name"), None
        if named not in names:
            raise _bad(f"tool_choice.function.name: unknown tool {named!r} (tools define {', '.join(names)})")
    elif choice not in _CHOICES:
        raise _bad(f'tool_choice must be "none", "auto", "required" or a named function, got {choice!r}')
    if choice == "auto" and not enable_auto:
        raise _bad(
            'tool_choice: "auto" tool choice requires the server flag --enable-auto-tool-choice (it is the '
            'default when tools are given); use "required", "none" or a named function'
        )
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    return ToolRequest(tools=tools, choice=choice, named=named, parallel=parallel)


def tool_grammar_tools(req: ToolRequest) -> list[tuple[str, dict[str, Any]]] | None:
    """[(name, parameters schema)] the output must call (for mmserve.engine.grammar.tool_call_grammar):
    all tools for "required", the named one for a named choice; None when the output is unconstrained.
    "required" allows several calls unless `req.parallel` is False; a named choice means exactly one."""
    if req.named is not None:
        return [(req.named, req.parameters(req.named))]
    if req.choice == "required":
        return [(t["function"]["name"], req.parameters(t["function"]["name"])) for t in req.tools]
    return None


def _template_text(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates (e.g. "default", "tool_use")
        return "\n".join(str(t) for t in template.values())
    return template or ""


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the chat template renders `tools` itself (Qwen2.5 text, Qwen3-VL do; Qwen2-VL and
    Qwen2.5-VL never mention them)."""
    return "tools" in _template_text(tokenizer)


def _with_text(content: Any, text: str) -> Any:
    """Template-message content (a string or content parts) followed by `text`."""
    if isinstance(content, list):
        return [*content, {"type": "text", "text": text}]
    return (content or "") + text


def _call_block(function: dict[str, Any]) -> str:
    call = {"name": function["name"], "arguments": function["arguments"]}
    return f"<tool_call>\n{json.dumps(call, ensure_ascii=False)}\n</tool_call>"


def _hermes_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """The conversation as Qwen2.5's hermes template writes it, for templates that know no tools: the tools
    section in the system message, assistant calls as <tool_call> blocks, a run of tool results as one user
    message of <tool_response> blocks."""
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if message["role"] == "tool":
            response = f"<tool_response>\n{message['content']}\n</tool_response>"
            if i > 0 and messages[i - 1]["role"] == "tool":
                out[-1] = {"role": "user", "content": out[-1]["content"] + "\n" + response}
            else:
                out.append({"role": "user", "content": response})
        elif message.get("tool_calls"):
            blocks = "\n".join(_call_block(call["function"]) for call in message["tool_calls"])
            content = _with_text(message["content"], ("\n" if message["content"] else "") + blocks)
            out.append({"role": "assistant", "content": content})
        else:
            out.append(message)
    if tools:
        section = TOOLS_HEADER + "\n".join(json.dumps(t, ensure_ascii=False) for t in tools) + TOOLS_FOOTER
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": _with_text(out[0]["content"], "\n\n" + section)}
        else:
            out.insert(0, {"role": "system", "content": f"{DEFAULT_SYSTEM_PROMPT}\n\n{section}"})
    return out


def render_chat(
    tokenizer: Any,
    template_messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The prompt text for template messages (mmserve.multimodal.messages.parse_messages) and tools.
    A template that renders tools gets them as `tools=`; for one that does not, the tools, the assistant's
    calls and the tool results are written into the messages in the Hermes format (_hermes_messages).
    `template_kwargs` (vLLM's `chat_template_kwargs`, e.g. `enable_thinking`) become template variables."""
    flags = {
        **(template_kwargs or {}),
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final_message,
    }
    if template_renders_tools(tokenizer):
        return tokenizer.apply_chat_template(template_messages, tools=tools or None, tokenize=False, **flags)
    messages = _hermes_messages(template_messages, tools)
    return tokenizer.apply_chat_template(messages, tokenize=False, **flags)
