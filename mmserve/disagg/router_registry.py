"""The router's prefill and decode servers: membership, health, and the policy that picks one of each.

Prefill servers are chosen by cache affinity: bounded-load rendezvous hashing on a digest of the prompt's
prefix (`affinity_key`), so a repeated image or prefix lands where its embeddings and KV are cached. Decode
servers are chosen by least outstanding requests (the router's own in-flight counts).

Health, per server: `failure_threshold` consecutive failures (a failed /health probe, or a connect failure
while dispatching) make it unhealthy and unselectable; one success makes it healthy again. A server is only
selectable once its /disagg/info is known (role, model and bootstrap checked).

Everything here runs on the router's event loop; nothing is shared with other threads, so no locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
from dataclasses import dataclass
from typing import Any

import httpx

from mmserve.dispatch.policy import rendezvous_score

ROLES = ("prefill", "decode")
logger = logging.getLogger("mmserve.router")


class InfoError(Exception):
    """/disagg/info of a server could not be fetched (`status` 502) or does not fit this router (400)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


class TokenRefused(InfoError):
    """The server answered 401 / 403 to the router's cluster token (a secret not shared, or none there)."""

    def __init__(self, url: str, status: int, content: bytes) -> None:
        super().__init__(502, "server_info_refused", refusal_reason(url, status, content))


def refusal_reason(url: str, status: int, content: bytes) -> str:
    """Why a server refuses the router (its 401 / 403 answer), and the fix; the same words whichever request
    met it (a probe or a handoff), so that a server's state changes only when its answer does."""
    error: Any = {}
    with contextlib.suppress(ValueError, TypeError):
        error = json.loads(content).get("error") or {}
    if not isinstance(error, dict):
        error = {}
    message = error.get("message") or content[:200].decode(errors="replace")
    said = f"{status} {error.get('code', '')}: {message}"
    if error.get("code") == "invalid_api_key":  # not the token: the router never sends clients' keys on
        return f"server {url} refused the router: {said}; a prefill or decode server takes no --api-key"
    return (
        f"server {url} refused the router's cluster token: {said}; set the same --cluster-secret (or "
        "$MMSERVE_CLUSTER_SECRET) on the router and the server"
    )


@dataclass(frozen=True)
class ServerInfo:
    """What a server says about itself in `GET /disagg/info`."""

    mode: str
    model: str
    bootstrap: str | None  # decode servers: where prefill servers ship the KV
    kv_backends: tuple[str, ...]
    max_model_len: int | None
    kv_cache_tokens: int | None

    @classmethod
    def parse(cls, body: Any) -> ServerInfo:
        if not isinstance(body, dict) or not isinstance(body.get("mode"), str):
            raise InfoError(502, "bad_server_info", f"/disagg/info is not an info object: {str(body)[:200]}")
        backends = body.get("kv_backends") or ()
        return cls(
            body["mode"],
            str(body.get("model") or ""),
            body.get("bootstrap"),
            tuple(str(b) for b in backends),
            body.get("max_model_len"),
            body.get("kv_cache_tokens"),
        )

    def check(self, role: str, model: str | None, backend: str) -> None:
        """Raises InfoError(400) if a server of this info cannot serve as `role` behind this router."""
        if self.mode != role:
            raise InfoError(400, "role_mismatch", f"the server is a {self.mode!r} server, not {role!r}")
        if model is not None and self.model != model:
            raise InfoError(400, "model_mismatch", f"the server serves {self.model!r}; this router {model!r}")
        if backend not in self.kv_backends:
            raise InfoError(
                400,
                "kv_backend_unsupported",
                f"the server offers KV backends {list(self.kv_backends)}, not {backend!r}",
            )
        if role == "decode" and not (isinstance(self.bootstrap, str) and self.bootstrap):
            raise InfoError(502, "bad_server_info", "the decode server reports no KV bootstrap address")


@dataclass
class UpstreamServer:
    """One prefill or decode server as the router sees it. Mutated only by ServerRegistry and the relay's
    acquire/release, on the router's event loop."""

    url: str
    role: str
    static: bool  # given on the command line (kept, and retried, until unregistered)
    info: ServerInfo | None = None  # None until /disagg/info was fetched and checked
    healthy: bool = False
    strikes: int = 0  # consecutive failures
    in_flight: int = 0  # requests the router has open on this server
    dispatched: int = 0  # requests ever sent here: breaks ties between equally loaded decode servers
    last_error: str | None = None
    refused: str | None = None  # why the server refuses the router's token (`refusal_reason`), while it does

    @property
    def selectable(self) -> bool:
        return self.healthy and self.info is not None

    @property
    def bootstrap(self) -> str | None:
        return self.info.bootstrap if self.info else None

    def as_json(self) -> dict[str, Any]:
        info = self.info
        return {
            "url": self.url,
            "role": self.role,
            "static": self.static,
            "healthy": self.healthy,
            "strikes": self.strikes,
            "in_flight": self.in_flight,
            "dispatched": self.dispatched,
            "model": info.model if info else None,
            "bootstrap": self.bootstrap,
            "kv_backends": list(info.kv_backends) if info else None,
            "max_model_len": info.max_model_len if info else None,
            "kv_cache_tokens": info.kv_cache_tokens if info else None,
            "last_error": self.last_error,
            "refused": self.refused,
        }


