"""What every reasoning parser shares: the think tags, where the prompt leaves the model, and the stream that
splits a choice's output text into reasoning and content.

A `ReasoningParser` (one per server, `--reasoning-parser`) knows the model's tags and their token ids. Each
choice of a chat answer gets a `ReasoningStream` from it; the stream takes the output text as it comes
(`feed`, then `finish`) and returns (reasoning delta, content delta) pairs. `split(text)` is a fresh stream
fed once, so a streamed answer and a whole one agree whatever the chunking. The stream is a state machine:

| phase     | its text is | it leaves on                                                                   |
|-----------|-------------|--------------------------------------------------------------------------------|
| START     | held        | `<think>` after nothing but whitespace: REASONING (the whitespace dropped);    |
|           |             | an end tag: CONTENT; other text: REASONING (`text_first_is_reasoning`) or      |
|           |             | CONTENT                                                                        |
| REASONING | reasoning   | the end tag (dropped) or an implicit end (kept in the content: qwen3's         |
|           |             | `<tool_call>`): CONTENT; a stray `<think>` is dropped                          |
| CONTENT   | content     | never                                                                          |

So `reasoning + content` is the output text without the think tags that delimit the block (and without
whitespace before a leading `<think>`, as vLLM drops it). A tag split across deltas is held back until it is
complete or cannot be one. Where vLLM's own streamed and whole results differ (text before a `<think>` that
is not at the start, an unclosed `<think>` under glm45), the stream follows vLLM's streamed behaviour; empty
reasoning or content is None.

The first phase comes from the prompt (`first_phase`): a prompt whose last think tag closes the block (a
template with thinking off writes `<think>\\n\\n</think>\\n\\n`) starts in CONTENT, as vLLM's
`prompt_is_reasoning_end`; one whose last tag opens it (Qwen3.5's `<think>\\n`) in REASONING; else START.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any, ClassVar

import msgspec

from mmserve.sampling_params import SamplingParams


class Phase(enum.Enum):
    START = "start"
    REASONING = "reasoning"
    CONTENT = "content"


class ReasoningParser:
    """A model family's think tags. Subclasses set the class variables and may refine `reasoning_ended`."""

    name: ClassVar[str]
    start_tag: ClassVar[str] = "<think>"
    end_tag: ClassVar[str] = "</think>"
    implicit_end_tags: ClassVar[tuple[str, ...]] = ()  # end the reasoning and start the content (kept)
    text_first_is_reasoning: ClassVar[bool] = True  # START: text before any tag is reasoning, else content
    end_tags_at_start: ClassVar[bool] = True  # START: an end tag (or implicit end) ends an untagged block

    def __init__(self, tokenizer: Any) -> None:
        vocab = tokenizer.get_vocab()
        missing = [tag for tag in (self.start_tag, self.end_tag) if tag not in vocab]
        if missing:  # vLLM refuses such a tokenizer too: the tags must be tokens for the engine to see them
            raise ValueError(
                f"--reasoning-parser {self.name}: the tokenizer has no token {' or '.join(missing)}"
            )
        self.tokenizer = tokenizer
        self.start_id: int = vocab[self.start_tag]
        self.end_id: int = vocab[self.end_tag]
        self.implicit_end_ids = {tag: vocab[tag] for tag in self.implicit_end_tags if tag in vocab}

    @property
    def end_token_ids(self) -> tuple[int, ...]:
        """The tokens that end the reasoning in the engine's eyes (`StructuredOutputs.after`)."""
        return (self.end_id,)

    def reasoning_ended(self, prompt_ids: Sequence[int]) -> bool:
        """vLLM's `is_reasoning_end` on the prompt: its last think tag is the end tag."""
        for token in reversed(prompt_ids):
            if token == self.start_id:
                return False
            if token == self.end_id:
                return True
        return False

    def reasoning_open(self, prompt_ids: Sequence[int]) -> bool:
        """The prompt's last think tag opens the block: the model continues inside it."""
        for token in reversed(prompt_ids):
            if token in (self.start_id, self.end_id):
                return token == self.start_id
        return False

    def first_phase(self, prompt_ids: Sequence[int], template_kwargs: dict[str, Any] | None) -> Phase:
        if self.reasoning_ended(prompt_ids):
            return Phase.CONTENT
        return Phase.REASONING if self.reasoning_open(prompt_ids) else Phase.START

    def stream(
        self,
        prompt_ids: Sequence[int],
        template_kwargs: dict[str, Any] | None = None,
        implicit_ends: bool = True,
    ) -> ReasoningStream:
        """A fresh stream for one choice whose prompt is `prompt_ids`, rendered with `template_kwargs`.
        `implicit_ends=False` for a constrained output: the engine starts the constraint at the end tag only
        (`constrain`), so only the end tag ends the reasoning and the content is what the constraint made."""
        implicit = self.implicit_end_tags if implicit_ends else ()
        return ReasoningStream(self, self.first_phase(prompt_ids, template_kwargs), implicit)

    def constrain(
        self, params: SamplingParams, prompt_ids: Sequence[int], template_kwargs: dict[str, Any] | None
    ) -> SamplingParams:
        """`params` with its output constraint (if any) deferred past the reasoning: the grammar applies to
        the answer only (vLLM's structured outputs skip the reasoning the same way)."""
        structured = params.structured
        if structured is None or self.first_phase(prompt_ids, template_kwargs) is Phase.CONTENT:
            return params
        deferred = msgspec.structs.replace(structured, after=self.end_token_ids)
        return msgspec.structs.replace(params, structured=deferred)

    def is_whitespace_token(self, token: int) -> bool:
        return not self.tokenizer.decode([token]).strip()


