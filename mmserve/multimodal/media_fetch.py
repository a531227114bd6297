"""Getting the raw bytes of a media item: data URIs, allowed local files, and SSRF-safe http(s) fetches.

Every path enforces `MediaConfig.max_media_bytes` before it holds the whole item in memory, and every
failure is a typed `MediaError`. Decoding the bytes lives in `mmserve.multimodal.media`.

http(s) fetches are pinned to the address that was validated: the host is resolved once, every resolved
address is checked, and the request is sent to that IP with the original `Host` header (and TLS SNI /
certificate name), so a DNS answer that changes between check and connect (rebinding) cannot redirect
the request. Redirects are followed by hand and every hop is validated the same way.
"""

from __future__ import annotations

import base64
import binascii
import functools
import ipaddress
import os
import socket
import ssl
import stat
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import httpx

from mmserve.config import MediaConfig
from mmserve.multimodal.errors import (
    MediaDecodeError,
    MediaFetchError,
    MediaForbiddenError,
    MediaTooLargeError,
)

if TYPE_CHECKING:
    from mmserve.multimodal.media import MediaRef

Resolver = Callable[[str, int], list[str]]
"""Maps (host, port) to the IP address strings it resolves to."""

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_METADATA_ADDRESSES = frozenset(
    {ipaddress.ip_address("169.254.169.254"), ipaddress.ip_address("fd00:ec2::254")}
)
_NAT64_PREFIX = ipaddress.ip_network("64:ff9b::/96")
_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})


@dataclass(frozen=True)
class MediaBytes:
    """The bytes of one media item and where they came from.

    `mime` is the type the source declared (data URI header or HTTP Content-Type, without parameters),
    or None. It is informational only: decoders sniff the content and never trust it.
    """

    data: bytes = field(repr=False)
    mime: str | None
    source: str


def load_media(
    ref: MediaRef,
    cfg: MediaConfig,
    *,
    resolver: Resolver | None = None,
    transport: httpx.BaseTransport | None = None,
) -> MediaBytes:
    """Returns the bytes of `ref` with their declared MIME type, enforcing the limits of `cfg`.

    Raises MediaTooLargeError (over `max_media_bytes`), MediaDecodeError (malformed data URI),
    MediaForbiddenError (file outside the allowed dir, refused host or address), MediaFetchError (missing
    file, network error, timeout, HTTP status >= 400, too many redirects).
    """
    if ref.kind == "bytes":
        assert ref.data is not None
        _check_size(len(ref.data), cfg)
        return MediaBytes(ref.data, None, "bytes")
    assert ref.url is not None
    if ref.kind == "data":
        data, mime = parse_data_uri(ref.url, max_bytes=cfg.max_media_bytes)
        return MediaBytes(data, mime, "data URI")
    if ref.kind == "file":
        return _read_file(ref.url, cfg)
    return _fetch_http(ref.url, cfg, resolver or default_resolver, transport)


def load_bytes(
    ref: MediaRef,
    cfg: MediaConfig,
    *,
    resolver: Resolver | None = None,
    transport: httpx.BaseTransport | None = None,
) -> bytes:
    """Returns the bytes of `ref`; `load_media` without the metadata. Raises as `load_media`."""
    return load_media(ref, cfg, resolver=resolver, transport=transport).data


def _check_size(n_bytes: int, cfg: MediaConfig) -> None:
    """Raises MediaTooLargeError if `n_bytes` exceeds `cfg.max_media_bytes`."""
    if n_bytes > cfg.max_media_bytes:
        raise MediaTooLargeError(f"media is {n_bytes} bytes, more than the limit of {cfg.max_media_bytes}")


# --- data: URIs -------------------------------------------------------------------------------------


def parse_data_uri(uri: str, *, max_bytes: int | None = None) -> tuple[bytes, str | None]:
    """Decodes `data:[<mime>][;params][;base64],<payload>` into (bytes, declared MIME or None).

    With `max_bytes`, the size is checked from the encoded length before decoding and exactly after.
    Raises MediaDecodeError for a malformed URI or base64 payload, MediaTooLargeError over `max_bytes`.
    """
    if not uri[:5].lower() == "data:":
        raise MediaDecodeError("not a data URI")
    header, sep, payload = uri[5:].partition(",")
    if not sep:
        raise MediaDecodeError("malformed data URI: no ',' before the payload")
    params = [p.strip() for p in header.split(";")]
    is_base64 = len(params) > 1 and params[-1].lower() == "base64"
    mime = params[0].lower() or None
    if is_base64:
        payload = "".join(payload.split())  # clients wrap long base64 lines
        if max_bytes is not None and len(payload) * 3 // 4 > max_bytes + 2:
            raise MediaTooLargeError(
                f"data URI holds about {len(payload) * 3 // 4} bytes, more than the limit of {max_bytes}"
            )
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise MediaDecodeError("malformed base64 in data URI") from e
    else:
        if max_bytes is not None and len(payload) // 3 > max_bytes:  # "%XX" is the densest encoding
            raise MediaTooLargeError(f"data URI payload is larger than the limit of {max_bytes} bytes")
        data = urllib.parse.unquote_to_bytes(payload)
    if max_bytes is not None and len(data) > max_bytes:
        raise MediaTooLargeError(f"data URI holds {len(data)} bytes, more than the limit of {max_bytes}")
    return data, mime


