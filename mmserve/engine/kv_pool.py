"""Token-granular KV cache pool with reference-counted slots.

Every token of every request occupies one slot; a slot holds one K row and one V row in every layer. Slots
are shared (by the prefix cache and any number of requests) through reference counts: `alloc` hands out
slots with refcount 1, `ref` adds an owner, `free` drops one, and a slot returns to the free list when its
last owner lets go.

The bookkeeping (refcounts, free list, slot ids) always lives on the CPU, whatever device holds the cache
tensors; callers move slot ids to the device when they index the caches. Not thread-safe: every method
that mutates must be called by the one thread that owns the pool (the scheduler), or under its lock.
"""

from __future__ import annotations

import torch


class KVPool:
    """`num_slots` token slots of K/V cache for `num_layers` layers, with per-slot reference counts."""

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.dtype = dtype
        self.device = torch.device(device)
        # One allocation for the whole cache, (K|V, layer, slot, head, dim): a KV transfer backend registers it
        # once (Mooncake) and addresses any row by offset; the per-layer lists are views into it.
        self.buffer = torch.zeros(
            (2, num_layers, num_slots, num_kv_heads, head_dim), dtype=dtype, device=self.device
        )
        self.k_cache: list[torch.Tensor] = [self.buffer[0, layer] for layer in range(num_layers)]
        self.v_cache: list[torch.Tensor] = [self.buffer[1, layer] for layer in range(num_layers)]
        self._refcount = torch.zeros(num_slots, dtype=torch.int64)
        # A stack: reversed so that a fresh pool hands out slots 0, 1, 2, ... (easier to read in tests).
        self._free: list[int] = list(range(num_slots - 1, -1, -1))

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of K plus V cache one token occupies across all layers."""
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize

    @classmethod
    def from_budget(
        cls,
        budget_bytes: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
    ) -> KVPool:
        """A pool with as many slots as fit in `budget_bytes`. Raises ValueError if not even one fits."""
        per_token = cls.bytes_per_token(num_layers, num_kv_heads, head_dim, dtype)
        num_slots = budget_bytes // per_token
        if num_slots < 1:
            raise ValueError(
                f"KV budget of {budget_bytes} bytes holds no token ({per_token} bytes per token needed)"
            )
        return cls(num_slots, num_layers, num_kv_heads, head_dim, dtype, device)

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

    @property
    def row_bytes(self) -> int:
        """Bytes of one slot's K (or V) row in one layer."""
        return self.buffer[0, 0, 0].numel() * self.dtype.itemsize

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """The K and V rows of `slots` in every layer, as a new contiguous (2, layers, n, heads, dim) tensor."""
        return self.buffer.index_select(2, slots.to(self.device)).contiguous()

    def scatter(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Write `rows` (2, layers, n, heads, dim), as `gather` returns them, into `slots`. The caller owns them."""
        self.buffer.index_copy_(2, slots.to(self.device), rows.to(self.device, self.dtype))

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
