"""Local encoder worker processes for `mmserve serve --encoder-workers N` (EPD on one machine).

Each worker is a real `mmserve encoder` subprocess on a free loopback port, registered as a static encoder
and stopped with the server (SIGTERM, then SIGKILL).

A worker that dies while the server runs is reaped and restarted on its own port (its URL is what the
dispatcher knows), after a backoff (mmserve.server.restart_policy); one that crash-loops is given up, and
logged as such. Meanwhile the dispatcher fails its parts over to the other encoders (or the engine's tower),
and /health says "degraded", naming it. The other children of a server are not restarted: the engine process
holds every request's KV and state, so its death fails them all and the server exits 1 for its supervisor to
restart the whole (launch.py); the server starts no Mooncake master (the embedding store's is the operator's).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from mmserve.config import EngineConfig
from mmserve.server.parent_watch import child_of_this_process
from mmserve.server.restart_policy import RestartBackoff, RestartPolicy
from mmserve.transport.cluster_auth import child_env

logger = logging.getLogger("mmserve.server")
# Failed health checks in a row that end the start-up (a refused connection, not listening yet, is no strike).
UNHEALTHY_STRIKES = 3
WATCH_INTERVAL_S = 0.5  # how often the supervisor looks for a dead worker (and reaps it)


def free_port() -> int:
    """A port free on 127.0.0.1 now; another process may still take it before the child binds it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def as_args(flags: dict[str, str]) -> list[str]:
    """{"--flag": value} as the command-line words `--flag value`, in order."""
    return [word for pair in flags.items() for word in pair]


def encoder_command(engine_cfg: EngineConfig, port: int, log_level: str) -> list[str]:
    """The `mmserve encoder` command line of one worker: the server's model, dtype, device, GEMM and packing
    choices, kernels, cache size and media policy, on `port` of 127.0.0.1."""
    media = engine_cfg.media
    flags = {
        "--model": engine_cfg.model,
        "--port": str(port),
        "--dtype": engine_cfg.dtype,
        "--device": engine_cfg.device,
        "--log-level": log_level,
        "--embedding-cache-mb": str(engine_cfg.embedding_cache_mb),
        "--max-media-mb": str(media.max_media_bytes / 2**20),
        "--media-fetch-timeout-s": str(media.fetch_timeout_s),
    }
    cmd = [sys.executable, "-m", "mmserve.cli", "encoder", *as_args(flags)]
    cmd += ["--fp32-gemm", engine_cfg.fp32_gemm]  # the towers' GEMMs as the server's own tower's
    if not engine_cfg.pack_weights:
        cmd.append("--disable-weight-packing")
    if not engine_cfg.cpu_kernels:
        cmd.append("--disable-cpu-kernels")
    if engine_cfg.quantization is not None and engine_cfg.quantize_tower:
        cmd += ["--quantization", engine_cfg.quantization]
    if media.allowed_local_media_path:
        cmd += ["--allowed-local-media-path", media.allowed_local_media_path]
    if media.allowed_media_domains:
        cmd += ["--allowed-media-domains", *media.allowed_media_domains]
    if media.allow_private_urls:
        cmd.append("--allow-private-media-urls")
    if media.allowed_media_networks:
        cmd += ["--allowed-media-networks", *media.allowed_media_networks]
    if media.media_host_overrides:
        cmd += ["--media-resolve", *(f"{host}={ip}" for host, ip in media.media_host_overrides)]
    if engine_cfg.mm_processor_kwargs:
        import json

        cmd += ["--mm-processor-kwargs", json.dumps(dict(engine_cfg.mm_processor_kwargs))]
    if (store := engine_cfg.embedding_store) is not None:
        cmd += as_args(
            {
                "--embedding-store": store.url,
                "--embedding-store-local-host": store.local_host,
                "--embedding-store-segment-mb": str(store.segment_mb),
                "--embedding-store-buffer-mb": str(store.buffer_mb),
                "--embedding-store-timeout-s": str(store.timeout_s),
                "--embedding-store-retry-s": str(store.retry_s),
            }
        )
    return cmd


@dataclass
class WorkerState:
    """One worker as /health, /metrics and the dashboard show it."""

    name: str  # "encoder-worker-0": the `process` label of mmserve:child_process_restarts_total
    url: str
    state: str = "starting"  # starting | running | restarting (dead, or starting again) | failed (given up)
    restarts: int = 0
    last_exit_code: int | None = None

    @property
    def problem(self) -> str | None:
        """Why the worker does not serve now (None: it does)."""
        if self.state in ("starting", "running"):
            return None
        what = "restarting" if self.state == "restarting" else "down: it crash-looped and is not restarted"
        return f"{self.name} ({self.url}) is {what} (last exit code {self.last_exit_code})"

    def as_json(self) -> dict:
        return {
            "name": self.name,
            "url": self.url,
            "state": self.state,
            "restarts": self.restarts,
            "last_exit_code": self.last_exit_code,
        }