# --- file:// ----------------------------------------------------------------------------------------


def _read_file(url: str, cfg: MediaConfig) -> MediaBytes:
    """Reads a file:// URL below `cfg.allowed_local_media_path`.

    Raises MediaForbiddenError (file:// disabled, remote host, path outside the allowed dir after
    resolving `..` and symlinks), MediaFetchError (missing or not a regular file), MediaTooLargeError.
    """
    if not cfg.allowed_local_media_path:
        raise MediaForbiddenError("file:// media is disabled on this server (no allowed local media path)")
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaForbiddenError(f"file:// URL names a remote host {parts.netloc!r}")
    requested = urllib.parse.unquote(parts.path)
    path = os.path.realpath(requested)
    allowed = os.path.realpath(cfg.allowed_local_media_path)
    if os.path.commonpath([allowed, path]) != allowed:
        # Name the path the client gave, not where symlinks lead: that would tell it about the file system.
        raise MediaForbiddenError(f"file {requested!r} is outside the allowed local media directory")
    # O_NOFOLLOW closes the window where the last component is swapped for a symlink after realpath;
    # O_NONBLOCK keeps a FIFO from blocking the open.
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise MediaFetchError(f"cannot open file {requested!r}: {e.strerror}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise MediaFetchError(f"{requested!r} is not a regular file")
        _check_size(st.st_size, cfg)
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(cfg.max_media_bytes + 1)  # the file may have grown since fstat
    except OSError as e:
        raise MediaFetchError(f"cannot read file {requested!r}: {e.strerror}") from e
    finally:
        os.close(fd)
    _check_size(len(data), cfg)
    return MediaBytes(data, None, url)


# --- http(s) ----------------------------------------------------------------------------------------


def default_resolver(host: str, port: int) -> list[str]:
    """Resolves `host` with `socket.getaddrinfo`; returns the distinct IP strings. Raises OSError."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def _embedded_ipv4(addr: IPAddress) -> list[ipaddress.IPv4Address]:
    """Returns the IPv4 addresses an IPv6 address tunnels to (mapped, 6to4, Teredo, NAT64)."""
    if not isinstance(addr, ipaddress.IPv6Address):
        return []
    found = [addr.ipv4_mapped, addr.sixtofour, *(addr.teredo or ())]
    if addr in _NAT64_PREFIX:
        found.append(ipaddress.IPv4Address(int(addr) & 0xFFFFFFFF))
    return [a for a in found if a is not None]


def forbidden_address_class(addr: IPAddress) -> str | None:
    """Returns why `addr` is not a safe fetch destination ("loopback", "private", ...), or None."""
    for inner in _embedded_ipv4(addr):
        if (reason := forbidden_address_class(inner)) is not None:
            return f"{reason} (tunnelled in IPv6)"
    checks = (
        (addr in _METADATA_ADDRESSES, "cloud metadata"),
        (addr.is_loopback, "loopback"),
        (addr.is_unspecified, "unspecified"),
        (addr.is_link_local, "link-local"),
        (addr.is_multicast, "multicast"),
        (addr.is_private, "private"),
        (addr.is_reserved, "reserved"),
        (not addr.is_global, "non-global"),  # e.g. carrier-grade NAT 100.64.0.0/10
    )
    return next((name for hit, name in checks if hit), None)


def _host_allowed(host: str, domains: tuple[str, ...]) -> bool:
    """True if `domains` is empty or `host` is one of them or a subdomain of one."""
    if not domains:
        return True
    host = host.rstrip(".").lower()
    for domain in (d.rstrip(".").lower() for d in domains):
        if host == domain or host.endswith("." + domain):
            return True
    return False


def _resolve_safe(url: httpx.URL, cfg: MediaConfig, resolver: Resolver) -> str:
    """Validates the host of `url` and returns the IP to connect to. Connects to nothing.

    Raises MediaForbiddenError (bad scheme, host not allowed, any address in a refused class),
    MediaFetchError (resolution failed).
    """
    if url.scheme not in ("http", "https"):
        raise MediaForbiddenError(f"refusing to fetch a {url.scheme!r} URL")
    host = url.raw_host.decode("ascii")
    if not host:
        raise MediaFetchError(f"URL {url} has no host")
    if not _host_allowed(host, cfg.allowed_media_domains):
        raise MediaForbiddenError(f"host {host!r} is not in the allowed media domains")
    pinned = dict(cfg.media_host_overrides).get(host.rstrip(".").lower())
    try:
        ips = [ipaddress.ip_address(pinned or host)]
    except ValueError:
        try:
            ips = [ipaddress.ip_address(ip) for ip in resolver(host, url.port or _default_port(url))]
        except (OSError, ValueError) as e:
            raise MediaFetchError(f"cannot resolve host {host!r}: {e}") from e
    if not ips:
        raise MediaFetchError(f"host {host!r} resolved to no addresses")
    if not cfg.allow_private_urls:
        allowed = [ipaddress.ip_network(n, strict=False) for n in cfg.allowed_media_networks]
        for ip in ips:
            if any(ip in net for net in allowed):
                continue
            if (reason := forbidden_address_class(ip)) is not None:
                raise MediaForbiddenError(f"host {host!r} resolves to {reason} address {ip}")
    return str(ips[0])


def _default_port(url: httpx.URL) -> int:
    return 443 if url.scheme == "https" else 80


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """httpx's default TLS context (certifi's CAs), made once: a client makes its own on every construction, 27 ms
    of CPU per fetched URL otherwise. An SSLContext is shared safely between threads and connections."""
    return httpx.create_ssl_context()


def _fetch_http(
    url_str: str, cfg: MediaConfig, resolver: Resolver, transport: httpx.BaseTransport | None
) -> MediaBytes:
    """Downloads an http(s) URL, following at most `cfg.max_redirects` validated redirects.

    Raises as `load_media`.
    """
    deadline = time.monotonic() + cfg.fetch_timeout_s
    try:
        url = httpx.URL(url_str)
        # trust_env=False: a proxy from the environment would bypass the address pinning.
        tls = _tls_context()
        with httpx.Client(transport=transport, trust_env=False, follow_redirects=False, verify=tls) as client:
            for _ in range(cfg.max_redirects + 1):
                ip = _resolve_safe(url, cfg, resolver)
                result = _fetch_once(client, url, ip, cfg, deadline)
                if isinstance(result, MediaBytes):
                    return result
                url = result
    except httpx.TimeoutException as e:
        raise MediaFetchError(f"timed out fetching {url_str} (limit {cfg.fetch_timeout_s} s)") from e
    except (httpx.HTTPError, httpx.InvalidURL) as e:
        raise MediaFetchError(f"error fetching {url_str}: {e}") from e
    raise MediaFetchError(f"too many redirects fetching {url_str} (limit {cfg.max_redirects})")


def _fetch_once(
    client: httpx.Client, url: httpx.URL, ip: str, cfg: MediaConfig, deadline: float
) -> MediaBytes | httpx.URL:
    """Sends one GET for `url` to `ip`; returns the body, or the next URL for a redirect.

    Raises MediaFetchError (status, timeout), MediaTooLargeError, httpx errors (mapped by the caller).
    """
    remaining = _remaining(deadline, url, cfg)
    extensions = {"sni_hostname": url.raw_host.decode("ascii")} if url.scheme == "https" else {}
    request = client.build_request(
        "GET",
        url.copy_with(host=ip),
        headers={"Host": url.netloc.decode("ascii"), "Accept-Encoding": "identity"},
        extensions=extensions,
        timeout=httpx.Timeout(remaining),
    )
    response = client.send(request, stream=True)
    try:
        if response.status_code in _REDIRECT_STATUSES:
            location = response.headers.get("location")
            if not location:
                raise MediaFetchError(f"HTTP {response.status_code} redirect without Location from {url}")
            return url.join(location)
        if response.status_code >= 400:
            raise MediaFetchError(f"HTTP {response.status_code} fetching {url}")
        if not 200 <= response.status_code < 300:
            raise MediaFetchError(f"unexpected HTTP status {response.status_code} fetching {url}")
        declared = response.headers.get("content-length", "")
        if declared.isdigit():
            _check_size(int(declared), cfg)
        data = _read_body(response, url, cfg, deadline)
    finally:
        response.close()
    content_type = response.headers.get("content-type", "").split(";")[0].strip().lower()
    return MediaBytes(data, content_type or None, str(url))


def _read_body(response: httpx.Response, url: httpx.URL, cfg: MediaConfig, deadline: float) -> bytes:
    """Streams the body, aborting as soon as it exceeds the size limit or the deadline passes.

    Raises MediaTooLargeError, MediaFetchError (deadline).
    """
    chunks: list[bytes] = []
    total = 0
    for chunk in response.iter_bytes():  # no chunk_size: httpx would buffer up to it before yielding
        total += len(chunk)
        _check_size(total, cfg)
        chunks.append(chunk)
        _remaining(deadline, url, cfg)
    return b"".join(chunks)


def _remaining(deadline: float, url: httpx.URL, cfg: MediaConfig) -> float:
    """Returns the seconds left before `deadline`. Raises MediaFetchError if none are left."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise MediaFetchError(f"timed out fetching {url} (limit {cfg.fetch_timeout_s} s)")
    return left
