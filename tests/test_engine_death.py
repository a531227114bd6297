"""The engine process dies: in-flight requests get 503 quickly and the server exits non-zero (no hang)."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import httpx

from mmserve.testing.probes import metric
from mmserve.testing.server_process import start_server


def test_engine_death_fails_in_flight_requests_and_exits_nonzero(tiny_qwen2_vl, tmp_path):
    server = start_server(tiny_qwen2_vl, "--kv-cache-mb", "16", log_dir=str(tmp_path))
    try:
        (engine_pid,) = server.child_pids()
        body = {"messages": [{"role": "user", "content": "Talk for a long time."}], "max_tokens": 3000,
                "ignore_eos": True, "temperature": 0}  # fmt: skip
        url = server.url + "/v1/chat/completions"

        def stream() -> str:
            with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
                assert r.status_code == 200
                return "".join(r.iter_text())

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(httpx.post, url, json=body, timeout=60) for _ in range(2)]
            streamed = pool.submit(stream)
            # Until the three requests are decoding (a fixed sleep was not enough on a slow machine: the stream
            # arrived too late).
            deadline = time.monotonic() + 60
            while metric(server.url, "num_requests_running") < 3:
                assert time.monotonic() < deadline, "the requests never all ran"
                time.sleep(0.1)
            start = time.monotonic()
            os.kill(engine_pid, signal.SIGKILL)
            responses = [f.result(timeout=30) for f in futures]
            text = streamed.result(timeout=30)
        for r in responses:
            assert r.status_code == 503 and "engine" in r.json()["error"]["message"]
        assert '"code": "engine_dead"' in text and text.endswith("data: [DONE]\n\n")  # in-band error
        assert time.monotonic() - start < 10
        try:  # until it has exited, the server reports itself unhealthy
            assert httpx.get(server.url + "/health", timeout=5).status_code == 503
        except httpx.TransportError:
            pass  # already gone
        assert server.proc.wait(timeout=30) == 1  # a supervisor sees a failure and restarts it
    finally:
        if server.proc.poll() is None:
            server.stop()
