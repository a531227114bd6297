"""Mistral tool calls (vLLM's `--tool-call-parser mistral`), in both of Mistral's formats after the
`[TOOL_CALLS]` control token:

- tokenizer v11 and later (Mistral Small 3.2, Ministral 3, Magistral, Devstral): one `[TOOL_CALLS]` per call,
  `[TOOL_CALLS]NAME[ARGS]{...}` (`[ARGS]` is absent before v13, and then the arguments follow the name);
- before v11 (Mistral 7B v0.3, Mistral Small 3.1): one `[TOOL_CALLS]` and a JSON array of the calls,
  `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (keys in any order).

vLLM tells the two apart by the tokenizer; this parser by what follows the marker (`[` opens the array), so
one parser reads both. A call's arguments are its JSON object's text as written (strict JSON, no duplicate
keys), so streamed fragments add up to it; a call whose arguments are not such an object stays content
(vLLM keeps a v11+ call with broken arguments as a call). Text after the calls is content too (vLLM drops
it). `[TOOL_CALLS]` and `[ARGS]` are special tokens: the request keeps special tokens in the text, as vLLM's
adjust_request does. Call ids are 9 letters and digits: Mistral's templates and mistral-common reject others.
"""

from __future__ import annotations

import re
import secrets
import string

from mmserve.server.tool_parsers.base import Block, ToolParser, skip_ws
from mmserve.server.tool_parsers.hermes import DECODER, HEADER, JsonObjectScan, parse_call_object

START, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME = re.compile(r"[^\s{}\[\]\"'<>]*")
_ID_CHARS = string.ascii_letters + string.digits


def _json_object_end(text: str, start: int) -> int | None:
    """End of the strict JSON object written at `start` (None: it is not one)."""
    try:
        obj, end = DECODER.raw_decode(text, start)
    except ValueError:
        return None
    return end if isinstance(obj, dict) else None


class MistralBlock(Block):
    def __init__(self, parser: ToolParser, start: int) -> None:
        super().__init__(parser, start)
        self.body = start + len(START)
        self.array: bool | None = None  # which format, once the first character after the marker is seen
        self.pos = self.body
        self.args_start = 0
        self.scanner: JsonObjectScan | None = None  # the object being read: arguments, or an array element
        self.args_scanner: JsonObjectScan | None = None  # array: the arguments of the element being read
        self.expect_element = True  # array: an element next (else "," or "]")

    def advance(self, text: str, final: bool) -> None:
        if self.array is None:
            i = skip_ws(text, self.body)
            if i == len(text):
                if final:
                    self.fail(self.body)
                return
            self.array, self.pos = text[i] == "[", i + (text[i] == "[")
        if self.array:
            self._array(text, final)
        else:
            self._named(text, final)

    def _named(self, text: str, final: bool) -> None:
        """`NAME[ARGS]{...}` or `NAME{...}` at `self.pos`."""
        if self.scanner is None:
            match = _NAME.match(text, self.pos)
            name, after = match.group(), match.end()
            rest = text[after : after + len(ARGS)]
            if rest == ARGS:
                args_start = after + len(ARGS)
            elif rest.startswith("{"):
                args_start = after
            elif not final and ARGS.startswith(rest):
                return  # the name, or "[ARGS]", is still being written
            else:  # not a call: the marker stays content, the text after it is read on
                self.fail(self.body)
                return
            if args_start == len(text) and not final:
                return
            if not name or not text.startswith("{", args_start):
                self.fail(self.body)
                return
            self.name, self.args_start = name, args_start
            self.scanner = JsonObjectScan(args_start)
        end = self.scanner.scan(text, len(text))
        self.args = text[self.args_start : end]
        if self.scanner.done:
            if _json_object_end(text, self.args_start) == end:
                self.complete(end)
            else:
                self.fail(end)
        elif final:
            self.fail(len(text))

    def _array(self, text: str, final: bool) -> None:
        """`[{"name": ..., "arguments": {...}}, ...]` from `self.pos` (past the `[`)."""
        while self.end is None:
            i = skip_ws(text, self.pos)
            if i == len(text):
                if final:
                    self.fail(i)
                return
            if not self.expect_element:
                if text[i] in ",]":
                    self.pos, self.expect_element = i + 1, text[i] == ","
                    if text[i] == "]":
                        self.complete(i + 1)
                else:
                    self.fail(i)
                continue
            if self.scanner is None:
                if text[i] != "{":
                    self.fail(i)
                    return
                self.pos, self.scanner = i, JsonObjectScan(i)
            element_end = self.scanner.scan(text, len(text))
            if not self.scanner.done:
                self._stream_element(text)
                if final:
                    self.fail(len(text))
                return
            parsed = parse_call_object(text, self.pos)
            if parsed is None or parsed[2] != element_end:
                self.fail(element_end)
                return
            self.name, self.args = parsed[0], parsed[1]
            self.complete()
            self.pos, self.scanner, self.expect_element = element_end, None, False

    def _stream_element(self, text: str) -> None:
        """The element being written: announced once `{"name": "...", "arguments": ` is (name first)."""
        if self.name is None:
            match = HEADER.match(text, self.pos)
            if match is None:
                return
            try:
                name = DECODER.decode(match.group(1))
            except ValueError:
                return
            self.name, self.args_start = name, match.end()
            self.args_scanner = JsonObjectScan(match.end())
        self.args = text[self.args_start : self.args_scanner.scan(text, len(text))]


class MistralParser(ToolParser):
    START = START
    BLOCK = MistralBlock
    needs_special_tokens = True

    def new_id(self) -> str:
        return "".join(secrets.choice(_ID_CHARS) for _ in range(9))
