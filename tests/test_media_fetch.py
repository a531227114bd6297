"""Tests for mmserve.multimodal.media_fetch through `load_bytes` / `load_media`: http(s) fetching and its SSRF
policy.

Real network traffic only ever goes to a local server on 127.0.0.1; every other address appears only behind
an httpx.MockTransport, reached through an injected resolver.
"""

from __future__ import annotations

import dataclasses
import io
import socket
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from PIL import Image

from mmserve.config import MediaConfig
from mmserve.multimodal.errors import MediaFetchError, MediaForbiddenError, MediaTooLargeError
from mmserve.multimodal.media import MediaRef, load_bytes, load_image, load_media
from mmserve.testing import media_host as mh

pytestmark = pytest.mark.timeout(60)

CFG = MediaConfig()


@pytest.fixture(scope="module")
def png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (32, 24), (10, 60, 120)).save(buf, format="PNG")
    return buf.getvalue()


# --- http(s) against a real server on 127.0.0.1 -----------------------------------------------------

BIG_BODY_BYTES = 1 << 20


@pytest.fixture(scope="module")
def server(png: bytes) -> Iterator[mh.MediaHost]:
    with mh.MediaHost() as host:
        host.routes.update(
            {
                "/img.png": lambda h: mh.send(h, png, content_type="image/png; charset=binary"),
                "/big-declared": lambda h: mh.send(h, b"x" * 1000, declared=BIG_BODY_BYTES),
                "/big-stream": lambda h: mh.send(h, b"x" * BIG_BODY_BYTES, length=False),
                "/slow": mh.send_slowly,
                "/redirect": lambda h: mh.redirect(h, "/img.png"),
            }
        )
        yield host


LOCAL = MediaConfig(allow_private_urls=True, fetch_timeout_s=5.0)


def test_http_fetch_success(server: mh.MediaHost, png: bytes) -> None:
    media = load_media(MediaRef.parse(server.url("/img.png")), LOCAL)
    assert media.data == png and media.mime == "image/png"
    assert load_image(MediaRef.parse(server.url("/img.png")), LOCAL).size == (32, 24)


def test_http_404(server: mh.MediaHost) -> None:
    with pytest.raises(MediaFetchError, match="404"):
        load_bytes(MediaRef.parse(server.url("/missing")), LOCAL)


def test_http_too_large_by_content_length(server: mh.MediaHost) -> None:
    with pytest.raises(MediaTooLargeError, match=str(BIG_BODY_BYTES)):
        load_bytes(
            MediaRef.parse(server.url("/big-declared")), dataclasses.replace(LOCAL, max_media_bytes=100_000)
        )


def test_http_too_large_while_streaming(server: mh.MediaHost) -> None:
    with pytest.raises(MediaTooLargeError):
        load_bytes(
            MediaRef.parse(server.url("/big-stream")), dataclasses.replace(LOCAL, max_media_bytes=100_000)
        )
    assert len(load_bytes(MediaRef.parse(server.url("/big-stream")), LOCAL)) == BIG_BODY_BYTES


def test_http_slow_server_times_out(server: mh.MediaHost) -> None:
    start = time.monotonic()
    with pytest.raises(MediaFetchError, match="timed out"):
        load_bytes(MediaRef.parse(server.url("/slow")), dataclasses.replace(LOCAL, fetch_timeout_s=0.5))
    assert time.monotonic() - start < 2.0


def test_http_redirect_followed(server: mh.MediaHost, png: bytes) -> None:
    assert load_bytes(MediaRef.parse(server.url("/redirect")), LOCAL) == png
    with pytest.raises(MediaFetchError, match="too many redirects"):
        load_bytes(MediaRef.parse(server.url("/redirect")), dataclasses.replace(LOCAL, max_redirects=0))


