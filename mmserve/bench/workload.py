"""Synthetic multimodal workloads for `mmserve bench`: made offline, deterministic under a seed.

Each request is one user message: some images (and optionally one short video) as base64 data URIs, then
filler text and an instruction. Every image has an identity (`image_keys`): items drawn from the small
shared pool ("pool-K") are byte-identical wherever they appear, so a server with an encoder or prefix
cache can hit; every other item ("unique-I-J") has its own pixels.
"""

from __future__ import annotations

import base64
import io
import random
from dataclasses import dataclass

import av
import numpy as np
from PIL import Image

__all__ = [
    "BenchRequest",
    "WorkloadConfig",
    "build_workload",
    "parse_range",
    "parse_size",
    "parse_sizes",
]

_FORMATS = {"png": ("PNG", "image/png"), "jpeg": ("JPEG", "image/jpeg")}
_JPEG_QUALITY = 90
_VIDEO_FPS = 2
# Seed-stream tags, so pool images, unique images and videos never share a numpy stream.
_POOL, _UNIQUE, _VIDEO = 0, 1, 2

_WORDS = (
    "apple river stone cloud window garden paper light orange forest signal market bridge copper "
    "winter engine silver harbor candle meadow rocket violet thunder pencil island mirror planet "
    "lantern velvet canyon falcon marble ribbon summit tunnel whisper anchor breeze cactus dragon "
    "ember glacier hollow ivory jungle kettle lemon magnet nectar oasis pepper quartz saddle timber"
).split()
_INSTRUCTIONS = (
    "Describe the images in detail.",
    "List every object you can see.",
    "What colors dominate each picture?",
    "Write a short story about what is shown.",
    "Compare the images and explain how they differ.",
    "Summarize the scene in one paragraph.",
)


@dataclass(frozen=True)
class WorkloadConfig:
    """What `build_workload` makes; every field has a default so the CLI can override a few."""

    num_requests: int = 64
    images_per_request: tuple[int, int] = (1, 1)  # inclusive range; a fixed N is (N, N)
    image_sizes: tuple[tuple[int, int], ...] = ((448, 448),)  # (W, H) choices, picked uniformly
    image_format: str = "png"  # png | jpeg
    image_reuse: float = 0.0  # probability that an item is drawn from the shared pool
    reuse_pool_size: int = 8
    video: bool = False  # add one short generated video per request
    video_frames: int = 8
    video_size: tuple[int, int] = (224, 224)  # (W, H); even, as yuv420p needs
    prompt_tokens: int = 32  # approximate: words of filler text
    system_prompt_tokens: int = (
        0  # approximate: words of a system message of its own per request (before media)
    )
    output_tokens: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        lo, hi = self.images_per_request
        if self.num_requests < 0:
            raise ValueError(f"num_requests must be >= 0, got {self.num_requests}")
        if not 0 <= lo <= hi:
            raise ValueError(f"images_per_request must be 0 <= lo <= hi, got {self.images_per_request}")
        if not self.image_sizes or any(w < 1 or h < 1 for w, h in self.image_sizes):
            raise ValueError(f"image_sizes must be non-empty positive (W, H) pairs, got {self.image_sizes}")
        if self.image_format not in _FORMATS:
            raise ValueError(f"image_format must be one of {sorted(_FORMATS)}, got {self.image_format!r}")
        if not 0.0 <= self.image_reuse <= 1.0:
            raise ValueError(f"image_reuse must be in [0, 1], got {self.image_reuse}")
        if self.reuse_pool_size < 1:
            raise ValueError(f"reuse_pool_size must be >= 1, got {self.reuse_pool_size}")
        if self.video and self.video_frames < 1:
            raise ValueError(f"video_frames must be >= 1, got {self.video_frames}")
        if self.video and any(d < 2 or d % 2 for d in self.video_size):
            raise ValueError(f"video_size must be even and >= 2 in both dimensions, got {self.video_size}")
        if self.prompt_tokens < 0 or self.system_prompt_tokens < 0 or self.output_tokens < 1:
            raise ValueError("prompt_tokens and system_prompt_tokens must be >= 0, output_tokens >= 1")


@dataclass
class BenchRequest:
    """One chat request of a workload, ready to send."""

    index: int
    messages: list[dict]  # OpenAI chat messages; media as data: URIs
    max_tokens: int
    image_keys: list[str]  # identity per image, e.g. "pool-3" or "unique-17-0"
    image_sizes: list[tuple[int, int]]  # (W, H) per image, in message order


