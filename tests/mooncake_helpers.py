"""A real `mooncake_master` on 127.0.0.1 for tests: free ports, no HTTP metadata server, logs to a file.

    proc, url = start_master(tmp_path)          # url: "mooncake://127.0.0.1:PORT"
    ...
    stop_master(proc)

or `with running_master(tmp_path) as (proc, url): ...`. Clients use metadata "P2PHANDSHAKE" (no metadata
server). The master's admin/metrics server defaults to 0.0.0.0:9003, so it is bound to a free loopback port
here too.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

START_TIMEOUT_S = 20.0
ATTEMPTS = 3  # a free port picked here can be taken before the master binds it


def master_binary() -> str:
    """`mooncake_master` of this virtualenv (the mooncake-transfer-engine-non-cuda wheel ships it)."""
    return str(Path(sys.executable).with_name("mooncake_master"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
    except OSError:
        return False
    return True


def start_master(tmp_path: str | os.PathLike, rpc_port: int | None = None) -> tuple[subprocess.Popen, str]:
    """Start a master (on `rpc_port`, or a free one) and wait until its RPC port accepts connections.
    Returns the process and the store URL. Raises AssertionError, with the master's log, if it does not
    start."""
    error = ""
    for _ in range(1 if rpc_port is not None else ATTEMPTS):
        port, metrics_port = rpc_port or free_port(), free_port()
        log_path = Path(tmp_path) / f"mooncake_master-{port}.log"
        cmd = [
            master_binary(),
            f"--rpc_port={port}",
            "--rpc_address=127.0.0.1",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={metrics_port}",
            "--enable_http_metadata_server=false",
        ]
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while proc.poll() is None and time.monotonic() < deadline:
            if _accepts(port):
                return proc, f"mooncake://127.0.0.1:{port}"
            time.sleep(0.05)
        stop_master(proc)
        error = log_path.read_text()
    raise AssertionError(f"mooncake_master did not start:\n{error[-4000:]}")


def stop_master(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """Kill the master (SIGKILL: its state is memory only) and reap it. Idempotent."""
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=timeout_s)


@contextlib.contextmanager
def running_master(tmp_path: str | os.PathLike) -> Iterator[tuple[subprocess.Popen, str]]:
    proc, url = start_master(tmp_path)
    try:
        yield proc, url
    finally:
        stop_master(proc)
