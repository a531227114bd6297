"""Linear-attention layers (Gated DeltaNet: Qwen3.5, Qwen3.5-MoE) over the engine's state pool.

transformers' layer keeps one sequence's conv window and recurrent matrix in a `Cache`; mmserve's packed rows
hold many requests, each with its state in a `StatePool` slot. `PoolLinearAttention` replaces the HF module (the
same parameters) and runs HF's own forward, unchanged, once per request segment and once for all decode rows,
each time with a small cache object (`_SlotCache`) that hands HF's code that request's state and takes back the
new one. So the recurrence, the conv and their branches (a first chunk with no state; a continuation chunk, whose
conv sees the saved window; one token with a state: the recurrent rule) are transformers' own, as its `generate`
runs them.

Per step (`StateMetadata`, built by the runner in row order):
- every prefill chunk is a segment: its rows, its request's state slot, whether the state is empty (the chunk
  starts the sequence), and the checkpoints to take inside it: the segment is cut at each checkpoint position
  and the state after that piece is copied into the checkpoint's slot (`StatePool.copy_layer_`);
- every decode row (one token after the prompt) runs in one batched call over the gathered states, which are
  written back after it (transformers' recurrent rule and conv update give each row the bits it gets alone).
  With mmserve's CPU kernels, the decode rows take a fast path instead (`_decode_in_pool`): transformers' forward
  op for op, but its per-token recurrent loop is `gated_delta_step_`, which updates each state in place in the
  pool in two sweeps (the loop's ten ops were ~8 passes over every state, plus the gather and the scatter);
  bitwise transformers' for Qwen3.5's head sizes (csrc/linear_state.cpp says when and why).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from mmserve.engine.cache.state_pool import StatePool


@dataclass
class StateSegment:
    row: int  # first packed row
    num_rows: int
    slot: int  # the request's running state
    fresh: bool  # no state yet: the chunk starts the sequence
    checkpoints: list[tuple[int, int]] = field(default_factory=list)  # (rows into the segment, state slot)


@dataclass
class StateMetadata:
    pool: StatePool
    segments: list[StateSegment]
    decode_rows: slice | None = None  # the decode rows, consecutive
    decode_slots: torch.Tensor | None = None  # int64 (B,): their state slots


class _SlotCache:
    """The part of transformers' `Cache` interface a linear-attention layer calls, over one state (a request's
    slot, or B gathered rows): conv (B, conv dim, K) and recurrent (B, H, Dk, Dv) tensors it reads and writes."""

    def __init__(self, conv: torch.Tensor, recurrent: torch.Tensor, fresh: bool) -> None:
        self.conv, self.recurrent, self.fresh = conv, recurrent, fresh

    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        return None if self.fresh else self.conv

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        return None if self.fresh else self.recurrent

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def increase_count(self, layer_idx: int, state_idx: int = 0) -> None:
        """Token counts are the engine's business."""

    def get_recurrent_states_to_keep(self, layer_idx: int) -> int:
        return 0

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        """transformers' `LinearAttentionLayer.update_conv_state`: the inputs the conv must see (the saved window
        before the new columns, or the new columns padded on the left to the kernel), the last K kept."""
        kernel = self.conv.shape[-1]
        if self.fresh:
            full = conv_states
            if full.shape[-1] < kernel:
                full = torch.nn.functional.pad(full, (kernel - full.shape[-1], 0), value=0)
        else:
            full = torch.cat([self.conv, conv_states], dim=-1)
        self.conv.copy_(full[..., -kernel:])
        return full

    def update_recurrent_state(self, recurrent_states, layer_idx: int, state_idx: int = 0, **kwargs):
        self.recurrent.copy_(recurrent_states)
        return self.recurrent


