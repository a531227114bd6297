"""Structured outputs (mmserve.engine.grammar): random-logit generation under every kind of constraint.

Each loop samples argmax of seeded random logits after `apply_grammar_masks`, so the output is a random walk
through the constraint; whatever it produces must satisfy it. Loops are bounded: strings carry maxLength and
arrays maxItems so every walk here ends well within MAX_STEPS (the longest takes ~130 tokens). With random
logits a walk only ends where the constraint bounds it: unbounded integers/numbers end here only because the
tiny vocabulary has few digit tokens (with a 151k vocabulary they do not), and `json_object`'s keys are
unbounded strings, so its walk gets a bias towards closing characters.
"""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from mmserve.engine.grammar import GrammarCompiler, apply_grammar_masks, tool_call_grammar
from mmserve.sampling_params import StructuredOutputs

MAX_STEPS = 400
PAD = 40  # logits wider than the tokenizer, like a padded lm_head


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen2_vl):
    return AutoTokenizer.from_pretrained(tiny_qwen2_vl)


@pytest.fixture(scope="module")
def eos_ids(tokenizer) -> list[int]:
    return [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|endoftext|>")]


@pytest.fixture(scope="module")
def compiler(tokenizer, eos_ids) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, len(tokenizer) + PAD, eos_ids)


def generate(compiler, tokenizer, eos_ids, specs, seed=0, bias=None, eos_only_at_end=True, free_row=True):
    """Random walks for all `specs` as one batch; checks the mask invariants at every step and returns the
    decoded outputs (EOS not included). `free_row` adds an unconstrained row that must stay untouched.
    `eos_only_at_end`: EOS is allowed only once terminated (false for constraints that a complete output may
    still extend, such as `a+`)."""
    matchers = [compiler.matcher(s) for s in specs]
    outputs: list[list[int]] = [[] for _ in specs]
    done = [False] * len(specs)
    gen = torch.Generator().manual_seed(seed)
    other_special = [t for t in tokenizer.all_special_ids if t not in eos_ids]
    for _ in range(MAX_STEPS):
        active = [i for i in range(len(specs)) if not done[i]]
        if not active:
            break
        logits = torch.randn(len(active) + free_row, compiler.vocab_size, generator=gen)
        if bias is not None:
            logits += bias
        unmasked = logits.clone()
        apply_grammar_masks(logits, [matchers[i] for i in active] + [None] * free_row)
        if free_row:
            assert torch.equal(logits[-1], unmasked[-1]), "a row without a matcher was masked"
        allowed = torch.isfinite(logits[: len(active)])
        assert not allowed[:, len(tokenizer) :].any(), "an id past the tokenizer was allowed"
        assert not allowed[:, other_special].any(), "a special token other than EOS was allowed"
        for row, i in enumerate(active):
            allowed_ids = set(allowed[row].nonzero().flatten().tolist())
            if matchers[i].terminated:
                assert allowed_ids == set(eos_ids)
            elif eos_only_at_end:
                assert not allowed_ids & set(eos_ids)
            token = int(logits[row].argmax())
            matchers[i].accept(token)
            if token in eos_ids:
                assert matchers[i].terminated
                done[i] = True
            else:
                outputs[i].append(token)
    assert all(done), (
        f"walks did not end within {MAX_STEPS} steps: {[i for i, d in enumerate(done) if not d]}"
    )
    return [tokenizer.decode(ids) for ids in outputs]


def assert_compact(text: str) -> None:
    outside_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
    assert not re.search(r"\s", outside_strings), text


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    kinds = ["string", "integer", "number", "boolean", "enum", "null"]
    if depth < 3:
        kinds += ["object", "object", "array"]
    kind = "object" if depth == 0 else rng.choice(kinds)
    if kind == "object":
        names = rng.sample(
            ["id", "name", "tags", "kind", "score", "a b", 'q"x', "ünï", "nested"], rng.randint(1, 4)
        )
        return {
            "type": "object",
            "properties": {n: random_schema(rng, depth + 1) for n in names},
            "required": [n for n in names if rng.random() < 0.6],
            "additionalProperties": False,
        }
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "maxItems": rng.randint(0, 3)}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(0, 8)}
    if kind == "enum":
        return {
            "enum": rng.sample(["red", "green", 'say "hi"', "a\\b", 7, 2.5, None, True], rng.randint(1, 4))
        }
    if kind == "integer" and rng.random() < 0.5:
        return {"type": "integer", "minimum": -5, "maximum": 300}
    return {"type": kind}


def test_random_json_schemas(compiler, tokenizer, eos_ids):
    rng = random.Random(0)
    schemas = [random_schema(rng) for _ in range(20)]
    specs = [StructuredOutputs(json=json.dumps(s)) for s in schemas]
    for seed in range(2):
        for schema, text in zip(
            schemas, generate(compiler, tokenizer, eos_ids, specs, seed=seed), strict=True
        ):
            assert_compact(text)
            jsonschema.validate(json.loads(text), schema)


def test_json_object(compiler, tokenizer, eos_ids):
    # Keys are unbounded strings: bias the walk towards characters that close strings and objects.
    bias = torch.zeros(compiler.vocab_size)
    for char in ('"', "}", "]"):
        bias[tokenizer.convert_tokens_to_ids(char)] = 3.0
    specs = [StructuredOutputs(json_object=True)] * 6
    for text in generate(compiler, tokenizer, eos_ids, specs, seed=1, bias=bias):
        assert isinstance(json.loads(text), dict)
        assert_compact(text)


