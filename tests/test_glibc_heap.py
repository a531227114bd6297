"""Large temporaries stay in glibc's heap (mmserve.glibc_heap): an op's 64 MB output, made and freed again and
again on a thread as a tower batch does, faults its pages in once instead of on every op."""

import json
import os
import subprocess
import sys

import pytest

from mmserve.glibc_heap import IdleTrim, _libc

PROBE = r"""
import json, resource, threading, torch
from mmserve.glibc_heap import keep_large_blocks
kept = keep_large_blocks()
torch.set_num_threads(1)
x = torch.ones(16 << 20)  # 64 MB of fp32
faults = []
def ops():
    for _ in range(16):  # the heap settles within a few ops
        (x * 2).sum()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(8):
        (x * 2).sum()  # an element-wise output of 64 MB, freed at once
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
t = threading.Thread(target=ops)  # the tower's thread: another arena than the main thread's by default
t.start(); t.join()
print(json.dumps({"kept": kept, "faults": faults[0]}))
"""


def _probe(malloc: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("MMSERVE_MALLOC", "LD_PRELOAD")}
    if malloc is not None:
        env["MMSERVE_MALLOC"] = malloc
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(_libc() is None, reason="malloc is not glibc's")
def test_large_outputs_reuse_the_heap_and_system_keeps_glibcs_defaults():
    kept, system = _probe(None), _probe("system")
    assert kept["kept"] is True and system["kept"] is False
    pages = (64 << 20) // 4096
    # glibc's defaults: every 64 MB output is a fresh mapping, its 16k pages faulted in on each of the 8 ops
    assert system["faults"] >= 6 * pages, system
    # kept in the heap: reused, no page faulted in again
    assert kept["faults"] <= pages // 8, kept


def test_idle_trim_gives_pages_back_once_per_idle_spell_after_work():
    trims = []
    trim = IdleTrim(after_s=2.0, release=lambda: trims.append(1))
    assert trim.wait_s() is None and not trim.idle(0.0)  # nothing done yet: nothing to give back
    trim.worked()
    assert trim.wait_s() == 2.0
    assert not trim.idle(10.0) and not trim.idle(11.9)  # the idle spell starts at 10.0
    trim.worked()  # work again: the spell starts over
    assert not trim.idle(12.0) and not trim.idle(13.0)
    assert trim.idle(14.0) and trims == [1]
    assert not trim.idle(20.0) and trims == [1] and trim.wait_s() is None  # once per spell


@pytest.mark.skipif(_libc() is None, reason="malloc is not glibc's")
def test_release_hands_the_heaps_free_pages_back():
    probe = r"""
import json, torch
from mmserve.glibc_heap import keep_large_blocks, release_freed_memory
keep_large_blocks()
def rss():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) * 1024
a = torch.ones(32 << 20); b = torch.ones(32 << 20); keep = torch.ones(1 << 10)  # 2 x 128 MB, then a small tail
del a  # freed inside the heap: kept resident
held = rss()
release_freed_memory()
print(json.dumps({"held": held, "after": rss()}))
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["held"] - r["after"] >= 100 << 20, r  # most of the 128 MB block went back
