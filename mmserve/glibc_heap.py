"""glibc's heap kept for large temporaries, and handed back after load.

glibc serves an allocation at or above its mmap threshold (raised by large frees, 32 MB at most) with a fresh
`mmap` and unmaps it on `free`. Every torch op whose output is that large then faults in each page of it as it
writes, and the kernel zeroes each page first: the element-wise ops of a tower batch of 4 x 1024² images
(19,600 x 768 fp32 rows, 60 MB each), a 2B model's 2048-row prefill MLP (73 MB), a tower's MLP over several
images. Measured on the AVX2 machine: a residual add, a LayerNorm and QuickGELU over 19,600 x 768 fp32 rows took
154 ms with 3.7 M page faults; with the blocks kept in the heap 32 ms and none (tcmalloc, preloaded: 35 ms).

`share_main_arena` (at start) puts every thread in the main arena (`M_ARENA_MAX` 1: another thread's arena
lives in 64 MB heaps and maps anything larger regardless, and the tower runs on a thread of its own);
`keep_large_blocks` (once loaded) has glibc serve every size from the heap (`M_MMAP_MAX` 0) and keep up to
`TRIM_BYTES` free at the heap's top instead of returning it after every op. vLLM's and SGLang's CPU backends get the same from a preloaded tcmalloc (`LD_PRELOAD`); `mallopt` does it
in process, with nothing to install or re-exec. Freed blocks inside the heap stay resident for the next op (a
caching allocator's trade) until `release_freed_memory` (`malloc_trim`) gives the free pages back: after loading
(the weights it replaced), and through `IdleTrim` once the engine loop or the tower's thread has been idle for
`IDLE_TRIM_S` after work (a burst's temporaries go back between bursts, not between ops).

`MMSERVE_MALLOC=system` leaves glibc's defaults. Nothing happens where malloc is not glibc's (musl, macOS) or an
allocator is preloaded (its `mallopt`, if any, is not glibc's).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
from collections.abc import Callable

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_MAX = -4
M_ARENA_MAX = -8
# free bytes kept at the heap's top: a large batch's temporaries, reused by the next one
TRIM_BYTES = 256 << 20
IDLE_TRIM_S = 2.0  # idle this long after work: the heap's free pages go back to the OS


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    # glibc exports gnu_get_libc_version; musl and others do not, and their mallopt means something else
    return libc if libc is not None and hasattr(libc, "gnu_get_libc_version") else None


def _enabled() -> ctypes.CDLL | None:
    if os.environ.get("MMSERVE_MALLOC", "").lower() == "system":
        return None
    if any(a in os.environ.get("LD_PRELOAD", "") for a in ("tcmalloc", "jemalloc", "mimalloc")):
        return None
    return _libc()


@functools.cache
def share_main_arena() -> bool:
    """Every thread that has not allocated yet allocates from glibc's main arena (once per process; True if
    set). Call it first, before torch's threads (OpenMP workers, the tower's thread) allocate."""
    libc = _enabled()
    return libc is not None and libc.mallopt(M_ARENA_MAX, 1) == 1  # mallopt returns 1 on success


@functools.cache
def keep_large_blocks() -> bool:
    """From now on, serve large temporaries from the heap and keep them there for reuse (once per process; True if
    set). Call it once the weights are loaded: their load-time copies are then mapped and unmapped as glibc's
    defaults do, which keeps the load's peak where it was (+1.1 GB of 12.5 GB for a 2B engine otherwise)."""
    libc = _enabled()
    if libc is None:
        return False
    ok = share_main_arena() and all(
        libc.mallopt(p, v) == 1 for p, v in ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, TRIM_BYTES))
    )
    if not ok:
        log.info("glibc's mallopt refused a setting: large temporaries may be mapped afresh per op")
    return ok


def release_freed_memory() -> None:
    """Return the heap's free pages to the OS (glibc's malloc_trim; a no-op elsewhere). What loading replaces (the
    model-dtype weights that fusion, quantization and packing swap out) is freed inside the heap, so it stays
    resident until trimmed: ~300 MB of the `small` model's int8 engine."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


class IdleTrim:
    """Gives the heap's free pages back once its owner has been idle `after_s` since it last worked. The owner calls
    `worked()` after work and `idle(now)` while it waits; `wait_s()` bounds its wait so the trim is not late."""

    def __init__(
        self, after_s: float = IDLE_TRIM_S, release: Callable[[], None] = release_freed_memory
    ) -> None:
        self.after_s, self._release = after_s, release
        self._idle_since: float | None = None
        self.pending = False  # worked since the last trim

    def worked(self) -> None:
        self.pending, self._idle_since = True, None

    def idle(self, now: float) -> bool:
        """True if it trimmed now."""
        if not self.pending:
            return False
        if self._idle_since is None:
            self._idle_since = now
        if now - self._idle_since < self.after_s:
            return False
        self._release()
        self.pending, self._idle_since = False, None
        return True

    def wait_s(self) -> float | None:
        """How long its owner may block waiting for work (None: as long as it likes)."""
        return self.after_s if self.pending else None
