"""A request's cache as bytes, for the prefill -> decode handoff (mmserve.disagg): its KV rows in every plane of
the KV pool and, for hybrid models, its linear layers' state, read from a detached request's slots on the prefill
side and written into a reservation on the decode side; and the memory a transfer backend registers to move them
without a copy (Mooncake), with where each plane's rows lie in it.

Reading is safe from another thread while the engine loop runs: the slots belong to a detached request (or a
reservation) that nobody else writes until the loop frees them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmserve.engine.cache.kv_pool import KVPool
from mmserve.engine.cache.state_pool import StatePool
from mmserve.models.layer_specs import LayerSpec


@dataclass(frozen=True)
class Region:
    """One registered allocation and its planes: plane i's row r is at `address + planes[i][0] + r *
    planes[i][1]`."""

    address: int
    nbytes: int
    num_rows: int  # rows per plane (slots)
    planes: tuple[tuple[int, int], ...]  # (byte offset, row bytes)


class CacheTransfer:
    def __init__(self, specs: tuple[LayerSpec, ...], kv: KVPool, states: StatePool | None) -> None:
        self.specs = specs
        self.kv = kv
        self.states = states

    @property
    def layout(self) -> list[str]:
        """What each decoder layer keeps, in words: two engines exchange caches only if these are equal."""
        return [spec.describe() for spec in self.specs]

    @property
    def dtype(self) -> torch.dtype:
        return self.kv.dtype

    def kv_bytes(self, num_tokens: int) -> int:
        return num_tokens * self.kv.token_bytes

    @property
    def state_bytes(self) -> int:
        return self.states.slot_bytes if self.states is not None else 0

    def read(self, slots: torch.Tensor, state_slot: int | None) -> torch.Tensor:
        """The KV rows of `slots` (every plane) followed by the state of `state_slot`, as one uint8 tensor."""
        kv = self.kv.gather(slots)
        if state_slot is None:
            return kv
        return torch.cat([kv, self.states.gather(state_slot)])

    def write(self, slots: torch.Tensor, state_slot: int | None, data: torch.Tensor) -> None:
        """`read`'s bytes into `slots` (and `state_slot`), which the caller owns. Raises ValueError when the size
        does not fit."""
        kv_bytes = self.kv_bytes(slots.numel())
        expected = kv_bytes + (self.state_bytes if state_slot is not None else 0)
        if data.numel() != expected:
            raise ValueError(f"handoff payload is {data.numel()} bytes, {expected} expected")
        self.kv.scatter(slots, data[:kv_bytes])
        if state_slot is not None:
            self.states.scatter(state_slot, data[kv_bytes:])

    def kv_region(self) -> Region:
        buf = self.kv.buffer
        return Region(buf.data_ptr(), buf.numel() * buf.element_size(), self.kv.num_slots, tuple(self.kv.planes()))

    def state_region(self) -> Region | None:
        if self.states is None:
            return None
        buf, planes = self.states.buffer, self.states.planes
        return Region(
            buf.data_ptr(), buf.numel(), self.states.num_slots, tuple((p.offset, p.row_bytes) for p in planes)
        )