class EncoderWorkers:
    def __init__(
        self,
        engine_cfg: EngineConfig,
        count: int,
        log_level: str,
        cluster_secret: str | None = None,
        policy: RestartPolicy | None = None,
    ) -> None:
        self.procs: list[subprocess.Popen] = []
        self.urls: list[str] = []
        self.states: list[WorkerState] = []
        self.policy = policy or RestartPolicy()
        self._commands: list[list[str]] = []
        self._env = child_of_this_process(child_env(cluster_secret))
        self._stopping = False
        self._watchers: list[asyncio.Task] = []
        for i in range(count):
            port = free_port()
            cmd = encoder_command(engine_cfg, port, log_level)
            self.procs.append(subprocess.Popen(cmd, env=self._env))
            self.urls.append(f"http://127.0.0.1:{port}")
            self.states.append(WorkerState(f"encoder-worker-{i}", self.urls[-1]))
            self._commands.append(cmd)

    @property
    def problems(self) -> list[str]:
        """Why some workers do not serve now (empty: every one does)."""
        return [p for s in self.states if (p := s.problem) is not None]

    async def wait_healthy(self, timeout_s: float) -> None:
        """Raises RuntimeError, naming the worker and why, as soon as one exits, answers its health check
        with a failure `UNHEALTHY_STRIKES` times in a row (a tower that cannot encode at start-up will not
        start to later), or is not healthy within `timeout_s`."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        async with httpx.AsyncClient(timeout=2.0) as http:
            for proc, url in zip(self.procs, self.urls, strict=True):
                strikes = 0
                while True:
                    if proc.poll() is not None:
                        raise RuntimeError(f"encoder worker {url} exited with code {proc.returncode}")
                    try:  # not listening yet: httpx.ConnectError, keep waiting
                        response = await http.get(url + "/health")
                    except httpx.HTTPError:
                        response = None
                    if response is not None and response.status_code == 200:
                        break
                    if response is not None:
                        strikes += 1
                        if strikes >= UNHEALTHY_STRIKES:
                            reason = _reason(response)
                            raise RuntimeError(f"encoder worker {url} is unhealthy at start-up: {reason}")
                    if asyncio.get_running_loop().time() > deadline:
                        raise RuntimeError(f"encoder worker {url} not healthy after {timeout_s}s")
                    await asyncio.sleep(0.2)
        for state in self.states:
            state.state = "running"

    # -- supervision --------------------------------------------------------------------------------
    def supervise(
        self,
        on_restart: Callable[[WorkerState], None],
        on_back: Callable[[WorkerState], None],
        start_timeout_s: float,
    ) -> None:
        """Watch every worker from now on (tasks on the running event loop, ended by `terminate`): a dead one
        is reaped and restarted per `policy`; `on_restart` is called as each restart is spawned, `on_back` once
        it answers /health (within `start_timeout_s`, else it is killed and counts as one more exit)."""
        self._watchers = [
            asyncio.create_task(self._watch(i, on_restart, on_back, start_timeout_s))
            for i in range(len(self.procs))
        ]

    async def _watch(self, i: int, on_restart, on_back, start_timeout_s: float) -> None:
        state, backoff = self.states[i], RestartBackoff(self.policy)
        while not self._stopping:
            await asyncio.sleep(WATCH_INTERVAL_S)
            code = self.procs[i].poll()  # reaps a dead worker: no zombie is left
            if code is None or self._stopping:
                continue
            state.last_exit_code = code
            delay = backoff.exited(time.monotonic())
            if delay is None:
                state.state = "failed"
                p = self.policy
                logger.error(
                    "%s (%s) exited with code %s, %d times within %.0f s: giving up, it is not restarted "
                    "again; the other encoders (and the engine's tower, if it has one) serve without it",
                    state.name,
                    state.url,
                    code,
                    p.max_exits,
                    p.window_s,
                )
                return
            state.state = "restarting"
            logger.warning(
                "%s (%s) exited with code %s: restarting it in %.1f s", state.name, state.url, code, delay
            )
            await asyncio.sleep(delay)
            if self._stopping:  # NOTE: no await between this check and the spawn: `stop` sees every process
                return
            self.procs[i] = subprocess.Popen(self._commands[i], env=self._env)
            state.restarts += 1
            on_restart(state)
            if await self._answers(i, start_timeout_s):
                backoff.healthy(time.monotonic())
                state.state = "running"
                on_back(state)
                logger.info("%s (%s) is back after restart %d", state.name, state.url, state.restarts)

    async def _answers(self, i: int, timeout_s: float) -> bool:
        """Whether the restarted worker `i` answers /health with 200 within `timeout_s`; killed if it does not
        (the watch then reaps it as an exit)."""
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=2.0) as http:
            while time.monotonic() < deadline and not self._stopping:
                if self.procs[i].poll() is not None:
                    return False
                try:
                    if (await http.get(self.urls[i] + "/health")).status_code == 200:
                        return True
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.2)
        if self.procs[i].poll() is None and not self._stopping:
            logger.warning(
                "%s (%s) not healthy %.0f s after its restart: killing it",
                self.states[i].name,
                self.urls[i],
                timeout_s,
            )
            self.procs[i].kill()
        return False

    def terminate(self) -> None:
        """Ask every worker to stop (SIGTERM) without waiting: they shut down beside the engine. Ends the
        supervision first, so that nothing is restarted."""
        self._stopping = True
        for watcher in self._watchers:
            watcher.cancel()
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop every worker and wait for it (SIGKILL after `timeout_s`)."""
        self.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _reason(response: httpx.Response) -> str:
    """The `reason` an encoder's failed /health names, or the start of whatever else answered."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and body.get("reason"):
        return str(body["reason"])
    return f"HTTP {response.status_code}: {response.text[:200]}"
