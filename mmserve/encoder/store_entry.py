"""Keys and values of the global embedding store (`embedding_store.py`): what is stored, never how.

Key: ``mmserve/emb/v1/<model fingerprint>/<content hash>``, both hex. The content hash already covers the
media bytes and every output-relevant setting (and the request's cache salt); the fingerprint
(`model_fingerprint`) covers the model family, the tower's dtype, the widths of its tensors and the
checkpoint's files, so two checkpoints never share entries.

Value (no pickle), offsets in bytes:

  | 0   | 4  | magic ``MMES``                                                                    |
  | 4   | 1  | format version (1)                                                                |
  | 5   | 1  | flags: bit 0 = signed                                                             |
  | 8   | 4  | header length, little endian                                                      |
  | 12  | 4  | payload offset (a multiple of 64, so tensors can view the value in place)         |
  | 16  |    | header: a one-item part of `embedding_wire` (msgpack), zero padding to the payload |
  |     |    | payload: that part's tensor bytes                                                 |
  | -32 | 32 | if signed: HMAC-SHA256 over (len, key, len, everything before the MAC)            |

The MAC covers the key, so a signed entry cannot be moved to another item's key either.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from collections.abc import Sequence
from pathlib import Path

from mmserve.encoder.store_backends import EntryRejected
from mmserve.multimodal.items import ItemEmbedding
from mmserve.transport.embedding_wire import ITEM_ALIGN, EmbeddingItem, WireError, decode_part, encode_part

KEY_PREFIX = "mmserve/emb/v1"
MAGIC = b"MMES"
FORMAT_VERSION = 1
FLAG_SIGNED = 1
MAC_BYTES = 32
_PREFIX = struct.Struct("<4sBBxxII")  # magic, version, flags, (reserved), header length, payload offset
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
FINGERPRINT_SAMPLES = 16  # blocks of each weight file hashed into the fingerprint
FINGERPRINT_BLOCK_BYTES = 64 * 1024


def model_fingerprint(model_path: str, model_type: str, tower_dtype: str, widths: dict[str, int]) -> str:
    """Hex identity of the embeddings a tower produces: family, dtype, tensor widths, and the checkpoint
    (config.json's bytes; each weight file's name, size and SHA-256 of FINGERPRINT_SAMPLES evenly spaced
    blocks: a fine-tune of the same architecture differs in every block, and reading ~1 MiB per file keeps
    start-up cheap for large checkpoints)."""
    root = Path(model_path)
    config = root / "config.json"
    files = []
    for path in sorted(p for p in root.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)):
        size = path.stat().st_size
        sampled = hashlib.sha256()
        with path.open("rb") as f:
            for i in range(FINGERPRINT_SAMPLES):
                f.seek(max(0, size - FINGERPRINT_BLOCK_BYTES) * i // (FINGERPRINT_SAMPLES - 1))
                sampled.update(f.read(FINGERPRINT_BLOCK_BYTES))
        files.append([path.name, size, sampled.hexdigest()])
    identity = {
        "model_type": model_type,
        "tower_dtype": tower_dtype,
        "widths": dict(sorted(widths.items())),
        "config": hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else None,
        "weights": files,
    }
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.blake2b(canonical, digest_size=16).hexdigest()


def entry_key(fingerprint: str, digest: bytes) -> str:
    return f"{KEY_PREFIX}/{fingerprint}/{digest.hex()}"


def _mac(mac_key: bytes, key: str, parts: Sequence[bytes | memoryview]) -> bytes:
    """HMAC-SHA256 over the key and the value's bytes before the MAC, each with its length."""
    k = key.encode()
    mac = hmac.new(mac_key, len(k).to_bytes(8, "little") + k, hashlib.sha256)
    mac.update(sum(memoryview(p).nbytes for p in parts).to_bytes(8, "little"))
    for p in parts:
        mac.update(p)
    return mac.digest()


def encode_entry(key: str, item: ItemEmbedding, mac_key: bytes | None) -> list[bytes | memoryview]:
    """The value of `item` under `key`, as buffers to be written one after the other (see module doc)."""
    header, payload = encode_part("embedding-store", 0, 1, "embedding-store", [EmbeddingItem(0, item)])
    offset = -(-(_PREFIX.size + len(header)) // ITEM_ALIGN) * ITEM_ALIGN
    flags = FLAG_SIGNED if mac_key is not None else 0
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, flags, len(header), offset)
    parts = [prefix, header, bytes(offset - _PREFIX.size - len(header)), payload]
    return parts + [_mac(mac_key, key, parts)] if mac_key is not None else parts


def decode_entry(key: str, value: bytes, mac_key: bytes | None) -> ItemEmbedding:
    """The item stored in `value` (tensors view `value` in place: treat them as read-only). Raises
    EntryRejected for a value that is malformed or, with `mac_key`, unsigned or wrongly signed."""
    if len(value) < _PREFIX.size:
        raise EntryRejected(f"entry of {len(value)} bytes is too short")
    magic, version, flags, header_len, offset = _PREFIX.unpack_from(value)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise EntryRejected(f"not an mmserve entry of format {FORMAT_VERSION}")
    end = len(value)
    if flags & FLAG_SIGNED:
        end -= MAC_BYTES
    if mac_key is not None:
        if not flags & FLAG_SIGNED or end < _PREFIX.size:
            raise EntryRejected("entry is not signed (a cluster secret is set)")
        body = memoryview(value)[:end]
        if not hmac.compare_digest(_mac(mac_key, key, [body]), value[end:]):
            raise EntryRejected("entry MAC does not match (forged, corrupted, or another secret)")
    if not _PREFIX.size + header_len <= offset <= end:
        raise EntryRejected("entry header or payload out of bounds")
    view = memoryview(value)
    try:
        _, items = decode_part([view[_PREFIX.size : _PREFIX.size + header_len], view[offset:end]], copy=False)
    except WireError as e:
        raise EntryRejected(f"malformed entry: {e}") from e
    if len(items) != 1:
        raise EntryRejected(f"entry holds {len(items)} items")
    return items[0].item
