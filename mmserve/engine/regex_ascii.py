"""`\\d`, `\\w`, `\\s` as ASCII classes in the regexes of structured outputs.

llguidance parses regexes with Rust's `regex-syntax`, where these classes are Unicode: `\\d` admits '߁' or '၅',
so an IPv4 pattern let a model write digits no parser of IPv4 accepts. vLLM's grammar backends (xgrammar,
outlines) and Python's `re.ASCII`, which clients test their patterns with, mean the ASCII sets; this module
rewrites a pattern so the Rust engine means them too:

| escape | outside a class  | inside a class (`[...]`)          |
|--------|------------------|-----------------------------------|
| `\\d`   | `[0-9]`          | `0-9`                             |
| `\\w`   | `[0-9A-Za-z_]`   | `0-9A-Za-z_`                      |
| `\\s`   | `[\\t\\n\\v\\f\\r ]`  | `\\t\\n\\v\\f\\r ` (the same characters)    |
| `\\D` `\\W` `\\S` | the negated class | a nested negated class (`[^0-9]`: Rust nests classes) |

Everything else is copied unchanged, escapes included (`\\\\d` stays a backslash and a `d`).
"""

from __future__ import annotations

from typing import Any

_SETS = {"d": "0-9", "w": "0-9A-Za-z_", "s": "\\t\\n\\x0B\\f\\r "}
_DATA_KEYS = {"const", "enum", "default", "examples"}  # values, not schemas: never rewritten


def ascii_classes(pattern: str) -> str:
    """`pattern` with `\\d \\w \\s \\D \\W \\S` replaced by their ASCII classes (see the module docstring)."""
    out: list[str] = []
    depth = 0  # inside how many (Rust-nested) character classes
    class_start = False  # just after `[` or `[^`: a `]` here is a literal
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\" and i + 1 < n:
            e = pattern[i + 1]
            i += 2
            class_start = False
            if e.lower() in _SETS:
                chars = _SETS[e.lower()]
                if e.islower():
                    out.append(chars if depth else f"[{chars}]")
                else:
                    out.append(f"[^{chars}]")  # a nested class inside a class, a class outside
            else:
                out.append(c + e)
            continue
        if c == "[":
            if depth and pattern.startswith("[:", i):  # a POSIX class `[:alpha:]`: copied whole
                end = pattern.find(":]", i + 2)
                if end != -1:
                    out.append(pattern[i : end + 2])
                    i = end + 2
                    class_start = False
                    continue
            depth += 1
            out.append(c)
            i += 1
            if i < n and pattern[i] == "^":
                out.append("^")
                i += 1
            class_start = True
            continue
        if c == "]" and depth and not class_start:
            depth -= 1
        class_start = False
        out.append(c)
        i += 1
    return "".join(out)


def ascii_schema(schema: Any) -> Any:
    """A JSON schema with every `pattern` and `patternProperties` key rewritten by `ascii_classes`."""
    if isinstance(schema, list):
        return [ascii_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "pattern" and isinstance(value, str):
            out[key] = ascii_classes(value)
        elif key in _DATA_KEYS:
            out[key] = value
        elif key == "patternProperties" and isinstance(value, dict):
            out[key] = {ascii_classes(k): ascii_schema(v) for k, v in value.items()}
        else:
            out[key] = ascii_schema(value)
    return out
