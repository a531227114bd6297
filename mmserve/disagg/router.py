"""`mmserve router`: the OpenAI-compatible front of prefill and decode servers.

Routes, by concern (one APIRouter each, over one RouterContext):
- OpenAI: `POST /v1/chat/completions`, `POST /v1/completions` (relayed, mmserve.disagg.relay), `GET /v1/models`.
- control plane: `POST /register_server`, `POST /unregister_server`, `GET /servers`. With a cluster secret they
  require its token (401); without one they are closed (403) unless `--enable-anonymous-registration`.
- operations: `GET /health` (200 with a healthy server of each role, else 503 with reasons), `GET /metrics`.

The app's lifespan opens the upstream HTTP client and probes every server's /health each
`health_interval_s` (mmserve.disagg.router_registry).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import signal
import sys
import time
from typing import Any
from urllib.parse import urlsplit

import httpx
import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from mmserve.config import RouterConfig
from mmserve.disagg.relay import RouterContext, UpstreamStream, relay
from mmserve.disagg.router_metrics import RouteNote, RouterMetrics
from mmserve.disagg.router_registry import ROLES, InfoError, ServerRegistry, fetch_info, probe_once
from mmserve.server.disconnect import watch_disconnect
from mmserve.server.protocol import APIError
from mmserve.transport import cluster_auth
from mmserve.transport.cluster_auth import HTTP_HEADER

logger = logging.getLogger("mmserve.router")


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


async def read_json_object(request: Request, max_bytes: int) -> dict[str, Any]:
    """The request body as a JSON object; APIError 413 past `max_bytes`, 400 if not a JSON object."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise APIError(413, f"request body is over {max_bytes} bytes", "body_too_large")
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > max_bytes:
            raise APIError(413, f"request body is over {max_bytes} bytes", "body_too_large")
    try:
        # NaN / Infinity are refused: they are not JSON, and could not be sent on to the servers.
        body = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}", "invalid_json") from e
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object", "invalid_request")
    return body


async def run_with_disconnect(request: Request, coro) -> Response:
    """Await `coro`, cancelling it (and so closing both upstream requests) if the client goes away."""
    task = asyncio.ensure_future(coro)
    gone = watch_disconnect(request)  # the body was read: woken by the client's disconnect itself
    try:
        while not task.done():
            done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
            if task not in done:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    response = await task
                    if isinstance(response, UpstreamStream):  # finished just before the cancel landed
                        await response.close_upstream()
                raise APIError(499, "client disconnected", "client_closed")
        return task.result()
    finally:
        gone.cancel()
        task.cancel()


def _is_server_url(url: str) -> bool:
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname) and parts.path in ("", "/")


def _openai_routes(ctx: RouterContext) -> APIRouter:
    api_key = ctx.cfg.api_key

    def check_api_key(request: Request) -> None:
        """`Authorization: Bearer KEY` on the OpenAI routes when the router has an API key."""
        if api_key:
            header = request.headers.get("authorization", "")
            token = header[7:] if header.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(token.encode(), api_key.encode()):
                raise APIError(401, "missing or invalid API key", "invalid_api_key")

    routes = APIRouter(dependencies=[Depends(check_api_key)])

    async def routed(request: Request, kind: str) -> Response:
        note = RouteNote(ctx.cfg.kv_transfer_backend)
        try:
            body = await read_json_object(request, ctx.cfg.max_request_body_bytes)
            if "kv_transfer_params" in body:
                raise APIError(
                    400, "kv_transfer_params is set by the router, not by clients", "invalid_request"
                )
            response = await run_with_disconnect(request, relay(ctx, kind, body, note))
        except APIError as e:
            note.status = e.status
            ctx.metrics.finish(note)
            raise
        if not isinstance(response, UpstreamStream):  # a stream is counted when it ends
            ctx.metrics.finish(note)
        return response

    @routes.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await routed(request, "chat")

    @routes.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await routed(request, "completion")

    @routes.get("/v1/models")
    async def models() -> Any:
        """A healthy server's own listing (it knows max_model_len); else one built from the model name."""
        assert ctx.http is not None
        for server in ctx.registry.selectable("prefill") + ctx.registry.selectable("decode"):
            with contextlib.suppress(httpx.HTTPError, ValueError):
                resp = await ctx.http.get(f"{server.url}/v1/models", timeout=ctx.cfg.health_timeout_s)
                if resp.status_code == 200:
                    return resp.json()
        name = ctx.registry.expected_model()
        if name is None:
            raise APIError(503, "no server has reported its model yet", "no_server")
        return {
            "object": "list",
            "data": [{"id": name, "object": "model", "created": int(time.time()), "owned_by": "mmserve"}],
        }

    return routes


