"""Peers of `mmserve bench compare`: other OpenAI-compatible servers (llama.cpp's llama-server, vLLM, another
mmserve) launched from a shell command line, benchmarked with the same workload and client as mmserve.

`--peer NAME=CMD`: CMD runs under /bin/sh in a session of its own, with `{port}` replaced by a free loopback
port chosen here and `{model}` by the compare's model (shell-quoted). The start machinery is the one the
bench uses for `mmserve serve` (mmserve.testing.server_process: log file, start-up timeout, GET /health until
200, a retry on a port taken meanwhile); llama-server and vLLM answer /health once their model is loaded.

Stopping reaches every process CMD started, pipelines and wrapper scripts included: the shell's TERM trap
forwards the signal to its whole process group (the session is the peer's alone, so nothing of ours), waits
for them, and whatever is still there afterwards gets SIGKILL. A CMD that exits by itself (a failed start)
has what it left behind terminated the same way.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
from dataclasses import dataclass

from mmserve.testing.server_process import ServerHandle
from mmserve.testing.server_process import _start as start_process

PEER_START_TIMEOUT_S = 900.0  # a peer may load a large model from a cold disk
_LOG_TAIL_LINES = 40  # of the peer's log, in a start-up error

# The shell that runs CMD: on TERM, or when CMD ends by itself (a failed start), every process left in the
# group gets TERM too; the shell exits once they are gone.
_SCRIPT = """trap 'trap "" TERM; kill -TERM 0; wait; exit 143' TERM
(
{command}
) &
wait $!
status=$?
trap "" TERM
kill -TERM 0
wait
exit $status
"""
# Runs `sh -c SCRIPT` as the leader of a new session and process group, in this same process (no fork).
_NEW_SESSION = "import os, sys; os.setsid(); os.execv('/bin/sh', ['sh', '-c', sys.argv[1]])"


class PeerError(RuntimeError):
    """A peer that could not be started (its command failed, exited, or never became healthy)."""


@dataclass(frozen=True)
class PeerSpec:
    """`NAME=CMD` of the command line."""

    name: str
    command: str

    @classmethod
    def parse(cls, spec: str) -> PeerSpec:
        name, sep, command = spec.partition("=")
        if not sep or not name.strip() or not command.strip():
            raise ValueError(f"--peer takes NAME=COMMAND, got {spec!r}")
        if "{port}" not in command:
            raise ValueError(f"--peer {name.strip()}: the command must listen on {{port}}: {command!r}")
        return cls(name.strip(), command.strip())

    def expand(self, port: int, model: str) -> str:
        """The command line with `{port}` and `{model}` filled in (other braces are left alone)."""
        return self.command.replace("{port}", str(port)).replace("{model}", shlex.quote(model))


def start_peer(
    spec: PeerSpec, model: str, log_dir: str, timeout_s: float = PEER_START_TIMEOUT_S
) -> ServerHandle:
    """Starts the peer and returns once its /health is 200. Raises PeerError with the end of its log when it
    exits or is not healthy within `timeout_s`; nothing it started is left running then."""

    def argv(port: int) -> list[str]:
        return [sys.executable, "-c", _NEW_SESSION, _SCRIPT.format(command=spec.expand(port, model))]

    try:
        return start_process(argv, None, log_dir, f"peer-{spec.name}", timeout_s, None)
    except AssertionError as e:  # the start machinery's "exited during start-up" / "not healthy"
        first, _, log = str(e).partition("\n")
        tail = "\n".join(log.splitlines()[-_LOG_TAIL_LINES:])
        raise PeerError(
            f"peer {spec.name!r} did not start ({first.rstrip(':')}): {spec.command}\n{tail}"
        ) from None


def stop_peer(handle: ServerHandle) -> None:
    """SIGTERM to the peer's shell (forwarded to its whole group), then SIGKILL to any process left in it.
    Never raises: a peer that had to be killed is reported on stderr (the bench's other servers still get
    stopped)."""
    try:
        handle.stop()
    except AssertionError as e:  # did not stop in time, or left a child behind: killed below
        print(f"bench: peer at {handle.url} had to be killed: {e}", file=sys.stderr)
    try:
        os.killpg(handle.proc.pid, signal.SIGKILL)  # the shell leads the group: its pid is the group id
    except ProcessLookupError:
        pass  # all gone, as they should be
