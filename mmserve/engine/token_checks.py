"""The token ids an engine accepts, checked before a request joins a batch: one bad id would otherwise fail
the whole step, every co-batched request with it (mmserve.engine.engine.Engine.add_request, and the decode
side of a P/D handoff)."""

from __future__ import annotations

from collections.abc import Container

from mmserve.sampling_params import SamplingParams


def check_prompt_ids(prompt_token_ids: list[int], vocab: int, placeholder_ids: Container[int]) -> None:
    """Every prompt id must index the embedding: one outside it (negative, past the vocabulary, or a media
    pad value, which would also key the prefix cache as another user's image), like an empty prompt, fails
    the whole batch the request would join. Ids past the tokenizer but inside the embedding are valid, and so
    is a family's placeholder past the embedding (`expand` replaces it by its item's rows)."""
    if not prompt_token_ids:  # nothing to prefill: the step would fail on it
        raise ValueError("prompt is empty")
    if min(prompt_token_ids) >= 0 and max(prompt_token_ids) < vocab:
        return  # the common case, checked in C
    bad = next((t for t in prompt_token_ids if not (0 <= t < vocab or t in placeholder_ids)), None)
    if bad is not None:
        raise ValueError(f"prompt: token id {bad} is outside the vocabulary [0, {vocab})")


def check_token_params(params: SamplingParams, vocab: int) -> None:
    """ValueError for a token id of `params` outside the vocabulary (the sampler would fail the batch)."""
    for name, ids in (("logit_bias", params.logit_bias), ("stop_token_ids", params.stop_token_ids)):
        bad = [t for t in ids if t >= vocab]
        if bad:
            raise ValueError(f"{name}: token id {bad[0]} is outside the vocabulary [0, {vocab})")
