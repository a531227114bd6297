"""Tool calls in model output, Hermes style (vLLM's `--tool-call-parser hermes`), whole and streamed.

The model writes each call as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`. A block whose
body is a JSON object with a string `name` and an object `arguments` (no duplicate keys) is a call; its
`arguments` string is the object's text exactly as the model wrote it, so the streamed fragments add up to
the same string. A block that is not (bad JSON, a missing field) stays in the content as written. A last
block the output never closed still counts when its JSON is complete (like vLLM).

Content is the text outside the blocks. When there are calls it loses trailing whitespace and is None if
nothing else is left; without calls it is the text unchanged. The streaming parser emits the same content
and calls with one exception: a block announced as a call once its name and the start of its arguments were
seen stays a call even if the rest of its JSON turns out broken (the fragments were already sent).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

START, END = "<tool_call>", "</tool_call>"
_WS = " \t\n\r"
_J = r"[ \t\n\r]*"  # JSON whitespace, in a regex
# The prefix of a block after which the arguments object streams: `{"name": "<name>", "arguments": `.
_HEADER = re.compile(rf'{_J}\{{{_J}"name"{_J}:{_J}("(?:[^"\\]|\\.)*"){_J},{_J}"arguments"{_J}:{_J}(?=\{{)')


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise ValueError("duplicate key")
    return obj


_DECODER = json.JSONDecoder(parse_constant=_no_constants, object_pairs_hook=_unique)


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def parse_call_block(body: str) -> tuple[str, str] | None:
    """(name, arguments text as written) for the body of one <tool_call> block; None if it is no call."""
    i = _skip_ws(body, 0)
    try:
        obj, end = _DECODER.raw_decode(body, i)
    except ValueError:
        return None
    if _skip_ws(body, end) != len(body) or not isinstance(obj, dict):
        return None
    if not isinstance(obj.get("name"), str) or not isinstance(obj.get("arguments"), dict):
        return None
    pos = i + 1  # walk the members again to find where the arguments value is written
    while True:
        key, pos = _DECODER.raw_decode(body, _skip_ws(body, pos))
        start = _skip_ws(body, _skip_ws(body, pos) + 1)  # past the ':'
        _, pos = _DECODER.raw_decode(body, start)
        if key == "arguments":
            return obj["name"], body[start:pos]
        pos = _skip_ws(body, pos) + 1  # past the ','


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def _call(name: str, arguments: str, call_id: str | None = None) -> dict[str, Any]:
    return {
        "id": call_id or new_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, calls in OpenAI's shape) for a whole output; see the module docstring."""
    content, calls, pos = [], [], 0
    while (start := text.find(START, pos)) >= 0:
        content.append(text[pos:start])
        end = text.find(END, start + len(START))
        body_end = len(text) if end < 0 else end
        pos = len(text) if end < 0 else end + len(END)
        parsed = parse_call_block(text[start + len(START) : body_end])
        if parsed is None:
            content.append(text[start:pos])
        else:
            calls.append(_call(*parsed))
    if not calls:
        return text, []
    content.append(text[pos:])
    return "".join(content).rstrip() or None, calls


def finish_reason_for(calls: list[dict[str, Any]] | bool, engine_reason: str | None) -> str | None:
    """OpenAI's "tool_calls" when the answer made calls and ended normally; "length" (cut short), "abort"
    and errors keep their meaning."""
    return "tool_calls" if calls and engine_reason == "stop" else engine_reason


