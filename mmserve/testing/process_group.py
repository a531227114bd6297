"""Start several test processes (servers, encoders) side by side, and stop them together.

Start-up is imports and model loading, CPU-bound. A standalone encoder is one process on one core, so beside
a server it starts in little more than the server's time alone; a server with its engine (and encoder
workers) keeps both cores of a two-core CI runner mostly busy, so two servers side by side gain little. An
encoder and a server that uses it (`--encoder-urls`) start together too, on a port picked beforehand: see
`start_with_encoders`.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from mmserve.server.encoder_workers import free_port
from mmserve.testing.server_process import ServerHandle, start_encoder, start_server

MAX_PARALLEL_STARTS = 2  # more starts at once than a CI runner's cores only thrashes
PROBE_SLACK_S = 1.5  # how far our view of a server's start may be off from its prober's first round


def start_together(
    starts: Mapping[str, Callable[[], ServerHandle]], max_parallel: int = MAX_PARALLEL_STARTS
) -> dict[str, ServerHandle]:
    """Runs the start functions (each bounded by its own start-up timeout) `max_parallel` at a time; returns
    name -> handle once every one is healthy. If any start fails, the processes that did start are stopped
    and the first failure is raised."""
    with concurrent.futures.ThreadPoolExecutor(max_parallel) as pool:
        futures = {name: pool.submit(start) for name, start in starts.items()}
    errors = [f.exception() for f in futures.values() if f.exception() is not None]
    started = {name: f.result() for name, f in futures.items() if f.exception() is None}
    if errors:
        stop_all(started.values())
        raise errors[0]
    return started


def stop_all(handles: Iterable[ServerHandle]) -> list[int]:
    """Stops the processes side by side (SIGTERM, then checks that no child outlives its parent); returns
    their exit codes in the order given."""
    handles = list(handles)
    if not handles:
        return []
    with concurrent.futures.ThreadPoolExecutor(len(handles)) as pool:
        return list(pool.map(lambda handle: handle.stop(), handles))


class SharedProcess:
    """One process that several tests share: the first `get()` starts it (a caller in another thread waits for
    that start), the first `stop()` stops it; later calls return the same exit code."""

    def __init__(self, start: Callable[[], ServerHandle]) -> None:
        self._start = start
        self._lock = threading.Lock()
        self._handle: ServerHandle | None = None
        self._exit_code: int | None = None

    def get(self) -> ServerHandle:
        with self._lock:
            assert self._exit_code is None, "the shared process was stopped already"
            if self._handle is None:
                self._handle = self._start()
            return self._handle

    def get_beside(self, start: Callable[[], ServerHandle]) -> tuple[ServerHandle, ServerHandle]:
        """(the shared process, a process of the caller's own from `start()`), started side by side when the
        shared one is not up yet. If either start fails, the caller's process is stopped."""
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            own = pool.submit(start)
            try:
                shared = self.get()
            except BaseException:
                if own.exception() is None:
                    own.result().stop()
                raise
            return shared, own.result()

    def stop(self, before: Callable[[ServerHandle], object] = lambda handle: None) -> int | None:
        """Runs `before(handle)` (a last check), then stops the process; None if it never started."""
        with self._lock:
            if self._handle is not None and self._exit_code is None:
                try:
                    before(self._handle)
                finally:
                    self._exit_code = self._handle.stop()
            return self._exit_code


@dataclass
class EncoderSpec:
    """One standalone encoder of `start_with_encoders`: its extra CLI arguments and environment."""

    args: Sequence[str] = ()
    env: dict[str, str] | None = None


def start_with_encoders(
    model_dir: str,
    server_args: Sequence[str],
    encoders: Sequence[EncoderSpec | str],
    *,
    log_dir: str,
    server_env: dict[str, str] | None = None,
    probe_interval_s: float = 5.0,
    max_parallel: int = MAX_PARALLEL_STARTS,
) -> tuple[ServerHandle, list[ServerHandle]]:
    """Standalone encoders and a server that uses them, started side by side on ports picked beforehand.

    `encoders` lists the server's `--encoder-urls` (added after `server_args`) in order: an `EncoderSpec` is
    started here, a URL is an encoder already running. Returns (server, the encoders started here) once the
    server's view of every encoder is the one it would have had if the encoders had started first: the
    server takes a static encoder for healthy until its prober (every `probe_interval_s`, the server's
    `--encoder-probe-interval-s`) has failed to reach it twice, so when an encoder came up so late after the
    server that this may have happened, this waits until the prober has seen it up."""
    ports = {i: free_port() for i, spec in enumerate(encoders) if isinstance(spec, EncoderSpec)}
    urls = [f"http://127.0.0.1:{ports[i]}" if i in ports else str(spec) for i, spec in enumerate(encoders)]
    ready_at: dict[str, float] = {}

    def timed(name: str, start: Callable[[], ServerHandle]) -> Callable[[], ServerHandle]:
        def run() -> ServerHandle:
            handle = start()
            ready_at[name] = time.monotonic()
            return handle

        return run

    def encoder_start(spec: EncoderSpec, port: int) -> Callable[[], ServerHandle]:
        return lambda: start_encoder(model_dir, *spec.args, port=port, log_dir=log_dir, env=spec.env)

    starts = {
        f"encoder{i}": timed(f"encoder{i}", encoder_start(encoders[i], port)) for i, port in ports.items()
    }
    starts["server"] = timed(
        "server",
        lambda: start_server(
            model_dir, *server_args, "--encoder-urls", *urls, log_dir=log_dir, env=server_env
        ),
    )
    handles = start_together(starts, max_parallel)
    # The prober's first round runs as the server starts answering /health (at ready_at["server"], give or
    # take our polling slack); its second, which may mark an encoder that is still down unhealthy, comes at
    # least `probe_interval_s` later.
    last_encoder = max((ready_at[name] for name in starts if name != "server"), default=0.0)
    if last_encoder > ready_at["server"] + probe_interval_s - PROBE_SLACK_S:
        time.sleep(max(0.0, last_encoder + probe_interval_s + PROBE_SLACK_S - time.monotonic()))
    return handles.pop("server"), list(handles.values())
