"""`serve --encoder-workers 2`: a worker SIGKILLed under load is reaped and restarted (counted in /metrics,
shown "degraded" by /health and the dashboard meanwhile) while every request still gets the HF answer; a
worker that cannot start again (its port taken by another process) crash-loops and is given up, named."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import socket
import time

import httpx
import pytest

from mmserve.testing.probes import child_pids, metric
from mmserve.testing.server_process import start_server
from tests.engine_helpers import image_case, reference_text

MAX_NEW = 8
WAIT_S = 120.0  # bound of every wait for a state change (a worker's restart loads torch and the tower)


@pytest.fixture(scope="module")
def expected(tiny_qwen2_vl):
    return reference_text(tiny_qwen2_vl, MAX_NEW)


def chat(url: str, case) -> str:
    body = {"messages": case.messages, "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def worker_pids(server_pid: int) -> dict[int, int]:
    """port -> pid of the server's encoder workers (its `mmserve encoder` children)."""
    out = {}
    for pid in child_pids(server_pid):
        try:
            with open(f"/proc/{pid}/cmdline") as f:
                argv = f.read().split("\0")
        except FileNotFoundError:
            continue
        if "encoder" in argv and "--port" in argv:
            out[int(argv[argv.index("--port") + 1])] = pid
    return out


def wait_until(check, what: str, timeout_s: float = WAIT_S):
    deadline = time.monotonic() + timeout_s
    while not (result := check()):
        assert time.monotonic() < deadline, f"not within {timeout_s:.0f} s: {what}"
        time.sleep(0.05)
    return result


def health(url: str) -> dict:
    r = httpx.get(url + "/health", timeout=10)
    assert r.status_code == 200, r.text  # degraded or not, the server serves
    return r.json()


def reaped(pid: int) -> bool:
    return not os.path.exists(f"/proc/{pid}")  # a zombie still has its /proc entry


def test_a_killed_worker_is_restarted_and_a_crash_looping_one_given_up(tiny_qwen2_vl, expected, tmp_path):
    args = ("--kv-cache-mb", "16", "--encoder-workers", "2", "--language-only")
    args += ("--encoder-routing", "round_robin")
    server = start_server(tiny_qwen2_vl, *args, log_dir=str(tmp_path))
    held = None
    try:
        assert health(server.url) == {"status": "ok"}
        states = httpx.get(server.url + "/ui/api/stats", timeout=10).json()["encoder_workers"]
        assert [(w["name"], w["state"]) for w in states] == [
            ("encoder-worker-0", "running"),
            ("encoder-worker-1", "running"),
        ]
        first, other = (int(w["url"].rsplit(":", 1)[1]) for w in states)  # the workers' ports
        workers = worker_pids(server.proc.pid)
        assert set(workers) == {first, other}
        assert metric(server.url, "child_process_restarts_total", process="encoder-worker-0") == 0

        # 1. SIGKILL under load: every request completes with the HF answer (failover meanwhile).
        cases = [image_case([300 + i, 320 + i], f"Pair {i}.") for i in range(6)]
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            answers = [pool.submit(chat, server.url, c) for c in cases]
            time.sleep(0.3)
            os.kill(workers[first], signal.SIGKILL)
            assert [a.result(timeout=WAIT_S) for a in answers] == [expected(c) for c in cases]
        body = wait_until(lambda: (b := health(server.url))["status"] == "degraded" and b, "degraded")
        assert any("encoder-worker-0" in r and "restarting" in r for r in body["reasons"]), body
        wait_until(lambda: reaped(workers[first]), "the killed worker reaped (no zombie)")
        wait_until(lambda: health(server.url) == {"status": "ok"}, "recovered")
        assert metric(server.url, "child_process_restarts_total", process="encoder-worker-0") == 1
        assert metric(server.url, "child_process_restarts_total", process="encoder-worker-1") == 0
        restarted = worker_pids(server.proc.pid)
        assert set(restarted) == {first, other}
        assert restarted[first] != workers[first]  # the same port, a new process
        stats = httpx.get(server.url + "/ui/api/stats", timeout=10).json()["encoder_workers"]
        assert [(w["name"], w["state"], w["restarts"]) for w in stats] == [
            ("encoder-worker-0", "running", 1),
            ("encoder-worker-1", "running", 0),
        ]
        case = image_case([340, 341], "After the restart.")
        assert chat(server.url, case) == expected(case)

        # 2. A crash loop: worker 1 killed, its port taken by another process: each restart exits at once.
        held = socket.socket()
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        for _ in range(10):  # the restarter may take the port back first (0.5 s backoff): kill that one too
            pid = worker_pids(server.proc.pid).get(other)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                wait_until(lambda p=pid: reaped(p) or _zombie(p), "worker 1 dead")
            try:
                held.bind(("127.0.0.1", other))
                break
            except OSError:
                time.sleep(0.1)
        else:
            pytest.fail("could not take worker 1's port")
        held.listen()
        body = wait_until(
            lambda: (
                (b := health(server.url)).get("encoder_workers")
                and b["encoder_workers"][1]["state"] == "failed"
                and b
            ),
            "worker 1 given up",
        )
        assert body["status"] == "degraded" and "encoder-worker-1" in body["reasons"][0], body
        assert "crash-looped" in body["reasons"][0]
        assert metric(server.url, "child_process_restarts_total", process="encoder-worker-1") == 4
        assert "encoder-worker-1" in server.log() and "giving up" in server.log()
        case = image_case([350, 351], "Without worker 1.")
        assert chat(server.url, case) == expected(case)
    finally:
        if held is not None:
            held.close()
        assert server.stop() == 0


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"
    except FileNotFoundError:
        return True
