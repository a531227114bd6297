"""Noticing at once that an HTTP client went away, so its engine request is aborted instead of run to its end.

The ASGI server tells the app by answering `receive()` with `http.disconnect`; once the request body has been
read, the next `receive()` blocks until exactly that (or until the response is complete). A task waiting on it
is woken by the disconnect itself: no polling, nothing missed between polls.
"""

from __future__ import annotations

import asyncio

from fastapi import Request


def watch_disconnect(request: Request) -> asyncio.Task[None]:
    """A task that ends when the client of `request` disconnects. The caller must have read the whole body
    (else this would swallow body chunks) and must cancel the task once it no longer cares."""

    async def wait() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    return asyncio.ensure_future(wait())
