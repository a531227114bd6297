"""Per-item media options and identities: how a request asks for an item to be decoded before the family's
processor (`detail`, vLLM's `media_io_kwargs`), and the caller-supplied `uuid` that can stand for its bytes.

Options are part of the item's identity: they enter its content hash (so its cache entries everywhere and its
pad value) and travel with it to whichever encoder computes it (`MediaItemMsg.options`). Their canonical form,
the one that travels and is hashed (a default is never written, so an item without options hashes as before):

- `detail: "low"` (image; the part's `image_url.detail`): downscaled, aspect kept, to at most
  `LOW_DETAIL_PIXELS` (512x512 pixels' worth), then the processor as usual. "high" / "auto": no option.
- `rgba_background_color: [r, g, b]` (image; `media_io_kwargs.image`): transparent pixels composited on this
  color, not white.
- `num_frames: n` (video; `media_io_kwargs.video`): at most n frames kept, 1 <= n <= the server's
  `max_video_frames` (-1: that cap).
- `fps: f` or null (video; `media_io_kwargs.video`): frames sampled at f a second, 0 < f <= `MAX_VIDEO_FPS`;
  null (vLLM's -1): uniformly over the whole video.

The video options replace the server's sampling (`MediaConfig.video_fps` / `max_video_frames`) for that item,
and hash as it does, so an option equal to the server's setting is the same item.

A `uuid` (vLLM's, on a media part) replaces content hashing: the item's hash is derived from the uuid, its
settings, options and the cache salt instead of its bytes, and a part with a uuid and no media refers to the
item sent earlier with it (`MultimodalEncoder.encode`).

Validation raises ValueError naming the key (HTTP 400); the API server checks a request, and the encoder
checks again what it receives (a peer could send anything).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from PIL import Image

from mmserve.config import MediaConfig
from mmserve.multimodal.errors import UnsupportedMediaError
from mmserve.multimodal.items import Modality
from mmserve.multimodal.media import decode_audio, decode_image, decode_video

LOW_DETAIL_PIXELS = 512 * 512  # OpenAI's low-detail image: 512x512 pixels' worth
# Any sampling rate above a video's own frame rate keeps every frame; the bound only keeps the sampling grid
# (seconds x fps points) small.
MAX_VIDEO_FPS = 1000.0
MAX_MEDIA_UUID_CHARS = 256
DETAILS = ("auto", "low", "high")
WHITE = (255, 255, 255)
# media_io_kwargs keys this server honours, per modality (vLLM's media connectors take others: 400 here).
REQUEST_KEYS = {
    Modality.IMAGE: ("rgba_background_color",),
    Modality.VIDEO: ("num_frames", "fps"),
    Modality.AUDIO: (),
}
_ITEM_KEYS = {**REQUEST_KEYS, Modality.IMAGE: ("detail", "rgba_background_color")}


def check_uuid(value: Any, where: str) -> str:
    """A media part's uuid: a non-empty printable string of at most MAX_MEDIA_UUID_CHARS. Raises
    ValueError."""
    if (
        not isinstance(value, str)
        or not value
        or len(value) > MAX_MEDIA_UUID_CHARS
        or not value.isprintable()
    ):
        raise ValueError(
            f"{where}: 'uuid' must be a non-empty printable string of at most {MAX_MEDIA_UUID_CHARS} "
            "characters"
        )
    return value


def detail_option(value: Any, where: str) -> dict[str, Any]:
    """An image part's `detail` as options: {"detail": "low"} or none. Raises ValueError."""
    if value not in DETAILS:
        raise ValueError(f"{where}.detail must be one of {', '.join(map(repr, DETAILS))}, got {value!r}")
    return {"detail": "low"} if value == "low" else {}


def request_options(media_io_kwargs: Any, cfg: MediaConfig) -> dict[Modality, dict[str, Any]]:
    """vLLM's chat `media_io_kwargs` ({"video": {"num_frames": 4}, ...}) as each modality's options for every
    item of that modality in the request. Raises ValueError naming the key for anything else."""
    if media_io_kwargs is None:
        return {}
    if not isinstance(media_io_kwargs, dict):
        raise ValueError("media_io_kwargs must be an object: modality -> options")
    out = {}
    for name, kwargs in media_io_kwargs.items():
        where = f"media_io_kwargs.{name}"
        if name not in {m.value for m in Modality}:
            raise ValueError(f"{where}: unknown modality (image, video or audio)")
        modality = Modality(name)
        if not isinstance(kwargs, dict):
            raise ValueError(f"{where} must be an object")
        unknown = sorted(set(kwargs) - set(REQUEST_KEYS[modality]))
        if unknown:
            takes = ", ".join(REQUEST_KEYS[modality]) or "none"
            raise ValueError(f"{where}.{unknown[0]}: not supported by this server (it takes: {takes})")
        out[modality] = checked(modality, kwargs, cfg, where)
    return out


