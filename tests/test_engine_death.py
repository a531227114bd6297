"""The engine process dies: in-flight requests get 503 quickly and the server exits non-zero (no hang)."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import httpx

from mmserve.testing.server_process import start_server


def test_engine_death_fails_in_flight_requests_and_exits_nonzero(tiny_qwen2_vl, tmp_path):
    server = start_server(tiny_qwen2_vl, "--kv-cache-mb", "16", log_dir=str(tmp_path))
    try:
        (engine_pid,) = server.child_pids()
        body = {"messages": [{"role": "user", "content": "Talk for a long time."}], "max_tokens": 3000,
                "ignore_eos": True, "temperature": 0}  # fmt: skip
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            future = pool.submit(httpx.post, server.url + "/v1/chat/completions", json=body, timeout=60)
            time.sleep(0.5)  # the request is decoding
            start = time.monotonic()
            os.kill(engine_pid, signal.SIGKILL)
            r = future.result(timeout=30)
        assert r.status_code == 503 and "engine" in r.json()["error"]["message"]
        assert time.monotonic() - start < 10
        assert server.proc.wait(timeout=30) == 1  # a supervisor sees a failure and restarts it
    finally:
        if server.proc.poll() is None:
            server.stop()
