"""Start `mmserve serve` as a real subprocess on a free loopback port, wait until healthy, and stop it.

Used by the end-to-end tests and by `mmserve demo`. Stopping checks that no child process (the engine)
outlives the server.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from mmserve.server.encoder_workers import free_port
from mmserve.testing.probes import child_pids


@dataclass
class ServerHandle:
    url: str
    proc: subprocess.Popen
    log_path: str

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def child_pids(self) -> list[int]:
        return child_pids(self.proc.pid)

    def stop(self, timeout_s: float = 30.0) -> int:
        children = self.child_pids()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError("server did not stop within the timeout after SIGTERM") from None
        if orphans := still_running(children):  # no orphans: the engine process is gone too
            for pid in orphans:
                os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"child processes {orphans} outlived the server")
        return code


def gone(pid: int) -> bool:
    """The process has exited (reaped, or a zombie its parent has not waited for)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"
    except FileNotFoundError:
        return True


def still_running(pids: list[int], wait_s: float = 5.0) -> list[int]:
    """Those of `pids` still running after up to `wait_s` (a stopped server's children get a moment's lag)."""
    deadline = time.monotonic() + wait_s
    while (alive := [pid for pid in pids if not gone(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def start_server(model_dir: str, *args: str, log_dir: str, timeout_s: float = 180.0,
                 served_model_name: str = "tiny", port: int | None = None,
                 env: dict[str, str] | None = None) -> ServerHandle:  # fmt: skip
    """`mmserve serve` on a free (or the given) loopback port; returns once /health is 200.

    `env` is added to this process's environment for the child (e.g. MMSERVE_CLUSTER_SECRET)."""

    def cmd(port: int) -> list[str]:
        return [sys.executable, "-m", "mmserve.cli", "serve", "--model", model_dir, "--port", str(port),
                "--served-model-name", served_model_name, "--log-level", "warning", *args]  # fmt: skip

    return _start(cmd, port, log_dir, "server", timeout_s, env)


def start_encoder(model_dir: str, *args: str, log_dir: str, timeout_s: float = 120.0,
                  port: int | None = None, env: dict[str, str] | None = None) -> ServerHandle:  # fmt: skip
    """`mmserve encoder` on a free (or the given) loopback port; returns once /health is 200."""

    def cmd(port: int) -> list[str]:
        return [sys.executable, "-m", "mmserve.cli", "encoder", "--model", model_dir, "--port", str(port),
                "--log-level", "warning", *args]  # fmt: skip

    return _start(cmd, port, log_dir, "encoder", timeout_s, env)


def start_router(
    prefill: list[str],
    decode: list[str],
    *args: str,
    log_dir: str,
    timeout_s: float = 60.0,
    env: dict[str, str] | None = None,
) -> ServerHandle:
    """`mmserve router` over these prefill and decode servers on a free loopback port; returns once its /health
    is 200 (it has a healthy server of each role)."""

    def cmd(port: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "mmserve.cli",
            "router",
            "--prefill",
            *prefill,
            "--decode",
            *decode,
            "--port",
            str(port),
            "--log-level",
            "warning",
            *args,
        ]

    return _start(cmd, None, log_dir, "router", timeout_s, env)


def _start(cmd: Callable[[int], list[str]], port: int | None, log_dir: str, kind: str, timeout_s: float,
           env: dict[str, str] | None, attempts: int = 3) -> ServerHandle:  # fmt: skip
    """Starts `cmd(port)`; a free port picked here can be taken by another process before the child binds
    it, so a start that fails with "address already in use" is retried on a new port."""
    for attempt in range(attempts):
        try:
            return _start_once(cmd, port or free_port(), log_dir, kind, timeout_s, env)
        except _PortTaken:
            if port is not None or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


class _PortTaken(AssertionError):
    pass


def _start_once(cmd: Callable[[int], list[str]], port: int, log_dir: str, kind: str, timeout_s: float,
                env: dict[str, str] | None) -> ServerHandle:  # fmt: skip
    log_path = os.path.join(log_dir, f"{kind}-{port}.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd(port), stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
    handle = ServerHandle(f"http://127.0.0.1:{port}", proc, log_path)
    deadline = time.monotonic() + timeout_s
    # One client for the whole wait: `httpx.get` builds a client, and its TLS context, on every call (30 ms of
    # CPU), which polled every 50 ms took 60% of a core from the server starting beside it.
    with httpx.Client(timeout=2) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                error = _PortTaken if "address already in use" in handle.log().lower() else AssertionError
                raise error(f"{kind} exited during start-up:\n{handle.log()}")
            try:
                if client.get(handle.url + "/health").status_code == 200:
                    return handle
            except httpx.HTTPError:
                pass
            time.sleep(0.05)  # a refused connect costs ~nothing: readiness is seen ~25 ms late on average
    handle.stop()
    raise AssertionError(f"{kind} not healthy after {timeout_s}s:\n{handle.log()}")