class ReasoningStream:
    """One choice's split into reasoning and content. Text and token ids are fed separately (`feed` /
    `add_tokens`); both walk the same phases, the ids to count `reasoning_tokens`. Not thread-safe."""

    def __init__(
        self, parser: ReasoningParser, phase: Phase, implicit_end_tags: tuple[str, ...] = ()
    ) -> None:
        self.parser = parser
        self.phase = phase
        implicit_ids = (parser.implicit_end_ids[t] for t in implicit_end_tags if t in parser.implicit_end_ids)
        self._end_ids = frozenset({parser.end_id, *implicit_ids})
        ends = (parser.end_tag, *implicit_end_tags)
        self._start_tags = (parser.start_tag, *ends) if parser.end_tags_at_start else (parser.start_tag,)
        self._reasoning_tags = (*ends, parser.start_tag)
        self._held = ""  # text not yet assigned (a tag's beginning, whitespace before a possible `<think>`)
        self._token_phase = phase
        self._counted = 0  # reasoning tokens so far (think tags are not reasoning, as in vLLM)
        self._pending = 0  # START: whitespace tokens that are reasoning unless a `<think>` follows

    def split(self, text: str) -> tuple[str | None, str | None]:
        """The whole output text as (reasoning, content); a fresh stream only."""
        reasoning, content = self.feed(text)
        more_reasoning, more_content = self.finish()
        return (reasoning + more_reasoning) or None, (content + more_content) or None

    def feed(self, text: str) -> tuple[str, str]:
        """The (reasoning, content) text that `text` releases."""
        self._held += text
        return self._run(final=False)

    def finish(self) -> tuple[str, str]:
        """What is still held back, at the end of the output."""
        return self._run(final=True)

    @property
    def reasoning_tokens(self) -> int:
        """Output tokens in the reasoning (vLLM's `count_reasoning_tokens`: the think tags not counted)."""
        started = self._token_phase is Phase.START and self.parser.text_first_is_reasoning
        return self._counted + (self._pending if started else 0)

    def add_tokens(self, token_ids: Sequence[int]) -> None:
        """Count the reasoning among the next output tokens (the same phases as the text, by token id)."""
        p = self.parser
        for token in token_ids:
            ends = token in self._end_ids
            if self._token_phase is Phase.CONTENT:
                return
            if token == p.start_id:
                self._token_phase, self._pending = Phase.REASONING, 0
            elif self._token_phase is Phase.REASONING:
                if ends:
                    self._token_phase = Phase.CONTENT
                else:
                    self._counted += 1
            elif ends and p.end_tags_at_start:  # START: the whitespace before it was the reasoning
                self._counted += self._pending
                self._token_phase = Phase.CONTENT
            elif p.is_whitespace_token(token):
                self._pending += 1
            elif p.text_first_is_reasoning:
                self._counted += self._pending + 1
                self._token_phase, self._pending = Phase.REASONING, 0
            else:
                self._token_phase = Phase.CONTENT

    def _run(self, final: bool) -> tuple[str, str]:
        p = self.parser
        reasoning: list[str] = []
        content: list[str] = []
        text = self._held
        while True:
            if self.phase is Phase.CONTENT:
                content.append(text)
                text = ""
                break
            if self.phase is Phase.START:
                tags = self._start_tags
                tag, at = _first_tag(text, tags)
                lead = text if tag is None else text[:at]
                if tag is None and (not lead.strip() or (not final and _could_start(lead.lstrip(), tags))):
                    if final:  # nothing but whitespace ever came
                        (reasoning if p.text_first_is_reasoning else content).append(text)
                        text = ""
                    break
                if tag is None or lead.strip():  # the output starts with text, not a tag
                    self.phase = Phase.REASONING if p.text_first_is_reasoning else Phase.CONTENT
                    continue
                if tag == p.start_tag:
                    text, self.phase = text[at + len(tag) :], Phase.REASONING
                else:  # an end: what came before it (whitespace) was the reasoning
                    reasoning.append(lead)
                    text = text[at + len(tag) :] if tag == p.end_tag else text[at:]
                    self.phase = Phase.CONTENT
                continue
            tags = self._reasoning_tags
            tag, at = _first_tag(text, tags)
            if tag is None:
                keep = 0 if final else _partial_tag_len(text, tags)
                reasoning.append(text[: len(text) - keep])
                text = text[len(text) - keep :]
                break
            reasoning.append(text[:at])
            if tag == p.start_tag:  # a stray opening tag inside the reasoning
                text = text[at + len(tag) :]
            elif tag == p.end_tag:
                text, self.phase = text[at + len(tag) :], Phase.CONTENT
            else:  # an implicit end belongs to the content (the tool parser reads it)
                text, self.phase = text[at:], Phase.CONTENT
        self._held = text
        return "".join(reasoning), "".join(content)


def _first_tag(text: str, tags: tuple[str, ...]) -> tuple[str | None, int]:
    found = [(text.find(tag), tag) for tag in tags if tag in text]
    if not found:
        return None, -1
    at, tag = min(found)
    return tag, at


def _could_start(text: str, tags: tuple[str, ...]) -> bool:
    return any(tag.startswith(text) for tag in tags)


def _partial_tag_len(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that begins one of `tags` (held back: it may complete one)."""
    best = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:k]):
                best = k
                break
    return best
