"""Helper threads hand back their OpenMP pools (mmserve.omp_pools), counted as this process's OS threads.

A pool that a helper thread keeps makes libgomp stop spinning in every pool once its threads outnumber the
CPUs, which slowed each decode step by 1.2x on two cores (the module's docstring). What these tests check is the
cause itself: after a helper's torch work, no OpenMP worker thread of its own is left in the process.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from mmserve.encoder.batcher import TowerBatcher
from mmserve.multimodal.items import Modality, TowerInput
from mmserve.omp_pools import loaded_libgomp, release_thread_pool, released

pytestmark = pytest.mark.skipif(
    loaded_libgomp() is None or torch.get_num_threads() < 2,
    reason="needs torch on GNU OpenMP and two threads: only then does a parallel op start worker threads",
)


def os_threads() -> set[int]:
    """This process's threads by id: sets, not counts, since other tests' threads may exit meanwhile."""
    return {int(tid) for tid in os.listdir("/proc/self/task")}


def parallel_work() -> float:
    """An element-wise op far above ATen's grain size: it runs as an OpenMP parallel region."""
    return float((torch.ones(4_000_000) * 2).sum())


def threads_since(before: set[int], expected: int, timeout_s: float = 5.0) -> int:
    """How many of the threads alive now were not alive `before`, once that is `expected` (a released worker
    exits asynchronously) or when the timeout ends."""
    deadline = time.monotonic() + timeout_s
    while len(os_threads() - before) != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return len(os_threads() - before)


def threads_beside_helper(work) -> int:
    """Threads started since a helper thread started and ran `work`, while it is still alive (it counts one)."""
    parallel_work()  # this thread's own pool exists before the count
    before = os_threads()
    done, stop = threading.Event(), threading.Event()

    def helper() -> None:
        work()
        done.set()
        stop.wait(10)

    thread = threading.Thread(target=helper, daemon=True)
    thread.start()
    try:
        assert done.wait(30)
        return threads_since(before, 1)
    finally:
        stop.set()
        thread.join(10)


def test_the_runtime_is_torchs_own_libgomp():
    path = loaded_libgomp()
    assert os.path.basename(path).startswith("libgomp")
    assert path in open("/proc/self/maps").read()


def test_a_helper_keeps_its_pool_unless_it_releases_it():
    assert threads_beside_helper(parallel_work) > 1  # the helper and its pool's worker(s): the cause
    assert threads_beside_helper(released(parallel_work)) == 1  # the helper alone


def test_release_is_harmless_without_a_pool_and_the_thread_works_after():
    def work() -> None:
        assert release_thread_pool()  # no pool yet: nothing to free
        parallel_work()
        assert release_thread_pool()
        assert parallel_work() == 8_000_000.0  # a new pool, the same result
        release_thread_pool()

    assert threads_beside_helper(work) == 1


def test_the_tower_thread_hands_its_pool_back_when_idle():
    def encode(items: list[TowerInput]) -> list[dict[str, torch.Tensor]]:
        parallel_work()
        return [{"main": item.tensors["x"] * 2} for item in items]

    parallel_work()
    batcher = TowerBatcher(encode, max_batch_wait_ms=0)
    try:
        before = os_threads()  # the batcher's thread included
        for _ in range(2):
            item = TowerInput(Modality.IMAGE, {"x": torch.ones(3)}, b"", 1, 1)
            assert batcher.submit(item).result(timeout=30)["main"].tolist() == [2.0, 2.0, 2.0]
            assert threads_since(before, 0) == 0  # its pool's worker came and went
    finally:
        batcher.close()
