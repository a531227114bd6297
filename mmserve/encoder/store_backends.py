"""Clients of the key-value stores behind the global embedding store (`embedding_store.py`), chosen by the
URL scheme of `--embedding-store` through `BACKENDS`. Each call blocks; the store tier bounds it.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from typing import Protocol

from mmserve.config import EmbeddingStoreConfig


class StoreError(RuntimeError):
    """The store failed or is unreachable (it trips the back-off)."""


class EntryRejected(ValueError):
    """An entry is not a valid, signed embedding of the requested item for this model (or is too large to
    read). Defined here, beside StoreError, so that the CLI can check `--embedding-store` without torch."""


class StoreBackend(Protocol):
    """A key-value store client, connected by its constructor (`cls(cfg)`, on the connector thread). Calls
    block; the caller bounds them."""

    @staticmethod
    def configure_process() -> None:
        """Process-wide settings of the client library, applied on the thread that builds the store tier
        (before any client exists, so no other thread reads them meanwhile)."""
        ...

    def get(self, key: str) -> bytes | None:
        """The value, or None when the store does not have it. Raises StoreError, or EntryRejected for a
        value too large to read."""
        ...

    def put(self, key: str, parts: Sequence[bytes | memoryview], replace: bool) -> None:
        """Store the concatenation of `parts` (replacing an existing value only if `replace`). Raises
        StoreError."""
        ...

    def close(self) -> None: ...


class MooncakeBackend:
    """Mooncake Store over TCP with the P2P handshake: `mooncake://HOST:PORT` names everything a client
    needs. This process contributes `segment_mb` of memory to the store; `buffer_mb` bounds one entry."""

    NOT_FOUND = -704  # Mooncake's OBJECT_NOT_FOUND

    @staticmethod
    def configure_process() -> None:
        # Mooncake retries a failed setup 20 times (~90 s, holding the GIL); one attempt, then our own
        # back-off. Set only if the operator did not.
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")

    def __init__(self, cfg: EmbeddingStoreConfig) -> None:
        from mooncake.store import MooncakeDistributedStore  # its native library loads only when used

        self.max_bytes = int(cfg.buffer_mb * 2**20)
        self.store = MooncakeDistributedStore()
        segment_bytes = int(cfg.segment_mb * 2**20)
        # local host, metadata ("P2PHANDSHAKE": none), segment, buffer, protocol, RDMA devices, master
        rc = self.store.setup(
            cfg.local_host, "P2PHANDSHAKE", segment_bytes, self.max_bytes, "tcp", "", cfg.address
        )
        if rc != 0:
            raise StoreError(f"Mooncake store setup against {cfg.address} failed (code {rc})")

    def get(self, key: str) -> bytes | None:
        # get() answers b"" both for a missing key and a failed RPC; get_size tells them apart.
        size = self.store.get_size(key)
        if size == self.NOT_FOUND:
            return None
        if size < 0:
            raise StoreError(f"Mooncake get_size failed (code {size})")
        if size > self.max_bytes:
            raise EntryRejected(f"entry of {size} bytes exceeds the {self.max_bytes}-byte transfer buffer")
        # Empty: the entry went with the instance that wrote it (its memory segment), i.e. a miss.
        return self.store.get(key) or None

    def put(self, key: str, parts: Sequence[bytes | memoryview], replace: bool) -> None:
        rc = (self.store.upsert_parts if replace else self.store.put_parts)(key, *parts)
        if rc != 0:
            raise StoreError(f"Mooncake put failed (code {rc})")

    def close(self) -> None:
        self.store.close()


BACKENDS: dict[str, type[StoreBackend]] = {"mooncake": MooncakeBackend}


def reachable(address: str, timeout_s: float) -> bool:
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError:
        return False
    return True
