"""A media server on 127.0.0.1 for tests of URL fetching: a route table of small, bounded handlers.

`MediaHost(routes)` serves on a free loopback port from a daemon thread (use it as a context manager) and
records every requested path. The handler helpers cover what a fetcher must survive: a body with or
without Content-Length, a lying Content-Length, a chunked stream, a trickle past any timeout, a redirect.
Every handler ends on its own (bounded writes), so a broken client cannot hang the test server.
"""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Callable
from types import TracebackType

Route = Callable[["MediaHandler"], None]


class MediaHandler(http.server.BaseHTTPRequestHandler):
    server: MediaHost

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - silence request logging
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server API
        self.server.paths.append(self.path)
        route = self.server.routes.get(self.path.split("?")[0])
        try:
            if route is None:
                self.send_error(404)
            else:
                route(self)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the fetcher gave up, as intended


class MediaHost(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, routes: dict[str, Route] | None = None) -> None:
        super().__init__(("127.0.0.1", 0), MediaHandler)
        self.routes: dict[str, Route] = dict(routes or {})
        self.paths: list[str] = []
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self.server_address[1]

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def __enter__(self) -> MediaHost:
        self._thread = threading.Thread(
            target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.shutdown()
        self.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)


def send(h: MediaHandler, body: bytes, *, length: bool = True, declared: int | None = None,
         content_type: str = "image/png") -> None:  # fmt: skip
    """200 with `body`; Content-Length true, `declared` (a lie) or absent (HTTP/1.0: ends at close)."""
    h.send_response(200)
    h.send_header("Content-Type", content_type)
    if declared is not None or length:
        h.send_header("Content-Length", str(declared if declared is not None else len(body)))
    h.end_headers()
    for i in range(0, len(body), 16 * 1024):
        h.wfile.write(body[i : i + 16 * 1024])


def send_chunked(h: MediaHandler, total: int) -> None:
    """200 with `total` bytes in 64 KiB chunks of `Transfer-Encoding: chunked` (no Content-Length)."""
    h.protocol_version = "HTTP/1.1"
    h.send_response(200)
    h.send_header("Transfer-Encoding", "chunked")
    h.send_header("Connection", "close")
    h.end_headers()
    chunk = b"x" * 65536
    for _ in range(total // len(chunk)):  # bounded; the fetcher hangs up after its limit
        h.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
    h.wfile.write(b"0\r\n\r\n")


def send_slowly(h: MediaHandler, seconds: float = 5.0) -> None:
    """200 and one byte every 0.1 s for `seconds` (past a fetch timeout, yet bounded)."""
    h.send_response(200)
    h.end_headers()
    for _ in range(round(seconds / 0.1)):
        h.wfile.write(b"x")
        h.wfile.flush()
        time.sleep(0.1)


def redirect(h: MediaHandler, location: str) -> None:
    h.send_response(302)
    h.send_header("Location", location)
    h.send_header("Content-Length", "0")
    h.end_headers()
