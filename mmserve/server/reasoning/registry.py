"""The reasoning parsers by `--reasoning-parser` name (vLLM's names); the CLI's choices read this table."""

from __future__ import annotations

from typing import Any

from mmserve.server.reasoning.base import ReasoningParser
from mmserve.server.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from mmserve.server.reasoning.glm45 import Glm45ReasoningParser
from mmserve.server.reasoning.qwen3 import Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (DeepSeekR1ReasoningParser, Glm45ReasoningParser, Qwen3ReasoningParser)
}


def reasoning_parser(name: str, tokenizer: Any) -> ReasoningParser:
    """The parser `name` for `tokenizer`. ValueError for an unknown name or a tokenizer without the tags."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {', '.join(REASONING_PARSERS)}")
    return REASONING_PARSERS[name](tokenizer)
