"""`\\d`, `\\w`, `\\s` mean the ASCII classes in every structured-output regex (mmserve.engine.regex_ascii), as
in vLLM's grammar backends: before, a `\\d` let the model write Unicode digits ('߁', '၅') into an IPv4 pattern."""

from __future__ import annotations

import json
import re

import pytest
from transformers import AutoTokenizer

from mmserve.engine.grammar import GrammarCompiler
from mmserve.engine.regex_ascii import ascii_classes, ascii_schema
from mmserve.sampling_params import StructuredOutputs

IPV4 = r"\d{1,3}(\.\d{1,3}){3}"


@pytest.mark.parametrize(
    "pattern, expected",
    [
        (r"\d+", "[0-9]+"),
        (r"[\d.]+", "[0-9.]+"),
        (r"[^\d\s]", r"[^0-9\t\n\x0B\f\r ]"),
        (r"\W", "[^0-9A-Za-z_]"),
        (r"[\D]", "[[^0-9]]"),  # Rust nests classes
        (r"\\d", r"\\d"),  # an escaped backslash and a d
        (r"[]\d]", "[]0-9]"),  # a leading ] is a literal
        (r"[[:alpha:]\w]", "[[:alpha:]0-9A-Za-z_]"),
        (r"\p{L}\.", r"\p{L}\."),
    ],
)
def test_rewrite(pattern, expected):
    assert ascii_classes(pattern) == expected


@pytest.mark.parametrize("pattern", [IPV4, r"\w+@\w+\.\w{2,3}", r"[\w.-]+\s\S+", r"\D\d\s*[\d,]+"])
@pytest.mark.parametrize("text", ["10.0.0.1", "١٠.0.0.1", "1߁.0.0.1", "a_b@x1.io", "é@x.io", "x.y 7z", "a1  2,3"])
def test_rewritten_pattern_means_what_python_ascii_means(pattern, text):
    """Python's `re.ASCII` is what clients check their patterns with (no nested classes in these patterns,
    so Python reads the rewrite as Rust does)."""
    assert bool(re.fullmatch(ascii_classes(pattern), text)) == bool(re.fullmatch(pattern, text, re.ASCII))


def test_schema_patterns_are_rewritten_and_values_are_not():
    schema = {
        "type": "object",
        "properties": {"ip": {"type": "string", "pattern": IPV4}, "pattern": {"const": r"\d"}},
        "patternProperties": {r"^\w+$": {"type": "string", "pattern": r"\s"}},
    }
    out = ascii_schema(schema)
    assert out["properties"]["ip"]["pattern"] == ascii_classes(IPV4)
    assert out["properties"]["pattern"] == {"const": r"\d"}
    assert out["patternProperties"] == {"^[0-9A-Za-z_]+$": {"type": "string", "pattern": r"[\t\n\x0B\f\r ]"}}


@pytest.fixture(scope="module")
def compiler(tiny_qwen2_vl):
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2_vl)
    return tokenizer, GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def _accepts(compiler, spec: StructuredOutputs, text: str) -> bool:
    tokenizer, grammar = compiler
    matcher = grammar.matcher(spec)
    try:
        for token in tokenizer.encode(text, add_special_tokens=False):
            matcher.accept(token)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("digit", ["߁", "၅", "٣"])
def test_the_grammar_refuses_unicode_digits_in_a_regex_and_a_schema_pattern(compiler, digit):
    ip = StructuredOutputs(regex=IPV4)
    assert _accepts(compiler, ip, "192.168.0.1")
    assert not _accepts(compiler, ip, f"19{digit}.168.0.1")
    schema = {"type": "object", "properties": {"ip": {"type": "string", "pattern": f"^{IPV4}$"}}}
    spec = StructuredOutputs(json=json.dumps(schema))
    assert _accepts(compiler, spec, '{"ip":"10.0.0.1"}')
    assert not _accepts(compiler, spec, f'{{"ip":"1{digit}.0.0.1"}}')
