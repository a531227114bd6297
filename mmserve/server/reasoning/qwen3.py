"""vLLM's `qwen3` parser: Qwen3 / Qwen3-VL-Thinking / Qwen3.5 / Qwen3.6.

Qwen3.5's template puts `<think>\\n` in the prompt (thinking is the default) and `<think>\\n\\n</think>\\n\\n`
with `enable_thinking: false`; Qwen3 up to the 2507 release lets the model write `<think>` itself. Both
read the same way: reasoning up to `</think>`, a leading `<think>` dropped, and no `</think>` at all means
the output was cut inside the reasoning, unless the request turned thinking off. Qwen3.5 may open a
`<tool_call>` without closing its reasoning first: that ends the reasoning too, and the call stays in the
content for the tool parser (vLLM's implicit end).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mmserve.server.reasoning.base import Phase, ReasoningParser

TOOL_CALL = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    implicit_end_tags = (TOOL_CALL,)

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        vocab = tokenizer.get_vocab()
        self.tool_call_id = vocab.get(TOOL_CALL)
        self.tool_call_end_id = vocab.get(TOOL_CALL_END)

    def reasoning_ended(self, prompt_ids: Sequence[int]) -> bool:
        """As vLLM's: the last think tag closes the block, or an unclosed `<tool_call>` comes after it (a
        closed one is an example in the tools section or an earlier turn's call)."""
        closed_after = False
        for token in reversed(prompt_ids):
            if token == self.start_id:
                return False
            if token == self.end_id:
                return True
            if token == self.tool_call_end_id:
                closed_after = True
            elif token == self.tool_call_id and self.tool_call_id is not None and not closed_after:
                return True
        return False

    def first_phase(self, prompt_ids: Sequence[int], template_kwargs: dict[str, Any] | None) -> Phase:
        # `enable_thinking: false` with a template that writes no empty think block: all of it is content.
        if (template_kwargs or {}).get("enable_thinking", True) is False:
            return Phase.CONTENT
        return super().first_phase(prompt_ids, template_kwargs)
