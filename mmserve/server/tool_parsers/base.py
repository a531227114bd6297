"""What every tool-call parser shares: turning a model's output, whole or streamed, into content and OpenAI
`tool_calls`, with one machine for both.

A format (hermes.py, qwen3_coder.py, mistral.py, glm45.py) says where a call block starts (`START`) and reads
one block with its `Block` subclass; `ToolParser` does the rest, the same way for every format:

- `feed(delta)` returns OpenAI chat-chunk delta dicts: `{"content": ...}`, a call's announcement
  `{"tool_calls": [{"index", "id", "type", "function": {"name", "arguments": ""}}]}` and its argument
  fragments `{"tool_calls": [{"index", "function": {"arguments"}}]}`; `finish()` the deltas still held back.
  `calls` lists the calls made so far (OpenAI shape, for the final finish_reason).
- The argument fragments of a call concatenate to exactly its final `arguments` string.
- Content is the text outside the call blocks. When there are calls it loses trailing whitespace (and is
  None if nothing else is left); without calls it is the text unchanged. Text that may begin `START` is held
  back until the next delta decides.
- A block that is not a well-formed call stays in the content as written; no output makes a parser raise.
- `parse(text)` reads a whole output at once: the same content and calls as streaming it, with one exception.
  While streaming, a call is announced as soon as its name is known (and its arguments stream as they are
  written); a block announced that turns out broken stays a call (its fragments were sent), with the
  arguments sent so far. `parse` sees every block whole and keeps a broken one as content.
"""

from __future__ import annotations

import secrets
from typing import Any

