"""One routed request: a room on a decode server, the prefill that fills it, and the decode answer relayed.

Per attempt (a fresh room each, at most `max_attempts`):

    1. POST the client's body + {"room"} to the decode server (streaming, as the client asked); once that
       request is written, POST the body + {"room", "decode_bootstrap", "backend"} to the prefill server.
    2. Await the prefill's answer. An error closes the decode request (the decode server then aborts the
       room) and is the client's answer unchanged, except 503 `decode_at_capacity`: another decode server
       is tried. A connect failure (either server) is a strike and another server of that role is tried.
       A decode error answered before the prefill finished ends the attempt the same way.
    3. Relay the decode answer: status, content type and bytes. An SSE stream that breaks ends with one
       `decode_server_failed` error event and `data: [DONE]`; a broken JSON answer becomes a 502.

Retries happen only before any byte went to the client. Every wait is bounded by `request_timeout_s`.

Ownership: the relay holds one in-flight count on each server while it talks to it; the decode count and
the decode connection pass to `UpstreamStream` once the answer is handed to the client, which releases both
when the stream ends, breaks, or the client goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import anyio
import httpx
from fastapi.responses import Response, StreamingResponse

from mmserve.config import RouterConfig
from mmserve.disagg.router_metrics import ROUTE_HEADER, RouteNote, RouterMetrics
from mmserve.disagg.router_registry import ServerRegistry, UpstreamServer, affinity_key, refusal_reason
from mmserve.server.protocol import APIError

logger = logging.getLogger("mmserve.router")
PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}
_EVENT_ENDS = (b"\n\n", b"\r\n\r\n")


@dataclass
class RouterContext:
    """The router app's state, built once per app; `http` is opened and closed by the app's lifespan."""

    cfg: RouterConfig
    registry: ServerRegistry
    metrics: RouterMetrics
    upstream_headers: dict[str, str]  # the cluster token, when there is a secret
    http: httpx.AsyncClient | None = None


class _Retry(Exception):
    """This attempt cannot succeed on `server`; try another of its role. `answer`: the client's answer if no
    attempt is left."""

    def __init__(self, server: UpstreamServer, reason: str, answer: Response) -> None:
        super().__init__(reason)
        self.server, self.reason, self.answer = server, reason, answer


async def relay(ctx: RouterContext, kind: str, body: dict, note: RouteNote) -> Response:
    """The client's answer. Raises APIError when no server can take the request."""
    cfg, registry = ctx.cfg, ctx.registry
    key = affinity_key(kind, body, cfg.affinity_text_chars, cfg.affinity_token_ids)
    excluded: dict[str, set[str]] = {"prefill": set(), "decode": set()}
    last: Response | None = None
    for attempt in range(1, cfg.max_attempts + 1):
        prefill = registry.choose_prefill(key, excluded["prefill"])
        decode = registry.choose_decode(excluded["decode"])
        if prefill is None or decode is None:
            if last is not None:
                return last
            role = "prefill" if prefill is None else "decode"
            refused = [s.refused for s in registry.all() if s.role == role and s.refused]  # say why, if known
            raise APIError(
                503,
                "; ".join([f"no healthy {role} server", *refused]),
                f"no_{role}_server",
                headers={"Retry-After": "1"},
            )
        note.prefill, note.decode, note.attempts = prefill.url, decode.url, attempt
        note.room = uuid.uuid4().hex
        try:
            return await _Attempt(ctx, kind, body, prefill, decode, note).run()
        except _Retry as r:
            excluded[r.server.role].add(r.server.url)
            last = r.answer
            if attempt < cfg.max_attempts:
                ctx.metrics.retries.labels(r.reason).inc()
            logger.info("room %s: %s on %s (attempt %d)", note.room, r.reason, r.server.url, attempt)
    assert last is not None
    return last


