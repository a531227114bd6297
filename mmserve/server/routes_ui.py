"""The browser UI: the playground (`/`), the fleet dashboard (`/dashboard`), their files (`/ui/static/NAME`) and
the JSON they read (`/ui/api/config`, `/ui/api/stats`). `build_app` installs it unless --disable-ui.

The pages are plain files in `static/` (HTML, one stylesheet, JS modules; no build step), served with explicit
content types and a strict Content-Security-Policy: scripts, styles, images and connections only to this
origin, no inline code, no third-party request. They hold no secret: with --api-key the browser asks for the
key and sends it with every API call. `/ui/api/stats` needs the key too (middleware.API_KEY_PATHS: it names
the encoders' URLs, as answers' `encoded_by` do); `/ui/api/config` (is a key needed?) stays open.
None of these routes is in the OpenAPI schema: they are not part of the API.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

import mmserve
from mmserve.server.app_state import AppState, app_state
from mmserve.server.protocol import APIError
from mmserve.server.ui_stats import EncoderMetrics, StatsHistory, snapshot

STATIC_DIR = Path(__file__).with_name("static")
STATIC_NAME = re.compile(r"[a-z0-9][a-z0-9_-]*\.(js|css|svg)")  # no path separators, no dot files
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}
CSP = "; ".join(
    (
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' blob:",  # previews of attached images (object URLs of the user's own files)
        "media-src 'self' blob:",  # previews of attached video and audio
        "connect-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    )
)
PAGE_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cache-Control": "no-cache",  # revalidate: a server upgrade serves its own pages at once
}
API_HEADERS = {"X-Content-Type-Options": "nosniff", "Cache-Control": "no-store"}

router = APIRouter(include_in_schema=False)
State = Annotated[AppState, Depends(app_state)]


class UiState:
    """The UI's share of the server: the dashboard's history and the encoders' metrics cache."""

    def __init__(self, state: AppState) -> None:
        self.history = StatsHistory(state)
        self.encoders = EncoderMetrics()


def install(app: FastAPI) -> None:
    """Add the UI routes to `app` (built by `build_app`, its AppState set)."""
    app.state.ui = UiState(app.state.mmserve)
    app.include_router(router)


async def _ui(request: Request) -> UiState:
    ui: UiState = request.app.state.ui
    ui.history.start()  # the history starts with the first UI request: a page load or a poll
    return ui


Ui = Annotated[UiState, Depends(_ui)]


def _file(name: str) -> Response:
    path = STATIC_DIR / name
    if not path.is_file():
        raise APIError(404, f"no UI file {name!r}", "not_found")
    return Response(path.read_bytes(), media_type=CONTENT_TYPES[path.suffix], headers=PAGE_HEADERS)


@router.get("/")
async def playground(_: Ui) -> Response:
    return _file("playground.html")


@router.get("/dashboard")
async def dashboard(_: Ui) -> Response:
    return _file("dashboard.html")


@router.get("/ui/static/{name}")
async def static_file(name: str) -> Response:
    if not STATIC_NAME.fullmatch(name):
        raise APIError(404, f"no UI file {name!r}", "not_found")
    return _file(name)


@router.get("/ui/api/config")
async def ui_config(state: State) -> JSONResponse:
    """What a page needs before it has a key: whether it needs one."""
    body = {"auth_required": bool(state.cfg.api_key), "version": mmserve.__version__}
    return JSONResponse(body, headers=API_HEADERS)


@router.get("/ui/api/stats")
async def ui_stats(state: State, ui: Ui) -> JSONResponse:
    """The dashboard's poll (needs the API key when the server has one: see middleware.API_KEY_PATHS)."""
    return JSONResponse(await snapshot(state, ui.history, ui.encoders), headers=API_HEADERS)
