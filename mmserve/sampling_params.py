"""Per-request sampling parameters, shaped like vLLM's `SamplingParams`.

A msgspec Struct, so the same object travels from the API server to the engine process (msgpack) and is
validated again on arrival: no field-by-field copy at either boundary.
"""

from __future__ import annotations

import math

import msgspec

MAX_N = 16
MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit
MAX_REPETITION_PENALTY = 10.0
# Logits divided by a penalty near 0 overflow to inf (the fuzzer's 5e-324 made the sampler's probabilities NaN).
MIN_REPETITION_PENALTY = 0.01


class StructuredOutputs(msgspec.Struct, frozen=True, kw_only=True):
    """A constraint on the output (vLLM's `StructuredOutputsParams`): exactly one field is set.

    `json` is a JSON schema as text (`response_format` json_schema, `guided_json`), `json_object` any JSON
    object, `regex` / `choice` / `grammar` (mmserve.engine.grammar's syntax) as vLLM's guided_* extras.
    The engine compiles it with the tokenizer and masks the logits of the rows that carry one.

    `after` (a thinking model's end of reasoning, e.g. the id of `</think>`): the output is free until it
    contains these token ids, and the constraint applies from the next token on (vLLM's reasoning-aware
    structured outputs). Empty: from the first output token.
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    after: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise ValueError(f"structured outputs take exactly one constraint, got {kinds or 'none'}")
        if not all(_is_int(t) and t >= 0 for t in self.after):
            raise ValueError(f"structured outputs' `after` must be token ids, got {self.after!r}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("guided_choice must be a non-empty list of strings")


class SamplingParams(msgspec.Struct, kw_only=True):
    """How to pick tokens for one request and when to stop.

    Treat instances as immutable after construction; `stop` is normalised to a tuple of strings and
    `stop_token_ids` to a tuple of ints. Invalid values raise `ValueError` naming the parameter.
    `max_tokens=None` means "the rest of the context": the engine resolves it at admission.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 disables top-k
    min_p: float = 0.0
    seed: int | None = None
    # Accepts a string or a list too (normalised in __post_init__); declared as the normal form so that
    # msgspec can decode it.
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    n: int = 1  # choices; the engine prefills the prompt once and forks (each choice's seed: seed + index)
    presence_penalty: float = 0.0  # [-2, 2], subtracted once from every token already generated
    frequency_penalty: float = 0.0  # [-2, 2], subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # > 0; HF / vLLM's: divides positive (multiplies negative) logits of
    # tokens in the prompt or output
    logit_bias: dict[int, float] = {}  # token id -> added to its logit, [-100, 100]
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens are out
    logprobs: int | None = None  # None: none; k >= 0: the sampled token's logprob and the top k
    prompt_logprobs: int | None = None  # None: none; k >= 0: each prompt token's logprob and the top k
    structured: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        self.stop = _normalise_stop(self.stop)
        self.stop_token_ids = _normalise_stop_token_ids(self.stop_token_ids)
        self.validate()

    def validate(self) -> None:
        """Raise `ValueError` if any parameter is out of range."""
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        _check_number("temperature", self.temperature)
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k}")
        _check_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _check_int("seed", self.seed)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise ValueError(f"stop_token_ids must be non-negative integers, got {t!r}")
        _check_int("n", self.n)
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(name, value)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        _check_number("repetition_penalty", self.repetition_penalty)
        if not (
            math.isfinite(self.repetition_penalty)
            and MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY
        ):
            raise ValueError(
                f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY}], "
                f"got {self.repetition_penalty}"
            )
        for token, bias in self.logit_bias.items():
            if not _is_int(token) or token < 0:
                raise ValueError(f"logit_bias keys must be non-negative token ids, got {token!r}")
            _check_number("logit_bias", bias)
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {token}")
        _check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value)
                if not 0 <= value <= MAX_LOGPROBS:
                    raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax over the (processed) logits."""
        return self.temperature == 0 or self.top_k == 1

    @property
    def penalised(self) -> bool:
        """True when the logits need the output/prompt token history (penalties)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def for_choice(self, index: int) -> SamplingParams:
        """The settings of choice `index` of an n > 1 request: one choice, its own seed stream."""
        seed = None if self.seed is None else self.seed + index
        return msgspec.structs.replace(self, n=1, seed=seed)

    def with_max_tokens(self, max_tokens: int) -> SamplingParams:
        """A copy with `max_tokens` set (the engine resolving None at admission)."""
        return msgspec.structs.replace(self, max_tokens=max_tokens)


def _is_int(value: object) -> bool:
    # bool is a subclass of int, but `seed=True` or `max_tokens=True` is a caller mistake.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: object) -> None:
    if not _is_int(value):
        raise ValueError(f"{name} must be an integer, got {value!r}")


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")


def _normalise_stop(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if not isinstance(stop, list | tuple):
        raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
    return tuple(stop)


def _normalise_stop_token_ids(ids: object) -> tuple[int, ...]:
    if ids is None:
        return ()
    if not isinstance(ids, list | tuple):
        raise ValueError(f"stop_token_ids must be a list of integers, got {ids!r}")
    return tuple(ids)
