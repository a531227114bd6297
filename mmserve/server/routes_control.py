"""Control-plane endpoints: the encoder registry (EPD) and what `mmserve router` reads (/disagg/info).

Every route checks the cluster token first (`AppState.check_control_plane`), before reading the body.
"""

from __future__ import annotations

import json
from typing import Annotated

from fastapi import APIRouter, Depends, Request

from mmserve.server.app_state import AppState, app_state
from mmserve.server.protocol import APIError

router = APIRouter()
State = Annotated[AppState, Depends(app_state)]


async def encoder_url(request: Request) -> tuple[str, dict]:
    """The body's encoder URL (without a trailing slash) and the body."""
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}", "invalid_json") from e
    url = body.get("url") if isinstance(body, dict) else None
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise APIError(400, 'body must be {"url": "http(s)://host:port"}', "invalid_encoder_url")
    return url.rstrip("/"), body


@router.post("/register_encoder")
async def register_encoder(request: Request, state: State):
    state.check_control_plane(request)
    url, body = await encoder_url(request)
    registry = state.dispatcher.registry
    if body.get("heartbeat") and registry.is_unregistered(url):
        message = f"encoder {url} was unregistered; register it explicitly to bring it back"
        raise APIError(409, message, "encoder_unregistered")
    if body.get("heartbeat") and registry.get(url) is not None:
        registry.record_success(url)
    else:
        registry.register(url)
    return {"url": url, "registered": True}


@router.post("/unregister_encoder")
async def unregister_encoder(request: Request, state: State):
    state.check_control_plane(request)
    url, _ = await encoder_url(request)
    if not state.dispatcher.registry.unregister(url):
        raise APIError(404, f"encoder {url} is not registered", "encoder_not_found")
    return {"url": url, "registered": False}


@router.get("/encoders")
async def encoders(request: Request, state: State):
    state.check_control_plane(request)
    dispatcher = state.dispatcher
    return {
        "encoders": [e.as_json() for e in dispatcher.registry.all()],
        "routing": state.cfg.encoder_routing,
        "embedding_endpoint": dispatcher.routes.endpoints["tcp"],
        "embedding_endpoints": dict(dispatcher.routes.endpoints),
        "transport": dispatcher.routes.transport,
        "failovers": dispatcher.failovers,
        "local_fallbacks": dispatcher.local_fallbacks,
    }


@router.get("/disagg/info")
async def disagg_info(request: Request, state: State):
    """What `mmserve router` needs to know about this server (a control-plane route)."""
    state.check_control_plane(request)
    ready = state.client.ready
    return {
        "mode": state.cfg.disaggregation_mode,
        "model": state.cfg.served_model_name,
        "bootstrap": ready.kv_bootstrap,
        "kv_backends": list(ready.kv_backends),
        "max_model_len": ready.max_model_len,
        "kv_cache_tokens": ready.kv_cache_tokens,
        "has_tower": ready.has_tower,  # a decode server never loads vision or audio weights
    }
