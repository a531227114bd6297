"""Shared-secret authentication between encoders and language servers (`--cluster-secret`).

One secret, set on every process of a deployment (flag or the `MMSERVE_CLUSTER_SECRET` environment
variable), protects the two internal surfaces:

* HTTP: `POST /encode` on encoders and the control plane of language servers (`/register_encoder`,
  `/unregister_encoder`, `/encoders`) require the header `X-MMServe-Cluster-Token`. The token is derived
  from the secret, never the secret itself, so a token seen on the wire does not give away the key that
  signs embeddings. The API key never stands in for it. Without a secret, a language server keeps its
  control plane closed (403) unless started with `--enable-anonymous-registration`; `/encode` is then open.
* ZMQ embedding parts: the sender appends a third frame, HMAC-SHA256 over the header and payload frames
  (with both lengths, so bytes cannot move between frames; the payload enters as the SHA-256 digests of its
  1 MiB chunks, hashed in parallel). The receiver drops and counts parts whose
  MAC is missing or wrong (forged or tampered), and parts replayed: a valid MAC seen before, or a header
  `sent_at` outside the freshness window. Request id and part index are inside the signed header, so a
  signed part cannot be re-targeted at another request either.

The secret travels to child processes (engine, local encoder workers) in the environment, never in argv.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import zmq

ENV_VAR = "MMSERVE_CLUSTER_SECRET"
HTTP_HEADER = "X-MMServe-Cluster-Token"
MAC_BYTES = 32
MAC_CHUNK_BYTES = 1 << 20  # part of the MAC's definition: sender and receiver must agree
PARALLEL_MIN_CHUNKS = 4  # below this, starting threads costs more than it saves
MAC_THREADS = min(8, os.cpu_count() or 1)


def resolve_secret(flag_value: str | None) -> ClusterSecret | None:
    """The deployment's secret from the flag, else the environment; None when neither is set."""
    value = flag_value or os.environ.get(ENV_VAR)
    return ClusterSecret(value.encode()) if value else None


def from_config(value: str | None) -> ClusterSecret | None:
    """The secret of a config field (`ServerConfig.cluster_secret`, `EncoderConfig.cluster_secret`), if set."""
    return ClusterSecret(value.encode()) if value else None


def child_env(value: str | None) -> dict[str, str]:
    """This process's environment for a child process, carrying exactly the given secret (or none)."""
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    if value:  # through the environment: argv is visible to every user of the machine
        env[ENV_VAR] = value
    return env


def _bytes(frame: bytes | memoryview | zmq.Frame) -> memoryview:
    view = frame.buffer if isinstance(frame, zmq.Frame) else memoryview(frame)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _sha256(chunk: memoryview) -> bytes:
    return hashlib.sha256(chunk).digest()


def _chunk_digests(payload: memoryview) -> list[bytes]:
    """SHA-256 of each MAC_CHUNK_BYTES slice. hashlib releases the GIL on large inputs, so a multi-megabyte
    payload (an image's embeddings) is hashed on up to MAC_THREADS threads: 16 MB took 9.4 ms on one thread
    and 5.6 ms on a 2-core machine; more cores, less time."""
    chunks = [payload[i : i + MAC_CHUNK_BYTES] for i in range(0, len(payload), MAC_CHUNK_BYTES)]
    if len(chunks) < PARALLEL_MIN_CHUNKS:
        return [_sha256(c) for c in chunks]
    with ThreadPoolExecutor(min(MAC_THREADS, len(chunks)), thread_name_prefix="mac") as pool:
        return list(pool.map(_sha256, chunks))


@dataclass(frozen=True)
class ClusterSecret:
    secret: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if len(self.secret) < 16:
            raise ValueError("the cluster secret must be at least 16 bytes long")

    def derive(self, purpose: bytes) -> bytes:
        """A key for one purpose (HTTP token, part MAC, store entries), never the secret itself."""
        return hmac.new(self.secret, b"mmserve/" + purpose, hashlib.sha256).digest()

    @property
    def token(self) -> str:
        """What HTTP callers send in `HTTP_HEADER`."""
        return self.derive(b"http-token").hex()

    @property
    def headers(self) -> dict[str, str]:
        return {HTTP_HEADER: self.token}

    def check_token(self, value: str | None) -> bool:
        return value is not None and hmac.compare_digest(value.encode(), self.token.encode())

    def mac(self, header: bytes | memoryview | zmq.Frame, payload: bytes | memoryview | zmq.Frame) -> bytes:
        """HMAC-SHA256 over the header (with its length) and the payload, the payload as the SHA-256 digests
        of its 1 MiB chunks (with its length): the chunks of a large payload are hashed on several threads."""
        h, p = _bytes(header), _bytes(payload)
        mac = hmac.new(self.derive(b"embedding-mac"), len(h).to_bytes(8, "little"), hashlib.sha256)
        mac.update(h)
        mac.update(len(p).to_bytes(8, "little"))
        for digest in _chunk_digests(p):
            mac.update(digest)
        return mac.digest()

    def sign(self, frames: Sequence[bytes | memoryview | zmq.Frame]) -> list:
        """`[header, payload]` -> `[header, payload, mac]`."""
        return [*frames, self.mac(frames[0], frames[1])]


class PartRejected(ValueError):
    """A part dropped by authentication; `reason` is "forged" or "replayed"."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class PartVerifier:
    """The receiving side: checks MACs, freshness and replays. Single consumer (the engine loop)."""

    def __init__(self, secret: ClusterSecret, max_age_s: float = 120.0, max_skew_s: float = 30.0,
                 clock: Callable[[], float] = time.time, max_remembered: int = 200_000) -> None:  # fmt: skip
        self.secret = secret
        self.max_age_s, self.max_skew_s = max_age_s, max_skew_s
        self.clock = clock
        self.max_remembered = max_remembered
        self._seen: OrderedDict[bytes, float] = OrderedDict()  # MAC -> sent_at, oldest first

    def check_mac(self, frames: Sequence) -> bytes:
        """Returns the part's MAC if it is present and right. Raises PartRejected("forged")."""
        if len(frames) != 3:
            raise PartRejected("forged", f"part has {len(frames)} frames; a signed part has 3")
        mac = bytes(_bytes(frames[2]))
        if not hmac.compare_digest(mac, self.secret.mac(frames[0], frames[1])):
            raise PartRejected("forged", "part MAC does not match (wrong secret or tampered)")
        return mac

    def check_fresh(self, mac: bytes, sent_at: float) -> None:
        """Remembers a verified part. Raises PartRejected("replayed") for a repeat or a stale timestamp."""
        now = self.clock()
        while self._seen and (
            len(self._seen) >= self.max_remembered or next(iter(self._seen.values())) < now - self.max_age_s
        ):
            self._seen.popitem(last=False)
        if not now - self.max_age_s <= sent_at <= now + self.max_skew_s:
            raise PartRejected("replayed", f"part sent at {sent_at:.3f} is outside the freshness window")
        if mac in self._seen:
            raise PartRejected("replayed", "part was already received")
        self._seen[mac] = sent_at
