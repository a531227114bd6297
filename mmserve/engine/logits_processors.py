"""What the sampler does to a batch's logits before it picks: grammar masks, logit bias, min_tokens, penalties.

Order (vLLM's): the structured-output mask, `logit_bias`, `min_tokens` (EOS and stop ids masked), then the
repetition, frequency and presence penalties. The result is "the logits the sampler used": logprobs are
computed from it (before temperature, top-k, top-p and min-p, which only choose among them).

Everything is vectorised over the batch: a row that needs no processing costs nothing, the rows that do are
handled by a few batched tensor ops (one scatter for all biases, one for all token histories).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mmserve.sampling_params import SamplingParams


@dataclass
class RowState:
    """What the processors need to know about one row besides its params."""

    params: SamplingParams
    prompt_ids: Sequence[int] | torch.Tensor  # expanded (pad values >= vocab are ignored); unique ids suffice
    output_ids: Sequence[int]
    matcher: object | None = None  # mmserve.engine.grammar.GrammarMatcher
    eos_token_ids: Sequence[int] = ()


def needs_processing(rows: Sequence[RowState]) -> bool:
    return any(_needs(r) for r in rows)


def _needs(r: RowState) -> bool:
    p = r.params
    return r.matcher is not None or bool(p.logit_bias) or (p.min_tokens > len(r.output_ids)) or p.penalised


def process_logits(logits: torch.Tensor, rows: Sequence[RowState], apply_masks=None) -> torch.Tensor:
    """A processed copy of `logits` (B, V) float32 (or `logits` itself when no row needs processing)."""
    if not needs_processing(rows):
        return logits
    logits = logits.clone()
    if apply_masks is not None and any(r.matcher is not None for r in rows):
        apply_masks(logits, [r.matcher for r in rows])
    _apply_bias(logits, rows)
    _apply_min_tokens(logits, rows)
    _apply_penalties(logits, rows)
    return logits


def _apply_bias(logits: torch.Tensor, rows: Sequence[RowState]) -> None:
    vocab = logits.shape[1]
    r_idx, t_idx, values = [], [], []
    for i, r in enumerate(rows):
        for token, bias in r.params.logit_bias.items():
            if token < vocab:  # the API checked ids against the vocabulary; the model's width may be larger
                r_idx.append(i)
                t_idx.append(token)
                values.append(bias)
    if r_idx:
        logits.index_put_(
            (torch.tensor(r_idx), torch.tensor(t_idx)),
            torch.tensor(values, dtype=logits.dtype),
            accumulate=True,
        )


def _apply_min_tokens(logits: torch.Tensor, rows: Sequence[RowState]) -> None:
    vocab = logits.shape[1]
    r_idx, t_idx = [], []
    for i, r in enumerate(rows):
        if r.params.min_tokens > len(r.output_ids):
            for token in {*r.params.stop_token_ids, *r.eos_token_ids}:
                if token < vocab:
                    r_idx.append(i)
                    t_idx.append(token)
    if r_idx:
        logits[torch.tensor(r_idx), torch.tensor(t_idx)] = -math.inf


def _history(ids_per_row: list[Sequence[int] | torch.Tensor], vocab: int) -> torch.Tensor:
    """(len(ids_per_row), vocab) float32 counts of each id per row (ids outside [0, vocab) dropped)."""
    tensors = [
        ids if isinstance(ids, torch.Tensor) else torch.tensor(ids, dtype=torch.int64) for ids in ids_per_row
    ]
    lengths = [t.numel() for t in tensors]
    counts = torch.zeros(len(ids_per_row), vocab + 1)
    if not sum(lengths):
        return counts[:, :vocab]
    flat = torch.cat(tensors)
    row = torch.repeat_interleave(torch.arange(len(ids_per_row)), torch.tensor(lengths))
    flat = torch.where((flat >= 0) & (flat < vocab), flat, vocab)  # pad values land in a dropped column
    counts.index_put_((row, flat), torch.ones(flat.numel()), accumulate=True)
    return counts[:, :vocab]


def _apply_penalties(logits: torch.Tensor, rows: Sequence[RowState]) -> None:
    idx = [i for i, r in enumerate(rows) if r.params.penalised]
    if not idx:
        return
    vocab = logits.shape[1]
    sub = [rows[i] for i in idx]
    where = torch.tensor(idx)
    out_counts = _history([r.output_ids for r in sub], vocab).to(logits.device)
    rep = torch.tensor([r.params.repetition_penalty for r in sub], device=logits.device).unsqueeze(1)
    freq = torch.tensor([r.params.frequency_penalty for r in sub], device=logits.device).unsqueeze(1)
    pres = torch.tensor([r.params.presence_penalty for r in sub], device=logits.device).unsqueeze(1)
    x = logits[where]
    if any(r.params.repetition_penalty != 1.0 for r in sub):
        # HF's and vLLM's repetition penalty: every token of the prompt or the output, once.
        seen = (_history([r.prompt_ids for r in sub], vocab).to(logits.device) + out_counts) > 0
        penalised = torch.where(x > 0, x / rep, x * rep)
        x = torch.where(seen, penalised, x)
    # OpenAI's definitions: frequency scales with the count in the output, presence applies once.
    x = x - freq * out_counts - pres * (out_counts > 0).to(x.dtype)
    logits[where] = x
