"""The logprobs of one position as every boundary carries them (engine -> API server, prefill -> decode server,
the Python API): shared vocabulary below the engine, so wire formats never import it (nor torch: CLI start-up).
The engine computes them in mmserve.engine.logprobs."""

from __future__ import annotations

import msgspec


class TokenLogprobs(msgspec.Struct, array_like=True, frozen=True):
    """One position: the chosen token's logprob and rank (1 = most likely), and the top-k alternatives."""

    token_id: int
    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]
