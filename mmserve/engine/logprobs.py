"""Log-probabilities of sampled (and prompt) tokens, as OpenAI's `logprobs` and vLLM's `prompt_logprobs` report.

Computed from the processed logits (mmserve.engine.logits_processors: after the grammar mask, bias, min_tokens
and penalties; before temperature and the top-k / top-p / min-p filters), in float32, batched: one
log_softmax and one topk over the rows that asked.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from mmserve.logprobs import TokenLogprobs

if TYPE_CHECKING:
    import torch


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, ks: Sequence[int]) -> list[TokenLogprobs]:
    """Logprobs of `token_ids[i]` under row i of `logits` (R, V), with the top `ks[i]` of each row."""
    import torch

    if logits.shape[0] == 0:
        return []
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    # rank: 1 + how many tokens are strictly more likely (ties share the better rank, as vLLM's)
    ranks = (logp > chosen.unsqueeze(1)).sum(dim=1) + 1
    k_max = max(ks)
    top_vals, top_ids = torch.topk(logp, k_max, dim=-1) if k_max else (None, None)
    chosen_l, ranks_l, ids_l = chosen.tolist(), ranks.tolist(), token_ids.tolist()
    vals_l = top_vals.tolist() if k_max else None
    tids_l = top_ids.tolist() if k_max else None
    return [
        TokenLogprobs(
            ids_l[i], chosen_l[i], ranks_l[i], tids_l[i][:k] if k else [], vals_l[i][:k] if k else []
        )
        for i, k in enumerate(ks)
    ]
