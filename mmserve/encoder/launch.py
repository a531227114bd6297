"""`mmserve encoder`: run the encoder service under uvicorn, with registration heartbeats."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

import uvicorn

from mmserve.config import EncoderConfig
from mmserve.server.parent_watch import exit_with_parent


def serve_encoder(cfg: EncoderConfig, log_level: str = "info") -> int:
    from mmserve.encoder.service import EncoderService, build_encoder_app, register_loop

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    service = EncoderService(cfg)
    app = build_encoder_app(service)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        stop = asyncio.Event()
        task = asyncio.create_task(register_loop(cfg, stop)) if cfg.register_urls else None
        print(f"mmserve encoder: serving {cfg.model} on {cfg.url}", flush=True)
        orphan_watch = asyncio.create_task(exit_with_parent(lambda: setattr(server, "should_exit", True)))
        yield
        orphan_watch.cancel()
        stop.set()
        if task is not None:
            await task
        service.close()

    app.router.lifespan_context = lifespan
    # A requested shutdown is a clean exit: see mmserve.server.launch.serve_async.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server = uvicorn.Server(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=log_level,
                                           timeout_graceful_shutdown=5))  # fmt: skip
    server.run()
    return 0 if server.started else 1
