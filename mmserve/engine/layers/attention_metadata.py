"""What one step's attention reads and writes: per layer kind a view (its pool's slots for this step's tokens, each
prefill chunk's keys and mask, the decode rows' slots), built once per step for every layer (`AttentionPlan`).

Kinds: a layer's pool (the KV pool, or the window pool of sliding-window layers) and whether an item's tokens
see each other both ways. Masks are transformers': key j is visible to query i iff (j <= i, or both lie in the
same bidirectional block) and, in a window W, j > i - W.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from mmserve.models.layer_specs import AttentionSpec, LayerSpec

if TYPE_CHECKING:
    from mmserve.engine.cpu_kernels import CpuKernels
    from mmserve.engine.layers.linear_state import StateMetadata
    from mmserve.engine.request import Request


@dataclass
class SeqAttention:
    q_start: int  # first query row of this request in the packed batch
    q_len: int
    kv_slots: torch.Tensor  # int64 (kv_len,): the request's slots, this step's included
    mask: torch.Tensor | None  # bool (q_len, kv_len) bottom-right causal, None for decode / fresh prefill

    @staticmethod
    def make(q_start: int, q_len: int, kv_slots: torch.Tensor) -> SeqAttention:
        kv_len = kv_slots.shape[0]
        mask = None
        if 1 < q_len < kv_len:
            mask = torch.ones(q_len, kv_len, dtype=torch.bool).tril(diagonal=kv_len - q_len)
        return SeqAttention(q_start, q_len, kv_slots, mask)

    @staticmethod
    def chunk(
        q_start: int,
        start: int,
        end: int,
        kv_slots: torch.Tensor,
        window: int | None = None,
        block_ids: torch.Tensor | None = None,
    ) -> SeqAttention:
        """Queries at positions [start, end) over the keys of positions [end - len(kv_slots), end) (a window's
        first visible position on): transformers' mask for a sliding window and bidirectional blocks
        (`block_ids`: per position from 0, -1 outside blocks; may be shorter than `end`: the rest is text)."""
        kv_start = end - kv_slots.shape[0]
        q_len = end - start
        near = block_ids is None or not bool((block_ids[kv_start:end] >= 0).any())
        if near and (window is None or end <= window) and kv_start == 0:
            return SeqAttention.make(q_start, q_len, kv_slots)  # plain causal: the fast forms above
        i = torch.arange(start, end).unsqueeze(1)
        j = torch.arange(kv_start, end).unsqueeze(0)
        visible = j <= i
        if not near:
            ids = torch.full((end,), -1, dtype=torch.int32)
            known = min(end, block_ids.shape[0])
            ids[:known] = block_ids[:known]
            qb, kb = ids[start:end].unsqueeze(1), ids[kv_start:end].unsqueeze(0)
            visible |= (qb == kb) & (qb >= 0)
        if window is not None:
            visible &= j > i - window
        return SeqAttention(q_start, q_len, kv_slots, visible)


@dataclass
class DecodeGroup:
    """Every one-row query of a step, attended in one call."""

    rows: torch.Tensor | slice  # their query rows in the packed batch (a slice when consecutive)
    slots: torch.Tensor  # int64 (B, L): each row's KV slots, padded with slot 0 past its length
    mask: torch.Tensor | None  # bool (B, 1, 1, L), True where a slot is the row's; None if none is padded
    row_ids: torch.Tensor  # int64 (B,): the rows as ids (the CPU kernel's form of `rows`)
    lengths: torch.Tensor  # int64 (B,): each row's number of slots

    @staticmethod
    def make(rows: list[int], kv_slots: list[torch.Tensor], device: torch.device) -> DecodeGroup:
        lengths = torch.tensor([s.shape[0] for s in kv_slots])
        longest = int(lengths.max())
        if int(lengths.min()) == longest:
            slots, mask = torch.stack(kv_slots), None
        else:
            slots = torch.nn.utils.rnn.pad_sequence(kv_slots, batch_first=True)
            mask = (torch.arange(longest) < lengths.unsqueeze(1))[:, None, None, :].to(device)
        consecutive = rows == list(range(rows[0], rows[0] + len(rows)))
        row_ids = torch.tensor(rows, device=device)
        where = slice(rows[0], rows[0] + len(rows)) if consecutive else row_ids
        return DecodeGroup(where, slots.to(device), mask, row_ids, lengths.to(device))


@dataclass
class AttentionView:
    """What the layers of one kind (one pool, with or without item blocks) write and read in one step."""

    new_slots: torch.Tensor  # int64 (total_tokens,): slot of every packed token in this view's pool
    seqs: list[SeqAttention]  # the queries of more than one row (prefill chunks), each attended on its own
    decode: DecodeGroup | None = None  # the one-row queries

    def __post_init__(self) -> None:
        # One gather per layer for all prefill chunks is much cheaper than one per request; each request then
        # reads its rows of the gathered block as a view. Offsets into that block:
        lengths = [s.kv_slots.shape[0] for s in self.seqs]
        self.kv_slots = torch.cat([s.kv_slots for s in self.seqs]) if self.seqs else None
        self.kv_offsets = [sum(lengths[:i]) for i in range(len(lengths))]

    @classmethod
    def build(cls, new_slots: torch.Tensor, seqs: list[SeqAttention], device) -> AttentionView:
        """Split `seqs` (in row order) into the decode group and the chunks attended one by one."""
        ones = [s for s in seqs if s.q_len == 1]
        decode = (
            DecodeGroup.make([s.q_start for s in ones], [s.kv_slots for s in ones], device) if ones else None
        )
        rest = [s for s in seqs if s.q_len > 1]
        if torch.device(device).type != "cpu":  # slot ids and masks are built on the CPU
            rest = [
                SeqAttention(s.q_start, s.q_len, s.kv_slots.to(device), _to(s.mask, device)) for s in rest
            ]
        return cls(new_slots, rest, decode)


@dataclass
class AttentionMetadata:
    k_cache: list[torch.Tensor | None]  # per layer (num_slots, num_kv_heads, kv_dtype.row_width); None: no rows
    v_cache: list[torch.Tensor | None]
    views: list[AttentionView]  # one per layer kind present (a model of full causal layers has one)
    view_of: list[int]  # per layer, its view (0 for layers that have no attention)
    writes: list[bool]  # per layer, whether it writes its K/V (False: it reads another layer's rows)
    num_rows: int = 0  # total packed query rows
    # this step's RoPE rows, built by the first fused layer for the others (fused_layers.rotary_rows), per layer
    # type where the types rotate by their own bases (fused_gemma; None: the model's one kind)
    rotary: dict[str | None, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    kernels: CpuKernels | None = None  # mmserve's CPU kernels when the engine runs them (cpu_kernels.py)
    state: StateMetadata | None = None  # hybrid models: the linear layers' state slots (layers/linear_state.py)

    # The first view's parts: the whole step of a model whose layers are all of one kind (the fused layers').
    @property
    def new_slots(self) -> torch.Tensor:
        return self.views[0].new_slots

    @property
    def seqs(self) -> list[SeqAttention]:
        return self.views[0].seqs

    @property
    def decode(self) -> DecodeGroup | None:
        return self.views[0].decode

    @classmethod
    def build(
        cls, k_cache, v_cache, new_slots, seqs: list[SeqAttention], device, kernels: CpuKernels | None = None
    ) -> AttentionMetadata:
        """One view over every layer: causal attention, each layer writing its own rows."""
        n = len(k_cache)
        view = AttentionView.build(new_slots, seqs, device)
        return cls(k_cache, v_cache, [view], [0] * n, [True] * n, sum(s.q_len for s in seqs), kernels=kernels)


def _to(mask: torch.Tensor | None, device) -> torch.Tensor | None:
    return None if mask is None else mask.to(device)


@dataclass(frozen=True)
class ViewKind:
    window: int | None  # None: the KV pool's layers; W: the window pool's
    blocks: bool  # bidirectional item blocks


class AttentionPlan:
    """The views a model's attention layers need and which layer reads which; `metadata` builds a step's."""

    def __init__(self, specs: tuple[LayerSpec, ...]) -> None:
        kinds: list[ViewKind] = []
        self.view_of, self.writes = [], []
        for spec in specs:
            if not isinstance(spec, AttentionSpec):
                self.view_of.append(0)
                self.writes.append(False)
                continue
            kind = ViewKind(spec.window, spec.bidirectional_items)
            if kind not in kinds:
                kinds.append(kind)
            self.view_of.append(kinds.index(kind))
            self.writes.append(spec.kv_source is None)
        self.kinds = kinds or [ViewKind(None, False)]

    def metadata(
        self,
        caches: tuple[list, list],
        prefills: list[tuple[int, Request, int, int]],
        decodes: list[tuple[int, Request, int]],
        device,
        kernels: CpuKernels | None,
    ) -> AttentionMetadata:
        """The step's metadata over `caches` (per layer K and V, from whichever pool holds the layer): prefill
        chunks (first row, request, start, end) then decode rows (row, request, position), in row order."""
        views = [self._view(kind, prefills, decodes, device) for kind in self.kinds]
        rows = sum(end - start for _, _, start, end in prefills) + len(decodes)
        return AttentionMetadata(
            caches[0], caches[1], views, self.view_of, self.writes, rows, kernels=kernels
        )

    @staticmethod
    def _view(kind: ViewKind, prefills, decodes, device) -> AttentionView:
        window = kind.window
        new, seqs = [], []
        for row, req, start, end in prefills:
            if window is None:
                slots, kv_start = req.slot_buffer, 0
            else:
                slots, kv_start = req.window_buffer, max(0, start - window + 1)
            new.append(slots[start:end])
            blocks = req.block_ids if kind.blocks else None
            seqs.append(SeqAttention.chunk(row, start, end, slots[kv_start:end], window, blocks))
        if decodes:
            kv = [
                req.slot_buffer[: s + 1]
                if window is None
                else req.window_buffer[max(0, s + 1 - window) : s + 1]
                for _, req, s in decodes
            ]
            new += [k[-1:] for k in kv]
            seqs += [SeqAttention(row, 1, k, None) for (row, _, _), k in zip(decodes, kv, strict=True)]
        return AttentionView.build(torch.cat(new).to(device), seqs, device)
