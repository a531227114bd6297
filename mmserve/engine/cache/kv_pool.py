"""Token-granular KV cache pool with reference-counted slots, over the layers that have K/V rows.

Every token of every request occupies one slot; a slot holds one K row and one V row in every layer that writes
rows (`AttentionSpec.has_kv`), whatever its shape: the layers are grouped by row shape (KV heads, head size), each
group one typed view `(K|V, layers in the group, slot, head, width)` (width: the head size, plus an int8 pool's
scale bytes, mmserve.engine.cache.kv_dtype), all carved from one allocation. Linear-state
layers have no rows here (their state is in `StatePool`); a layer that reads another's rows (`kv_source`) aliases
that layer's views. `k_cache[layer]` / `v_cache[layer]` are indexed by the decoder layer's own index (HF passes
`module.layer_idx`), None where the layer has no rows.

A pool may hold only some of the layers (`layers`): a model with sliding-window layers keeps them in a pool of
their own, whose rows are freed once behind every window that could read them (mmserve.engine.slots),
beside the pool of its full-attention layers, which keeps every token's rows.

Slots are shared (by the prefix cache and any number of requests) through reference counts: `alloc` hands out
slots with refcount 1, `ref` adds an owner, `free` drops one, and a slot returns to the free list when its last
owner lets go.

The bookkeeping (refcounts, free list, slot ids) always lives on the CPU, whatever device holds the cache
tensors; callers move slot ids to the device when they index the caches. Not thread-safe: every method that
mutates must be called by the one thread that owns the pool (the scheduler), or under its lock.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmserve.engine.cache.kv_dtype import row_width
from mmserve.models.layer_specs import AttentionSpec, LayerSpec

ALIGN_BYTES = 64


@dataclass(frozen=True)
class KvGroup:
    """Layers whose rows have one shape, and where their planes sit in the pool's allocation."""

    layers: tuple[int, ...]
    num_kv_heads: int
    head_dim: int
    offset: int  # bytes into the allocation of plane (K, first layer)
    width: int  # elements of a (token, KV head) row: head_dim, and an int8 pool's scale (kv_dtype.row_width)


def uniform_specs(num_layers: int, num_kv_heads: int, head_dim: int) -> tuple[AttentionSpec, ...]:
    """Specs of a model whose every layer is full attention of one shape."""
    return tuple(AttentionSpec(num_kv_heads, head_dim) for _ in range(num_layers))