def test_loopback_refused_by_default(server: mh.MediaHost) -> None:
    before = len(server.paths)
    for url in (server.url("/img.png"), server.url("/img.png").replace("127.0.0.1", "[::1]")):
        with pytest.raises(MediaForbiddenError, match="loopback"):
            load_bytes(MediaRef.parse(url), CFG)
    with pytest.raises(MediaForbiddenError, match="loopback"):
        load_bytes(MediaRef.parse(server.url("/img.png").replace("127.0.0.1", "localhost")), CFG)
    assert len(server.paths) == before


# --- SSRF policy behind a mock transport ------------------------------------------------------------

PUBLIC_IP = "93.184.215.14"  # a global address; only ever seen by the mock transport


class _Recorder:
    """A mock transport handler that records requests; serves an image from PUBLIC_IP."""

    def __init__(self, redirect_to: str | None = None) -> None:
        self.requests: list[httpx.Request] = []
        self.redirect_to = redirect_to

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if self.redirect_to is not None:
            return httpx.Response(302, headers={"Location": self.redirect_to})
        return httpx.Response(200, content=b"ok", headers={"Content-Type": "text/plain"})

    @property
    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self)


def _resolver(table: dict[str, list[str]]) -> Callable[[str, int], list[str]]:
    def resolve(host: str, port: int) -> list[str]:
        if host not in table:
            raise socket.gaierror(f"unknown test host {host}")
        return table[host]

    return resolve


@pytest.mark.parametrize(
    "addresses",
    [
        ["10.0.0.1"],
        ["169.254.169.254"],
        ["192.168.1.1"],
        ["fd00::1"],
        ["fd00:ec2::254"],
        ["127.0.0.1"],
        ["0.0.0.0"],
        ["100.64.0.1"],
        ["224.0.0.1"],
        ["::ffff:10.0.0.1"],
        ["64:ff9b::a00:1"],
        [PUBLIC_IP, "10.0.0.1"],  # any bad address is enough
    ],
)
def test_private_resolution_refused_before_connecting(addresses: list[str]) -> None:
    rec = _Recorder()
    resolver = _resolver({"evil.test": addresses})
    with pytest.raises(MediaForbiddenError, match="evil.test"):
        load_bytes(
            MediaRef.parse("http://evil.test/img.png"), CFG, resolver=resolver, transport=rec.transport
        )
    assert rec.requests == []


@pytest.mark.parametrize(
    "url",
    [
        "http://10.0.0.1/x",
        "http://[fd00::1]/x",
        "http://169.254.169.254/latest/meta-data/",
        "https://192.168.1.1/",
    ],
)
def test_private_ip_literal_refused(url: str) -> None:
    rec = _Recorder()
    resolver = _resolver({})
    with pytest.raises(MediaForbiddenError):
        load_bytes(MediaRef.parse(url), CFG, resolver=resolver, transport=rec.transport)
    assert rec.requests == []


def test_connects_to_validated_ip_with_host_header_and_sni() -> None:
    rec = _Recorder()
    resolver = _resolver({"public.test": [PUBLIC_IP]})
    media = load_media(
        MediaRef.parse("https://public.test/a/b.png?x=1"), CFG, resolver=resolver, transport=rec.transport
    )
    assert media.data == b"ok" and media.mime == "text/plain"
    [request] = rec.requests
    assert request.url.host == PUBLIC_IP and request.url.path == "/a/b.png" and request.url.query == b"x=1"
    assert request.headers["host"] == "public.test"
    assert request.extensions["sni_hostname"] == "public.test"


def test_redirect_to_private_address_refused() -> None:
    rec = _Recorder(redirect_to="http://10.0.0.2/secret")
    resolver = _resolver({"public.test": [PUBLIC_IP]})
    with pytest.raises(MediaForbiddenError, match="10.0.0.2"):
        load_bytes(
            MediaRef.parse("http://public.test/img.png"), CFG, resolver=resolver, transport=rec.transport
        )
    assert [r.url.host for r in rec.requests] == [PUBLIC_IP]  # the private hop was never requested