_WS = " \t\n\r"


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def call_dict(name: str, arguments: str, call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def finish_reason_for(calls: list[dict[str, Any]] | bool, engine_reason: str | None) -> str | None:
    """OpenAI's "tool_calls" when the answer made calls and ended normally; "length" (cut short), "abort"
    and errors keep their meaning."""
    return "tool_calls" if calls and engine_reason == "stop" else engine_reason


def skip_ws(text: str, i: int, stop: int | None = None) -> int:
    stop = len(text) if stop is None else stop
    while i < stop and text[i] in _WS:
        i += 1
    return i


def held(text: str, tag: str, floor: int = 0) -> int:
    """Length of the longest end of `text` (not reaching below `floor`) that could begin `tag`."""
    for n in range(min(len(tag) - 1, len(text) - floor), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def tool_parameters(tools: list[dict[str, Any]] | None, name: str) -> dict[str, Any] | None:
    """The `parameters` schema of the request's tool `name` (None: no such tool, or it has none)."""
    for tool in tools or ():
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and function.get("name") == name:
            parameters = function.get("parameters")
            return parameters if isinstance(parameters, dict) else None
    return None


class Block:
    """One call block being read, from its `START` at `start`. `advance(text, final)` reads it further over the
    parser's whole text (`final`: the output ended) and sets:

    | attribute | meaning                                                                                   |
    |-----------|-------------------------------------------------------------------------------------------|
    | `calls`   | the block's complete calls, in order: (name, final arguments text)                        |
    | `name`    | the call being read after them, once its name is known (it is then announced)             |
    | `args`    | that call's arguments text so far; only ever grows (fragments are its new ends)           |
    | `end`     | where the block ends in the text, once decided (always, after a final `advance`)           |
    | `ok`      | with `end`: the block is well formed (else, if nothing of it was announced, it is content) |

    A subclass may keep what it read in earlier calls; `advance` is called with the text grown only."""

    def __init__(self, parser: ToolParser, start: int) -> None:
        self.parser = parser
        self.start = start
        self.calls: list[tuple[str, str]] = []
        self.name: str | None = None
        self.args = ""
        self.end: int | None = None
        self.ok = False

    def advance(self, text: str, final: bool) -> None:
        raise NotImplementedError

    def fail(self, end: int) -> None:
        """Ends the block as no (further) call at `end`."""
        self.end, self.ok = end, False

    def complete(self, end: int | None = None) -> None:
        """The call being read is complete: it joins `calls`; with `end`, the block ends well formed there."""
        if self.name is not None:
            self.calls.append((self.name, self.args))
            self.name, self.args = None, ""
        if end is not None:
            self.end, self.ok = end, True


class ToolParser:
    """Streams one choice's output into content and tool-call deltas; see the module docstring. Built per choice
    with the request's `tools` (OpenAI tool dicts; formats that type arguments read their schemas)."""

    START = ""
    BLOCK: type[Block] = Block
    # The format's markers are special tokens the detokenizer would drop (vLLM's mistral adjust_request).
    needs_special_tokens = False

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = tools or []
        self._text = ""
        self._pos = 0  # text before this offset is handled
        self._block: Block | None = None
        self._done_in_block = 0  # calls of the open block already in `calls`
        self._open: list[str] | None = None  # the announced call being streamed: [id, name, arguments sent]
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

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, calls in OpenAI's shape) of a whole output, on a fresh parser."""
        self._text += text
        deltas = self.finish()
        if not self.calls:
            return text, []
        return "".join(d["content"] for d in deltas if "content" in d) or None, self.calls

    def new_id(self) -> str:
        return new_call_id()

    def find_start(self, text: str, pos: int) -> int:
        """Where the next block starts at or after `pos` (-1: none yet)."""
        return text.find(self.START, pos)

    def _advance(self, final: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        text = self._text
        while True:
            if self._block is None:
                start = self.find_start(text, self._pos)
                if start < 0:
                    safe = len(text) - (0 if final else held(text, self.START, self._pos))
                    self._content(text[self._pos : safe], out)
                    self._pos = safe
                    break
                self._content(text[self._pos : start], out)
                self._block, self._done_in_block = self.BLOCK(self, start), 0
                continue
            block = self._block
            block.advance(text, final)
            if block.end is None:
                self._sync(block, out)
                break
            if block.ok or self._open is not None or self._done_in_block:
                self._sync(block, out)
                if self._open is not None:  # announced, then broken: it stays a call (see the module doc)
                    self._close_call()
            else:
                self._content(text[block.start : block.end], out)
            self._pos, self._block = block.end, None
        return _merge(out)

    def _sync(self, block: Block, out: list[dict[str, Any]]) -> None:
        """Announces and streams what `block` knows that was not sent yet."""
        while self._done_in_block < len(block.calls):
            self._stream(*block.calls[self._done_in_block], out)
            self._close_call()
            self._done_in_block += 1
        if block.name is not None:
            self._stream(block.name, block.args, out)

    def _stream(self, name: str, args: str, out: list[dict[str, Any]]) -> None:
        index = len(self.calls)
        if self._open is None:
            self._open = [self.new_id(), name, ""]
            function = {"name": name, "arguments": ""}
            call = {"index": index, "id": self._open[0], "type": "function", "function": function}
            out.append({"tool_calls": [call]})
        sent = self._open[2]
        if len(args) > len(sent) and args.startswith(sent):
            out.append({"tool_calls": [{"index": index, "function": {"arguments": args[len(sent) :]}}]})
            self._open[2] = args

    def _close_call(self) -> None:
        call_id, name, sent = self._open
        self.calls.append(call_dict(name, sent, call_id))
        self._open = None

    def _content(self, text: str, out: list[dict[str, Any]]) -> None:
        combined = self._pending_ws + text
        head = combined.rstrip()
        if head:
            out.append({"content": head})
        self._pending_ws = combined[len(head) :]


def _merge(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Joins neighbouring content deltas."""
    out: list[dict[str, Any]] = []
    for delta in deltas:
        if out and "content" in delta and "content" in out[-1]:
            out[-1] = {"content": out[-1]["content"] + delta["content"]}
        else:
            out.append(delta)
    return out
