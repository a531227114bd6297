"""A request's cache as bytes, for the prefill -> decode handoff (mmserve.disagg): its KV rows in every plane of
the KV pool, for models with sliding-window layers the window pool's rows of its last W - 1 prompt tokens (all
the decode side will ever read of them), and for hybrid models its linear layers' state, read from a detached
request's slots on the prefill side and written into a reservation on the decode side; and the memory a
transfer backend registers to move them without a copy (Mooncake), with where each plane's rows lie in it.

Reading is safe from another thread while the engine loop runs: the slots belong to a detached request (or a
reservation) that nobody else writes until the loop frees them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmserve.engine.cache.kv_pool import KVPool
from mmserve.engine.cache.state_pool import StatePool
from mmserve.models.layer_specs import LayerSpec


@dataclass
class HandoffSlots:
    """Where a request's cache lies for a prefill -> decode handoff: on the prefill side the detached request's
    slots (it owns them until the send ends); on the decode side the slots reserved for them (owned by the
    reservation until `Scheduler.adopt` hands them to the request or `unreserve` frees them)."""

    slots: torch.Tensor  # a KV-pool slot for every prompt row
    window_slots: torch.Tensor | None = None  # window-pool slots of the last W - 1 prompt rows (windowed models)
    state_slot: int | None = None  # the linear layers' state (hybrid models)


@dataclass(frozen=True)
class Region:
    """One registered allocation and its planes: plane i's row r is at `address + planes[i][0] + r *
    planes[i][1]`."""

    address: int
    nbytes: int
    num_rows: int  # rows per plane (slots)
    planes: tuple[tuple[int, int], ...]  # (byte offset, row bytes)


class CacheTransfer:
    def __init__(
        self,
        specs: tuple[LayerSpec, ...],
        kv: KVPool,
        states: StatePool | None,
        window: KVPool | None = None,
    ) -> None:
        self.specs = specs
        self.kv = kv
        self.states = states
        self.window = window  # the window pool (None: the model has no sliding-window layers)

    @property
    def layout(self) -> list[str]:
        """What each decoder layer keeps, in words: two engines exchange caches only if these are equal."""
        return [spec.describe() for spec in self.specs]

    @property
    def dtype(self) -> str:
        """The caches' element types: the KV rows' (the model's, or fp8) and a hybrid's states' (the model's)."""
        states = f" (states {self.states.dtype})" if self.states is not None else ""
        return f"{self.kv.dtype}{states}"

    def kv_bytes(self, num_tokens: int, window_rows: int = 0) -> int:
        return num_tokens * self.kv.token_bytes + (
            window_rows * self.window.token_bytes if window_rows else 0
        )

    @property
    def state_bytes(self) -> int:
        return self.states.slot_bytes if self.states is not None else 0

    def nbytes(self, cache: HandoffSlots) -> int:
        """Bytes of a request's cache (`read`'s size)."""
        rows = cache.window_slots.numel() if cache.window_slots is not None else 0
        return self.kv_bytes(cache.slots.numel(), rows) + (
            self.state_bytes if cache.state_slot is not None else 0
        )

    def read(self, cache: HandoffSlots) -> torch.Tensor:
        """The KV rows of its slots (every plane), then its window rows (every plane of the window pool), then
        its state, as one uint8 tensor."""
        parts = [self.kv.gather(cache.slots)]
        if cache.window_slots is not None:
            parts.append(self.window.gather(cache.window_slots))
        if cache.state_slot is not None:
            parts.append(self.states.gather(cache.state_slot))
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def write(self, cache: HandoffSlots, data: torch.Tensor) -> None:
        """`read`'s bytes into the slots of `cache`, which the caller owns. Raises ValueError when the size does
        not fit."""
        expected = self.nbytes(cache)
        if data.numel() != expected:
            raise ValueError(f"handoff payload is {data.numel()} bytes, {expected} expected")
        kv_bytes = self.kv_bytes(cache.slots.numel())
        self.kv.scatter(cache.slots, data[:kv_bytes])
        if cache.window_slots is not None:
            rows = cache.window_slots.numel() * self.window.token_bytes
            self.window.scatter(cache.window_slots, data[kv_bytes : kv_bytes + rows])
            kv_bytes += rows
        if cache.state_slot is not None:
            self.states.scatter(cache.state_slot, data[kv_bytes:])

    def kv_region(self) -> Region:
        return _region(self.kv)

    def window_region(self) -> Region | None:
        return _region(self.window) if self.window is not None else None

    def state_region(self) -> Region | None:
        if self.states is None:
            return None
        buf, planes = self.states.buffer, self.states.planes
        return Region(
            buf.data_ptr(), buf.numel(), self.states.num_slots, tuple((p.offset, p.row_bytes) for p in planes)
        )


def _region(pool: KVPool) -> Region:
    buf = pool.buffer
    return Region(buf.data_ptr(), buf.numel() * buf.element_size(), pool.num_slots, tuple(pool.planes()))