def _control_routes(ctx: RouterContext) -> APIRouter:
    routes = APIRouter()
    secret = cluster_auth.from_config(ctx.cfg.cluster_secret)
    closed = (
        "server registration and listing are off: this router has no cluster secret. Set --cluster-secret "
        "(or $MMSERVE_CLUSTER_SECRET) on the router and its servers, or start the router with "
        "--enable-anonymous-registration"
    )

    def check_control_plane(request: Request) -> None:
        """Gate of the control plane, checked before the body is read. These routes choose where users'
        prompts and KV go and disclose internal endpoints, so the API key (a client credential) never opens
        them: with a cluster secret, its token (401 without it); without one, nothing (403) unless the
        operator started the router with --enable-anonymous-registration."""
        if secret is not None:
            if not secret.check_token(request.headers.get(HTTP_HEADER)):
                raise APIError(
                    401, f"missing or invalid {HTTP_HEADER} (cluster secret)", "invalid_cluster_token"
                )
        elif not ctx.cfg.anonymous_control_plane:
            raise APIError(403, closed, "control_plane_disabled", "permission_error")

    async def server_url(request: Request) -> tuple[str, dict[str, Any]]:
        body = await read_json_object(request, 64 * 1024)
        url = body.get("url")
        if not isinstance(url, str) or not _is_server_url(url):
            raise APIError(400, 'body must be {"url": "http(s)://host:port", ...}', "invalid_server_url")
        return url.rstrip("/"), body

    @routes.post("/register_server")
    async def register_server(request: Request) -> Any:
        check_control_plane(request)
        url, body = await server_url(request)
        role = body.get("role")
        if role not in ROLES:
            raise APIError(400, f"role must be one of {list(ROLES)}", "invalid_role")
        assert ctx.http is not None
        try:
            info = await fetch_info(ctx.http, url, ctx.upstream_headers, ctx.cfg.health_timeout_s)
            info.check(role, ctx.registry.expected_model(url), ctx.cfg.kv_transfer_backend)
        except InfoError as e:
            raise APIError(e.status, e.message, e.code) from None
        server = ctx.registry.register(url, role, info)
        logger.info("registered %s server %s (model %r, bootstrap %s)", role, url, info.model, info.bootstrap)
        return {"registered": True, **server.as_json()}

    @routes.post("/unregister_server")
    async def unregister_server(request: Request) -> Any:
        check_control_plane(request)
        url, _ = await server_url(request)
        if not ctx.registry.remove(url):
            raise APIError(404, f"server {url} is not registered", "server_not_found")
        logger.info("unregistered server %s", url)
        return {"url": url, "registered": False}

    @routes.get("/servers")
    async def servers(request: Request) -> Any:
        check_control_plane(request)
        return {
            "servers": [s.as_json() for s in ctx.registry.all()],
            "kv_transfer_backend": ctx.cfg.kv_transfer_backend,
            "model": ctx.registry.expected_model(),
        }

    return routes


def _ops_routes(ctx: RouterContext) -> APIRouter:
    routes = APIRouter()

    @routes.get("/health")
    async def health() -> Response:
        counts = {role: len(ctx.registry.selectable(role)) for role in ROLES}
        reasons = [f"no healthy {role} server" for role, n in counts.items() if n == 0]
        body = {"status": "unhealthy" if reasons else "ok", "healthy_servers": counts}
        # A server refusing the router's token is named even while others serve: it is a deployment error.
        refused = [s.refused for s in ctx.registry.all() if s.refused]
        if reasons:
            body["reasons"] = reasons + [
                s.refused or f"{s.url}: {s.last_error}" for s in ctx.registry.all() if s.last_error
            ]
        elif refused:
            body["reasons"] = refused
        return JSONResponse(body, status_code=503 if reasons else 200)

    @routes.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(ctx.registry), media_type="text/plain; version=0.0.4")

    return routes


