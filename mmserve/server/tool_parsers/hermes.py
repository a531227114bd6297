"""Hermes-style tool calls (vLLM's `--tool-call-parser hermes`): Qwen2.5, Qwen2-VL / Qwen2.5-VL / Qwen3-VL,
Qwen-Omni, and every model whose chat template renders no tools (mmserve.server.tools then writes the tools
into the prompt in this format).

The model writes each call as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`. A block whose
body is a JSON object with a string `name` and an object `arguments` (no duplicate keys) is a call; its
`arguments` string is the object's text exactly as the model wrote it, so the streamed fragments add up to
the same string. A last block the output never closed still counts when its JSON is complete (like vLLM).
Streaming announces a call once `{"name": "<name>", "arguments": ` is written; its arguments object then
streams as it is written (text that may begin `</tool_call>` held back).
"""

from __future__ import annotations

import json
import re
from typing import Any

from mmserve.server.tool_parsers.base import Block, ToolParser, held, skip_ws

START, END = "<tool_call>", "</tool_call>"
_J = r"[ \t\n\r]*"  # JSON whitespace, in a regex
# The prefix of a block after which the arguments object streams: `{"name": "<name>", "arguments": `.
HEADER = re.compile(rf'{_J}\{{{_J}"name"{_J}:{_J}("(?:[^"\\]|\\.)*"){_J},{_J}"arguments"{_J}:{_J}(?=\{{)')


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise ValueError("duplicate key")
    return obj


# Strict JSON: no NaN / Infinity, no duplicate keys (the arguments must mean one thing to every client).
DECODER = json.JSONDecoder(parse_constant=_no_constants, object_pairs_hook=_unique)


def parse_call_object(body: str, start: int = 0) -> tuple[str, str, int] | None:
    """(name, arguments text as written, end) of a `{"name": ..., "arguments": {...}}` object at `start` of
    `body` (whitespace first allowed; keys in any order); None if there is none."""
    i = skip_ws(body, start)
    try:
        obj, end = DECODER.raw_decode(body, i)
    except ValueError:
        return None
    if (
        not isinstance(obj, dict)
        or not isinstance(obj.get("name"), str)
        or not isinstance(obj.get("arguments"), dict)
    ):
        return None
    pos = i + 1  # walk the members again to find where the arguments value is written
    while True:
        key, pos = DECODER.raw_decode(body, skip_ws(body, pos))
        value_start = skip_ws(body, skip_ws(body, pos) + 1)  # past the ':'
        _, pos = DECODER.raw_decode(body, value_start)
        if key == "arguments":
            return obj["name"], body[value_start:pos], end
        pos = skip_ws(body, pos) + 1  # past the ','


def parse_call_block(body: str) -> tuple[str, str] | None:
    """(name, arguments text as written) for the body of one <tool_call> block; None if it is no call."""
    parsed = parse_call_object(body)
    if parsed is None or skip_ws(body, parsed[2]) != len(body):
        return None
    return parsed[0], parsed[1]


class JsonObjectScan:
    """Where a JSON object written from `start` ends, read incrementally: `scan(text, stop)` advances up to
    `stop` and returns how far the object's text goes (strings with braces and escaped quotes counted right)."""

    def __init__(self, start: int) -> None:
        self.pos = start
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.done = False

    def scan(self, text: str, stop: int) -> int:
        i = self.pos
        while i < stop and not self.done:
            c = text[i]
            if self.escaped:
                self.escaped = False
            elif self.in_string:
                self.escaped = c == "\\"
                self.in_string = c != '"'
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                self.done = self.depth == 0
            i += 1
        self.pos = i
        return i


class HermesBlock(Block):
    def __init__(self, parser: ToolParser, start: int) -> None:
        super().__init__(parser, start)
        self.body = start + len(START)
        self.end_search = self.body  # where to look for END next
        self.args_start = 0
        self.scanner: JsonObjectScan | None = None

    def advance(self, text: str, final: bool) -> None:
        end = text.find(END, self.end_search)
        if end >= 0 or final:
            body_end = end if end >= 0 else len(text)
            parsed = parse_call_block(text[self.body : body_end])
            if parsed is None:
                self.fail(body_end + (len(END) if end >= 0 else 0))
                return
            self.name, self.args = parsed
            self.complete(body_end + (len(END) if end >= 0 else 0))
            return
        self.end_search = max(self.body, len(text) - len(END) + 1)
        visible_end = len(text) - held(text, END, self.body)
        if self.scanner is None:
            match = HEADER.match(text, self.body, visible_end)
            if match is None:
                return
            try:
                name = json.loads(match.group(1))
            except ValueError:
                return
            self.name, self.args_start = name, match.end()
            self.scanner = JsonObjectScan(match.end())
        self.args = text[self.args_start : self.scanner.scan(text, visible_end)]


class HermesParser(ToolParser):
    START = START
    BLOCK = HermesBlock
