"""Qwen3-Coder / Qwen3.5 / Qwen3.6 XML tool calls (vLLM's `--tool-call-parser qwen3_coder`), as their chat
templates write them:

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    ...
    </function>
    </tool_call>

A value loses one leading and one trailing newline and is typed by the tool's JSON schema as vLLM does
(`qwen_value`): strings stay as written, integers / numbers / booleans / null are converted, objects and
arrays parsed; a parameter the schema does not declare stays a string. The arguments are the JSON object of
the parameters in order (`json.dumps`, as vLLM's). Streaming announces a call at `<function=NAME>`, sends
each parameter when it ends and a string parameter's value as it is written.

Values may hold tags: a `</parameter>` ends a value only when what follows is `<parameter=`, `</function>`,
`</tool_call>` or the end of the output. Like vLLM, a missing `</parameter>` is forgiven when the next line
opens a parameter the schema declares (any, for a tool without one) that was not given yet, or closes the
function. A last block the output never closed counts when its function is complete. vLLM also takes a bare
`<function=...>` without `<tool_call>`; this parser does not (it stays content).
"""

from __future__ import annotations

import math
import re
from typing import Any

from mmserve.server.tool_parsers.arguments import ArgsWriter, loads_or_literal, python_literal
from mmserve.server.tool_parsers.base import Block, ToolParser, held, skip_ws, tool_parameters

START, END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
_NOT_IN_NAMES = set("{}<>\"' \t\n\r")  # vLLM's test of a real function name
# Where a value may end: its close tag, or (a missing close) the next parameter or the function's end.
_VALUE_ENDS = re.compile(r"</parameter>|\n<parameter=|\n</function>")
_HELD_TAGS = (PARAMETER_END, "\n" + PARAMETER, "\n" + FUNCTION_END)
_LONGEST_TAG = max(map(len, _HELD_TAGS))
_STRINGS = ("string", "str", "text", "varchar", "char", "enum")


def schema_type(schema: Any) -> tuple[str, bool]:
    """(the value's type as vLLM's qwen3_coder parser reads it, whether null is allowed)."""
    if not isinstance(schema, dict):
        return "string", False
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        names = [str(t).strip().lower() for t in types]
        others = [t for t in names if t != "null"]
        return (others[0] if others else "null"), "null" in names
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            names = [
                str(o["type"]).strip().lower() for o in schema[key] if isinstance(o, dict) and "type" in o
            ]
            others = [t for t in names if t != "null"]
            return (others[0] if others else "string"), "null" in names
    return "string", False


def qwen_value(raw: str, schema: Any, declared: bool) -> Any:
    """A parameter's value as JSON data; `declared`: the tool's schema lists the parameter."""
    if not declared:
        return raw
    kind, nullable = schema_type(schema)
    if (nullable or kind not in _STRINGS) and raw.lower() in ("null", "none"):
        return None
    if kind in _STRINGS:
        return raw
    if kind.startswith(("int", "uint", "long", "short", "unsigned")):
        try:
            return int(raw)
        except ValueError:
            return raw
    if kind.startswith(("num", "float")):
        try:
            number = float(raw)
        except ValueError:
            return raw
        if not math.isfinite(number):
            return raw
        return int(number) if number.is_integer() else number
    if kind in ("boolean", "bool", "binary"):
        return raw.lower() == "true" if raw.lower() in ("true", "false") else raw
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        ok, value = loads_or_literal(raw)
        # A JSON string holding a Python repr (a template's json.dumps(str(dict))): read it once more.
        if ok and isinstance(value, str):
            ok, again = python_literal(value)
            value = again if ok else value
        return value if ok else raw
    ok, value = python_literal(raw)
    return value if ok else raw


def _streams_as_string(schema: Any, declared: bool) -> bool:
    """Whether the value stays the raw text whatever it turns out to be (so it can stream as written)."""
    kind, nullable = schema_type(schema)
    return not declared or (kind in _STRINGS and not nullable)


