"""GLM-4.5 / GLM-4.5V / GLM-4.6 tool calls (vLLM's `--tool-call-parser glm45`), as their chat templates write
them:

    <tool_call>NAME
    <arg_key>KEY</arg_key>
    <arg_value>VALUE</arg_value>
    ...
    </tool_call>

Typed as vLLM's glm4_moe parser does: a value whose parameter the tool's schema types `"string"` stays exactly
as written; any other is read as JSON, else as a Python literal, else kept as its stripped text. Keys are
stripped. The arguments are the JSON object of the pairs in order (`json.dumps`, as vLLM's). Streaming
announces a call once its name line is written, sends each pair when its value closes and a string value as
it is written. A block the output never closed is not a call (vLLM's rule); `<tool_call>` is a plain added
token in GLM's tokenizer, but as vLLM the request keeps special tokens in the text.
"""

from __future__ import annotations

from typing import Any

from mmserve.server.tool_parsers.arguments import ArgsWriter, loads_or_literal
from mmserve.server.tool_parsers.base import Block, ToolParser, held, skip_ws, tool_parameters

START, END = "<tool_call>", "</tool_call>"
KEY, KEY_END = "<arg_key>", "</arg_key>"
VALUE, VALUE_END = "<arg_value>", "</arg_value>"
_NOT_IN_NAMES = set("{}<>\"' \t\n\r")


def glm_value(raw: str, is_string: bool) -> Any:
    if is_string:
        return raw
    ok, value = loads_or_literal(raw.strip())
    return value if ok else raw.strip()


def _waits(text: str, i: int, tags: tuple[str, ...]) -> bool:
    """Whether the text from `i` is too short to tell which of `tags` (if any) it begins."""
    rest = text[i:]
    return any(len(rest) < len(t) and t.startswith(rest) for t in tags)


class Glm45Block(Block):
    def __init__(self, parser: ToolParser, start: int) -> None:
        super().__init__(parser, start)
        self.body = start + len(START)
        self.pos = self.body
        self.writer = ArgsWriter()
        self.properties: dict[str, Any] = {}
        self.broken = False

    def advance(self, text: str, final: bool) -> None:
        if not self.broken and self.name is None:
            self._name(text, final)
        while not self.broken and self.name is not None and self.end is None:
            i = skip_ws(text, self.pos)
            if text.startswith(END, i):
                self.args = self.writer.closed
                self.complete(i + len(END))
            elif text.startswith(KEY, i):
                if not self._pair(text, i, final):
                    break
            elif final or not _waits(text, i, (KEY, END)):
                self.broken = True
            else:
                break
        if self.broken:
            if self.name is not None:  # announced: what was sent, closed as JSON
                self.args = self.writer.abandoned
            end = text.find(END, self.body)
            if end >= 0 or final:
                self.fail(end + len(END) if end >= 0 else len(text))

    def _name(self, text: str, final: bool) -> None:
        """The name runs to the end of its line (or to the first tag, when the model puts none)."""
        newline, tag = text.find("\n", self.body), text.find("<", self.body)
        stops = [k for k in (newline, tag) if k >= 0]
        stop = min(stops) if stops else len(text)
        name = text[self.body : stop].strip()
        if _NOT_IN_NAMES & set(name) or (final and not stops):
            self.broken = True
            return
        if not stops:
            return
        if stop == tag and stop != newline:
            if _waits(text, tag, (KEY, END)) and not final:
                return
            if not text.startswith((KEY, END), tag):
                self.broken = True
                return
        if not name:
            self.broken = True
            return
        self.name, self.args, self.pos = name, self.writer.text, stop
        parameters = tool_parameters(self.parser.tools, name) or {}
        properties = parameters.get("properties")
        self.properties = properties if isinstance(properties, dict) else {}

    def _pair(self, text: str, i: int, final: bool) -> bool:
        """Reads `<arg_key>K</arg_key> <arg_value>V</arg_value>` at `i`; False when it must wait (or is broken)."""
        key_end = text.find(KEY_END, i + len(KEY))
        if key_end < 0:
            self.broken = final
            return False
        key = text[i + len(KEY) : key_end].strip()
        j = skip_ws(text, key_end + len(KEY_END))
        if not text.startswith(VALUE, j):
            self.broken = final or not _waits(text, j, (VALUE,))
            return False
        value_start = j + len(VALUE)
        value_end = text.find(VALUE_END, value_start)
        schema = self.properties.get(key)
        is_string = isinstance(schema, dict) and schema.get("type") == "string"
        if value_end < 0:
            if final:
                self.broken = True
            elif is_string:
                self.writer.open_string(
                    key, text, value_start, len(text) - held(text, VALUE_END, value_start)
                )
                self.args = self.writer.text
            return False
        self.writer.add(key, glm_value(text[value_start:value_end], is_string))
        self.args, self.pos = self.writer.text, value_end + len(VALUE_END)
        return True


class Glm45Parser(ToolParser):
    START = START
    BLOCK = Glm45Block
    needs_special_tokens = True
