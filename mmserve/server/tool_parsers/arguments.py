"""A call's arguments JSON written member by member, for the formats whose parameters are XML-ish tags with
raw values (qwen3_coder, glm45): the text is exactly `json.dumps(arguments, ensure_ascii=False)` of the
finished call (what vLLM's parsers return), and every text it had before is a prefix of it, so it streams.

A string-typed value also streams while it is written: the JSON escape of a string's prefix is a prefix of
the escape of the whole string (`json.dumps` escapes character by character).
"""

from __future__ import annotations

import ast
import json
import math
from typing import Any


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def as_json_value(value: Any) -> Any:
    """`value` if JSON can carry it as it is (no NaN / Infinity, no sets, bytes, tuples or complex numbers
    that `ast.literal_eval` may give), else None."""
    if isinstance(value, bool) or value is None or isinstance(value, str | int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, list):
        items = [as_json_value(v) for v in value]
        return None if any(i is None and v is not None for i, v in zip(items, value, strict=True)) else items
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        out = {k: as_json_value(v) for k, v in value.items()}
        return None if any(out[k] is None and value[k] is not None for k in value) else out
    return None


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def python_literal(text: str) -> tuple[bool, Any]:
    """(True, value) when `text` is a Python literal that JSON can carry; (False, None) if not."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None
    carried = as_json_value(value)
    return (carried is not None or value is None), carried


def loads_or_literal(text: str) -> tuple[bool, Any]:
    """(True, value) when `text` is JSON, or else a Python literal that JSON can carry; (False, None) if not."""
    try:
        return True, json.loads(text, parse_constant=_no_constants)
    except (ValueError, RecursionError):
        return python_literal(text)


class ArgsWriter:
    """The arguments object of one call: `add` a finished member, `open_string` the member being written when
    its value is a plain string, `text` / `closed` the JSON so far. A repeated key keeps its first value (a
    second would rewrite text already sent)."""

    def __init__(self) -> None:
        self.committed = "{"
        self.keys: set[str] = set()
        self._open_key: str | None = None  # the open string member: its key, raw length and escaped text
        self._open_len = 0
        self._open_escaped = ""

    def _sep(self) -> str:
        return ", " if self.keys else ""

    def add(self, key: str, value: Any) -> None:
        if key not in self.keys:
            self.committed += f"{self._sep()}{dumps(key)}: {dumps(value)}"
            self.keys.add(key)
        self._open_key = None

    def open_string(self, key: str, text: str, start: int, stop: int) -> None:
        """The member `key` whose string value begins `text[start:stop]` (its whole value comes with `add`);
        called again as the value grows, it escapes only what is new."""
        if key in self.keys:
            return
        if self._open_key != key:
            self._open_key, self._open_len, self._open_escaped = key, 0, ""
        if stop - start > self._open_len:
            self._open_escaped += dumps(text[start + self._open_len : stop])[1:-1]
            self._open_len = stop - start

    @property
    def text(self) -> str:
        if self._open_key is None:
            return self.committed
        return f'{self.committed}{self._sep()}{dumps(self._open_key)}: "{self._open_escaped}'

    @property
    def closed(self) -> str:
        return self.committed + "}"

    @property
    def abandoned(self) -> str:
        """What was written so far as a JSON object: an open string value is cut where it got to."""
        return self.text + ('"}' if self._open_key is not None else "}")