class _DecodeAnswered(Exception):
    """The decode server answered an error before the prefill finished: that is the client's answer."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status_code)
        self.response = response


class _Attempt:
    """One room: the decode request, then the prefill that fills it. Holds an in-flight count on each server
    while it talks to it, and the decode connection until the answer is handed to an UpstreamStream."""

    def __init__(
        self,
        ctx: RouterContext,
        kind: str,
        body: dict,
        prefill: UpstreamServer,
        decode: UpstreamServer,
        note: RouteNote,
    ) -> None:
        assert ctx.http is not None, "the router app's lifespan opens the HTTP client"
        self.ctx, self.http, self.body, self.note = ctx, ctx.http, body, note
        self.prefill, self.decode, self.path = prefill, decode, PATHS[kind]
        self.headers = {**ctx.upstream_headers, "accept-encoding": "identity"}  # bytes relayed as they come
        self.deadline = asyncio.get_running_loop().time() + ctx.cfg.request_timeout_s
        self.decode_task: asyncio.Task[httpx.Response] | None = None
        self.prefill_task: asyncio.Task[httpx.Response] | None = None
        self.handed_over = False

    def remaining(self) -> float:
        return max(0.0, self.deadline - asyncio.get_running_loop().time())

    async def run(self) -> Response:
        note = self.note
        self.ctx.registry.acquire(self.decode)
        try:
            await self._send_decode()
            answer = await self._run_prefill()
            if answer.status_code in (401, 403):
                self._refused(self.prefill, answer.status_code, answer.content)
            if answer.status_code != 200:
                passthrough = _passthrough(answer.content, answer, note)
                if answer.status_code == 503 and _error_code(answer.content) == "decode_at_capacity":
                    passthrough.headers.setdefault("Retry-After", "1")
                    raise _Retry(self.decode, "decode_at_capacity", passthrough)
                return passthrough
            with contextlib.suppress(ValueError):
                note.read_handoff(answer.json())
            upstream = await self._decode_headers()
            if upstream.status_code in (401, 403):
                await self._decode_finished_first()  # raises: its refusal is recorded there
            response = await _answer(self.ctx, self.decode, upstream, note, self.remaining())
            self.handed_over = isinstance(response, UpstreamStream)
            return response
        except _DecodeAnswered as done:
            return done.response
        finally:
            with anyio.CancelScope(shield=True):  # also when the client went away (cancelled)
                await self._close()

    async def _send_decode(self) -> None:
        """Start the decode request and wait until it is written, so that the decode server knows the room
        before the KV arrives; a decode server that does not even take it is found out before any prefill
        work. Bounded by the connect timeout: past it the prefill starts anyway."""
        written = asyncio.Event()

        async def trace(name: str, info: dict) -> None:
            if name.endswith("send_request_body.complete"):
                written.set()

        body = {**self.body, "kv_transfer_params": {"room": self.note.room}}
        request = self.http.build_request(
            "POST", self.decode.url + self.path, json=body, headers=self.headers, extensions={"trace": trace}
        )
        self.decode_task = asyncio.create_task(self.http.send(request, stream=True))
        waiter = asyncio.create_task(written.wait())
        await asyncio.wait(
            {self.decode_task, waiter},
            timeout=self.ctx.cfg.connect_timeout_s,
            return_when=asyncio.FIRST_COMPLETED,
        )
        waiter.cancel()
        if self.decode_task.done():
            await self._decode_finished_first()

    async def _run_prefill(self) -> httpx.Response:
        """The prefill server's answer, watching the decode request meanwhile."""
        assert self.decode_task is not None
        params = {
            "room": self.note.room,
            "decode_bootstrap": self.decode.bootstrap,
            "backend": self.ctx.cfg.kv_transfer_backend,
        }
        body = {**self.body, "kv_transfer_params": params}
        self.ctx.registry.acquire(self.prefill)
        try:
            self.prefill_task = task = asyncio.create_task(
                self.http.post(self.prefill.url + self.path, json=body, headers=self.headers)
            )
            while not task.done():
                watched = {task} if self.decode_task.done() else {task, self.decode_task}
                done, _ = await asyncio.wait(
                    watched, timeout=self.remaining(), return_when=asyncio.FIRST_COMPLETED
                )
                if not done:
                    raise APIError(
                        504, f"prefill server {self.prefill.url} did not answer in time", "prefill_timeout"
                    )
                if not task.done():
                    await self._decode_finished_first()
            try:
                return task.result()
            except httpx.HTTPError as e:
                self.ctx.registry.record_failure(self.prefill, f"dispatch: {type(e).__name__}")
                raise _Retry(self.prefill, "prefill_unreachable", _unreachable(self.prefill, e)) from e
        finally:
            self.ctx.registry.release(self.prefill)

    async def _decode_finished_first(self) -> None:
        """The decode request finished before the prefill. Its headers of a success: carry on. Otherwise the
        attempt ends: a retry (unreachable, or 503), or its error relayed (_DecodeAnswered)."""
        assert self.decode_task is not None
        upstream = await self._decode_headers()
        if upstream.status_code < 400:
            return
        try:
            content = await asyncio.wait_for(upstream.aread(), self.remaining())
        except (httpx.HTTPError, TimeoutError) as e:
            raise _Retry(self.decode, "decode_unreachable", _unreachable(self.decode, e)) from e
        if upstream.status_code in (401, 403):
            self._refused(self.decode, upstream.status_code, content)
        answer = _passthrough(content, upstream, self.note)
        if upstream.status_code == 503:
            raise _Retry(self.decode, "decode_at_capacity", answer)
        raise _DecodeAnswered(answer)

    def _refused(self, server: UpstreamServer, status: int, content: bytes) -> None:
        """The server refused the router's token: the client is told why with a 502 (relaying the 401 would
        read as the client's own credentials failing), and another server of that role is tried."""
        reason = refusal_reason(server.url, status, content)
        self.ctx.registry.record_refusal(server, reason)
        self.note.status = 502
        err = APIError(502, reason, "cluster_token_refused")
        answer = Response(json.dumps(err.body()), 502, {ROUTE_HEADER: self.note.header()}, "application/json")
        raise _Retry(server, "token_refused", answer)

    async def _decode_headers(self) -> httpx.Response:
        assert self.decode_task is not None
        try:
            return await asyncio.wait_for(asyncio.shield(self.decode_task), self.remaining())
        except TimeoutError:
            raise APIError(
                504, f"decode server {self.decode.url} did not answer in time", "decode_timeout"
            ) from None
        except httpx.HTTPError as e:
            self.ctx.registry.record_failure(self.decode, f"dispatch: {type(e).__name__}")
            raise _Retry(self.decode, "decode_unreachable", _unreachable(self.decode, e)) from e

    async def _close(self) -> None:
        """Cancel the prefill request if it still runs; unless the answer was handed over, close the decode
        request (cancel it, or close its response): the decode server then aborts the room."""
        if self.prefill_task is not None:
            self.prefill_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):  # its outcome was dealt with
                await self.prefill_task
        if self.handed_over:
            return
        task = self.decode_task
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        elif task is not None and not task.cancelled() and task.exception() is None:
            await task.result().aclose()
        self.ctx.registry.release(self.decode)


