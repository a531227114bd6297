"""Results of the offline API (mmserve.llm), shaped like vLLM's `RequestOutput` / `CompletionOutput` / `Logprob`.

`ChoiceState` gathers one choice's tokens, text (its own incremental detokenizer: stop strings) and logprobs
from the engine's `StepOutput`s; `RequestOutput.of` assembles a finished request from its choices.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from mmserve.engine.detokenizer import IncrementalDetokenizer
from mmserve.logprobs import TokenLogprobs


@dataclass
class Logprob:
    """One candidate token at one position (vLLM's `Logprob`). rank 1 = the most likely token."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per position: token id -> Logprob, the sampled (or prompt) token first, then the top k.
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]  # None for the first token and for media rows


@dataclass
class CompletionOutput:
    """One choice (vLLM's `CompletionOutput`). `token_ids` include a final EOS / stop token id (vLLM's),
    `text` does not (unless `include_stop_str_in_output`); `stop_reason` is the stop string or the stop token
    id that ended it (None for EOS, length, abort)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # sum of the sampled tokens' logprobs, when logprobs were asked for
    logprobs: SampleLogprobs | None  # one dict per token of token_ids, when logprobs were asked for
    finish_reason: str | None = None  # "stop" / "length" / "abort" / "error"
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One prompt's result (vLLM's `RequestOutput`), its choices in `outputs` (n of them).

    `prompt_token_ids` are the prompt as the engine ran it: media placeholders expanded, each item's rows
    carrying its pad value (>= the vocabulary size). `text`, `token_ids` and `finish_reason` are those of
    `outputs[0]` (the shape of mmserve's earlier API). `metrics` in seconds: encode_s, queue_s, prefill_s (to
    the first token), decode_s, e2e_s.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] = field(repr=False)
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool = True
    metrics: dict[str, float] = field(default_factory=dict)
    num_cached_tokens: int = 0

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


class TokenText:
    """Decoded text of single token ids (Logprob.decoded_token), memoised for one call."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._known: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._known.get(token_id)
        if text is None:
            text = self._known[token_id] = self._tokenizer.decode([token_id])
        return text


def logprob_dict(lp: TokenLogprobs, decode: Callable[[int], str]) -> dict[int, Logprob]:
    """vLLM's shape of one position: the chosen token first, then the top k (ranks 1..k; the chosen token
    keeps its first place in the dict when it is among them)."""
    out = {lp.token_id: Logprob(lp.logprob, lp.rank, decode(lp.token_id))}
    for r, (tid, value) in enumerate(zip(lp.top_ids, lp.top_logprobs, strict=True), start=1):
        out[tid] = Logprob(value, r, decode(tid))
    return out


def prompt_logprob_dicts(entries: list[TokenLogprobs | None], decode: Callable[[int], str]) -> PromptLogprobs:
    return [None if lp is None else logprob_dict(lp, decode) for lp in entries]


class ChoiceState:
    """One choice of a running request: what the engine sampled for it, detokenized as it arrives.

    `take` consumes one StepOutput of this choice and returns True when the choice's stop string matched
    (the caller then ends the choice in the engine). Tokens after that are ignored.
    """

    def __init__(
        self, index: int, detok: IncrementalDetokenizer, include_stop_str: bool, with_logprobs: bool
    ):
        self.index = index
        self.detok = detok
        self.include_stop_str = include_stop_str
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] | None = [] if with_logprobs else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def take(
        self,
        token_id: int | None,
        logprobs: TokenLogprobs | None,
        finish_reason: str | None,
        stop_token: int | None,
        stopped_on_token: bool,
    ) -> bool:
        if self.done:
            return False
        if token_id is not None:
            self.token_ids.append(token_id)
            if self.logprobs is not None and logprobs is not None:
                self.logprobs.append(logprobs)
            # An EOS / stop token id ends the choice but is not part of its text (vLLM's rule).
            if not (finish_reason == "stop" and stopped_on_token) or self.include_stop_str:
                self.detok.add(token_id)
        if self.detok.stopped:
            self.finish_reason, self.stop_reason = "stop", self.detok.matched_stop
            return finish_reason is None  # still running in the engine: end it there
        if finish_reason is not None:
            self.finish(finish_reason, stop_token)
        return False

    def finish(self, finish_reason: str, stop_token: int | None = None) -> None:
        """The engine ended this choice (or failed its batch)."""
        if not self.done:
            self.detok.finish()
            self.finish_reason, self.stop_reason = finish_reason, stop_token

    def output(self, decode: Callable[[int], str]) -> CompletionOutput:
        logprobs = cumulative = None
        if self.logprobs is not None:
            logprobs = [logprob_dict(lp, decode) for lp in self.logprobs]
            cumulative = sum(lp.logprob for lp in self.logprobs)
        return CompletionOutput(
            self.index,
            self.detok.text,
            list(self.token_ids),
            cumulative,
            logprobs,
            self.finish_reason,
            self.stop_reason,
        )
