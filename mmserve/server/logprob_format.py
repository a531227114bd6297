"""Engine logprobs (mmserve.engine.logprobs.TokenLogprobs) in the two shapes the OpenAI API answers with.

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`. Completions: parallel lists
`tokens`, `token_logprobs`, `top_logprobs` (a dict token -> logprob per position) and `text_offset`. A token's
string is its own decoding (a byte-level token that is part of a character decodes to U+FFFD, as in vLLM).
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

from mmserve.logprobs import TokenLogprobs

_FLOOR = -9999.0  # JSON has no -inf: a masked token's logprob is reported as vLLM does


def _finite(value: float) -> float:
    return value if math.isfinite(value) else _FLOOR


class TokenStrings:
    """Token id -> its decoded string, cached (the same ids recur on every step)."""

    def __init__(self, tokenizer: Any) -> None:
        self._decode = lru_cache(maxsize=65536)(lambda t: tokenizer.decode([t]))

    def __call__(self, token_id: int) -> str:
        return self._decode(token_id)


def token_id_strings(token_id: int) -> str:
    """vLLM's `return_tokens_as_token_ids`: a token named by its id, whatever its bytes."""
    return f"token_id:{token_id}"


def chat_logprobs(strings: TokenStrings, entries: list[TokenLogprobs]) -> dict[str, Any]:
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = strings(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}

    content = []
    for e in entries:
        entry = item(e.token_id, e.logprob)
        entry["top_logprobs"] = [item(t, lp) for t, lp in zip(e.top_ids, e.top_logprobs, strict=True)]
        content.append(entry)
    return {"content": content}


def completion_logprobs(
    strings: TokenStrings, entries: list[TokenLogprobs | None], token_ids: list[int], offset: int = 0
) -> dict[str, Any]:
    """`entries[i]` describes `token_ids[i]` (None: no logprob, e.g. the first prompt token when echoed);
    `offset` is where the first token's text starts in the choice's text."""
    tokens, logprobs, tops, offsets = [], [], [], []
    for token_id, e in zip(token_ids, entries, strict=True):
        text = strings(token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if e is None:
            logprobs.append(None)
            tops.append(None)
            continue
        logprobs.append(_finite(e.logprob))
        top = {strings(t): _finite(lp) for t, lp in zip(e.top_ids, e.top_logprobs, strict=True)}
        # OpenAI's completions include the sampled token among the alternatives
        top.setdefault(text, _finite(e.logprob))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}
