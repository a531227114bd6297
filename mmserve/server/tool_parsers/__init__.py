"""Tool-call parsers (`--tool-call-parser`, vLLM's names): each model family's own way of writing calls in its
output, turned into OpenAI `tool_calls`, whole or streamed (mmserve.server.tool_parsers.base).

`PARSERS` is the one table; the CLI's choices read it. Without the flag a model gets its family's format
(`ModelFamily.tool_call_parser`) when its chat template renders tools itself; a template that renders none
gets the tools written into the prompt in the Hermes format (mmserve.server.tools), so its output is parsed
as hermes.
"""

from __future__ import annotations

from typing import Any

from mmserve.server.tool_parsers.base import ToolParser, finish_reason_for
from mmserve.server.tool_parsers.glm45 import Glm45Parser
from mmserve.server.tool_parsers.hermes import HermesParser
from mmserve.server.tool_parsers.mistral import MistralParser
from mmserve.server.tool_parsers.qwen3_coder import Qwen3CoderParser

PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "qwen3_coder": Qwen3CoderParser,
    "mistral": MistralParser,
    "glm45": Glm45Parser,
}


def check_tool_call_parser(name: str | None) -> None:
    """Raises ValueError unless `name` is None (the family's own) or a registered parser."""
    if name is not None and name not in PARSERS:
        raise ValueError(f"tool_call_parser must be one of {', '.join(sorted(PARSERS))}, not {name!r}")


def get_parser(name: str) -> type[ToolParser]:
    check_tool_call_parser(name)
    return PARSERS[name]


def resolve_tool_call_parser(flag: str | None, family: Any, template_renders_tools: bool) -> str:
    """The parser in effect: the flag's; else the family's own format when its template renders tools; else
    hermes, the format mmserve writes tools in for a template that knows none."""
    if flag is not None:
        check_tool_call_parser(flag)
        return flag
    return getattr(family, "tool_call_parser", "hermes") if template_renders_tools else "hermes"


__all__ = [
    "PARSERS",
    "ToolParser",
    "check_tool_call_parser",
    "finish_reason_for",
    "get_parser",
    "resolve_tool_call_parser",
]
