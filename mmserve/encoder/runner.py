"""The multimodal encoder: media reference -> item embedding, once per content hash.

Used in-process by the engine in monolithic mode and, later, by the standalone encoder service: the same
class, the same cache. Flow per item: fetch the raw bytes, hash them with the processor's output-relevant
settings, and look the hash up in the embedding cache; only on a miss decode, preprocess and run the
tower. Concurrent requests for the same item compute it once (single-flight in the cache).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from mmserve.config import MediaConfig
from mmserve.encoder.batcher import TowerBatcher
from mmserve.multimodal.cache import EmbeddingCache
from mmserve.multimodal.errors import UnsupportedMediaError
from mmserve.multimodal.items import Modality, MultimodalItem, content_hash
from mmserve.multimodal.media import MediaRef, decode_audio, decode_image, decode_video, load_bytes
from mmserve.multimodal.processors.base import ProcessedItem


@dataclass
class EncodedItem:
    """An item's embedding `(num_tokens, hidden)` with what the engine needs to place it."""

    modality: Modality
    content_hash: bytes
    embedding: torch.Tensor
    grid_thw: tuple[int, int, int]
    second_per_grid_t: float = 1.0

    @property
    def num_tokens(self) -> int:
        return self.embedding.shape[0]

    @property
    def nbytes(self) -> int:
        return self.embedding.nbytes

    def to_item(self) -> MultimodalItem:
        return MultimodalItem(self.modality, self.content_hash, self.num_tokens, self.grid_thw,
                              second_per_grid_t=self.second_per_grid_t)  # fmt: skip


class BatchedTower:
    """The tower as a callable for one item, served by a TowerBatcher (fused with concurrent callers)."""

    def __init__(self, batcher: TowerBatcher, timeout_s: float = 300.0) -> None:
        self.batcher = batcher
        self.timeout_s = timeout_s

    def __call__(self, item: ProcessedItem) -> torch.Tensor:
        return self.batcher.submit(item).result(timeout=self.timeout_s)


@dataclass
class EncodeTimings:
    fetch_s: float = 0.0  # bytes of every item (download / base64 / file)
    preprocess_s: float = 0.0  # decode + preprocess, cache misses only
    forward_s: float = 0.0  # waiting for and running the tower, cache misses only
    hits: int = 0
    misses: int = 0

    @property
    def total_s(self) -> float:
        return self.fetch_s + self.preprocess_s + self.forward_s


class MultimodalEncoder:
    """Media reference -> EncodedItem through the embedding cache (see module docstring)."""

    def __init__(self, tower: BatchedTower, processor, cache: EmbeddingCache, media_cfg: MediaConfig) -> None:
        self.tower = tower
        self.processor = processor
        self.cache = cache
        self.media_cfg = media_cfg

    def item_hash(self, modality: Modality, data: bytes) -> bytes:
        return content_hash(modality, data, self.processor.hash_settings(modality))

    def encode(self, modality: Modality, ref: MediaRef, timings: EncodeTimings | None = None) -> EncodedItem:
        """Raises MediaError subclasses for bad media (the caller maps them to HTTP 4xx)."""
        timings = timings if timings is not None else EncodeTimings()
        start = time.perf_counter()
        data = load_bytes(ref, self.media_cfg)
        digest = self.item_hash(modality, data)
        timings.fetch_s += time.perf_counter() - start
        computed = []

        def compute() -> EncodedItem:
            computed.append(True)
            t0 = time.perf_counter()
            processed = self.processor.process(modality, self._decode(modality, data))
            t1 = time.perf_counter()
            embedding = self.tower(processed)
            timings.preprocess_s += t1 - t0
            timings.forward_s += time.perf_counter() - t1
            return EncodedItem(modality, digest, embedding, processed.grid_thw, processed.second_per_grid_t)

        encoded = self.cache.get_or_compute(digest, compute)
        timings.misses += bool(computed)
        timings.hits += not computed
        return encoded

    def _decode(self, modality: Modality, data: bytes):
        if modality == Modality.IMAGE:
            return decode_image(data, self.media_cfg)
        if modality == Modality.VIDEO:
            return decode_video(data, self.media_cfg)
        if modality == Modality.AUDIO:
            return decode_audio(data, self.media_cfg)
        raise UnsupportedMediaError(f"unknown modality {modality!r}")
