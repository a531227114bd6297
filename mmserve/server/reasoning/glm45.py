"""vLLM's `glm45` parser: GLM-4.5 / GLM-4.5V / GLM-4.1V-Thinking.

The model writes `<think>` itself: output that starts with other text is all content (thinking off, or a
template that closed the block). GLM's template writes `<think></think>` after every earlier assistant turn,
so the prompt's reasoning ended only if `</think>` comes after the last `<|assistant|>`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mmserve.server.reasoning.base import ReasoningParser

ASSISTANT = "<|assistant|>"


class Glm45ReasoningParser(ReasoningParser):
    name = "glm45"
    text_first_is_reasoning = False
    end_tags_at_start = False

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self.assistant_id = tokenizer.get_vocab().get(ASSISTANT)

    def reasoning_ended(self, prompt_ids: Sequence[int]) -> bool:
        for token in reversed(prompt_ids):
            if token == self.end_id:
                return True
            if token == self.assistant_id:
                return False
        return False

    def reasoning_open(self, prompt_ids: Sequence[int]) -> bool:
        """A template that opens the block after the last `<|assistant|>`."""
        for token in reversed(prompt_ids):
            if token in (self.start_id, self.end_id, self.assistant_id):
                return token == self.start_id
        return False