def checked(modality: Modality, options: Mapping[str, Any], cfg: MediaConfig, where: str = "options") -> dict:
    """The canonical form of an item's options (see the module docstring). Raises ValueError naming the
    key."""
    out: dict[str, Any] = {}
    for key, value in options.items():
        if key not in _ITEM_KEYS[modality]:
            raise ValueError(f"{where}.{key}: not an option of a {modality.value} item")
        if key == "detail":
            out |= detail_option(value, where)
        elif key == "rgba_background_color":
            color = _color(value, f"{where}.{key}")
            if color != list(WHITE):
                out[key] = color
        elif key == "num_frames":
            if isinstance(value, bool) or not isinstance(value, int) or not (value == -1 or value >= 1):
                raise ValueError(f"{where}.num_frames must be a positive integer (or -1), got {value!r}")
            if value > cfg.max_video_frames:
                raise ValueError(
                    f"{where}.num_frames: {value} is more than this server keeps of a video "
                    f"({cfg.max_video_frames} frames)"
                )
            if value != -1:
                out[key] = value
        elif key == "fps":
            out[key] = _fps(value, f"{where}.fps")
    return out


def _color(value: Any, where: str) -> list[int]:
    ok = isinstance(value, list | tuple) and len(value) == 3
    if not ok or any(isinstance(c, bool) or not isinstance(c, int) or not 0 <= c <= 255 for c in value):
        raise ValueError(f"{where} must be [R, G, B] with each value in 0..255, got {value!r}")
    return [int(c) for c in value]


def _fps(value: Any, where: str) -> float | None:
    if value is None or (not isinstance(value, bool) and value == -1):
        return None  # vLLM's -1: no rate, frames spread uniformly over the video
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= MAX_VIDEO_FPS:
        raise ValueError(
            f"{where} must be a number in (0, {MAX_VIDEO_FPS:g}] (or -1: uniform), got {value!r}"
        )
    return float(value)


def media_config(cfg: MediaConfig, modality: Modality, options: Mapping[str, Any]) -> MediaConfig:
    """The media settings an item with these (checked) options is decoded and hashed under."""
    if modality != Modality.VIDEO or not options:
        return cfg
    frames = options.get("num_frames", cfg.max_video_frames)
    return replace(cfg, max_video_frames=frames, video_fps=options.get("fps", cfg.video_fps))


def hash_settings(cfg: MediaConfig, modality: Modality, options: Mapping[str, Any]) -> dict[str, Any]:
    """Every media setting of the item that changes what the model sees (enters the content hash): the
    sampling it is decoded under, and the image options."""
    image = dict(options) if modality == Modality.IMAGE else {}
    return {**media_config(cfg, modality, options).hash_settings(modality.value), **image}


def low_detail_size(width: int, height: int) -> tuple[int, int]:
    """The size of a low-detail image: the largest of the same aspect (rounded down) with width * height <=
    LOW_DETAIL_PIXELS; a smaller image keeps its size."""
    if width * height <= LOW_DETAIL_PIXELS:
        return width, height
    scale = math.sqrt(LOW_DETAIL_PIXELS / (width * height))
    w, h = max(1, math.floor(width * scale)), max(1, math.floor(height * scale))
    if w * h > LOW_DETAIL_PIXELS:  # float rounding at the boundary
        w = LOW_DETAIL_PIXELS // h
    return w, h


def low_detail(image: Image.Image) -> Image.Image:
    """The image as `detail: "low"` gives it to the family's processor."""
    size = low_detail_size(*image.size)
    return image if size == image.size else image.resize(size, Image.Resampling.BICUBIC)


def decode(
    family: Any,
    modality: Modality,
    data: bytes,
    settings: Mapping[str, Any],
    cfg: MediaConfig,
    options: Mapping[str, Any],
) -> Any:
    """An item's bytes decoded as its family's processor takes them (PIL image, DecodedVideo, float32
    samples), under the server's `cfg` and the item's (checked) `options`. Raises MediaError subclasses."""
    if modality == Modality.IMAGE:
        image = decode_image(data, cfg, tuple(options.get("rgba_background_color", WHITE)))
        return low_detail(image) if options.get("detail") == "low" else image
    if modality == Modality.VIDEO:
        return decode_video(data, media_config(cfg, modality, options), family.video_audio_rate_hz(settings))
    if modality == Modality.AUDIO:
        return decode_audio(data, cfg, family.audio_sample_rate_hz)
    raise UnsupportedMediaError(f"unknown modality {modality!r}")
