"""The multimodal encoder: media reference -> item embedding, once per content hash.

Used in-process by the engine in monolithic mode and, later, by the standalone encoder service: the same
class, the same cache. Flow per item: fetch the raw bytes, hash them with the processor's output-relevant
settings, and look the hash up in the embedding cache; only on a miss decode, preprocess and run the
tower. Concurrent requests for the same item compute it once (single-flight in the cache).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from mmserve.config import MediaConfig
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


class VisionTower:
    """Runs an HF vision tower (the `visual` module, loaded on its own) on one processed item.

    Same computation as HF's `get_image_features` / `get_video_features` for a single item: the tower's
    merged output (`pooler_output`), `(num_tokens, hidden)`.
    """

    def __init__(self, visual: torch.nn.Module) -> None:
        self.visual = visual
        self.dtype = visual.dtype
        self.device = next(visual.parameters()).device

    @torch.no_grad()
    def __call__(self, item: ProcessedItem) -> torch.Tensor:
        if item.modality not in (Modality.IMAGE, Modality.VIDEO):
            raise UnsupportedMediaError(f"{item.modality.value} input is not supported by this model")
        grid = torch.tensor([item.grid_thw], device=self.device)
        pixels = item.pixel_values.to(self.device, self.dtype)
        return self.visual(pixels, grid_thw=grid).pooler_output


@dataclass
class EncodeTimings:
    fetch_s: float = 0.0
    compute_s: float = 0.0  # decode + preprocess + tower, on cache misses
    hits: int = 0
    misses: int = 0
    per_item: list[str] = field(default_factory=list)  # "hit" / "miss" in request order


class MultimodalEncoder:
    """Media reference -> EncodedItem through the embedding cache (see module docstring)."""

    def __init__(self, tower: VisionTower, processor, cache: EmbeddingCache, media_cfg: MediaConfig) -> None:
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
        fetched = time.perf_counter()
        timings.fetch_s += fetched - start
        computed = []

        def compute() -> EncodedItem:
            computed.append(True)
            processed = self.processor.process(modality, self._decode(modality, data))
            embedding = self.tower(processed)
            return EncodedItem(modality, digest, embedding, processed.grid_thw, processed.second_per_grid_t)

        encoded = self.cache.get_or_compute(digest, compute)
        timings.compute_s += time.perf_counter() - fetched
        timings.per_item.append("miss" if computed else "hit")
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
