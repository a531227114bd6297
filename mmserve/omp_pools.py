"""Helper threads hand back their OpenMP thread pools, so that the decode step's stay hot.

PyTorch's CPU ops run their parallel loops under OpenMP, GNU libgomp in the pip wheels. libgomp gives every
thread that starts a parallel region a pool of worker threads of its own and keeps it until that thread exits.
Once the process holds more libgomp threads than CPUs, libgomp stops spinning between parallel regions in
*every* pool (its "throttled" spin count, 100 iterations). Each parallel op then waits on a futex wake of its
workers instead of finding them spinning.

A decode step is about 150 parallel ops, 97 of them GEMMs. On the 2-core Xeon, one image encoded on the tower's
thread, whose pool then stays, made every later decode step of one row 1.20x slower: 64.2 ms against 53.3 ms.
Its GEMM floor went from 46 to 52 ms, and the attention kernel from 17 to 95 us a layer.

So a helper thread that runs torch ops gives its pool back when its work is done (`released`, or
`release_thread_pool` at a point of its own): `omp_pause_resource_all(omp_pause_soft)` frees the calling
thread's pool, and libgomp's count of its threads falls back. The thread's next parallel region builds a new
pool, which costs tens of microseconds, against the tower's hundreds of milliseconds. The thread that steps the
engine keeps its pool.

Only GNU libgomp is paused. In LLVM's and Intel's OpenMP (conda builds of torch), `omp_pause_resource_all` pauses
the whole runtime, every thread's pools included, and those runtimes keep no such count. With another runtime or
none, releasing does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import ParamSpec, TypeVar

log = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: threads and pools freed, the runtime's state kept
P = ParamSpec("P")
R = TypeVar("R")


def loaded_libgomp(maps: str = "/proc/self/maps") -> str | None:
    """The path of the GNU OpenMP runtime mapped into this process (torch's own copy, for the pip wheels), or
    None if there is none (or no /proc: not Linux)."""
    try:
        lines = Path(maps).read_text().splitlines()
    except OSError:
        return None
    for line in lines:  # address, permissions, offset, device, inode, path (if any)
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and Path(fields[5]).name.startswith("libgomp"):
            return fields[5]
    return None


@functools.cache  # one lookup per process: the runtime stays mapped once torch is imported
def _pause_all() -> Callable[[int], int] | None:
    import torch  # noqa: F401  (maps its OpenMP runtime, if it has one)

    path = loaded_libgomp()
    if path is None:
        return None
    try:
        fn = ctypes.CDLL(path).omp_pause_resource_all  # the mapped copy: dlopen of a loaded path re-uses it
    except (OSError, AttributeError) as exc:  # a libgomp older than OpenMP 5.0 (GCC 9)
        log.info("OpenMP pools of helper threads are not released (%s): %s", path, exc)
        return None
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    return fn


def release_thread_pool() -> bool:
    """Free the calling thread's OpenMP pool (its worker threads exit). Call it from a helper thread after its
    torch work, never inside a parallel region. True if a pool was released (or there was none to release)."""
    fn = _pause_all()
    return fn is not None and fn(OMP_PAUSE_SOFT) == 0


def released(fn: Callable[P, R]) -> Callable[P, R]:
    """`fn`, then the calling thread's pool released: for work handed to helper threads (executors, to_thread)."""

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        finally:
            release_thread_pool()

    return run