class ServerRegistry:
    def __init__(self, failure_threshold: int, load_factor: float, model: str | None = None) -> None:
        self.failure_threshold = failure_threshold
        self.load_factor = load_factor
        self.configured_model = model
        self._servers: dict[str, UpstreamServer] = {}

    # -- membership -------------------------------------------------------------------------------
    def add_static(self, url: str, role: str) -> UpstreamServer:
        """A command-line server: unselectable until the prober has fetched its info."""
        server = UpstreamServer(url, role, static=True)
        self._servers[url] = server
        return server

    def register(self, url: str, role: str, info: ServerInfo) -> UpstreamServer:
        """A server whose info the caller fetched and checked; healthy at once. An entry of the same URL is
        updated in place, so that requests in flight on it release the count they hold."""
        server = self._servers.setdefault(url, UpstreamServer(url, role, static=False))
        server.role, server.info = role, info
        self.record_success(server)
        return server

    def remove(self, url: str) -> bool:
        return self._servers.pop(url, None) is not None

    def get(self, url: str) -> UpstreamServer | None:
        return self._servers.get(url)

    def all(self) -> list[UpstreamServer]:
        return list(self._servers.values())

    def selectable(self, role: str) -> list[UpstreamServer]:
        """The healthy servers of `role`; if none is, every one whose info is known. A server too busy to answer
        /health in time (a long prefill step holds its engine loop past the probe's timeout) still serves, and a
        dead one fails to connect at once (a strike; the request moves on): trying beats a certain 503 for
        every request while the only server of a role is merely busy (measured: docs/benchmarks.md, 5e)."""
        known = [s for s in self._servers.values() if s.role == role and s.info is not None]
        return [s for s in known if s.healthy] or known

    def expected_model(self, url: str | None = None) -> str | None:
        """The model every server must serve: the configured name, else that of any known server but `url`."""
        if self.configured_model:
            return self.configured_model
        return next((s.info.model for s in self._servers.values() if s.info and s.url != url), None)

    # -- health -----------------------------------------------------------------------------------
    def record_success(self, server: UpstreamServer) -> None:
        if server.refused is not None:
            logger.info("%s server %s accepts the router's cluster token again", server.role, server.url)
        server.strikes, server.healthy, server.last_error, server.refused = 0, True, None, None

    def record_refusal(self, server: UpstreamServer, reason: str) -> None:
        """The server refused the router's token (`refusal_reason`): unselectable until a probe fetches its
        info again. Logged once per change of its answer, not per request or probe."""
        if server.refused != reason:
            logger.warning("%s %s", server.role, reason)
        server.refused = server.last_error = reason
        server.info, server.healthy = None, False

    def record_failure(self, server: UpstreamServer, reason: str) -> None:
        server.strikes += 1
        server.last_error = reason
        if server.strikes >= self.failure_threshold:
            server.healthy = False

    # -- selection --------------------------------------------------------------------------------
    def choose_prefill(self, key: bytes, exclude: set[str]) -> UpstreamServer | None:
        """The highest-ranked server for `key` whose load stays within `load_factor` x the mean after taking
        this request (bounded-load rendezvous: a hot prefix spills over instead of piling on one server)."""
        candidates = [s for s in self.selectable("prefill") if s.url not in exclude]
        if not candidates:
            return None
        ranked = sorted(candidates, key=lambda s: (-rendezvous_score(key, s.url), s.url))
        bound = math.ceil(self.load_factor * (sum(s.in_flight for s in candidates) + 1) / len(candidates))
        return next((s for s in ranked if s.in_flight + 1 <= bound), ranked[0])

    def choose_decode(self, exclude: set[str]) -> UpstreamServer | None:
        """Least outstanding requests; ties go to the server sent the fewest requests so far."""
        candidates = [s for s in self.selectable("decode") if s.url not in exclude]
        return min(candidates, key=lambda s: (s.in_flight, s.dispatched, s.url), default=None)

    @staticmethod
    def acquire(server: UpstreamServer) -> None:
        server.in_flight += 1
        server.dispatched += 1

    @staticmethod
    def release(server: UpstreamServer) -> None:
        server.in_flight -= 1


