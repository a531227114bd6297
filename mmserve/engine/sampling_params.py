"""Per-request sampling parameters, shaped like vLLM's `SamplingParams`.

A msgspec Struct, so the same object travels from the API server to the engine process (msgpack) and is
validated again on arrival: no field-by-field copy at either boundary.
"""

from __future__ import annotations

import math

import msgspec


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

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax over the raw logits."""
        return self.temperature == 0 or self.top_k == 1

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