def build_workload(cfg: WorkloadConfig) -> list[BenchRequest]:
    """Builds `cfg.num_requests` requests; the same config (seed included) gives byte-identical output.

    Each item is independently a pool item with probability `cfg.image_reuse`; pool images are encoded
    once per call and reused. Sizes of pool images are fixed per pool slot, so a pool image is the same
    bytes wherever it appears.
    """
    rng = random.Random(cfg.seed)
    pool_sizes = [rng.choice(cfg.image_sizes) for _ in range(cfg.reuse_pool_size)]
    cache: dict[str, str] = {}
    requests = []
    for i in range(cfg.num_requests):
        keys, sizes = _draw_images(cfg, rng, i, pool_sizes)
        parts: list[dict] = [
            {"type": "image_url", "image_url": {"url": _image_uri(cfg, key, size, cache)}}
            for key, size in zip(keys, sizes, strict=True)
        ]
        if cfg.video:
            parts.append({"type": "video_url", "video_url": {"url": _video_uri(cfg, i)}})
        parts.append({"type": "text", "text": _prompt_text(rng, i, cfg.prompt_tokens)})
        messages = [{"role": "user", "content": parts}]
        if cfg.system_prompt_tokens:  # its own per request: text before the media that no cache holds
            words = [rng.choice(_WORDS) for _ in range(cfg.system_prompt_tokens)]
            messages.insert(0, {"role": "system", "content": " ".join([f"Session {i}.", *words])})
        requests.append(BenchRequest(i, messages, cfg.output_tokens, keys, sizes))
    return requests


def _draw_images(
    cfg: WorkloadConfig, rng: random.Random, index: int, pool_sizes: list[tuple[int, int]]
) -> tuple[list[str], list[tuple[int, int]]]:
    count = rng.randint(*cfg.images_per_request)
    keys: list[str] = []
    sizes: list[tuple[int, int]] = []
    for j in range(count):
        if rng.random() < cfg.image_reuse:
            slot = rng.randrange(cfg.reuse_pool_size)
            keys.append(f"pool-{slot}")
            sizes.append(pool_sizes[slot])
        else:
            keys.append(f"unique-{index}-{j}")
            sizes.append(rng.choice(cfg.image_sizes))
    return keys, sizes


def _image_uri(cfg: WorkloadConfig, key: str, size: tuple[int, int], cache: dict[str, str]) -> str:
    if key not in cache:
        kind, *ids = key.split("-")
        tag = _POOL if kind == "pool" else _UNIQUE
        pixels = _pixels(np.random.default_rng([cfg.seed, tag, *map(int, ids)]), size)
        fmt, mime = _FORMATS[cfg.image_format]
        buf = io.BytesIO()
        options = {"quality": _JPEG_QUALITY} if fmt == "JPEG" else {}
        Image.fromarray(pixels).save(buf, format=fmt, **options)
        cache[key] = f"data:{mime};base64," + base64.b64encode(buf.getvalue()).decode("ascii")
    return cache[key]


def _pixels(rng: np.random.Generator, size: tuple[int, int]) -> np.ndarray:
    """A smooth random color field plus fine noise: distinct per seed, and it compresses roughly like a
    photo rather than like pure noise (which would make payloads unrealistically large)."""
    w, h = size
    coarse = rng.integers(0, 256, size=(max(1, h // 32), max(1, w // 32), 3), dtype=np.uint8)
    field = np.asarray(Image.fromarray(coarse).resize((w, h), Image.BILINEAR), dtype=np.int16)
    noise = rng.integers(-12, 13, size=(h, w, 3), dtype=np.int16)
    return np.clip(field + noise, 0, 255).astype(np.uint8)


def _video_uri(cfg: WorkloadConfig, index: int) -> str:
    rng = np.random.default_rng([cfg.seed, _VIDEO, index])
    w, h = cfg.video_size
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=_VIDEO_FPS)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        for _ in range(cfg.video_frames):
            frame = av.VideoFrame.from_ndarray(_pixels(rng, (w, h)), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return "data:video/mp4;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _prompt_text(rng: random.Random, index: int, words: int) -> str:
    filler = [rng.choice(_WORDS) for _ in range(words)]
    instruction = _INSTRUCTIONS[rng.randrange(len(_INSTRUCTIONS))]
    # The request number keeps prompts distinct even with prompt_tokens=0.
    return " ".join([f"Request {index}.", *filler, instruction])


def parse_size(text: str) -> tuple[int, int]:
    """Parses "WxH" (e.g. "448x448") into (W, H); ValueError for anything else."""
    parts = text.strip().lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"expected a size like 448x448, got {text!r}")
    w, h = int(parts[0]), int(parts[1])
    if w < 1 or h < 1:
        raise ValueError(f"size must be positive, got {text!r}")
    return w, h


def parse_sizes(text: str) -> tuple[tuple[int, int], ...]:
    """Parses a comma-separated mix of sizes ("224x224,448x448"); ValueError if empty or malformed."""
    items = [s for s in text.split(",") if s.strip()]
    if not items:
        raise ValueError(f"expected one or more sizes like 224x224,448x448, got {text!r}")
    return tuple(parse_size(s) for s in items)


def parse_range(text: str) -> tuple[int, int]:
    """Parses "N" into (N, N) and "LO-HI" into (LO, HI), both inclusive; ValueError otherwise."""
    parts = text.strip().split("-")
    if len(parts) not in (1, 2) or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"expected a count like 2 or a range like 1-4, got {text!r}")
    lo, hi = int(parts[0]), int(parts[-1])
    if lo > hi:
        raise ValueError(f"range must have lo <= hi, got {text!r}")
    return lo, hi
