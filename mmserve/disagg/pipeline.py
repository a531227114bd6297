"""`mmserve serve ... --prefill-workers P --decode-workers D [--encoder-workers N]`: a whole disaggregated
deployment on one machine, fronted by the router in this process.

On free loopback ports: N encoder workers (mmserve.server.encoder_workers), P prefill servers and D decode
servers (`mmserve serve --disaggregation-mode prefill|decode`, with the user's argv minus the pipeline's own
flags, so every model and engine flag reaches them unchanged; the prefill servers get the encoder workers as
`--encoder-urls`). Then the router serves on the user's --host/--port.

The cluster secret (the user's, else a random one for this pipeline) reaches every child in the environment,
never in argv. If a child exits during start-up the others are stopped and the launcher exits 1 naming it;
a child that dies later stops the pipeline (exit 1) so that a supervisor restarts the whole. Nothing is
restarted in place here, unlike `serve --encoder-workers` (mmserve.server.encoder_workers): the pipeline is one
unit for its supervisor, and a prefill or decode server that dies has failed every request it held.

Children are stopped (SIGTERM, then SIGKILL after `stop_timeout_s`) in a `finally` whenever the launcher
ends: a clean exit, SIGINT/SIGTERM, a failed start-up, an exception. A launcher killed with SIGKILL cannot
do that: each child watches its parent (mmserve.server.parent_watch) and shuts down within a second.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from mmserve.config import EngineConfig, RouterConfig
from mmserve.disagg.router import configure_logging, make_server
from mmserve.server.encoder_workers import EncoderWorkers, free_port
from mmserve.server.parent_watch import child_of_this_process
from mmserve.transport.cluster_auth import child_env

logger = logging.getLogger("mmserve.pipeline")
# Flags of the pipeline itself, never forwarded to a child: where the router listens, how many children,
# how the router talks to them, and the secret (children get it in the environment).
PIPELINE_FLAGS = (
    "--prefill-workers",
    "--decode-workers",
    "--encoder-workers",
    "--host",
    "--port",
    "--kv-transfer-backend",
    "--api-key",
    "--cluster-secret",
)
POLL_S = 0.2


def child_argv(serve_argv: Sequence[str]) -> list[str]:
    """The user's `serve ...` argv without PIPELINE_FLAGS, as `--flag value` or `--flag=value`, and as the
    abbreviations argparse accepts (`--prefill-w 2`: argparse already refused any ambiguous one, and no
    `serve` flag is a prefix of a pipeline flag)."""
    kept: list[str] = []
    tokens = iter(serve_argv)
    for token in tokens:
        name, eq, _ = token.partition("=")
        matches = [f for f in PIPELINE_FLAGS if f.startswith(name)] if name.startswith("--") else []
        if len(matches) != 1 or len(name) < 3:
            kept.append(token)
        elif not eq:
            next(tokens, None)  # its value
    return kept


@dataclass(frozen=True)
class PipelineConfig:
    serve_argv: tuple[str, ...]  # the user's `serve ...` argv as typed (forwarded minus PIPELINE_FLAGS)
    prefill_workers: int
    decode_workers: int
    router: RouterConfig  # host, port, backend, secret (None: generate one), API key of the front
    encoder_workers: int = 0
    # The user's remote encoders (--encoder-urls): the prefill servers keep them beside the workers.
    encoder_urls: tuple[str, ...] = ()
    encoder_transport: str = "auto"
    log_level: str = "info"
    start_timeout_s: float = 600.0  # every child healthy by then (model loading included)
    stop_timeout_s: float = 15.0  # SIGTERM to SIGKILL
    launcher: tuple[str, ...] = (
        sys.executable,
        "-m",
        "mmserve.cli",
    )  # what runs `serve ...` (tests: a stand-in)

    def __post_init__(self) -> None:
        if self.prefill_workers < 1 or self.decode_workers < 1:
            raise ValueError("a pipeline needs at least one prefill and one decode worker")
        if self.encoder_workers < 0:
            raise ValueError("encoder_workers must be >= 0")

    def child_command(self, role: str, port: int, worker_urls: Sequence[str]) -> list[str]:
        """A prefill or decode server's command line (the pipeline's own values last: argparse keeps those)."""
        cmd = [
            *self.launcher,
            *child_argv(self.serve_argv),
            "--disaggregation-mode",
            role,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--prefill-workers",
            "0",
            "--decode-workers",
            "0",
            "--encoder-workers",
            "0",
        ]
        if role == "prefill" and worker_urls:
            cmd += ["--encoder-urls", *self.encoder_urls, *worker_urls]
            if self.encoder_transport == "auto" and not self.encoder_urls:
                cmd += ["--encoder-transport", "shm"]  # every encoder is on this host
        return cmd


@dataclass
class Child:
    name: str  # "prefill server http://127.0.0.1:PORT"
    url: str
    proc: subprocess.Popen


class StartupError(RuntimeError):
    pass


def spawn(cfg: PipelineConfig, secret: str, engine_cfg: EngineConfig | None, children: list[Child]) -> None:
    """Start every child at once (model loading in parallel), appending each to `children` as it starts (so
    that the caller can stop those started if a later one fails to)."""
    worker_urls: list[str] = []
    if cfg.encoder_workers:
        if engine_cfg is None:
            raise ValueError("encoder workers need the engine config")
        workers = EncoderWorkers(engine_cfg, cfg.encoder_workers, cfg.log_level, secret)
        worker_urls = list(workers.urls)
        for url, proc in zip(workers.urls, workers.procs, strict=True):
            children.append(Child(f"encoder worker {url}", url, proc))
    env = child_of_this_process(child_env(secret))  # children stop if this process is SIGKILLed
    for role, count in (("prefill", cfg.prefill_workers), ("decode", cfg.decode_workers)):
        for _ in range(count):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            proc = subprocess.Popen(cfg.child_command(role, port, worker_urls), env=env)
            children.append(Child(f"{role} server {url}", url, proc))


async def wait_ready(children: Sequence[Child], timeout_s: float) -> None:
    """Return once every child answers /health with 200, printing a line for each. Raises StartupError if
    one exits or is not healthy in time."""
    deadline = time.monotonic() + timeout_s
    waiting = list(children)
    async with httpx.AsyncClient(timeout=2.0, trust_env=False) as http:
        while waiting:
            for child in list(waiting):
                if child.proc.poll() is not None:
                    raise StartupError(
                        f"{child.name} exited with code {child.proc.returncode} during start-up"
                    )
                try:
                    ready = (await http.get(f"{child.url}/health")).status_code == 200
                except httpx.HTTPError:
                    ready = False
                if ready:
                    print(f"mmserve: {child.name} ready", flush=True)
                    waiting.remove(child)
            if waiting and time.monotonic() > deadline:
                raise StartupError(f"{waiting[0].name} not healthy after {timeout_s:.0f}s")
            if waiting:
                await asyncio.sleep(POLL_S)


def stop(children: Sequence[Child], timeout_s: float) -> None:
    """SIGTERM every child, wait up to `timeout_s` in all, SIGKILL the rest."""
    for child in children:
        if child.proc.poll() is None:
            child.proc.terminate()
    deadline = time.monotonic() + timeout_s
    for child in children:
        try:
            child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("%s did not stop in %.0fs: killing it", child.name, timeout_s)
            child.proc.kill()
            child.proc.wait()


async def _run(cfg: PipelineConfig, router: RouterConfig, children: list[Child]) -> int:
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # until the router runs (uvicorn then takes them)
        loop.add_signal_handler(sig, stopping.set)
    try:
        ready = asyncio.create_task(wait_ready(children, cfg.start_timeout_s))
        stop_wait = asyncio.create_task(stopping.wait())
        await asyncio.wait({ready, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
        stop_wait.cancel()
        if not ready.done():
            ready.cancel()
            print("mmserve: pipeline start-up interrupted", file=sys.stderr, flush=True)
            return 0
        try:
            ready.result()
        except StartupError as e:
            print(f"mmserve: {e}; stopping the pipeline", file=sys.stderr, flush=True)
            return 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
            signal.signal(
                sig, lambda *_: None
            )  # remove_signal_handler restored the default: see run_pipeline

    server = make_server(router)
    exit_code = 0

    async def watch() -> None:
        nonlocal exit_code
        while not server.should_exit:
            await asyncio.sleep(POLL_S * 2.5)
            if dead := next((c for c in children if c.proc.poll() is not None), None):
                logger.error("%s exited with code %s: stopping the pipeline", dead.name, dead.proc.returncode)
                exit_code, server.should_exit = 1, True

    watcher = asyncio.create_task(watch())
    try:
        await server.serve()
    finally:
        watcher.cancel()
    return exit_code if server.started else 1


def run_pipeline(cfg: PipelineConfig, engine_cfg: EngineConfig | None = None) -> int:
    """Run the pipeline until SIGINT / SIGTERM (exit 0) or a child's death (exit 1); stop every child."""
    configure_logging(cfg.log_level)
    # uvicorn re-raises the signal that stopped it through the handler installed before it ran: a requested
    # shutdown is a clean exit that must still reach the `finally` below, so that handler is a no-op.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    secret = cfg.router.cluster_secret or secrets.token_hex(32)
    children: list[Child] = []
    try:
        spawn(cfg, secret, engine_cfg, children)
        servers = {
            role: tuple(c.url for c in children if c.name.startswith(role)) for role in ("prefill", "decode")
        }
        router = dataclasses.replace(
            cfg.router, cluster_secret=secret, prefill_urls=servers["prefill"], decode_urls=servers["decode"]
        )
        return asyncio.run(_run(cfg, router, children))
    finally:
        stop(children, cfg.stop_timeout_s)
