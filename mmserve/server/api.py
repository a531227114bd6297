"""The FastAPI app of the API server: its state, middleware (body limit, API key), error handlers and routers.

Routes live in one router per concern: OpenAI (`routes_openai`), tokenizer (`routes_tokenize`), control plane
(`routes_control`), operations (`routes_ops`) and the browser UI (`routes_ui`, unless --disable-ui). They share
one `AppState` (`app.state.mmserve`).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from mmserve.config import ServerConfig
from mmserve.server import (
    routes_control,
    routes_openai,
    routes_ops,
    routes_responses,
    routes_tokenize,
    routes_ui,
)
from mmserve.server.app_state import AppState
from mmserve.server.engine_client import EngineClient
from mmserve.server.metrics import ServerMetrics
from mmserve.server.middleware import ApiKeyMiddleware, BodyLimitMiddleware
from mmserve.server.protocol import APIError


def build_app(
    cfg: ServerConfig,
    client: EngineClient,
    tokenizer,
    family,
    metrics: ServerMetrics,
    dispatcher=None,
    encoder_workers=None,
) -> FastAPI:
    """The app serving `client`'s engine. `client` must be started (its `ready` message read)."""
    app = FastAPI(title="mmserve", version="0.1.0")
    state = AppState(cfg, client, tokenizer, family, metrics, dispatcher, encoder_workers)
    app.state.mmserve = state
    app.add_middleware(BodyLimitMiddleware, max_bytes=cfg.max_request_body_bytes)
    if cfg.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=cfg.api_key, on_error=metrics.record_error)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, err: APIError):
        return state.error_response(err)

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, err: HTTPException):
        # Unknown paths (404) and methods (405) get the same error shape as every other answer.
        code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code, "http_error")
        return state.error_response(APIError(err.status_code, f"{err.detail}", code, headers=err.headers))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, err: RequestValidationError):
        problems = []
        for e in err.errors():
            loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
            msg = "not supported by this server" if e.get("type") == "extra_forbidden" else e.get("msg")
            if e.get("type") == "value_error":  # our own validators' messages name the field themselves
                msg = str(msg).removeprefix("Value error, ")
                problems.append(f"{loc}: {msg}" if loc else msg)
                continue
            problems.append(f"{loc or 'body'}: {msg}")
        return state.error_response(
            APIError(400, "; ".join(problems) or "invalid request", "invalid_request")
        )

    fastapi_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        schema = fastapi_openapi()  # built once and cached by FastAPI; adding the body models is idempotent
        schemas = schema.setdefault("components", {}).setdefault("schemas", {})
        schemas.update(routes_openai.BODY_SCHEMAS["$defs"])
        schemas.update(routes_tokenize.BODY_SCHEMAS["$defs"])
        return schema

    app.openapi = openapi
    for module in (routes_openai, routes_responses, routes_tokenize, routes_control, routes_ops):
        app.include_router(module.router)
    if not cfg.disable_ui:
        routes_ui.install(app)
    return app
