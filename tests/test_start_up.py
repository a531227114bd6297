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
from mmserve.testing.probes import child_pids
from mmserve.testing.server_process import still_running

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
        while not (children := child_pids(server.pid)):  # the engine is spawned: the start-up is under way
            assert server.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        server.send_signal(signal.SIGTERM)
        _, err = server.communicate(timeout=30)  # not the engine's start-up timeout (600 s)
        assert server.returncode == 0, err
        assert "stopped during start-up" in err and "Traceback" not in err, err
        assert not still_running(children), "a child outlived the server"
    finally:
        if server.poll() is None:
            server.kill()
            server.communicate()


# (stand-in program, what the start-up failure names): a worker answering 503 three times, not the whole
# timeout (which would raise "not healthy after 120s"); a worker that exits.
WORKER_FAULTS = [
    (UNHEALTHY_WORKER, "unhealthy at start-up: probe encode failed: tower exploded"),
    ("raise SystemExit(3)", "exited with code 3"),
]


@pytest.mark.parametrize(("program", "reason"), WORKER_FAULTS, ids=["unhealthy", "exits"])
def test_a_failing_worker_ends_the_start_up_with_its_reason(program, reason):
    workers = EncoderWorkers(EngineConfig(model="unused"), 0, "warning")
    port = free_port()
    workers.procs.append(subprocess.Popen([sys.executable, "-c", program, str(port)]))
    workers.urls.append(f"http://127.0.0.1:{port}")
    try:
        with pytest.raises(RuntimeError, match=reason):
            asyncio.run(workers.wait_healthy(timeout_s=120))
    finally:
        workers.stop()


def test_a_checkpoint_with_a_layer_kind_mmserve_does_not_run_fails_at_start_in_one_line(tmp_path):
    from mmserve.testing.tiny_models import build_tiny_model

    def chunked(config):  # Qwen2-VL with a chunked-attention layer (Llama 4's): not a kind the engine runs
        config.text_config.layer_types = ["chunked_attention", "full_attention"]

    model = build_tiny_model(str(tmp_path / "chunked"), "qwen2_vl", edit_config=chunked)
    cmd = [sys.executable, "-m", "mmserve.cli", "serve", model, "--port", str(free_port())]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if "cannot start" in line]
    assert errors and "decoder layer 0 is 'chunked_attention'" in errors[-1]
    assert "does not run" in errors[-1] and "Traceback" not in done.stderr, done.stderr
