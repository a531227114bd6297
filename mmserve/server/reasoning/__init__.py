"""Reasoning parsers (`--reasoning-parser`): a thinking model's output split into reasoning and content."""

from mmserve.server.reasoning.base import Phase, ReasoningParser, ReasoningStream
from mmserve.server.reasoning.registry import REASONING_PARSERS, reasoning_parser

__all__ = ["REASONING_PARSERS", "Phase", "ReasoningParser", "ReasoningStream", "reasoning_parser"]