class Qwen3CoderBlock(Block):
    def __init__(self, parser: ToolParser, start: int) -> None:
        super().__init__(parser, start)
        self.body = start + len(START)
        self.pos = self.body  # the next unread element
        self.stage = "function"  # -> "parameters" -> "close"
        self.writer = ArgsWriter()
        self.properties: dict[str, Any] | None = None
        self.broken = False  # not a call: waiting for the END that ends the block
        self.scan_from = (0, 0)  # (value start, offset): no candidate end of that value before the offset

    def advance(self, text: str, final: bool) -> None:
        if self.broken:
            self._break(text, final)
            return
        while self.end is None and not self.broken:
            i = skip_ws(text, self.pos)
            rest = text[i : i + len(FUNCTION_END) + len(END)]
            if self.stage == "function":
                if not self._function(text, i, final):
                    break
            elif self.stage == "parameters":
                if text.startswith(FUNCTION_END, i):
                    self.pos, self.stage = i + len(FUNCTION_END), "close"
                elif text.startswith(PARAMETER, i):
                    if not self._parameter(text, i, final):
                        break
                elif final or not (PARAMETER.startswith(rest) or FUNCTION_END.startswith(rest)):
                    self.broken = True
                else:
                    break
            elif text.startswith(END, i) or (final and i == len(text)):
                self.args = self.writer.closed
                self.complete(min(i + len(END), len(text)))
            elif final or not END.startswith(rest):
                self.broken = True
            else:
                break
        if self.broken:
            self._break(text, final)

    def _break(self, text: str, final: bool) -> None:
        """Not a call: the block runs to the next END (or the output's end)."""
        self.broken = True
        if self.name is not None:  # announced: what was sent, closed as JSON
            self.args = self.writer.abandoned
        end = text.find(END, self.body)
        if end >= 0 or final:
            self.fail(end + len(END) if end >= 0 else len(text))

    def _function(self, text: str, i: int, final: bool) -> bool:
        """Reads `<function=NAME>` at `i`; False when it must wait (or is broken)."""
        if not text.startswith(FUNCTION, i):
            self.broken = final or not FUNCTION.startswith(text[i : i + len(FUNCTION)])
            return False
        name_start = i + len(FUNCTION)
        gt = text.find(">", name_start)
        name = text[name_start : gt if gt >= 0 else len(text)]
        if _NOT_IN_NAMES & set(name) or (gt >= 0 and not name) or (gt < 0 and final):
            self.broken = True
            return False
        if gt < 0:
            return False
        self.name, self.args = name, self.writer.text
        parameters = tool_parameters(self.parser.tools, name)
        properties = parameters.get("properties") if parameters else None
        self.properties = properties if isinstance(properties, dict) else None
        self.pos, self.stage = gt + 1, "parameters"
        return True

    def _parameter(self, text: str, i: int, final: bool) -> bool:
        """Reads one `<parameter=KEY>VALUE</parameter>` at `i`; False when it must wait (or is broken)."""
        key_start = i + len(PARAMETER)
        gt = text.find(">", key_start)
        key = text[key_start : gt if gt >= 0 else len(text)]
        if set(key) & set("<\n") or (gt >= 0 and not key) or (gt < 0 and final):
            self.broken = True
            return False
        value_start = gt + 1
        if gt < 0 or (value_start == len(text) and not final):
            return False
        value_start += text.startswith("\n", value_start)
        schema = (self.properties or {}).get(key)
        declared = self.properties is not None and key in self.properties
        end, resume = self._value_end(text, value_start, key, final)
        if end is None:
            if final:
                self.broken = True
            elif _streams_as_string(schema, declared):
                safe = resume - (resume > value_start and text[resume - 1] == "\n")
                self.writer.open_string(key, text, value_start, safe)
                self.args = self.writer.text
            return False
        value = text[value_start:end]
        value = value[:-1] if value.endswith("\n") else value
        self.writer.add(key, qwen_value(value, schema, declared))
        self.args, self.pos = self.writer.text, resume
        return True

    def _value_end(self, text: str, start: int, key: str, final: bool) -> tuple[int | None, int]:
        """(end of the value, where reading goes on) once decided; else (None, how far the value is known).
        What it decided stays decided, so the next call goes on from where this one stopped."""
        pos = self.scan_from[1] if self.scan_from[0] == start else start
        end, known = self._scan_value(text, start, pos, key, final)
        if end is None:
            self.scan_from = (start, max(start, min(known - 1, len(text) - _LONGEST_TAG)))
        return end, known

    def _scan_value(self, text: str, start: int, pos: int, key: str, final: bool) -> tuple[int | None, int]:
        while (match := _VALUE_ENDS.search(text, pos)) is not None:
            at, tag = match.start(), match.group()
            if tag == "\n<parameter=":
                name_end = text.find(">", at + len(tag))
                if name_end < 0:
                    if final:
                        pos = at + 1
                        continue
                    return None, at + 1
                name = text[at + len(tag) : name_end]
                declared = self.properties is None or name in self.properties
                if declared and name != key and name not in self.writer.keys and not set(name) & set("<\n"):
                    return at + 1, at + 1
                pos = at + 1
                continue
            after = skip_ws(text, match.end())
            rest = text[after : after + len(FUNCTION_END) + len(END)]
            follows = (END,) if tag == "\n</function>" else (PARAMETER, FUNCTION_END, END)
            if any(rest.startswith(t) for t in follows) or (final and after == len(text)):
                return (at, match.end()) if tag == PARAMETER_END else (at + 1, at + 1)
            if not final and (after == len(text) or any(t.startswith(rest) for t in follows)):
                return None, at if tag == PARAMETER_END else at + 1
            pos = at + 1
        if final:
            return None, len(text)
        return None, len(text) - max(held(text, tag, start) for tag in _HELD_TAGS)


class Qwen3CoderParser(ToolParser):
    START = START
    BLOCK = Qwen3CoderBlock
