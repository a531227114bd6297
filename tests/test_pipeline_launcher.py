"""The P/D pipeline launcher (`mmserve serve --prefill-workers N --decode-workers M`): the argv its children get,
and a whole pipeline of stand-in servers (mmserve.testing.pd_standin) started, routed to and stopped."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading

import httpx

from mmserve.config import RouterConfig
from mmserve.disagg.pipeline import PipelineConfig, child_argv
from mmserve.server.encoder_workers import free_port
from mmserve.transport.cluster_auth import ENV_VAR
from tests.test_router import chat, eventually


def test_child_argv_drops_the_pipeline_flags():
    kept = "serve --model m --max-num-seqs 7 --served-model-name n --".split()
    dropped = "--prefill-workers 2 --decode-workers=1 --ho 0.0.0.0 --port 9000 --api-k k --cluster-secret"
    argv = [*kept[:3], *dropped.split(), "s" * 16, "--encoder-workers", "1", *kept[3:]]
    assert child_argv(argv) == kept
    cfg = PipelineConfig(tuple(argv), 2, 1, RouterConfig(), encoder_workers=1)
    cmd = cfg.child_command("prefill", 1234, ["http://127.0.0.1:5"])
    assert cmd[cmd.index("--port") + 1] == "1234" and "s" * 16 not in cmd
    assert cmd[cmd.index("--encoder-urls") + 1 :] == ["http://127.0.0.1:5", "--encoder-transport", "shm"]
    assert "--encoder-urls" not in cfg.child_command("decode", 1234, ["http://127.0.0.1:5"])


PIPELINE = """
import sys
from mmserve.config import RouterConfig
from mmserve.disagg.pipeline import PipelineConfig, run_pipeline
argv = ("serve", "--model", "m", "--prefill-workers", "1", "--decode-workers", "1", "--port", sys.argv[1],
        "--max-num-seqs", "7")
launcher = tuple(sys.argv[2:]) or (sys.executable, "-m", "mmserve.testing.pd_standin")
sys.exit(run_pipeline(PipelineConfig(argv, 1, 1, RouterConfig(port=int(sys.argv[1])), launcher=launcher,
                                     stop_timeout_s=5)))
"""


def test_pipeline_starts_routes_and_stops_its_children():
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}  # the launcher makes up a secret
    cmd = [sys.executable, "-c", PIPELINE, str(port)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    try:
        seen: list[str] = []
        while not any("router on" in line for line in seen):
            seen.append(lines.get(timeout=30))
        urls = [line.split()[3] for line in seen if line.startswith("mmserve: ") and line.endswith("ready\n")]
        assert len(urls) == 2, seen
        with httpx.Client(timeout=10, trust_env=False) as http:
            router = f"http://127.0.0.1:{port}"
            assert eventually(lambda: _status(http, f"{router}/health") == 200, 10)
            resp = http.post(f"{router}/v1/chat/completions", json=chat("hi"))
            assert resp.status_code == 200, resp.text
            states = [http.get(f"{u}/_standin/state").json() for u in urls]
        for state in states:  # the secret went by the environment; the user's flags are forwarded
            argv = state["argv"]
            assert state["has_secret"] and "--max-num-seqs" in argv
            assert argv[argv.index("--prefill-workers") + 1] == "0"
            assert not any(len(a) == 64 for a in state["argv"])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        for state in states:
            assert eventually(lambda s=state: not _alive(s["pid"]), 5)
    finally:
        proc.kill()
        proc.wait()


def _status(http: httpx.Client, url: str) -> int:
    try:
        return http.get(url).status_code
    except httpx.HTTPError:
        return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_pipeline_exits_1_when_a_child_dies_at_start_up():
    port = free_port()
    cmd = [sys.executable, "-c", PIPELINE, str(port), sys.executable, "-c", "import sys; sys.exit(3)"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert out.returncode == 1
    assert "exited with code 3 during start-up" in out.stderr and "server http://127.0.0.1:" in out.stderr
