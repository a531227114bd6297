"""The multimodal encoder: media reference -> item embedding, once per content hash.

One class serves every place that encodes: the encoder service, the engine process's local encoder
(monolithic mode and failover; owned by the intake, a peer of the engine) and the offline `LLM`. Flow per
item: fetch the raw bytes, hash them with every output-relevant setting, and look the hash up in the
embedding cache, then (with `--embedding-store`) in the global embedding store shared with other instances;
only on a miss decode (with the item's media options: mmserve.multimodal.media_options), preprocess (the
model family's processor) and run the tower (the family's `encode`, batched by a TowerBatcher), and write the
result to the store in the background. Concurrent requests for the same item compute it once (single-flight in
the cache, which covers the store lookup too). An item with a caller's `uuid` hashes the uuid instead of its
bytes, which are fetched only on a miss; one with a uuid and no media is a cache (or store) hit or a 400.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from mmserve.config import EmbeddingStoreConfig, MediaConfig
from mmserve.encoder.activation_table import tabulate_activations
from mmserve.encoder.batcher import TowerBatcher
from mmserve.encoder.embedding_store import EmbeddingStore
from mmserve.encoder.inplace_activation import block_activations
from mmserve.encoder.patch_linear import linearize_patch_convs
from mmserve.encoder.store_entry import model_fingerprint
from mmserve.encoder.vision_attention import fuse_vision_attention
from mmserve.engine.cpu_kernels import kernels_for
from mmserve.engine.packed_linear import can_pack, pack_linears
from mmserve.glibc_heap import keep_large_blocks, release_freed_memory, share_main_arena
from mmserve.models.family import ModelFamily, check_pixel_limit
from mmserve.models.loader import parse_dtype
from mmserve.multimodal import media_options
from mmserve.multimodal.cache import EmbeddingCache
from mmserve.multimodal.errors import MediaError, MediaNotCachedError, UnsupportedMediaError
from mmserve.multimodal.items import MAIN, ItemEmbedding, Modality, content_hash
from mmserve.multimodal.media import MediaRef, load_bytes
from mmserve.quant.linear import attach_kernels
from mmserve.quant.quantize import quantize_linears
from mmserve.transport.cluster_auth import ClusterSecret

TOWER_TIMEOUT_S = 300.0


@dataclass
class MediaInput:
    """One media item of a request, as the encoder takes it."""

    modality: Modality
    ref: MediaRef | None  # None: a reference by `uuid` to an item encoded before
    settings: Mapping[str, Any] = field(default_factory=dict)  # the family's per-item settings
    cache_salt: str | None = None  # the request's tenant scope: enters the content hash
    uuid: str | None = None  # the caller's identity for the item: hashed instead of its bytes
    options: Mapping[str, Any] = field(default_factory=dict)  # media options (multimodal.media_options)


@dataclass
class EncodeTimings:
    fetch_s: float = 0.0  # bytes of every item (download / base64 / file)
    preprocess_s: float = 0.0  # decode + preprocess, cache misses only
    forward_s: float = 0.0  # waiting for and running the tower, cache misses only
    hits: int = 0  # found in the local embedding cache
    misses: int = 0  # computed by the tower
    store_hits: int = 0  # found in the global embedding store

    @property
    def total_s(self) -> float:
        return self.fetch_s + self.preprocess_s + self.forward_s


class MultimodalEncoder:
    """Media reference -> ItemEmbedding through the embedding cache (see module docstring).

    Owns its batcher (the tower's thread), its cache and its store tier (optional); `close` stops them.
    """

    def __init__(
        self,
        family: ModelFamily,
        batcher: TowerBatcher,
        cache: EmbeddingCache,
        media_cfg: MediaConfig,
        store: EmbeddingStore | None = None,
        tower: torch.nn.Module | None = None,
    ) -> None:
        self.family = family
        self.tower = tower  # what the batcher runs (read-only here: its dtype, whether it is packed)
        self.batcher = batcher
        self.cache = cache
        self.media_cfg = media_cfg
        self.store = store

    def item_hash(
        self,
        modality: Modality,
        data: bytes,
        settings: Mapping[str, Any],
        cache_salt: str | None = None,
        options: Mapping[str, Any] | None = None,
        uuid: str | None = None,
    ) -> bytes:
        """Raises MediaError (400) for settings or options the family or the server does not know.

        A salted item hashes apart from the same item under any other salt or none (so its pad value, its
        cache entry here and in any store keyed by content hash are the tenant's own); unsalted hashes are
        unchanged. With `uuid`, the uuid stands for the bytes (`data` is not hashed); no hash of bytes has
        a "uuid" setting, so the two never meet."""
        hashed = {
            **self.family.hash_settings(modality, settings),
            **media_options.hash_settings(self.media_cfg, modality, self._options(modality, options or {})),
        }
        salt = {} if cache_salt is None else {"cache_salt": cache_salt}
        identity = {} if uuid is None else {"uuid": uuid}
        data = data if uuid is None else b""
        return content_hash(modality, data, {**hashed, "item": dict(settings), **salt, **identity})

    def _options(self, modality: Modality, options: Mapping[str, Any]) -> dict[str, Any]:
        try:
            return media_options.checked(modality, options, self.media_cfg)
        except ValueError as e:
            raise MediaError(str(e)) from e

    def encode(self, item: MediaInput, timings: EncodeTimings | None = None) -> ItemEmbedding:
        """Raises MediaError subclasses for bad media (the caller maps them to HTTP 4xx)."""
        timings = timings if timings is not None else EncodeTimings()
        modality = item.modality
        if modality not in self.family.modalities:
            raise UnsupportedMediaError(f"{modality.value} input is not supported by this model")
        options = self._options(modality, item.options)
        if item.uuid is not None:
            try:
                media_options.check_uuid(item.uuid, "item")
            except ValueError as e:
                raise MediaError(str(e)) from e
        elif item.ref is None:
            raise MediaError("an item needs its media or a uuid")
        start = time.perf_counter()
        # With a uuid the bytes are not hashed: they are fetched only when the item must be computed.
        data = load_bytes(item.ref, self.media_cfg) if item.uuid is None else b""
        digest = self.item_hash(modality, data, item.settings, item.cache_salt, options, item.uuid)
        timings.fetch_s += time.perf_counter() - start
        source = []  # "store" or "tower" when this call computed the entry; empty for a cache hit

        def compute() -> ItemEmbedding:
            if self.store is not None:
                stored = self.store.get(digest, modality)
                if stored is not None:
                    source.append("store")
                    return stored
            if item.ref is None:
                raise MediaNotCachedError(f"uuid {item.uuid!r} is not in the cache; send the media with it")
            t = time.perf_counter()
            raw = data if item.uuid is None else load_bytes(item.ref, self.media_cfg)
            timings.fetch_s += time.perf_counter() - t
            source.append("tower")
            t0 = time.perf_counter()
            media = media_options.decode(self.family, modality, raw, item.settings, self.media_cfg, options)
            tower_input = self.family.process(modality, media, item.settings)
            t1 = time.perf_counter()
            tensors = self.batcher.submit(tower_input).result(timeout=TOWER_TIMEOUT_S)
            timings.preprocess_s += t1 - t0
            timings.forward_s += time.perf_counter() - t1
            encoded = ItemEmbedding(modality, digest, tensors, tower_input.metadata)
            if self.store is not None:
                self.store.put(encoded)
            return encoded

        encoded = self.cache.get_or_compute(digest, compute)
        timings.misses += source == ["tower"]
        timings.store_hits += source == ["store"]
        timings.hits += not source
        return encoded

    def encode_all(
        self,
        media: list[MediaInput],
        timings: EncodeTimings,
        max_pixels: int | None = None,
        on_item: Callable[[list[ItemEmbedding]], None] | None = None,
    ) -> list[ItemEmbedding]:
        """Every item of a request, in order. Raises MediaError naming the item ("image #2: ..."); with
        `max_pixels`, stops at the item that crosses the limit (the rest is never encoded). `on_item` gets
        the items encoded so far after each one but the last (encode-prefill overlap)."""
        out, seen = [], {}
        for item in media:
            seen[item.modality] = seen.get(item.modality, 0) + 1
            try:
                out.append(self.encode(item, timings))
            except MediaError as e:
                raise type(e)(str(e), item=f"{item.modality.value} #{seen[item.modality]}") from e
            check_pixel_limit(self.family, out, max_pixels)
            if on_item is not None and len(out) < len(media):
                on_item(list(out))
        return out

    def health_probe(self, timeout_s: float = 30.0) -> None:
        """A real tiny encode of each of the family's modalities through the batcher, bypassing the cache."""
        # All submitted at once: they share one batch window (an encoder told to wait seconds for a batch answers
        # its /health within one such wait, not one per modality).
        jobs = [self.batcher.submit(self.family.process(m, media, {})) for m, media in self.family.probe_items()]
        deadline = time.monotonic() + timeout_s
        for job in jobs:
            job.result(timeout=max(0.0, deadline - time.monotonic()))

    def check_integrity(self) -> None:
        self.cache.check_integrity()

    def close(self) -> None:
        self.batcher.close()
        if self.store is not None:
            self.store.close()


def build_encoder(
    family: ModelFamily,
    dtype: str,
    device: str,
    cache_mb: float,
    media_cfg: MediaConfig,
    max_batch_items: int = 1,
    max_batch_wait_ms: float = 0.0,
    store_cfg: EmbeddingStoreConfig | None = None,
    model_path: str | None = None,
    secret: ClusterSecret | None = None,
    pack_weights: bool = True,
    fp32_gemm: str = "auto",
    cpu_kernels: bool = True,
    quantization: str | None = None,
) -> MultimodalEncoder:
    """Load the family's tower (no language-model weights) and wrap it in a batcher, a cache and media
    handling; with `store_cfg`, a global embedding store tier too (entries of the checkpoint in
    `model_path`, signed with `secret` when given). The store connects in the background. With
    `pack_weights`, a bf16/fp16 tower on a CPU has its linear weights packed, an fp32 one where `fp32_gemm` says
    (mmserve.engine.packed_linear). A 16-bit tower runs its patch convolutions as GEMMs (encoder.patch_linear);
    with `cpu_kernels`, a tower on a CPU runs its Qwen-VL vision RoPE (encoder.vision_attention) and, in bf16, its
    activations (encoder.activation_table) in mmserve's kernels. With `quantization` (int8 / int4), the tower's
    linear layers are quantized on load, weight-only (mmserve.quant.quantize)."""
    share_main_arena()  # before the tower's thread allocates (mmserve.glibc_heap)
    torch_dtype, torch_device = parse_dtype(dtype), torch.device(device)
    tower = family.load_tower(torch_dtype).to(torch_device)
    linearize_patch_convs(tower, torch_dtype)  # before packing: its linear layers are packed too
    kernels = kernels_for(torch_device, torch_dtype, cpu_kernels)
    fuse_vision_attention(tower, kernels)
    tabulate_activations(tower, torch_dtype, kernels)
    # the MLP activations without a table: over their input, in cache-sized blocks (with the kernels, as the others)
    block_activations(tower, kernels is not None)
    if quantization is not None:
        quantize_linears(tower, quantization, torch_dtype)
    attach_kernels(tower, kernels)  # a checkpoint's own quantized tower layers, or those just made
    if pack_weights and can_pack(torch_dtype, torch_device, fp32_gemm):
        pack_linears(tower)
    release_freed_memory()  # what quantization and packing replaced, freed inside the heap
    keep_large_blocks()  # the tower's large temporaries reused from the heap, not mapped afresh per op

    def encode(batch):
        return family.encode(tower, batch)

    batcher = TowerBatcher(encode, max_batch_items, max_batch_wait_ms)
    store = None
    if store_cfg is not None:
        if model_path is None:
            raise ValueError("an embedding store needs the model path (its entries are keyed by checkpoint)")
        tower_dtype = str(next(tower.parameters()).dtype)
        if quantization is not None:  # other embeddings than the unquantized tower's: other store entries
            tower_dtype += f"+{quantization}"
        widths = {MAIN: family.hidden_size, **family.extra_dims}
        fingerprint = model_fingerprint(model_path, family.model_type, tower_dtype, widths)
        store = EmbeddingStore(store_cfg, fingerprint, secret, check_item=family.check_item)
    return MultimodalEncoder(family, batcher, EmbeddingCache(cache_mb), media_cfg, store, tower)