class PoolLinearAttention(torch.nn.Module):
    """A drop-in for one HF linear-attention module when it runs over the state pool (`mm_attn.state`); without
    the engine's metadata it is the HF module (the same model can still run `generate`)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.layer_idx = inner.layer_idx

    def forward(self, hidden_states: torch.Tensor, cache=None, attention_mask=None, **kwargs) -> torch.Tensor:
        meta = kwargs.get("mm_attn")
        if meta is None or meta.state is None:
            return self.inner(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
        state: StateMetadata = meta.state
        pool, layer = state.pool, self.layer_idx
        conv, recurrent = pool.conv[layer], pool.recurrent[layer]
        x = hidden_states[0]  # (T, hidden)
        out = torch.empty_like(x)
        for seg in state.segments:
            cuts = [c for c, _ in seg.checkpoints if c < seg.num_rows]
            fresh, start = seg.fresh, 0
            for end in [*cuts, seg.num_rows]:
                piece = x[seg.row + start : seg.row + end].unsqueeze(0)  # (1, n, hidden)
                one = _SlotCache(conv[seg.slot : seg.slot + 1], recurrent[seg.slot : seg.slot + 1], fresh)
                out[seg.row + start : seg.row + end] = self.inner(piece, cache=one)[0]
                fresh, start = False, end
                for at, dst in seg.checkpoints:
                    if at == end:
                        pool.copy_layer_(layer, seg.slot, dst)
        if state.decode_rows is not None:
            slots = state.decode_slots
            rows = x[state.decode_rows].unsqueeze(1)  # (B, 1, hidden): one token per request
            if meta.kernels is not None:
                out[state.decode_rows] = self._decode_in_pool(rows, conv, recurrent, slots, meta.kernels)[:, 0]
            else:
                batch = _SlotCache(conv.index_select(0, slots), recurrent.index_select(0, slots), fresh=False)
                out[state.decode_rows] = self.inner(rows, cache=batch)[:, 0]
                conv.index_copy_(0, slots, batch.conv)
                recurrent.index_copy_(0, slots, batch.recurrent)
        return out.unsqueeze(0)

    def _decode_in_pool(self, hidden, conv, recurrent, slots, kernels) -> torch.Tensor:
        """transformers' Gated DeltaNet forward for one token of B requests with a state (its decode branch),
        the same ops on the same shapes, with the recurrent rule's loop in `gated_delta_step_` over the states in
        the pool. hidden (B, 1, hidden) -> (B, 1, hidden)."""
        m = self.inner
        hf = sys.modules[type(m).__module__]  # the functions transformers' own forward calls
        batch, seq_len, _ = hidden.shape
        mixed_qkv = m.in_proj_qkv(hidden).transpose(1, 2)  # (B, conv dim, 1)
        z = m.in_proj_z(hidden).reshape(batch, seq_len, -1, m.head_v_dim)
        b, a = m.in_proj_b(hidden), m.in_proj_a(hidden)
        window = conv.index_select(0, slots)  # (B, conv dim, K): updated in place by the conv update
        mixed_qkv = hf.causal_conv1d_update(
            mixed_qkv, window, m.conv1d.weight.squeeze(1), m.conv1d.bias, activation=m.activation
        )
        conv.index_copy_(0, slots, window)
        query, key, value = torch.split(mixed_qkv.transpose(1, 2), [m.key_dim, m.key_dim, m.value_dim], dim=-1)
        query = query.reshape(batch, seq_len, -1, m.head_k_dim)
        key = key.reshape(batch, seq_len, -1, m.head_k_dim)
        value = value.reshape(batch, seq_len, -1, m.head_v_dim)
        beta = b.sigmoid()
        g = -m.A_log.float().exp() * F.softplus(a.float() + m.dt_bias)
        # torch_recurrent_gated_delta_rule's prelude, then its loop (one step) in the kernel
        dtype = query.dtype
        if m.num_k_heads != m.num_v_heads:
            query = query.repeat_interleave(m.num_v_heads // m.num_k_heads, dim=2)
            key = key.repeat_interleave(m.num_v_heads // m.num_k_heads, dim=2)
        query, key, value, beta, decay = [
            t.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
            for t in (query, key, value, beta, g)
        ]
        query = hf.l2norm(query, dim=-1, eps=1e-6)
        key = hf.l2norm(key, dim=-1, eps=1e-6)
        query = query / (query.shape[-1] ** 0.5)
        # (`.to` returns its input as it is when the dtype already matches, strides and all: the kernel wants rows)
        q_t, k_t, v_t = (t[:, :, 0].contiguous() for t in (query, key, value))
        core = kernels.gated_delta_step_(
            recurrent, slots, q_t, k_t, v_t, decay[:, :, 0].exp(), beta[:, :, 0].contiguous()
        )  # (B, H, Dv)
        core = core.unsqueeze(1).to(dtype).reshape(-1, m.head_v_dim)  # transformers' (B, 1, H, Dv) rows
        core = m.norm(core, z.reshape(-1, m.head_v_dim)).reshape(batch, seq_len, -1)
        return m.out_proj(core)


def wrap_linear_layers(text_model: torch.nn.Module, specs) -> list[int]:
    """Replace the linear-attention module of every layer `specs` declares `LinearStateSpec` with a
    PoolLinearAttention, in place; returns those layers. Raises ValueError when the model's modules and the specs
    disagree (a layer the specs call linear has no such module, or the other way round)."""
    from mmserve.models.layer_specs import LinearStateSpec
    from mmserve.models.swap import swap_modules

    expected = {i: s.module_class for i, s in enumerate(specs) if isinstance(s, LinearStateSpec)}
    wrapped: list[int] = []

    def wrap(module):
        if type(module).__name__ in expected.values():
            wrapped.append(module.layer_idx)
            return PoolLinearAttention(module)
        return None

    swap_modules(text_model, wrap)
    if sorted(wrapped) != sorted(expected):
        raise ValueError(
            f"linear-attention layers {sorted(expected)} declared, modules found in layers {sorted(wrapped)}"
        )
    return sorted(wrapped)