async def _answer(
    ctx: RouterContext, decode: UpstreamServer, upstream: httpx.Response, note: RouteNote, timeout_s: float
) -> Response:
    """The decode server's answer as the client's: an SSE stream relayed as it comes, anything else read
    whole (so that a break can still become a 502)."""
    content_type = upstream.headers.get("content-type", "")
    if upstream.status_code < 400 and content_type.startswith("text/event-stream"):
        note.status = upstream.status_code

        async def close() -> None:
            await upstream.aclose()
            ctx.registry.release(decode)
            ctx.metrics.finish(note)

        events = _relay_events(ctx, decode, upstream, note)
        return UpstreamStream(
            events, close, upstream.status_code, {ROUTE_HEADER: note.header()}, content_type
        )
    try:
        content = await asyncio.wait_for(upstream.aread(), timeout_s)
    except (httpx.HTTPError, TimeoutError) as e:
        ctx.registry.record_failure(decode, f"answer: {type(e).__name__}")
        raise APIError(
            502,
            f"decode server {decode.url} failed while answering: {type(e).__name__}",
            "decode_server_failed",
            headers={ROUTE_HEADER: note.header()},
        ) from e
    note.mark_first_byte()
    return _passthrough(content, upstream, note)


async def _relay_events(
    ctx: RouterContext, decode: UpstreamServer, upstream: httpx.Response, note: RouteNote
) -> AsyncIterator[bytes]:
    """The stream's bytes, forwarded whole events at a time: a break then never leaves half an event
    before the error event. The bytes are the upstream's, unchanged and in order."""
    pending = bytearray()
    try:
        async for chunk in upstream.aiter_raw():
            pending += chunk
            end = max((pending.rfind(sep) + len(sep) for sep in _EVENT_ENDS if sep in pending), default=0)
            if end:
                note.mark_first_byte()
                yield bytes(pending[:end])
                del pending[:end]
        if pending:  # a stream that ends without a blank line: still the upstream's bytes
            yield bytes(pending)
    except httpx.HTTPError as e:
        ctx.registry.record_failure(decode, f"stream: {type(e).__name__}")
        note.status = 502
        logger.warning(
            "room %s: decode server %s broke the stream (%s: %s); %d bytes of an unfinished event dropped",
            note.room,
            decode.url,
            type(e).__name__,
            e,
            len(pending),
        )
        err = APIError(
            502, f"decode server {decode.url} failed mid-stream ({type(e).__name__})", "decode_server_failed"
        )
        yield f"data: {json.dumps(err.body())}\n\ndata: [DONE]\n\n".encode()


class UpstreamStream(StreamingResponse):
    """A relayed stream that owns its upstream: `close` runs exactly once, however the response ends
    (finished, broken, client gone, or never started)."""

    def __init__(
        self,
        content: AsyncIterator[bytes],
        close: Callable[[], Awaitable[None]],
        status: int,
        headers: dict[str, str],
        media_type: str,
    ) -> None:
        super().__init__(content, status, headers, media_type)
        self._close: Callable[[], Awaitable[None]] | None = close

    async def close_upstream(self) -> None:
        close, self._close = self._close, None
        if close is not None:
            with anyio.CancelScope(shield=True):
                await close()

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.close_upstream()


def _passthrough(content: bytes, upstream: httpx.Response, note: RouteNote) -> Response:
    note.status = upstream.status_code
    return Response(
        content,
        upstream.status_code,
        {ROUTE_HEADER: note.header()},
        media_type=upstream.headers.get("content-type"),
    )


def _unreachable(server: UpstreamServer, e: Exception) -> Response:
    err = APIError(
        502, f"{server.role} server {server.url} unreachable: {type(e).__name__}", "upstream_unreachable"
    )
    return Response(json.dumps(err.body()), 502, media_type="application/json")


def _error_code(content: bytes) -> str | None:
    with contextlib.suppress(ValueError, LookupError, TypeError):
        return json.loads(content)["error"]["code"]
    return None
