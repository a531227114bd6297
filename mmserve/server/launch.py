"""`mmserve serve`: start the engine process, then the API server; stop both cleanly.

Ctrl-C / SIGTERM make uvicorn stop accepting, and the app's lifespan shuts the engine down (ShutdownReq,
then SIGTERM, then SIGKILL). If the engine dies on its own, the server stops and exits with status 1 so a
supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import logging
import signal
import sys

import uvicorn

from mmserve.config import EngineConfig, ServerConfig
from mmserve.dispatch.dispatcher import Dispatcher, ReplyRoutes
from mmserve.dispatch.policy import make_policy
from mmserve.dispatch.registry import EncoderRegistry, RegistryConfig
from mmserve.server.encoder_workers import EncoderWorkers
from mmserve.server.engine_client import EngineClient, EngineDeadError
from mmserve.server.parent_watch import exit_with_parent
from mmserve.transport import cluster_auth
from mmserve.transport import messages as m

logger = logging.getLogger("mmserve.server")


def build_dispatcher(
    server_cfg: ServerConfig, engine_cfg: EngineConfig, client: EngineClient, ready, local_urls=()
) -> Dispatcher:
    registry = EncoderRegistry(RegistryConfig(
        failure_threshold=server_cfg.encoder_failure_threshold, drop_after_s=server_cfg.encoder_drop_after_s,
        probe_interval_s=server_cfg.encoder_probe_interval_s, probe_timeout_s=server_cfg.encoder_probe_timeout_s,
    ))  # fmt: skip
    # Two attempts per part (first encoder, one retry) must fit well inside the engine's deadline.
    secret = cluster_auth.from_config(server_cfg.cluster_secret)
    routes = ReplyRoutes(ready.embedding_endpoints, server_cfg.encoder_transport, frozenset(local_urls))
    return Dispatcher(
        registry,
        make_policy(server_cfg.encoder_routing),
        client,
        routes,
        ready.has_tower,
        attempt_timeout_s=engine_cfg.encode_timeout_s / 3,
        headers=secret.headers if secret else None,
        min_items=server_cfg.encoder_dispatch_min_items,
        part_per_item=engine_cfg.encode_prefill_overlap,
    )


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def engine_transports(server_cfg: ServerConfig) -> tuple[str, ...]:
    """The transports the engine must offer for the encoders this server will use (tcp always: encoders
    registered at runtime may be anywhere)."""
    wanted = {"tcp", server_cfg.encoder_transport}
    if server_cfg.encoder_transport == "auto" and server_cfg.encoder_workers:
        wanted.add("shm")
    return tuple(t for t in ("tcp", "shm", "mooncake") if t in wanted)


def warn_about_control_plane(cfg: ServerConfig) -> None:
    """Says loudly, in the log and on stderr, when the control plane is open to anyone (see api.py)."""
    if cfg.anonymous_control_plane:
        message = (
            "anonymous encoder registration is ON (--enable-anonymous-registration, no cluster secret): "
            f"anyone who can reach http://{cfg.host}:{cfg.port} can register an encoder and have other users' "
            "media sent to it, unregister encoders, and read internal endpoints from /encoders. Outside a "
            "trusted network, set --cluster-secret instead."
        )
        logger.warning("%s", message)
        print(f"mmserve: WARNING: {message}", file=sys.stderr, flush=True)
    elif cfg.enable_anonymous_registration:
        logger.warning(
            "--enable-anonymous-registration is ignored: with a cluster secret set, the control plane "
            "always requires its token"
        )


async def serve_async(server_cfg: ServerConfig, engine_cfg: EngineConfig) -> int:
    warn_about_control_plane(server_cfg)
    if server_cfg.cluster_secret is None and not _is_loopback(engine_cfg.embedding_host):
        logger.warning(
            "--embedding-host %s without a cluster secret: anyone who can reach it can push embeddings into "
            "other users' requests; set --cluster-secret",
            engine_cfg.embedding_host,
        )
    engine_cfg = dataclasses.replace(engine_cfg, embedding_transports=engine_transports(server_cfg))
    exit_code = 0
    server: uvicorn.Server | None = None

    def on_engine_death() -> None:
        nonlocal exit_code
        exit_code = 1
        if server is not None:
            server.should_exit = True

    client = EngineClient(engine_cfg, server_cfg.log_level, on_death=on_engine_death,
                          cluster_secret=server_cfg.cluster_secret)  # fmt: skip
    # Encoder workers need nothing from the engine: they start beside it (start-up in parallel, not in turn).
    workers = EncoderWorkers(
        engine_cfg, server_cfg.encoder_workers, server_cfg.log_level, server_cfg.cluster_secret
    )

    async def start_up():
        client.spawn()
        # This process's own heavy imports (torch, transformers, fastapi: seconds on a small machine), the
        # tokenizer and the family's request rules load on a thread while the engine boots.
        text_side = asyncio.create_task(asyncio.to_thread(_load_text_side, engine_cfg))
        ready = await client.wait_ready(server_cfg.engine_start_timeout_s)
        tokenizer, family, api = await text_side
        caches = [
            f"KV cache {ready.kv_cache_tokens} tokens ({ready.kv_cache_bytes / 2**20:.1f} MB, "
            f"{ready.kv_bytes_per_token} bytes/token)"
        ]
        if ready.state_slots:
            caches.append(f"state cache {ready.state_slots} request states ({ready.state_cache_bytes / 2**20:.1f} MB)")
        if ready.window_rows:
            caches.append(
                f"sliding-window cache {ready.window_rows} rows ({ready.window_cache_bytes / 2**20:.1f} MB, "
                f"window {ready.window})"
            )
        print(f"mmserve: engine ready: {', '.join(caches)}, max model len {ready.max_model_len}", flush=True)
        logger.info(
            "model %s: dtype %s, device %s, max model len %d",
            *(engine_cfg.model, engine_cfg.dtype, engine_cfg.device, ready.max_model_len),
        )
        await workers.wait_healthy(server_cfg.engine_start_timeout_s)
        return ready, tokenizer, family, api

    try:
        ready, tokenizer, family, api = await _cancelled_by_signals(start_up())
    except asyncio.CancelledError:  # SIGINT / SIGTERM before the server was up: a requested, clean stop
        print("mmserve: stopped during start-up", file=sys.stderr, flush=True)
        failed = 0
    except (EngineDeadError, RuntimeError, ValueError, OSError) as e:
        logger.error("%s", e)
        failed = 1
    else:
        failed = None
    if failed is not None:
        workers.stop()
        await client.shutdown()
        return failed
    # Until uvicorn takes the signals over, a stop request is remembered and honoured before it serves. uvicorn
    # re-raises the signal that stopped it through this handler once it has shut down: a requested shutdown
    # is a clean exit (status 0), so the handler only records it.
    stop_requested: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: stop_requested.append(signum))
    dispatcher = build_dispatcher(server_cfg, engine_cfg, client, ready, workers.urls)
    for url in (*server_cfg.encoder_urls, *workers.urls):
        dispatcher.registry.add_static(url)
    if dispatcher.registry.all():
        print(f"mmserve: EPD with encoders {[e.url for e in dispatcher.registry.all()]} "
              f"(routing {server_cfg.encoder_routing})", flush=True)  # fmt: skip
    from mmserve.server.metrics import ServerMetrics
    from mmserve.server.stats_log import start_stats_log

    metrics = ServerMetrics(server_cfg.served_model_name, ready.max_model_len)
    # One slot per token: the pool pages at token granularity (a block of 1), as the prefix cache shares.
    metrics.set_cache_config(
        block_size=1,
        cache_dtype=engine_cfg.kv_cache_dtype,
        num_gpu_blocks=ready.kv_cache_tokens,  # vLLM's name for the device's blocks (here the CPU's memory)
        num_cpu_blocks=0,
        kv_cache_memory_bytes=ready.kv_cache_bytes,
        enable_prefix_caching=not engine_cfg.disable_prefix_cache,
    )
    metrics.watch_children([w.name for w in workers.states])
    app = api.build_app(server_cfg, client, tokenizer, family, metrics, dispatcher, workers)

    def worker_back(worker) -> None:  # registered again as at start, healthy now (its cache starts empty)
        dispatcher.registry.add_static(worker.url)
        dispatcher.registry.register(worker.url)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        print(f"mmserve: serving {server_cfg.served_model_name!r} on http://{server_cfg.host}:{server_cfg.port}",
              flush=True)  # fmt: skip
        prober = asyncio.create_task(dispatcher.probe_forever())
        workers.supervise(lambda w: metrics.record_child_restart(w.name), worker_back,
                          server_cfg.engine_start_timeout_s)
        orphan_watch = asyncio.create_task(exit_with_parent(lambda: setattr(server, "should_exit", True)))
        stats_log = start_stats_log(metrics, server_cfg.log_stats_interval_s, lambda: client.stats)
        yield
        if stats_log is not None:
            stats_log.cancel()
        orphan_watch.cancel()
        prober.cancel()
        await dispatcher.close()
        workers.terminate()
        await client.shutdown()
        workers.stop()

    app.router.lifespan_context = lifespan
    config = uvicorn.Config(app, host=server_cfg.host, port=server_cfg.port, log_level=server_cfg.log_level,
                            timeout_graceful_shutdown=5)  # fmt: skip
    server = _Server(config, client)
    # The engine died after it was ready, before there was a server for on_engine_death to stop; or a stop was
    # asked for meanwhile.
    if client.dead or stop_requested:
        workers.stop()
        await client.shutdown()
        return 1 if client.dead else 0
    try:
        await server.serve()
    finally:
        workers.stop()
        if not client.dead and client.proc is not None and client.proc.poll() is None:
            await client.shutdown()
    return exit_code if server.started else max(exit_code, 1)


def _load_text_side(engine_cfg: EngineConfig):
    from mmserve.models.family import load_family
    from mmserve.models.loader import load_tokenizer
    from mmserve.server import api

    family = load_family(engine_cfg.model, mm_processor_kwargs=dict(engine_cfg.mm_processor_kwargs))
    return load_tokenizer(engine_cfg.model), family, api


async def _cancelled_by_signals(coro):
    """Await `coro`, cancelling it on SIGINT / SIGTERM (raises CancelledError then). uvicorn handles those
    signals only once it serves; a server still starting (an engine booting, an encoder worker not yet
    healthy) must stop when asked, not minutes later."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(coro)
    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        loop.add_signal_handler(sig, task.cancel)
    try:
        return await task
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)


class _Server(uvicorn.Server):
    """uvicorn's server, ending the generations in flight as its shutdown begins (Ctrl-C, SIGTERM): their
    streams end at once in-band (a 503 error event, then [DONE]) instead of running on until the graceful
    timeout cancels them mid-write, with a traceback in the log."""

    def __init__(self, config: uvicorn.Config, client: EngineClient) -> None:
        super().__init__(config)
        self.client = client

    async def shutdown(self, sockets=None) -> None:
        self.client.fail_all(m.Failure(503, "server_shutting_down", "the server is shutting down; retry"))
        await super().shutdown(sockets=sockets)


def serve(server_cfg: ServerConfig, engine_cfg: EngineConfig) -> int:
    logging.basicConfig(
        level=server_cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return asyncio.run(serve_async(server_cfg, engine_cfg))
