"""Regions of a fixed buffer: the allocator behind the shared-memory and Mooncake transports, and views whose
death gives their region back.

A transport that moves parts through a long-lived buffer (a shared-memory pool, a buffer registered with
Mooncake's transfer engine) carves each part's bytes out of it with a :class:`RegionAllocator` and frees
them when the last tensor viewing them is gone (:func:`owned_view`): the region's owner is whoever holds a
view, and the ordinary reference count says when that ends. No request-level bookkeeping can forget a
region, and no region can be reused while a tensor still reads it.
"""

from __future__ import annotations

import bisect
import threading
import time
import weakref
from collections.abc import Callable

import numpy as np

ALIGN = 64  # region starts and sizes: a cache line, and every dtype's alignment


class PoolExhausted(TimeoutError):
    """No region of the requested size became free within the timeout."""


def align_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class RegionAllocator:
    """First-fit allocation of aligned regions in ``[0, capacity)``, with coalescing frees.

    Thread-safe. ``alloc`` waits (bounded) for frees when the pool is full, which is the transport's
    back-pressure: a sender whose receiver holds everything slows down instead of growing without bound.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < ALIGN:
            raise ValueError(f"a region pool needs at least {ALIGN} bytes")
        self.capacity = capacity - capacity % ALIGN
        self._free: list[tuple[int, int]] = [(0, self.capacity)]  # (offset, size), sorted by offset
        self._used: dict[int, int] = {}  # offset -> size
        self._cond = threading.Condition()

    @property
    def used_bytes(self) -> int:
        with self._cond:
            return sum(self._used.values())

    @property
    def num_regions(self) -> int:
        with self._cond:
            return len(self._used)

    def alloc(self, nbytes: int, timeout_s: float) -> int:
        """Offset of a fresh region of at least ``nbytes``; raises PoolExhausted after ``timeout_s``."""
        size = align_up(max(nbytes, 1))
        if size > self.capacity:
            raise PoolExhausted(f"{nbytes} bytes do not fit in a pool of {self.capacity} bytes")
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                for i, (offset, free) in enumerate(self._free):
                    if free >= size:
                        if free == size:
                            del self._free[i]
                        else:
                            self._free[i] = (offset + size, free - size)
                        self._used[offset] = size
                        return offset
                left = deadline - time.monotonic()
                if left <= 0 or not self._cond.wait(left):
                    raise PoolExhausted(
                        f"no {nbytes}-byte region free in {timeout_s}s "
                        f"({sum(self._used.values())} of {self.capacity} bytes in use)"
                    )

    def free(self, offset: int) -> None:
        """Give a region back; freeing an unknown offset is a bug (KeyError)."""
        with self._cond:
            size = self._used.pop(offset)
            i = bisect.bisect(self._free, (offset, 0))
            if i < len(self._free) and self._free[i][0] == offset + size:  # merge with the next block
                size += self._free.pop(i)[1]
            if i > 0 and sum(self._free[i - 1]) == offset:  # and with the previous one
                offset, size = self._free[i - 1][0], self._free[i - 1][1] + size
                del self._free[i - 1]
                i -= 1
            self._free.insert(i, (offset, size))
            self._cond.notify_all()

    def free_all(self) -> None:
        with self._cond:
            self._used.clear()
            self._free = [(0, self.capacity)]
            self._cond.notify_all()

    def holds(self, offset: int, nbytes: int) -> bool:
        """Whether ``[offset, offset + nbytes)`` overlaps a region in use."""
        with self._cond:
            return any(o < offset + nbytes and offset < o + s for o, s in self._used.items())

    def check_integrity(self) -> None:
        with self._cond:
            spans = sorted([*self._free, *self._used.items()])
            pos = 0
            for offset, size in spans:
                assert offset == pos and size > 0, (offset, pos, size)
                pos += size
            assert pos == self.capacity, (pos, self.capacity)


def owned_view(buffer, offset: int, nbytes: int, on_release: Callable[[], None]) -> memoryview:
    """A byte view of ``buffer[offset : offset + nbytes]`` that calls ``on_release`` once nothing views it.

    Tensors built on the view (``torch.frombuffer``) keep it, and so the region, alive; when the last one
    is collected the callback runs, in whatever thread dropped it: keep callbacks short and lock-free
    (a queue put), since they can run while that thread holds locks of its own.
    """
    array = np.frombuffer(buffer, dtype=np.uint8, count=nbytes, offset=offset)
    weakref.finalize(array, on_release)
    return memoryview(array)
