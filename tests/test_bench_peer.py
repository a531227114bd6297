"""`mmserve bench compare --peer NAME=CMD`: another OpenAI server started from a command line gets the same
workload and client as the configurations; a peer that fails to start is a clear error and leaves nothing
running. The peer here is a real `mmserve serve` of the tiny model (no llama.cpp needed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from mmserve.bench.peer import PeerError, PeerSpec, start_peer, stop_peer

SERVE = f"{sys.executable} -m mmserve.cli serve --model {{model}} --port {{port}} --kv-cache-mb 16"


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mmserve.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def running(marker: str) -> list[str]:
    """Command lines of live processes that contain `marker`."""
    out = subprocess.run(["pgrep", "-af", marker], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "pgrep" not in line]


def gone(marker: str, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while running(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not running(marker)


def test_peer_spec_parsing() -> None:
    spec = PeerSpec.parse("llamacpp = llama-server -m {model} --port {port} --json-schema '{}'")
    assert spec.name == "llamacpp"
    assert spec.expand(8123, "/m dir") == "llama-server -m '/m dir' --port 8123 --json-schema '{}'"
    for bad in ("no-equals-sign", "=cmd {port}", "x=", "x=server-without-a-port"):
        with pytest.raises(ValueError, match="--peer"):
            PeerSpec.parse(bad)


def test_peer_runs_beside_a_config(tiny_qwen2_vl, tmp_path) -> None:
    out = tmp_path / "compare.json"
    workload = "--rounds 1 --num-requests 2 --image-size 64x64 --output-tokens 4 --concurrency 1 --seed 5"
    proc = run_cli(
        "bench",
        "compare",
        tiny_qwen2_vl,
        "--config",
        "hf=",
        "--peer",
        f"other={SERVE}",
        *workload.split(),
        "--json",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert list(results) == ["hf", "other"]
    for runs in results.values():
        [run] = runs
        assert run["ok"] == 2 and run["total_output_tokens"] == 8, run
        assert run["ttft_s"]["mean"] > 0 and run["output_throughput"] > 0
    # The peer is a real server measured by the bench's client; being an mmserve, it has a breakdown too.
    assert results["other"][0]["server"]["decode_s_mean"] is not None
    # Its process tree's memory (a tiny model's server: its engine process and torch, well over 100 MB), none
    # for the in-process baseline.
    other = results["other"][0]
    assert 100 < other["resident_mb"] <= other["peak_resident_mb"] and "resident_mb" not in results["hf"][0]
    assert "| hf |" in proc.stdout and "| other |" in proc.stdout
    assert gone(f"--model {tiny_qwen2_vl}")


def test_failed_peer_is_a_clear_error_and_leaves_nothing(tiny_qwen2_vl) -> None:
    marker = f"sleep {97000 + os.getpid() % 1000}"  # a child the failing command leaves behind
    proc = run_cli(
        "bench",
        "compare",
        tiny_qwen2_vl,
        "--config",
        "mm=--kv-cache-mb 16",
        "--peer",
        f"broken={marker} & echo starting on {{port}}; exit 3",
        "--num-requests",
        "1",
        "--seed",
        "1",
    )
    assert proc.returncode != 0
    assert "peer 'broken' did not start" in proc.stderr and "starting on" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert gone(marker)
    proc = run_cli("bench", "compare", tiny_qwen2_vl, "--peer", "x=no-such-server-xyz --port {port}")
    assert proc.returncode != 0 and "peer 'x' did not start" in proc.stderr and "not found" in proc.stderr


HEALTHY = """
import http.server, sys

class Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Ok).serve_forever()
"""


def test_peer_processes_all_end_unhealthy_or_stopped(tmp_path) -> None:
    marker = f"sleep {98000 + os.getpid() % 1000}"
    spec = PeerSpec.parse(f"mute={marker} | cat # never listens on {{port}}")
    with pytest.raises(PeerError, match="not healthy"):
        start_peer(spec, "unused", str(tmp_path), timeout_s=1.0)
    assert gone(marker)
    # A healthy peer behind a pipeline and a wrapper shell: stop_peer ends every process of it.
    script = tmp_path / "healthy_peer.py"
    script.write_text(HEALTHY)
    spec = PeerSpec.parse(f"ok={marker} | sh -c '{sys.executable} {script} {{port}}'")
    handle = start_peer(spec, "unused", str(tmp_path), timeout_s=30.0)
    assert running(marker) and running(str(script))
    stop_peer(handle)
    assert gone(marker) and gone(str(script))


@pytest.mark.parametrize("one_at_a_time", [False, True])
def test_one_at_a_time_starts_each_server_for_its_own_turn(tiny_qwen2_vl, tmp_path, one_at_a_time) -> None:
    """Two peers; the second notes at its start whether the first one's server is up. By default both are up for
    the whole run (the note says so: the negative control); with --one-at-a-time the first is gone first."""
    events = tmp_path / "events"
    first = f"{SERVE} --served-model-name first-{tmp_path.name}"
    # The first peer's processes only: a port number where the bench's own argv has "{port}", and "[e]" so
    # that the pattern does not match this shell's command line.
    marker = f"--port [0-9]+ --kv-cache-mb 16 --served-model-nam[e] first-{tmp_path.name}"
    probe = f"pgrep -f -- '{marker}' >/dev/null && echo overlap >> {events}"
    second = f"{{ {probe}; echo second >> {events}; }}; exec {SERVE}"
    workload = "--rounds 1 --num-requests 1 --image-size 64x64 --output-tokens 2 --concurrency 1 --seed 5"
    flags = ["--one-at-a-time"] if one_at_a_time else []
    out = tmp_path / "compare.json"
    proc = run_cli(
        "bench", "compare", tiny_qwen2_vl, "--peer", f"first={first}", "--peer", f"second={second}",
        *flags, *workload.split(), "--json", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert [r[0]["ok"] for r in results.values()] == [1, 1]
    assert events.read_text().split() == (["second"] if one_at_a_time else ["overlap", "second"])
    assert gone(f"--model {tiny_qwen2_vl}")