def build_router_app(cfg: RouterConfig) -> FastAPI:
    """The router app; its lifespan opens the upstream client, probes the static servers once (so that they
    are selectable from the first request), then keeps probing every `health_interval_s`."""
    secret = cluster_auth.from_config(cfg.cluster_secret)
    registry = ServerRegistry(cfg.failure_threshold, cfg.prefill_load_factor, cfg.served_model_name)
    for role, urls in (("prefill", cfg.prefill_urls), ("decode", cfg.decode_urls)):
        for url in urls:
            registry.add_static(url.rstrip("/"), role)
    ctx = RouterContext(cfg, registry, RouterMetrics(), dict(secret.headers) if secret else {})

    async def probe_forever() -> None:
        assert ctx.http is not None
        while True:
            await asyncio.sleep(cfg.health_interval_s)
            await probe_once(
                registry, ctx.http, ctx.upstream_headers, cfg.health_timeout_s, cfg.kv_transfer_backend
            )

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        timeout = httpx.Timeout(cfg.request_timeout_s, connect=cfg.connect_timeout_s)
        # No pool limit: each streamed answer holds a connection for its whole length.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as ctx.http:
            await probe_once(
                registry, ctx.http, ctx.upstream_headers, cfg.health_timeout_s, cfg.kv_transfer_backend
            )
            for s in registry.all():
                if not s.selectable and not s.refused:  # a refusal was logged as it was met
                    logger.warning(
                        "%s server %s not usable yet: %s", s.role, s.url, s.last_error or "unhealthy"
                    )
            prober = asyncio.create_task(probe_forever())
            print(
                f"mmserve: router on http://{cfg.host}:{cfg.port} (prefill {list(cfg.prefill_urls)}, "
                f"decode {list(cfg.decode_urls)}, KV backend {cfg.kv_transfer_backend})",
                flush=True,
            )
            try:
                yield
            finally:
                prober.cancel()

    app = FastAPI(title="mmserve router", version="0.1.0", lifespan=lifespan)
    app.state.router = ctx

    @app.exception_handler(APIError)
    async def _api_error(_: Request, err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, err: HTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code, "http_error")
        e = APIError(err.status_code, f"{err.detail}", code, headers=err.headers)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    for routes in (_openai_routes(ctx), _control_routes(ctx), _ops_routes(ctx)):
        app.include_router(routes)
    return app


def warn_about_control_plane(cfg: RouterConfig) -> None:
    """Says loudly, in the log and on stderr, when the control plane is open to anyone."""
    if cfg.anonymous_control_plane:
        message = (
            "anonymous server registration is ON (--enable-anonymous-registration, no cluster secret): anyone "
            f"who can reach http://{cfg.host}:{cfg.port} can register a prefill or decode server and have users' "
            "prompts sent to it. Outside a trusted network, set --cluster-secret instead."
        )
        logger.warning("%s", message)
        print(f"mmserve: WARNING: {message}", file=sys.stderr, flush=True)
    elif cfg.enable_anonymous_registration:
        logger.warning(
            "--enable-anonymous-registration is ignored: with a cluster secret set, the control "
            "plane always requires its token"
        )


def make_server(cfg: RouterConfig) -> uvicorn.Server:
    """The uvicorn server of a router app (not started)."""
    warn_about_control_plane(cfg)
    config = uvicorn.Config(
        build_router_app(cfg),
        host=cfg.host,
        port=cfg.port,
        log_level=cfg.log_level,
        timeout_graceful_shutdown=5,
    )
    return uvicorn.Server(config)


async def serve_router_async(cfg: RouterConfig) -> int:
    server = make_server(cfg)
    await server.serve()
    return 0 if server.started else 1


def configure_logging(level: str) -> None:
    """Once per router process. httpx logs every request at INFO: with a health probe per server per
    `health_interval_s`, that would bury the router's own one line per routed request."""
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))


def serve_router(cfg: RouterConfig) -> int:
    """`mmserve router`: serve until SIGINT / SIGTERM (then exit 0)."""
    configure_logging(cfg.log_level)
    # uvicorn re-raises the signal that stopped it through the handler installed before it ran: a requested
    # shutdown is a clean exit, so make that handler a no-op (as mmserve.server.launch does).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    return asyncio.run(serve_router_async(cfg))