def test_redirect_to_privately_resolving_host_or_file_refused() -> None:
    resolver = _resolver({"public.test": [PUBLIC_IP], "evil.test": ["192.168.0.10"]})
    for target in ("http://evil.test/x", "file:///etc/passwd"):
        rec = _Recorder(redirect_to=target)
        with pytest.raises(MediaForbiddenError):
            load_bytes(MediaRef.parse("http://public.test/"), CFG, resolver=resolver, transport=rec.transport)
        assert len(rec.requests) == 1


def test_allowed_media_domains() -> None:
    cfg = dataclasses.replace(CFG, allowed_media_domains=("example.com",))
    resolver = _resolver(
        {"example.com": [PUBLIC_IP], "img.example.com": [PUBLIC_IP], "notexample.com": [PUBLIC_IP]}
    )
    rec = _Recorder()
    for url in ("http://example.com/x", "http://img.example.com/x"):
        assert load_bytes(MediaRef.parse(url), cfg, resolver=resolver, transport=rec.transport) == b"ok"
    for url in ("http://notexample.com/x", "http://other.test/x", f"http://{PUBLIC_IP}/x"):
        with pytest.raises(MediaForbiddenError, match="allowed media domains"):
            load_bytes(MediaRef.parse(url), cfg, resolver=resolver, transport=rec.transport)
    assert len(rec.requests) == 2


def test_host_overrides_pin_addresses_and_are_still_checked() -> None:
    """--media-resolve answers before DNS (the resolver is never asked) and its address is still checked."""
    cfg = dataclasses.replace(CFG, media_host_overrides=(("cdn.test", PUBLIC_IP), ("evil.test", "10.9.8.7")))
    resolver = _resolver({})  # any DNS lookup would fail
    rec = _Recorder()
    assert (
        load_bytes(MediaRef.parse("http://CDN.test./x"), cfg, resolver=resolver, transport=rec.transport)
        == b"ok"
    )
    assert rec.requests[0].url.host == PUBLIC_IP and rec.requests[0].headers["host"].lower() == "cdn.test."
    with pytest.raises(MediaForbiddenError, match="private address 10.9.8.7"):
        load_bytes(MediaRef.parse("http://evil.test/x"), cfg, resolver=resolver, transport=rec.transport)
    assert len(rec.requests) == 1


def test_allowed_media_networks_open_only_those_networks() -> None:
    cfg = dataclasses.replace(CFG, allowed_media_networks=("10.20.0.0/16",))
    resolver = _resolver(
        {"intranet.test": ["10.20.1.2"], "other.test": ["10.21.0.1"], "meta.test": ["169.254.169.254"]}
    )
    rec = _Recorder()
    assert (
        load_bytes(MediaRef.parse("http://intranet.test/x"), cfg, resolver=resolver, transport=rec.transport)
        == b"ok"
    )
    for host in ("other.test", "meta.test"):
        with pytest.raises(MediaForbiddenError, match=host):
            load_bytes(MediaRef.parse(f"http://{host}/x"), cfg, resolver=resolver, transport=rec.transport)
    assert len(rec.requests) == 1


def test_redirect_limit_and_resolution_failure() -> None:
    rec = _Recorder(redirect_to="/again")
    resolver = _resolver({"public.test": [PUBLIC_IP]})
    cfg = dataclasses.replace(CFG, max_redirects=2)
    with pytest.raises(MediaFetchError, match="too many redirects"):
        load_bytes(MediaRef.parse("http://public.test/"), cfg, resolver=resolver, transport=rec.transport)
    assert len(rec.requests) == 3
    with pytest.raises(MediaFetchError, match="cannot resolve"):
        load_bytes(MediaRef.parse("http://unknown.test/"), CFG, resolver=resolver, transport=rec.transport)


def test_mock_transport_errors_are_typed() -> None:
    def fail(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    resolver = _resolver({"public.test": [PUBLIC_IP]})
    with pytest.raises(MediaFetchError, match="connection refused"):
        load_bytes(
            MediaRef.parse("http://public.test/"), CFG, resolver=resolver, transport=httpx.MockTransport(fail)
        )