def test_regex(compiler, tokenizer, eos_ids):
    pattern = r"(yes|no)-[0-9]{2,4}-[a-z]{1,5}"
    specs = [StructuredOutputs(regex=pattern)] * 8
    texts = generate(compiler, tokenizer, eos_ids, specs, eos_only_at_end=False)
    assert all(re.fullmatch(pattern, t) for t in texts), texts


def test_choice(compiler, tokenizer, eos_ids):
    choices = ("red", "a b", 'say "hi"', "back\\slash", "two\nlines", "ünïcode")
    specs = [StructuredOutputs(choice=choices)] * 12
    texts = generate(compiler, tokenizer, eos_ids, specs, seed=2, free_row=False)  # every row masked
    assert set(texts) <= set(choices) and len(set(texts)) > 1, texts


WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ODD = {
    "type": "object",
    "properties": {"q": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
    "additionalProperties": False,
}
NOOP = {"type": "object", "properties": {}, "additionalProperties": False}
TOOLS = [("get_weather", WEATHER), ('we"ird.na|me*(x){1}\\n', ODD), ("noop", NOOP)]
BLOCK = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.S)


def check_tool_calls(text: str, tools) -> list[str]:
    blocks = BLOCK.findall(text)
    assert "\n".join(f"<tool_call>\n{b}\n</tool_call>" for b in blocks) == text
    schemas = dict(tools)
    for block in blocks:
        assert block.startswith('{"name": "')  # Qwen's format: json.dumps separators
        call = json.loads(block)
        assert set(call) == {"name", "arguments"}
        jsonschema.validate(call["arguments"], schemas[call["name"]])
    return [json.loads(b)["name"] for b in blocks]


def test_tool_call_exactly_one(compiler, tokenizer, eos_ids):
    for tools in ([TOOLS[0]], [TOOLS[1]]):
        spec = StructuredOutputs(grammar=tool_call_grammar(tools, exactly_one=True))
        for text in generate(compiler, tokenizer, eos_ids, [spec] * 4, seed=3):
            assert check_tool_calls(text, tools) == [tools[0][0]]


def test_tool_call_required(compiler, tokenizer, eos_ids):
    spec = StructuredOutputs(grammar=tool_call_grammar(TOOLS, exactly_one=False))
    names = []
    for text in generate(compiler, tokenizer, eos_ids, [spec] * 10, seed=4, eos_only_at_end=False):
        names += check_tool_calls(text, TOOLS)
    assert len(names) > 10 and len(set(names)) == len(TOOLS), names  # several blocks, every tool


def test_forced_text_and_rejection(compiler, tokenizer, eos_ids):
    spec = StructuredOutputs(json=json.dumps(WEATHER))
    ok = tokenizer.encode('{"city":"Paris","unit":"celsius"}')
    matcher = compiler.matcher(spec)
    for token in ok:
        assert not matcher.terminated
        matcher.accept(token)
    assert matcher.terminated
    matcher.accept(eos_ids[1])
    fresh = compiler.matcher(spec)  # from the cache: its own state
    assert not fresh.terminated
    with pytest.raises(ValueError, match="not allowed"):
        fresh.accept(eos_ids[0])
    with pytest.raises(ValueError, match="not allowed"):
        compiler.matcher(spec).accept(tokenizer.encode(" ")[0])


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (StructuredOutputs(json='{"type": "objekt"}'), "invalid JSON schema"),
        (StructuredOutputs(json='{"properties": {"a": {"$ref": "#/nope"}}}'), "invalid JSON schema"),
        (StructuredOutputs(json="{not json"), "invalid JSON schema"),
        (StructuredOutputs(regex="(yes|no"), "invalid regex"),
        (StructuredOutputs(regex="a{3,1}"), "invalid regex"),
        (StructuredOutputs(grammar="start: undefined_rule"), "invalid grammar"),
    ],
)
def test_malformed_constraints(compiler, spec, message):
    with pytest.raises(ValueError, match=message):
        compiler.matcher(spec)


def test_gbnf_grammar_and_bad_batches(compiler, tokenizer, eos_ids):
    spec = StructuredOutputs(grammar='root ::= "on" | "off"')
    assert set(generate(compiler, tokenizer, eos_ids, [spec] * 6, seed=5)) <= {"on", "off"}
    with pytest.raises(ValueError, match="one matcher per logits row"):
        apply_grammar_masks(torch.zeros(2, compiler.vocab_size), [None])
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        GrammarCompiler(tokenizer, len(tokenizer) - 1, eos_ids)


def test_cpu_and_device_mask_paths_agree(compiler, tokenizer, eos_ids):
    """float32 on the CPU takes the numpy path, anything else (bfloat16 here, CUDA in serving) torch ops."""
    specs = [StructuredOutputs(json=json.dumps(WEATHER)), StructuredOutputs(regex="[a-z]+")]
    matchers = [compiler.matcher(s) for s in specs]
    matchers[0].accept(tokenizer.encode('{"')[0])
    wide = compiler.vocab_size + 7  # logits wider than the compiler's vocabulary: the extra ids are forbidden
    for batch in ([matchers[0], None, matchers[1]], matchers):
        logits = torch.randn(len(batch), wide, generator=torch.Generator().manual_seed(0))
        via_numpy, via_torch = logits.clone(), logits.to(torch.bfloat16)
        apply_grammar_masks(via_numpy, batch)
        apply_grammar_masks(via_torch, batch)
        assert torch.equal(torch.isinf(via_numpy), torch.isinf(via_torch))
        for row, matcher in enumerate(batch):
            finite = torch.isfinite(via_numpy[row])
            if matcher is None:
                assert finite.all()
            else:
                assert 0 < finite.sum() < len(tokenizer) and not finite[len(tokenizer) :].any()