def _held(text: str, tag: str, floor: int) -> int:
    """Length of the longest end of `text` (not reaching below `floor`) that could begin `tag`."""
    for n in range(min(len(tag) - 1, len(text) - floor), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclass
class _OpenCall:
    """The block being read: once its header is seen, its arguments object streams as it is written."""

    body_start: int  # offset of the block body in the parser's text
    call_id: str | None = None  # set when the call was announced
    name: str = ""
    args_start: int = 0
    args_sent: int = 0  # offset up to which the arguments were sent
    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    args_done: bool = False

    def scan(self, text: str, stop: int) -> int:
        """Advances over the arguments text up to `stop`; returns where the sendable text ends."""
        i = self.args_sent
        while i < stop and not self.args_done:
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
                self.args_done = self.depth == 0
            i += 1
        return i


class ToolCallStreamParser:
    """Turns text deltas into OpenAI chat-chunk delta dicts: `{"content": ...}`, a call's announcement
    `{"tool_calls": [{"index", "id", "type", "function": {"name", "arguments": ""}}]}` and its argument
    fragments `{"tool_calls": [{"index", "function": {"arguments"}}]}`. Text that may begin `<tool_call>`
    (or, inside a block, `</tool_call>`) is held back until the next delta decides. `calls` lists the
    calls made so far (OpenAI shape, for the final finish_reason)."""

    def __init__(self) -> None:
        self._text = ""
        self._pos = 0  # text before this offset is handled
        self._block: _OpenCall | None = None
        self._end_search = 0  # where to look for END in the current block
        self._pending_ws = ""  # trailing whitespace of the content, sent only if more content follows
        self.calls: list[dict[str, Any]] = []

    def feed(self, delta: str) -> list[dict[str, Any]]:
        self._text += delta
        return self._advance(final=False)

    def finish(self) -> list[dict[str, Any]]:
        """The deltas still held back, at the end of the output."""
        out = self._advance(final=True)
        if not self.calls and self._pending_ws:
            out = _merge(out + [{"content": self._pending_ws}])
        self._pending_ws = ""
        return out

    def _advance(self, final: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        text = self._text
        while True:
            if self._block is None:
                start = text.find(START, self._pos)
                if start < 0:
                    safe = len(text) - (0 if final else _held(text, START, self._pos))
                    self._content(text[self._pos : safe], out)
                    self._pos = safe
                    break
                self._content(text[self._pos : start], out)
                self._pos = self._end_search = start + len(START)
                self._block = _OpenCall(body_start=self._pos)
                continue
            end = text.find(END, self._end_search)
            if end >= 0:
                self._close(end, text[self._block.body_start : end + len(END)], out)
                self._pos = end + len(END)
                continue
            self._end_search = max(self._block.body_start, len(text) - len(END) + 1)
            if final:
                self._close(len(text), text[self._block.body_start :], out)
                self._pos = len(text)
            else:
                self._stream(len(text) - _held(text, END, self._block.body_start), out)
            break
        return _merge(out)

    def _content(self, text: str, out: list[dict[str, Any]]) -> None:
        combined = self._pending_ws + text
        head = combined.rstrip()
        if head:
            out.append({"content": head})
        self._pending_ws = combined[len(head) :]

    def _stream(self, visible_end: int, out: list[dict[str, Any]]) -> None:
        block, index = self._block, len(self.calls)
        if block.call_id is None:
            match = _HEADER.match(self._text, block.body_start, visible_end)
            if match is None:
                return
            try:
                name = json.loads(match.group(1))
            except ValueError:
                return
            block.call_id, block.name = new_call_id(), name
            block.args_start = block.args_sent = match.end()
            function = {"name": name, "arguments": ""}
            out.append(
                {
                    "tool_calls": [
                        {"index": index, "id": block.call_id, "type": "function", "function": function}
                    ]
                }
            )
        sendable = block.scan(self._text, visible_end)
        if sendable > block.args_sent:
            fragment = self._text[block.args_sent : sendable]
            out.append({"tool_calls": [{"index": index, "function": {"arguments": fragment}}]})
            block.args_sent = sendable

    def _close(self, body_end: int, raw: str, out: list[dict[str, Any]]) -> None:
        """Ends the current block (its body ends at `body_end`; `raw` is the block text after START)."""
        block, index = self._block, len(self.calls)
        self._block = None
        parsed = parse_call_block(self._text[block.body_start : body_end])
        if block.call_id is None and parsed is None:
            self._content(START + raw, out)
            return
        if block.call_id is None:
            block.call_id = new_call_id()
            function = {"name": parsed[0], "arguments": ""}
            out.append(
                {
                    "tool_calls": [
                        {"index": index, "id": block.call_id, "type": "function", "function": function}
                    ]
                }
            )
        sent = self._text[block.args_start : block.args_sent]
        if parsed is not None and parsed[1].startswith(sent) and len(parsed[1]) > len(sent):
            out.append({"tool_calls": [{"index": index, "function": {"arguments": parsed[1][len(sent) :]}}]})
            sent = parsed[1]
        self.calls.append(_call(parsed[0] if parsed is not None else block.name, sent, block.call_id))


def _merge(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Joins neighbouring content deltas."""
    out: list[dict[str, Any]] = []
    for delta in deltas:
        if out and "content" in delta and "content" in out[-1]:
            out[-1] = {"content": out[-1]["content"] + delta["content"]}
        else:
            out.append(delta)
    return out