def kv_groups(
    specs: tuple[LayerSpec, ...], layers: frozenset[int] | None = None
) -> list[tuple[tuple[int, int], list[int]]]:
    """((KV heads, head dim), layers) for every row shape, in order of first appearance (of `layers` only, when
    given)."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i, spec in enumerate(specs):
        if spec.has_kv and (layers is None or i in layers):
            groups.setdefault(spec.row_shape, []).append(i)
    return list(groups.items())


class KVPool:
    """`num_slots` token slots of K/V cache for the layers of `specs` that have rows (of `layers` only, when
    given), with per-slot refcounts."""

    def __init__(
        self,
        num_slots: int,
        specs: tuple[LayerSpec, ...],
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        layers: frozenset[int] | None = None,
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.specs = tuple(specs)
        self.layers = layers
        self.num_layers = len(self.specs)
        self.dtype = dtype
        self.device = torch.device(device)
        item = dtype.itemsize
        self.groups: list[KvGroup] = []
        offset = 0
        for (heads, dim), members in kv_groups(self.specs, layers):
            width = row_width(dim, dtype)
            self.groups.append(KvGroup(tuple(members), heads, dim, offset, width))
            size = 2 * len(members) * num_slots * heads * width * item
            offset += -(-size // ALIGN_BYTES) * ALIGN_BYTES
        # One allocation for the whole cache: a KV transfer backend registers it once (Mooncake) and addresses any
        # row by offset (`planes`); the per-layer lists are views into it.
        self.buffer = torch.zeros(max(offset // item, 1), dtype=dtype, device=self.device)
        self.k_cache: list[torch.Tensor | None] = [None] * self.num_layers
        self.v_cache: list[torch.Tensor | None] = [None] * self.num_layers
        for group in self.groups:
            n = len(group.layers) * num_slots * group.num_kv_heads * group.width
            view = self.buffer[group.offset // item : group.offset // item + 2 * n]
            view = view.view(2, len(group.layers), num_slots, group.num_kv_heads, group.width)
            for j, layer in enumerate(group.layers):
                self.k_cache[layer], self.v_cache[layer] = view[0, j], view[1, j]
        for i, spec in enumerate(self.specs):
            if isinstance(spec, AttentionSpec) and spec.kv_source is not None and (layers is None or i in layers):
                self.k_cache[i], self.v_cache[i] = self.k_cache[spec.kv_source], self.v_cache[spec.kv_source]
        self._refcount = torch.zeros(num_slots, dtype=torch.int64)
        # A stack: reversed so that a fresh pool hands out slots 0, 1, 2, ... (easier to read in tests).
        self._free: list[int] = list(range(num_slots - 1, -1, -1))

    @classmethod
    def uniform(
        cls, num_slots: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device="cpu"
    ) -> KVPool:
        return cls(num_slots, uniform_specs(num_layers, num_kv_heads, head_dim), dtype, device)

    @staticmethod
    def bytes_per_token(
        specs: tuple[LayerSpec, ...], dtype: torch.dtype, layers: frozenset[int] | None = None
    ) -> int:
        """Bytes of K plus V cache one token occupies across all layers that have rows (of `layers`, when given)."""
        groups = kv_groups(specs, layers)
        rows = sum(2 * len(members) * heads * row_width(dim, dtype) for (heads, dim), members in groups)
        return rows * dtype.itemsize

    @classmethod
    def from_budget(
        cls,
        budget_bytes: int,
        specs: tuple[LayerSpec, ...],
        dtype: torch.dtype,
        device="cpu",
        layers: frozenset[int] | None = None,
    ) -> KVPool:
        """A pool with as many slots as fit in `budget_bytes`. Raises ValueError if not even one fits."""
        per_token = cls.bytes_per_token(specs, dtype, layers)
        num_slots = budget_bytes // per_token if per_token else 0
        if num_slots < 1:
            raise ValueError(
                f"KV budget of {budget_bytes} bytes holds no token ({per_token} bytes per token needed)"
            )
        return cls(num_slots, specs, dtype, device, layers)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_slots

    def alloc(self, n: int) -> torch.Tensor | None:
        """Take `n` distinct free slots, each with refcount 1 owned by the caller.

        Mutates the free list and refcounts. Returns an int64 CPU tensor, or None (allocating nothing) if
        fewer than `n` slots are free. O(n).
        """
        assert n >= 0, n
        if n > len(self._free):
            return None
        if n == 0:
            return torch.empty(0, dtype=torch.int64)
        # Top of the stack, in ascending order: a fresh pool gives a request consecutive rows, which KV
        # transfer backends move as one segment per layer (mmserve.disagg.kv_mooncake).
        slots = torch.tensor(self._free[: -n - 1 : -1], dtype=torch.int64)
        del self._free[-n:]
        self._refcount[slots] = 1
        return slots

    def ref(self, slots: torch.Tensor) -> None:
        """Add one owner to each slot (a slot listed twice gains two). All slots must be live.

        Mutates refcounts; the caller then owns the new references and must `free` them.
        """
        unique, counts = self._unique(slots)
        live = self._refcount[unique] >= 1
        assert bool(live.all()), f"ref of free slots {unique[~live].tolist()}"
        self._refcount[unique] += counts

    def free(self, slots: torch.Tensor) -> int:
        """Drop one owner from each slot (a slot listed twice loses two); slots reaching refcount 0 return
        to the free list. Mutates refcounts and the free list; the caller must own the references it drops.
        Returns how many slots were returned to the free list."""
        unique, counts = self._unique(slots)
        if unique.numel() == 0:
            return 0
        before = self._refcount[unique]
        assert bool((before >= counts).all()), f"free below zero: slots {unique[before < counts].tolist()}"
        after = before - counts
        self._refcount[unique] = after
        released = unique[after == 0].tolist()
        # Pushed in descending order, so that allocations pop them ascending: slots freed together come back as
        # a run (the decode attention reads a run of slots in place; KV transfers move a run as one segment).
        self._free.extend(reversed(released))
        return len(released)

    # -- the rows as bytes (prefill -> decode handoff) ----------------------------------------------------
    def planes(self) -> list[tuple[int, int]]:
        """(byte offset, row bytes) of every (group, K|V, layer) plane of `num_slots` rows, in allocation order:
        the row of `slot` in a plane is at `offset + slot * row_bytes`."""
        out = []
        item = self.dtype.itemsize
        for group in self.groups:
            row = group.num_kv_heads * group.width * item
            for plane in range(2 * len(group.layers)):
                out.append((group.offset + plane * self.num_slots * row, row))
        return out

    @property
    def token_bytes(self) -> int:
        """Bytes of one slot's rows over every plane (what a handoff moves per token)."""
        return sum(row for _, row in self.planes())

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """The rows of `slots` in every plane, planes in order, as one new contiguous uint8 tensor."""
        idx = slots.to(self.device)
        parts = [self._group_view(g).index_select(2, idx).reshape(-1) for g in self.groups]
        return torch.cat(parts).view(torch.uint8) if parts else torch.empty(0, dtype=torch.uint8)

    def scatter(self, slots: torch.Tensor, data: torch.Tensor) -> None:
        """Write `data` (bytes, as `gather` returns them) into `slots`, which the caller owns. Raises ValueError
        when its size does not fit."""
        n = slots.numel()
        data = data.reshape(-1)
        if data.dtype != torch.uint8 or data.numel() != n * self.token_bytes:
            raise ValueError(f"KV payload is {data.numel()} bytes, {n * self.token_bytes} expected")
        idx, start = slots.to(self.device), 0
        values = data.to(self.device).view(self._row_type)
        for g in self.groups:
            view = self._group_view(g)  # (2, layers, slots, heads, dim)
            count = 2 * len(g.layers) * n * g.num_kv_heads * g.width
            rows = values[start : start + count].view(2, len(g.layers), n, g.num_kv_heads, g.width)
            view.index_copy_(2, idx, rows)
            start += count

    @property
    def _row_type(self) -> torch.dtype:
        """The type rows are copied as: an 8-bit pool's as bytes (torch has no index copies of fp8 on a CPU)."""
        return torch.uint8 if self.dtype.itemsize == 1 else self.dtype

    def _group_view(self, g: KvGroup) -> torch.Tensor:
        item = self.dtype.itemsize
        n = len(g.layers) * self.num_slots * g.num_kv_heads * g.width
        flat = self.buffer.view(self._row_type)[g.offset // item : g.offset // item + 2 * n]
        return flat.view(2, len(g.layers), self.num_slots, g.num_kv_heads, g.width)

    def refcount(self, slots: torch.Tensor) -> torch.Tensor:
        """Current refcounts of `slots` (a copy; mutates nothing)."""
        return self._refcount[self._as_index(slots)].clone()

    def check_integrity(self) -> None:
        """Raise AssertionError if the free list and refcounts disagree. Mutates nothing."""
        free = self._free
        assert len(set(free)) == len(free), "free list contains duplicate slots"
        assert all(0 <= s < self.num_slots for s in free), "free list contains out-of-range slots"
        assert int(self._refcount.min()) >= 0, "negative refcount"
        if free:
            held = self._refcount[torch.tensor(free, dtype=torch.int64)]
            assert bool((held == 0).all()), "slots on the free list have nonzero refcount"
        zero = int((self._refcount == 0).sum())
        assert zero == len(free), f"{zero} slots have refcount 0 but the free list holds {len(free)}"
        assert self.num_free + self.num_used == self.num_slots

    def _as_index(self, slots: torch.Tensor) -> torch.Tensor:
        slots = slots.to(device="cpu", dtype=torch.int64).reshape(-1)
        if slots.numel():
            lo, hi = int(slots.min()), int(slots.max())
            assert lo >= 0 and hi < self.num_slots, f"slot out of range [0, {self.num_slots}): {lo}..{hi}"
        return slots

    def _unique(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.unique(self._as_index(slots), return_counts=True)
