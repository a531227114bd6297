"""A server that is still starting: it stops when asked, and an encoder worker that cannot encode ends the
start-up at once with its reason instead of after the start-up timeout."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time

import pytest

from mmserve.config import EngineConfig
from mmserve.server.encoder_workers import EncoderWorkers, free_port

# A stand-in for a worker whose tower fails its health probe (`mmserve encoder` answers /health that way).
UNHEALTHY_WORKER = """
import http.server, json, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"status": "unhealthy", "reason": "probe encode failed: tower exploded"}).encode()
        self.send_response(503)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"
    except FileNotFoundError:
        return True


def test_sigterm_while_the_engine_boots_stops_the_server(tiny_qwen2_vl):
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "mmserve.cli",
        "serve",
        tiny_qwen2_vl,
        "--port",
        str(port),
        "--kv-cache-mb",
        "8",
    ]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (children := _children(server.pid)):  # the engine is spawned: the start-up is under way
            assert server.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        server.send_signal(signal.SIGTERM)
        _, err = server.communicate(timeout=30)  # not the engine's start-up timeout (600 s)
        assert server.returncode == 0, err
        assert "stopped during start-up" in err and "Traceback" not in err, err
        for pid in children:
            for _ in range(50):
                if _gone(pid):
                    break
                time.sleep(0.1)
            assert _gone(pid), f"child {pid} outlived the server"
    finally:
        if server.poll() is None:
            server.kill()
            server.communicate()


def test_an_unhealthy_worker_ends_the_start_up_with_its_reason():
    workers = EncoderWorkers(EngineConfig(model="unused"), 0, "warning")
    port = free_port()
    workers.procs.append(subprocess.Popen([sys.executable, "-c", UNHEALTHY_WORKER, str(port)]))
    workers.urls.append(f"http://127.0.0.1:{port}")
    try:
        # Three strikes, not the whole timeout (which would raise "not healthy after 120s").
        with pytest.raises(RuntimeError, match="unhealthy at start-up: probe encode failed: tower exploded"):
            asyncio.run(workers.wait_healthy(timeout_s=120))
    finally:
        workers.stop()


def test_a_worker_that_exits_ends_the_start_up():
    workers = EncoderWorkers(EngineConfig(model="unused"), 0, "warning")
    workers.procs.append(subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"]))
    workers.urls.append(f"http://127.0.0.1:{free_port()}")
    try:
        with pytest.raises(RuntimeError, match="exited with code 3"):
            asyncio.run(workers.wait_healthy(timeout_s=120))
    finally:
        workers.stop()
