"""Cache salts: a per-request tenant scope for the prefix cache and the embedding cache (vLLM's `cache_salt`).

A cache hit is observable (time to first token, `usage.prompt_tokens_details.cached_tokens`), so without a
scope one tenant could probe whether another sent a given prompt or image. Requests with equal salts share
hits as before; requests with different salts, or one with a salt and one without, never do.

- Prefix cache: the radix tree is keyed by `prefix_key(token_ids, salt)`, the token ids with the FIRST
  position replaced by `salted_key(salt, token_ids[0])`. Keys keep one entry per token, so the KV slot <->
  token mapping and every radix invariant stay as they are, and the tree needs no special case; a salted
  key lies in a reserved id range above every vocabulary id and pad value, so it never equals an unsalted
  key. The model only ever sees the real ids: the key is used for `match` / `insert` only.
- Embedding cache: the salt enters the item's content hash (`MultimodalEncoder.item_hash`), hence its pad
  value, every encoder's cache and any store keyed by content hash.

Id ranges of int64 keys:
| range                  | what                                                   |
| [0, 2**62)             | vocabulary ids                                         |
| [2**62, 2**62 + 2**61) | item pad values (`mmserve.multimodal.items.pad_value`) |
| [2**62 + 2**61, 2**63) | salted first keys (`salted_key`)                       |
Both hash ranges keep 61 bits: two different (salt, first token) pairs collide with probability 2**-61.
"""

from __future__ import annotations

import hashlib

from mmserve.multimodal.items import PAD_BASE, PAD_BITS

MAX_CACHE_SALT_CHARS = 256
SALT_KEY_BASE = PAD_BASE + (1 << PAD_BITS)
SALT_KEY_BITS = 61
assert SALT_KEY_BASE + (1 << SALT_KEY_BITS) == 1 << 63  # salted keys stay valid int64 ids


def check_cache_salt(salt: object) -> None:
    """Raise ValueError unless `salt` is None or a non-empty str of at most MAX_CACHE_SALT_CHARS."""
    if salt is None:
        return
    if not isinstance(salt, str) or not salt:
        raise ValueError(f"cache_salt must be a non-empty string, got {type(salt).__name__} {salt!r:.40}")
    if len(salt) > MAX_CACHE_SALT_CHARS:
        raise ValueError(f"cache_salt has {len(salt)} characters; at most {MAX_CACHE_SALT_CHARS} allowed")
    try:  # JSON allows a lone "\ud800" escape, which is not text (msgpack could not carry it)
        salt.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(
            "cache_salt contains an unpaired UTF-16 surrogate (not valid Unicode text)"
        ) from None


def salted_key(salt: str, token_id: int) -> int:
    """The prefix-cache key of a salted request's first token: it depends on both, so equal salts with
    different first tokens still diverge at position 0."""
    h = hashlib.blake2b(digest_size=16)
    data = salt.encode("utf-8", "surrogatepass")  # total even on a salt that skipped check_cache_salt
    h.update(len(data).to_bytes(8, "little"))
    h.update(data)
    h.update(token_id.to_bytes(8, "little"))  # int64 ids: vocabulary ids and pad values
    return SALT_KEY_BASE + (int.from_bytes(h.digest(), "little") & ((1 << SALT_KEY_BITS) - 1))


def prefix_key(token_ids: list[int], salt: str | None) -> list[int]:
    """`token_ids` (a fresh list, which the caller may keep) as the prefix cache keys them for `salt`."""
    keys = list(token_ids)
    if salt is not None and keys:
        keys[0] = salted_key(salt, keys[0])
    return keys
