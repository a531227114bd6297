"""What the engine needs from a prefix cache (`PrefixCache`, its `MatchResult`) and the cache that caches nothing
(`NoPrefixCache`: `--disable-prefix-cache`, a decode server). `RadixCache` (radix_cache.py) is the real one and
documents each method's contract."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from mmserve.engine.cache.state_pool import StatePool


@dataclass
class MatchResult:
    """The longest usable cached prefix of a query; slots and state are owned by the cache, not the caller."""

    slots: torch.Tensor  # int64 slots of the prefix, one per matched token
    handle: object  # opaque; pass to lock/unlock
    # state-checkpoint trees: the slot of the state after the prefix (None: the empty state)
    state: int | None = None
    # window trees: the window slot of every matched token, -1 where the row was freed
    window_slots: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.slots.numel()


class PrefixCache(Protocol):
    """What the engine needs from a prefix cache; `RadixCache` documents each method's contract."""

    keeps_states: bool

    def match(self, tokens: Sequence[int]) -> MatchResult: ...
    def cached_len(self, tokens: Sequence[int]) -> int: ...
    def lock(self, handle: object) -> None: ...
    def unlock(self, handle: object) -> None: ...
    def insert(
        self,
        tokens: Sequence[int],
        slots: torch.Tensor,
        state: int | None = None,
        window_slots: torch.Tensor | None = None,
    ) -> int: ...
    def evict(self, num_tokens: int) -> int: ...
    def evict_states(self, num_states: int) -> int: ...
    def evict_window(self, num_rows: int) -> int: ...
    @property
    def total_tokens(self) -> int: ...
    @property
    def evictable_tokens(self) -> int: ...
    @property
    def num_states(self) -> int: ...
    @property
    def window_rows(self) -> int: ...
    def reset(self) -> None: ...
    def check_integrity(self) -> None: ...


def empty_slots() -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64)


def cat_slots(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts) if parts else empty_slots()


class NoPrefixCache:
    """A `PrefixCache` that caches nothing (`--disable-prefix-cache`; a decode server). A state it is handed
    is freed at once."""

    def __init__(self, states: StatePool | None = None) -> None:
        self.states = states
        self.keeps_states = states is not None

    def match(self, tokens: Sequence[int]) -> MatchResult:
        """Always the empty prefix. Mutates nothing."""
        return MatchResult(slots=empty_slots(), handle=None, window_slots=empty_slots())

    def cached_len(self, tokens: Sequence[int]) -> int:
        return 0

    def lock(self, handle: object) -> None:
        """No-op."""

    def unlock(self, handle: object) -> None:
        """No-op."""

    def insert(
        self,
        tokens: Sequence[int],
        slots: torch.Tensor,
        state: int | None = None,
        window_slots: torch.Tensor | None = None,
    ) -> int:
        """Stores nothing and takes no slot references; frees `state`; returns 0."""
        if state is not None:
            self.states.free(state)
        return 0

    def evict(self, num_tokens: int) -> int:
        """Nothing to evict; returns 0."""
        return 0

    def evict_states(self, num_states: int) -> int:
        return 0

    def evict_window(self, num_rows: int) -> int:
        return 0

    @property
    def total_tokens(self) -> int:
        return 0

    @property
    def evictable_tokens(self) -> int:
        return 0

    @property
    def num_states(self) -> int:
        return 0

    @property
    def window_rows(self) -> int:
        return 0

    def reset(self) -> None:
        """No-op."""

    def check_integrity(self) -> None:
        """Nothing to check."""
