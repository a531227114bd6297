"""Stand-in prefill and decode servers: the HTTP contract of `mmserve serve --disaggregation-mode prefill|decode`
without a model, for tests of the router and the pipeline launcher.

The prefill stand-in "ships the KV" by POSTing the room to the decode stand-in's `/_standin/kv` (its bootstrap is
`tcp://127.0.0.1:<its HTTP port>`); the decode stand-in starts answering when the room has arrived, and records
the rooms whose request was closed before they finished (`aborted`). Tests steer a stand-in through its
`behaviour` (in-process) and read what it saw in `requests`.

`ServerThread` runs uvicorn apps on free loopback ports on one event loop in a daemon thread.
`python -m mmserve.testing.pd_standin serve --disaggregation-mode prefill --port N ...` runs one stand-in as a
process (other flags are ignored); its secret comes from $MMSERVE_CLUSTER_SECRET.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import threading
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from mmserve.transport import cluster_auth
from mmserve.transport.cluster_auth import HTTP_HEADER

MODEL = "standin-model"


def sse_chunks(count: int) -> list[bytes]:
    """The decode stand-in's stream as written: events split at awkward places (inside an event, inside a
    UTF-8 character) so that a relay that re-frames or re-decodes would change the bytes."""
    events = (
        b"".join(
            b"data: "
            + json.dumps(
                {
                    "object": "chat.completion.chunk",
                    "choices": [
                        {"index": 0, "delta": {"content": f"tok{i} \u00e9\u2603"}, "finish_reason": None}
                    ],
                },
                ensure_ascii=False,
            ).encode()
            + b"\n\n"
            for i in range(count)
        )
        + b"data: [DONE]\n\n"
    )
    cuts = list(range(0, len(events), 37)) + [len(events)]
    return [events[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]


def error(status: int, code: str, message: str = "stand-in error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "server_error", "code": code}}, status)


@dataclass
class Behaviour:
    """What a stand-in does; tests change it between requests."""

    healthy: bool = True
    prefill_error: tuple[int, dict] | None = None  # prefill: answer this (status, body) instead
    prefill_delay_s: float = 0.0
    refuse_kv: bool = False  # decode: refuse the KV (the prefill answers 503 decode_at_capacity)
    decode_error: tuple[int, dict] | None = None  # decode: answer this (status, body) at once
    chunks: int = 3  # decode: events in a stream
    chunk_delay_s: float = 0.0
    break_after_chunks: int | None = None  # decode: drop the connection after this many writes
    kv_wait_s: float = 5.0  # decode: 504 kv_transfer_timeout past this


@dataclass
class Standin:
    mode: str  # "prefill" | "decode"
    secret: str | None = None
    anonymous: bool = False  # open /disagg/info without a secret (--enable-anonymous-registration)
    model: str = MODEL
    port: int = 0  # set when served
    behaviour: Behaviour = field(default_factory=Behaviour)
    requests: list[dict[str, Any]] = field(default_factory=list)  # {"path", "body", "headers"}
    aborted: list[str] = field(default_factory=list)  # decode: rooms closed by the caller before the end
    rooms: dict[str, asyncio.Event] = field(default_factory=dict)
    _http: httpx.AsyncClient | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> Response:
            return JSONResponse(
                {"status": "ok" if self.behaviour.healthy else "bad"}, 200 if self.behaviour.healthy else 503
            )

        @app.get("/disagg/info")
        async def info(request: Request) -> Response:
            if (refused := self.refusal(request)) is not None:
                return refused
            bootstrap = f"tcp://127.0.0.1:{self.port}" if self.mode == "decode" else None
            return JSONResponse(
                {
                    "mode": self.mode,
                    "model": self.model,
                    "bootstrap": bootstrap,
                    "kv_backends": ["zmq", "mooncake"],
                    "max_model_len": 4096,
                    "kv_cache_tokens": 10000,
                }
            )

        @app.get("/v1/models")
        async def models() -> Any:
            return {"object": "list", "data": [{"id": self.model, "object": "model", "max_model_len": 4096}]}

        @app.get("/_standin/state")
        async def state() -> Any:
            return {"argv": sys.argv, "pid": os.getpid(), "has_secret": cluster_auth.ENV_VAR in os.environ}

        @app.post("/_standin/kv")
        async def kv(request: Request) -> Response:
            room = (await request.json())["room"]
            if self.behaviour.refuse_kv:
                return error(503, "decode_at_capacity")
            self._room(room).set()
            return JSONResponse({"ok": True})

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            return await self.handle(request)

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await self.handle(request)

        return app

    def refusal(self, request: Request) -> Response | None:
        """The control-plane gate (`AppState.check_control_plane`) on /disagg/info and on the router's requests.
        `secret` is read per request: a test changes it to play a server restarted with another one."""
        secret = cluster_auth.from_config(self.secret)
        if secret is not None and not secret.check_token(request.headers.get(HTTP_HEADER)):
            return error(401, "invalid_cluster_token", f"missing or invalid {HTTP_HEADER} (cluster secret)")
        if secret is None and not self.anonymous:
            return error(403, "control_plane_disabled", "the control plane is off: no cluster secret")
        return None

    def _room(self, room: str) -> asyncio.Event:
        return self.rooms.setdefault(room, asyncio.Event())

    async def handle(self, request: Request) -> Response:
        body = await request.json()
        self.requests.append({"path": request.url.path, "body": body, "headers": dict(request.headers)})
        params = body.get("kv_transfer_params")
        if not isinstance(params, dict):
            return error(400, "disaggregated_server")
        if (refused := self.refusal(request)) is not None:
            return refused
        if self.mode == "prefill":
            return await self.prefill(params)
        return await self.decode(request, params["room"], bool(body.get("stream")))

    async def prefill(self, params: dict) -> Response:
        b = self.behaviour
        if b.prefill_error is not None:
            return JSONResponse(b.prefill_error[1], b.prefill_error[0])
        await asyncio.sleep(b.prefill_delay_s)
        port = int(params["decode_bootstrap"].rsplit(":", 1)[1])
        if self._http is None:  # one client: making one per request costs more than the whole relay
            self._http = httpx.AsyncClient(trust_env=False)
        try:
            shipped = await self._http.post(
                f"http://127.0.0.1:{port}/_standin/kv", json={"room": params["room"]}
            )
        except httpx.HTTPError:
            return error(502, "kv_transfer_failed")
        if shipped.status_code == 503:
            return error(503, "decode_at_capacity", "decode server has no free KV slots")
        return JSONResponse(
            {
                "id": "prefill-" + params["room"],
                "object": "kv_handoff",
                "kv_transfer": {
                    "room": params["room"],
                    "backend": params["backend"],
                    "kv_bytes": 12345,
                    "transfer_s": 0.00123,
                    "decode_bootstrap": params["decode_bootstrap"],
                },
                "usage": {"prompt_tokens": 7, "prompt_tokens_details": {"cached_tokens": 0}},
                "mmserve": {
                    "timings": {},
                    "encoded_by": f"standin;{self.port} é",
                    "mm_items": 0,
                    "mm_cache_hits": 0,
                },
            }
        )

    async def decode(self, request: Request, room: str, stream: bool) -> Response:
        if self.behaviour.decode_error is not None:
            return JSONResponse(self.behaviour.decode_error[1], self.behaviour.decode_error[0])
        arrived = self._room(room)
        if stream:  # headers at once, then the events once the KV is here
            return StreamingResponse(self._events(request, room, arrived), media_type="text/event-stream")
        try:
            await asyncio.wait_for(self._wait_kv(request, room, arrived), self.behaviour.kv_wait_s)
        except TimeoutError:
            return error(504, "kv_transfer_timeout")
        except ConnectionAbortedError:
            return Response(status_code=499)
        body = json.dumps(
            {
                "object": "chat.completion",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "hello \u00e9"},
                        "finish_reason": "stop",
                    }
                ],
            }
        ).encode()
        if self.behaviour.break_after_chunks is None:
            return Response(body, media_type="application/json")
        return StreamingResponse(self._broken([body[: len(body) // 2]]), media_type="application/json")

    async def _wait_kv(self, request: Request, room: str, arrived: asyncio.Event) -> None:
        while not arrived.is_set():
            if await request.is_disconnected():
                self.aborted.append(room)
                raise ConnectionAbortedError(room)
            try:
                await asyncio.wait_for(arrived.wait(), 0.02)
            except TimeoutError:
                pass

    async def _events(self, request: Request, room: str, arrived: asyncio.Event):
        b, finished = self.behaviour, False
        try:
            await asyncio.wait_for(self._wait_kv(request, room, arrived), b.kv_wait_s)
            for i, chunk in enumerate(sse_chunks(b.chunks)):
                if b.break_after_chunks is not None and i >= b.break_after_chunks:
                    raise RuntimeError("stand-in decode server dies mid-stream")
                await asyncio.sleep(b.chunk_delay_s)
                yield chunk
            finished = True
        finally:
            if not finished and room not in self.aborted:
                self.aborted.append(room)

    async def _broken(self, chunks: list[bytes]):
        for chunk in chunks:
            yield chunk
        raise RuntimeError("stand-in decode server dies mid-answer")


def _bind() -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


class ServerThread:
    """uvicorn servers on one event loop in a daemon thread. `serve(app)` -> (port, server)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._servers: list[tuple[uvicorn.Server, asyncio.Future]] = []
        self.by_port: dict[int, uvicorn.Server] = {}
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine, timeout_s: float = 10.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def serve(self, app: FastAPI) -> tuple[int, uvicorn.Server]:
        sock = _bind()
        port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, log_level="critical", timeout_graceful_shutdown=1))

        async def start() -> asyncio.Future:
            task = asyncio.ensure_future(server.serve(sockets=[sock]))
            while not server.started and not task.done():
                await asyncio.sleep(0.01)
            if task.done():
                task.result()
            return task

        self._servers.append((server, self.run(start())))
        self.by_port[port] = server
        return port, server

    def serve_standin(self, standin: Standin) -> Standin:
        standin.port, _ = self.serve(standin.app())
        return standin

    def stop(self, server: uvicorn.Server) -> None:
        for s, task in self._servers:
            if s is server:
                s.should_exit = True
                self.run(asyncio.wait_for(asyncio.shield(task), 10))

    def close(self) -> None:
        for s, _ in self._servers:
            s.should_exit = True

        async def stopped() -> None:
            await asyncio.gather(*(t for _, t in self._servers), return_exceptions=True)

        self.run(stopped())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("command")
    p.add_argument("--disaggregation-mode", required=True, choices=["prefill", "decode"])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--served-model-name", default=None)
    args, _ = p.parse_known_args(argv)
    standin = Standin(
        args.disaggregation_mode,
        secret=os.environ.get(cluster_auth.ENV_VAR),
        model=args.served_model_name or MODEL,
        port=args.port,
    )
    uvicorn.run(standin.app(), host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
