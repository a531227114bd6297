"""ASGI middleware of the API server: the request body limit and the API key.

Plain ASGI, not Starlette's `BaseHTTPMiddleware` (`@app.middleware("http")`): that one hides the client's
disconnect from the endpoint (`request.is_disconnected()` never turns true), and a request whose client left
must be aborted, not run to its end.
"""

from __future__ import annotations

import hmac
import json

from mmserve.server.protocol import APIError


class BodyLimitMiddleware:
    """413 for request bodies over the limit, by Content-Length and while streaming the body."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await _send_error(
                send, APIError(413, f"request body is over {self.max_bytes} bytes", "body_too_large")
            )
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise APIError(413, f"request body is over {self.max_bytes} bytes", "body_too_large")
            return message

        try:
            await self.app(scope, limited_receive, send)
        except APIError as e:
            await _send_error(send, e)


# Paths besides /v1/* that need the API key: they do work on a user's input (/tokenize fetches and decodes
# media), or name the encoders' URLs as answers' `encoded_by` do (the dashboard's /ui/api/stats). Health,
# metrics and /version stay open to probes; the control plane has its own cluster token.
API_KEY_PATHS = frozenset({"/tokenize", "/detokenize", "/ui/api/stats"})


class ApiKeyMiddleware:
    """401 on /v1/* and API_KEY_PATHS without `Authorization: Bearer KEY`. Plain ASGI, not
    `@app.middleware("http")`: Starlette's BaseHTTPMiddleware hides the client's disconnect from the endpoint,
    and a request whose client left must be aborted, not run to its end."""

    def __init__(self, app, api_key: str, on_error) -> None:
        self.app, self.api_key, self.on_error = app, api_key.encode(), on_error

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path.startswith("/v1") or path in API_KEY_PATHS:
            header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            token = header[7:] if header.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(token.encode(), self.api_key):
                self.on_error(401)
                return await _send_error(send, APIError(401, "missing or invalid API key", "invalid_api_key"))
        return await self.app(scope, receive, send)


async def _send_error(send, err: APIError) -> None:
    body = json.dumps(err.body()).encode()
    await send({"type": "http.response.start", "status": err.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})  # fmt: skip
    await send({"type": "http.response.body", "body": body})
