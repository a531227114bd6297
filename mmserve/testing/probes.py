"""Probes of running processes and servers for the end-to-end, fault and soak tests.

Processes: resident memory (`/proc/PID/status` VmRSS) and open file descriptors (`/proc/PID/fd`) of a process
and its descendants (`pgrep -P`); Linux only. Servers: one value from `/metrics`, and the engine's integrity
check once the server has settled.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families


# -- servers ---------------------------------------------------------------------------------------------
def metric(url: str, name: str, **labels: str) -> float:
    """The sum of the `mmserve:<name>` samples of a server's or encoder's /metrics whose labels include
    `labels` (e.g. `metric(url, "request_errors_total", status="503")`). Raises AssertionError when no
    sample has that name at all, so a renamed metric fails the test instead of reading as 0."""
    text = httpx.get(url + "/metrics", timeout=10).text
    samples = [
        s for f in text_string_to_metric_families(text) for s in f.samples if s.name == f"mmserve:{name}"
    ]
    assert samples, f"no metric mmserve:{name} at {url}"
    return sum(s.value for s in samples if labels.items() <= s.labels.items())


def settled_integrity(url: str, settle_s: float = 30.0) -> dict:
    """`/health?check_integrity=true` once nothing runs, waits or is in flight (bounded wait); asserts the
    pools and caches are consistent and returns the body."""
    deadline = time.monotonic() + settle_s
    with httpx.Client(timeout=10) as client:  # one client: httpx.get makes one (30 ms of CPU) per call
        while True:
            r = client.get(url + "/health", params={"check_integrity": "true"})
            body = r.json()
            assert r.status_code == 200 and body["status"] == "ok", body
            if body["in_flight"] == body["num_running"] == body["num_waiting"] == 0:
                return body
            assert time.monotonic() < deadline, f"requests still held after the load ended: {body}"
            time.sleep(0.2)


# -- processes -------------------------------------------------------------------------------------------
def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    """Resident set size of a process (VmRSS), or its peak so far (`field="VmHWM"`)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0  # a zombie has no VmRSS


def tree_resident_mb(pid: int) -> tuple[float, float]:
    """(resident MB now, the sum of each process's peak) over `pid` and its descendants: a server's memory,
    its engine and encoder processes included. Processes that exit meanwhile count 0."""
    now = peak = 0
    for p in process_tree(pid):
        try:
            now, peak = now + rss_bytes(p), peak + rss_bytes(p, "VmHWM")
        except OSError:
            pass
    return now / 2**20, peak / 2**20


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def child_pids(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, timeout=10)
    return [int(p) for p in out.stdout.split()]


def process_tree(pid: int, max_depth: int = 3) -> list[int]:
    """`pid` and its descendants (breadth first, at most `max_depth` levels down)."""
    tree, level = [pid], [pid]
    for _ in range(max_depth):
        level = [c for p in level for c in child_pids(p)]
        tree += level
    return tree


@dataclass
class ProcSample:
    pid: int
    role: str  # from the command line: "server", "engine", "encoder" or the program name
    rss_bytes: int
    open_fds: int
    extra: dict = field(default_factory=dict)


def role_of(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    if "mmserve.runtime.loop" in argv:
        return "engine"
    for role in ("serve", "encoder"):
        if role in argv:
            return "server" if role == "serve" else role
    return os.path.basename(argv[0]) if argv else "?"


def sample(pids: list[int]) -> list[ProcSample]:
    """RSS and open fds of each process, now."""
    return [ProcSample(pid, role_of(pid), rss_bytes(pid), open_fds(pid)) for pid in pids]
