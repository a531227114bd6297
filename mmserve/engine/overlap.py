"""Encode-prefill overlap: a request's prompt is prefilled in stages while its media encode.

The first stage is its text before the first item; as items arrive in order, each next stage extends the
prompt up to the next item still missing, with the items before it. A stage is an internal request
(`text_prefill_id`, `prefill_only`) that samples nothing and ends once its KV is in the prefix cache; the
next stage matches everything earlier ones computed (hash-derived pad values for the items) and computes
only the new part. One stage runs at a time: a newer one waits (replacing an older waiting one) and starts
when the running one ends. The request itself, added with all its items, is held behind a running stage
(Engine.add_request) and reuses it: the same KV as computing it in one go, since positions before an item
depend on no later item. What the stages computed is its own work, not a prefix-cache hit
(`Request.own_prefill_tokens`).

Owned by the Engine, which it sees only through `StageHost` (what it calls of it); single-threaded (the engine
loop).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from mmserve.engine.cache_salt import prefix_key
from mmserve.engine.request import TEXT_PREFILL_SUFFIX, Request, choice_id, text_prefill_id
from mmserve.models.family import EmbeddingMismatch
from mmserve.multimodal.errors import MediaError
from mmserve.multimodal.items import ItemEmbedding
from mmserve.sampling_params import SamplingParams

MIN_OVERLAP_TOKENS = 16  # shorter text before the first item is not worth an extra request


@dataclass(frozen=True)
class Stage:
    """A request's prompt up to its first item not encoded yet, with the items before it."""

    prompt: list[int]
    items: list[ItemEmbedding]
    cache_salt: str | None


class StageHost(Protocol):
    """What the stages need of their engine."""

    requests: dict[str, Request]
    placeholder_ids: frozenset[int]  # the family's placeholder tokens: where items start in a prompt

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        items: list[ItemEmbedding],
        cache_salt: str | None = None,
        handoff=None,
        prefill_only: bool = False,
    ) -> Request: ...
    def abort(self, request_id: str, reason: str = "abort") -> None: ...
    def prefix_cached_len(self, tokens: list[int]) -> int | None: ...  # None: no prefix cache
    def end_stage(self, text: Request) -> None: ...  # a stage's prompt is cached: it leaves the engine


class OverlapStages:
    def __init__(self, engine: StageHost) -> None:
        self.engine = engine
        # request id -> prompt tokens its finished stages computed, until the request is added
        self.prefilled: dict[str, int] = {}
        self.waiting: dict[str, Stage] = {}  # request id -> its next stage, until the running one ends
        self.stages = 0  # stages run to the end, and the prompt tokens they computed (metrics)
        self.tokens = 0

    def prefill_before(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        items: Sequence[ItemEmbedding] = (),
        cache_salt: str | None = None,
    ) -> bool:
        """Prefill the request's prompt up to its first item not in `items` (its first items in prompt
        order: those ready). Returns whether a stage was started or is waiting: not for a short text, an
        already cached one, a request already added, or without a prefix cache."""
        engine = self.engine
        starts = [i for i, t in enumerate(prompt_token_ids) if t in engine.placeholder_ids]
        added = request_id in engine.requests or choice_id(request_id, 0) in engine.requests
        if len(items) >= len(starts) or engine.prefix_cached_len([]) is None or added:
            return False
        cut = starts[len(items)]
        text = prompt_token_ids[:cut]
        if not items and (
            cut < MIN_OVERLAP_TOKENS or engine.prefix_cached_len(prefix_key(text, cache_salt)) >= cut - 1
        ):
            return False
        stage = Stage(text, list(items), cache_salt)
        if text_prefill_id(request_id) in engine.requests:  # a stage runs: this one follows it
            self.waiting[request_id] = stage
            return True
        return self._start(request_id, stage)

    def _start(self, request_id: str, stage: Stage) -> bool:
        params = SamplingParams(temperature=0, max_tokens=1)
        try:
            rid = text_prefill_id(request_id)
            text = self.engine.add_request(
                rid, stage.prompt, params, stage.items, stage.cache_salt, prefill_only=True
            )
        except (ValueError, MediaError, EmbeddingMismatch):  # the request itself will say so when it is added
            return False
        text.own_prefill_tokens = self.prefilled.get(request_id, 0)  # earlier stages' work is no cache hit
        return True

    def claim(self, request_id: str) -> int:
        """The request is being added with all its items: the tokens its finished stages computed (a stage
        still waiting is moot)."""
        self.waiting.pop(request_id, None)
        return self.prefilled.pop(request_id, 0)

    def drop(self, request_id: str, reason: str = "abort") -> None:
        """The request will not be added (it failed before admission, or was aborted): end its running
        stage and forget a waiting one; what they computed stays in the prefix cache."""
        self.waiting.pop(request_id, None)
        self.engine.abort(text_prefill_id(request_id), reason)
        self.prefilled.pop(request_id, None)

    def aborted(self, stage_id: str) -> None:
        """A running stage ended without its KV (its batch failed, or dropped): no stage follows it; the
        request computes the rest itself."""
        self.waiting.pop(stage_id.removesuffix(TEXT_PREFILL_SUFFIX), None)

    def finished(self, text: Request) -> None:
        """A stage's prompt is in the prefix cache: credit its owner, and start the stage that waits."""
        engine = self.engine
        engine.end_stage(text)
        owner_id = text.request_id.removesuffix(TEXT_PREFILL_SUFFIX)
        computed = max(0, text.prompt_len - text.num_cached_tokens - text.own_prefill_tokens)
        self.stages += 1
        self.tokens += computed
        owner = engine.requests.get(owner_id) or engine.requests.get(
            choice_id(owner_id, 0)
        )  # n > 1: choice 0
        if owner is not None:  # added already, held until now
            owner.own_prefill_tokens += computed
            return
        self.prefilled[owner_id] = self.prefilled.get(owner_id, 0) + computed
        if (stage := self.waiting.pop(owner_id, None)) is not None:  # more items arrived meanwhile
            self._start(owner_id, stage)
