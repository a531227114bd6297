"""vLLM's `deepseek_r1` parser: DeepSeek-R1's template opens the think block in the prompt (older R1 builds
let the model write `<think>`), so everything before `</think>` is reasoning and a missing `</think>` means the
output ended inside the reasoning."""

from __future__ import annotations

from mmserve.server.reasoning.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