# -- affinity key ---------------------------------------------------------------------------------
def affinity_key(kind: str, body: dict[str, Any], text_chars: int, token_ids: int) -> bytes:
    """A digest of what makes the prompt's prefix: the prefill choice's key.

    chat: the media of the first user message, if it has any (image_url, video_url, audio_url, input_audio,
    *_embeds; each by the SHA-256 of its reference: a URL, or the bytes of a data: URL), so that the same image
    asked about in other words goes to the server holding its embeddings; else the first `text_chars`
    characters of the user messages' text. The first user message stays the same over a conversation's turns,
    so the turns go where their prefix is cached. System messages are left out: one system prompt is usually
    shared by every request and would key them all alike; each server caches it after one use.
    completion: the first `text_chars` characters of the prompt, or its first `token_ids` ids (the first
    prompt of a batch). A body the servers will refuse gets some key; they answer the 400.
    """
    h = hashlib.sha256(kind.encode() + b"\0")
    if kind == "completion":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch: the first prompt
        if isinstance(prompt, str):
            h.update(prompt[:text_chars].encode("utf-8", "surrogatepass"))
        elif isinstance(prompt, list):
            h.update(json.dumps(prompt[:token_ids]).encode())
        return h.digest()
    messages = body.get("messages") if isinstance(body.get("messages"), list) else []
    user = [_parts(m.get("content")) for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    media = [part for part in (user[0] if user else []) if part.get("type") != "text"]
    for part in media:  # a reference however large (a data: URL) enters as one digest
        ref = json.dumps(part.get(str(part.get("type"))), sort_keys=True, ensure_ascii=False)
        h.update(b"m" + hashlib.sha256(ref.encode("utf-8", "surrogatepass")).digest())
    if not media:
        text = "".join(p["text"] for parts in user for p in parts if isinstance(p.get("text"), str))
        h.update(b"t" + text[:text_chars].encode("utf-8", "surrogatepass"))
    return h.digest()


def _parts(content: Any) -> list[dict[str, Any]]:
    """A message's content as a list of part objects (a string is one text part; malformed parts dropped)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [p for p in content if isinstance(p, dict)] if isinstance(content, list) else []


# -- probing --------------------------------------------------------------------------------------
async def fetch_info(
    http: httpx.AsyncClient, url: str, headers: dict[str, str], timeout_s: float
) -> ServerInfo:
    """`GET url/disagg/info`. Raises InfoError(502) when unreachable, refused or malformed."""
    try:
        resp = await http.get(f"{url}/disagg/info", headers=headers, timeout=timeout_s)
    except httpx.HTTPError as e:
        raise InfoError(502, "server_unreachable", f"{url}/disagg/info: {type(e).__name__}: {e}") from e
    if resp.status_code in (401, 403):
        raise TokenRefused(url, resp.status_code, resp.content)
    if resp.status_code != 200:
        raise InfoError(
            502, "server_info_refused", f"{url}/disagg/info answered {resp.status_code}: {resp.text[:200]}"
        )
    try:
        return ServerInfo.parse(resp.json())
    except ValueError as e:
        raise InfoError(502, "bad_server_info", f"{url}/disagg/info is not JSON: {e}") from e


async def probe_once(
    registry: ServerRegistry, http: httpx.AsyncClient, headers: dict[str, str], timeout_s: float, backend: str
) -> None:
    """Probe every server's /health concurrently and mark it. The info is fetched (and checked) again when a
    server answers after failing, not only when it has none: a restarted decode server has a new bootstrap
    address. A server whose info does not fit is unselectable, with the reason in `last_error`."""

    async def probe(server: UpstreamServer) -> None:
        try:
            ok = (await http.get(f"{server.url}/health", timeout=timeout_s)).status_code == 200
            reason = "" if ok else "/health answered non-200"
        except httpx.HTTPError as e:
            ok, reason = False, f"/health: {type(e).__name__}"
        if not ok:
            registry.record_failure(server, reason)
            return
        if server.info is None or server.strikes > 0 or not server.healthy:
            try:
                info = await fetch_info(http, server.url, headers, timeout_s)
                info.check(server.role, registry.expected_model(server.url), backend)
            except TokenRefused as e:
                registry.record_refusal(server, e.message)
                return
            except InfoError as e:
                server.info, server.last_error = None, e.message
                return
            server.info = info
        registry.record_success(server)

    await asyncio.gather(*(probe(s) for s in registry.all()))
