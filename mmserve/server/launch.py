"""`mmserve serve`: start the engine process, then the API server; stop both cleanly.

Ctrl-C / SIGTERM make uvicorn stop accepting, and the app's lifespan shuts the engine down (ShutdownReq,
then SIGTERM, then SIGKILL). If the engine dies on its own, the server stops and exits with status 1 so a
supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

import uvicorn

from mmserve.config import EngineConfig, ServerConfig
from mmserve.server.engine_client import EngineClient, EngineDeadError

logger = logging.getLogger("mmserve.server")


async def serve_async(server_cfg: ServerConfig, engine_cfg: EngineConfig) -> int:
    from mmserve.models.loader import load_tokenizer
    from mmserve.server.api import build_app
    from mmserve.server.metrics import ServerMetrics

    exit_code = 0
    server: uvicorn.Server | None = None

    def on_engine_death() -> None:
        nonlocal exit_code
        exit_code = 1
        if server is not None:
            server.should_exit = True

    client = EngineClient(engine_cfg, server_cfg.log_level, on_death=on_engine_death)
    try:
        ready = await client.start(server_cfg.engine_start_timeout_s)
    except EngineDeadError as e:
        logger.error("%s", e)
        await client.shutdown()
        return 1
    print(f"mmserve: engine ready: KV cache {ready.kv_cache_tokens} tokens "
          f"({ready.kv_cache_bytes / 2**20:.1f} MB, {ready.kv_bytes_per_token} bytes/token), "
          f"max model len {ready.max_model_len}", flush=True)  # fmt: skip
    tokenizer = load_tokenizer(engine_cfg.model)
    app = build_app(server_cfg, client, tokenizer, ServerMetrics(server_cfg.served_model_name))

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        print(f"mmserve: serving {server_cfg.served_model_name!r} on http://{server_cfg.host}:{server_cfg.port}",
              flush=True)  # fmt: skip
        yield
        await client.shutdown()

    app.router.lifespan_context = lifespan
    config = uvicorn.Config(app, host=server_cfg.host, port=server_cfg.port, log_level=server_cfg.log_level,
                            timeout_graceful_shutdown=5)  # fmt: skip
    server = uvicorn.Server(config)
    try:
        await server.serve()
    finally:
        if not client.dead and client.proc is not None and client.proc.poll() is None:
            await client.shutdown()
    return exit_code if server.started else max(exit_code, 1)


def serve(server_cfg: ServerConfig, engine_cfg: EngineConfig) -> int:
    logging.basicConfig(
        level=server_cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # uvicorn re-raises the signal that stopped it once it has shut down, through the handler that was installed
    # before it ran. A requested shutdown is a clean exit (status 0): make that earlier handler a no-op.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    return asyncio.run(serve_async(server_cfg, engine_cfg))
