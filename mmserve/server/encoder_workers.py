"""Local encoder worker processes for `mmserve serve --encoder-workers N` (EPD on one machine).

Each worker is a real `mmserve encoder` subprocess on a free loopback port, registered as a static encoder
and stopped with the server (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys

import httpx

from mmserve.config import EngineConfig
from mmserve.server.parent_watch import child_of_this_process
from mmserve.transport.cluster_auth import child_env

# Failed health checks in a row that end the start-up (a refused connection, not listening yet, is no strike).
UNHEALTHY_STRIKES = 3


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


class EncoderWorkers:
    def __init__(
        self, engine_cfg: EngineConfig, count: int, log_level: str, cluster_secret: str | None = None
    ) -> None:
        self.procs: list[subprocess.Popen] = []
        self.urls: list[str] = []
        for _ in range(count):
            port = free_port()
            cmd = encoder_command(engine_cfg, port, log_level)
            self.procs.append(subprocess.Popen(cmd, env=child_of_this_process(child_env(cluster_secret))))
            self.urls.append(f"http://127.0.0.1:{port}")

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

    def terminate(self) -> None:
        """Ask every worker to stop (SIGTERM) without waiting: they shut down beside the engine."""
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
