"""Per-request state of linear-attention layers: one slot holds, for every such layer, its causal-conv window
(conv dim x kernel columns, the model's dtype) and its recurrent matrix (value heads x key dim x value dim,
float32), exactly as transformers keeps them for one sequence.

A slot has exactly one owner at a time (no sharing, so no reference counts): a running request (its state, which
every forward of it advances in place), a prefix-cache node (a checkpoint: the state after the node's last token),
a detached request whose state is being sent to a decode engine, or a decode-side reservation for an incoming
one. Ownership moves without a copy (a finished request donates its slot to the prefix cache); a request that
resumes from a checkpoint gets a copy (`copy_`), the checkpoint staying in the cache for others.

The data is one allocation carved into per-layer views, so a transfer backend registers it once (Mooncake) and
addresses any layer's row of a slot by offset (`planes`). The bookkeeping lives on the CPU. Not thread-safe: the
scheduler's thread owns every method that mutates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmserve.models.layer_specs import LinearStateSpec

ALIGN = 64  # bytes: every view starts on a cache line (and satisfies any dtype's alignment)


@dataclass(frozen=True)
class StatePlane:
    """One layer's conv or recurrent rows: `num_slots` rows of `row_bytes` each, `offset` bytes into the pool."""

    layer: int
    what: str  # "conv" | "recurrent"
    offset: int
    row_bytes: int


def state_bytes(specs: dict[int, LinearStateSpec], dtype: torch.dtype) -> int:
    """Bytes of one request's state over the given linear layers (`dtype`: the model's, for the conv windows)."""
    total = 0
    for spec in specs.values():
        c, k = spec.conv_shape
        h, dk, dv = spec.recurrent_shape
        total += c * k * dtype.itemsize + h * dk * dv * 4
    return total


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class StatePool:
    """`num_slots` request states over the linear layers in `specs` (layer index -> spec)."""

    def __init__(
        self,
        num_slots: int,
        specs: dict[int, LinearStateSpec],
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"the state pool needs at least one slot, got {num_slots}")
        if not specs:
            raise ValueError("a state pool needs at least one linear-attention layer")
        self.num_slots = num_slots
        self.dtype = dtype
        self.device = torch.device(device)
        self.layers = sorted(specs)
        self.planes: list[StatePlane] = []
        offset = 0
        for layer in self.layers:
            spec = specs[layer]
            c, k = spec.conv_shape
            h, dk, dv = spec.recurrent_shape
            for what, row in (("conv", c * k * dtype.itemsize), ("recurrent", h * dk * dv * 4)):
                self.planes.append(StatePlane(layer, what, offset, row))
                offset = _aligned(offset + num_slots * row)
        self.buffer = torch.zeros(max(offset, ALIGN), dtype=torch.uint8, device=self.device)
        # Per layer: conv (slots, conv dim, K) in the model dtype, recurrent (slots, H, Dk, Dv) in float32.
        self.conv: dict[int, torch.Tensor] = {}
        self.recurrent: dict[int, torch.Tensor] = {}
        for plane in self.planes:
            spec = specs[plane.layer]
            rows = self.buffer[plane.offset : plane.offset + num_slots * plane.row_bytes]
            if plane.what == "conv":
                self.conv[plane.layer] = rows.view(dtype).view(num_slots, *spec.conv_shape)
            else:
                self.recurrent[plane.layer] = rows.view(torch.float32).view(num_slots, *spec.recurrent_shape)
        self.slot_bytes = sum(p.row_bytes for p in self.planes)
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # a stack: slots 0, 1, 2 ... first
        self._used = torch.zeros(num_slots, dtype=torch.bool)

    @classmethod
    def from_budget(
        cls, budget_bytes: int, specs: dict[int, LinearStateSpec], dtype: torch.dtype, device="cpu"
    ) -> StatePool:
        per_slot = state_bytes(specs, dtype)
        if budget_bytes < per_slot:
            raise ValueError(
                f"a state budget of {budget_bytes} bytes holds no request state ({per_slot} bytes each); "
                "raise --state-cache-mb"
            )
        return cls(budget_bytes // per_slot, specs, dtype, device)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def alloc(self) -> int | None:
        """A free slot, owned by the caller (its contents are stale: the owner writes before it reads), or None."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._used[slot] = True
        return slot

    def free(self, slot: int) -> None:
        """Return the caller's slot to the pool."""
        assert 0 <= slot < self.num_slots and bool(self._used[slot]), f"free of a slot not in use: {slot}"
        self._used[slot] = False
        self._free.append(slot)

    def copy_(self, src: int, dst: int) -> None:
        """Every layer's state of `src` into `dst` (the caller owns both)."""
        for layer in self.layers:
            self.conv[layer][dst].copy_(self.conv[layer][src])
            self.recurrent[layer][dst].copy_(self.recurrent[layer][src])

    def copy_layer_(self, layer: int, src: int, dst: int) -> None:
        self.conv[layer][dst].copy_(self.conv[layer][src])
        self.recurrent[layer][dst].copy_(self.recurrent[layer][src])

    def gather(self, slot: int) -> torch.Tensor:
        """The slot's state as bytes (planes in order), a new contiguous uint8 tensor of `slot_bytes`."""
        rows = [self.buffer[p.offset + slot * p.row_bytes : p.offset + (slot + 1) * p.row_bytes] for p in self.planes]
        return torch.cat(rows)

    def scatter(self, slot: int, data: torch.Tensor) -> None:
        """Write `data` (`gather`'s bytes) into the caller's `slot`. Raises ValueError on a size mismatch."""
        data = data.reshape(-1)
        if data.numel() != self.slot_bytes or data.dtype != torch.uint8:
            raise ValueError(f"state payload is {data.numel()} bytes, {self.slot_bytes} expected")
        start = 0
        for p in self.planes:
            row = self.buffer[p.offset + slot * p.row_bytes : p.offset + (slot + 1) * p.row_bytes]
            row.copy_(data[start : start + p.row_bytes])
            start += p.row_bytes

    def check_integrity(self) -> None:
        """Raise AssertionError if the free list and the in-use marks disagree. Mutates nothing."""
        free = self._free
        assert len(set(free)) == len(free), "state free list holds a slot twice"
        assert all(0 <= s < self.num_slots for s in free), "state free list holds an out-of-range slot"
        if free:
            assert not bool(self._used[torch.tensor(free)].any()), "a free state slot is marked in use"
        assert int(self._used.sum()) == self.num_used, "state slots in use disagree with the free list"
