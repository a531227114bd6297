"""Media references and decoding of client images, videos and audio.

`MediaRef` says where an item's bytes come from; `load_bytes` / `load_media` (in `media_fetch`, re-exported
here) get them under the limits of `MediaConfig`; `decode_image` / `decode_video` / `decode_audio` turn
bytes into arrays. Decoding sniffs the content and never trusts a declared MIME type. Every limit is
checked before the expensive step it protects, and every failure is a typed `MediaError`: PIL, PyAV and
soundfile raise a grab bag of exception types on corrupt input, so their calls are wrapped broadly.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import av
import httpx
import numpy as np
import soundfile as sf
from PIL import Image, ImageOps

from mmserve.config import MediaConfig
from mmserve.multimodal.errors import MediaDecodeError, MediaError, MediaTooLargeError, UnsupportedMediaError
from mmserve.multimodal.media_fetch import MediaBytes, Resolver, load_bytes, load_media, parse_data_uri

__all__ = [
    "DecodedVideo",
    "MediaBytes",
    "MediaRef",
    "Resolver",
    "decode_audio",
    "decode_image",
    "decode_video",
    "load_audio",
    "load_bytes",
    "load_image",
    "load_media",
    "load_video",
]

MediaKind = Literal["url", "data", "file", "bytes"]
_SCHEME_KINDS: dict[str, MediaKind] = {"http": "url", "https": "url", "data": "data", "file": "file"}


@dataclass(frozen=True)
class MediaRef:
    """Where an item's bytes come from.

    kind "url" (http/https) and "file" (file://) keep the URL in `url`; "data" keeps the whole data URI
    in `url`; "bytes" keeps raw in-process bytes in `data`.
    """

    kind: MediaKind
    url: str | None = field(default=None, repr=False)
    data: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in ("url", "data", "file", "bytes"):
            raise ValueError(f"unknown MediaRef kind {self.kind!r}")
        if (self.kind == "bytes") != (self.data is not None) or (self.url is None) == (self.data is None):
            raise ValueError(f"a {self.kind!r} MediaRef needs exactly one of url / data, data for 'bytes'")

    def __repr__(self) -> str:
        shown = f"{len(self.data or b'')} bytes" if self.kind == "bytes" else _shorten(self.url or "")
        return f"MediaRef({self.kind}: {shown})"

    @classmethod
    def parse(cls, s: str) -> MediaRef:
        """Builds a ref from an http(s)://, data: or file:// string. Raises MediaError for other schemes."""
        scheme, sep, _ = s.strip().partition(":")
        kind = _SCHEME_KINDS.get(scheme.lower()) if sep else None
        if kind is None:
            named = f"scheme {scheme.lower()!r}" if sep and scheme else "no scheme"
            raise MediaError(
                f"unsupported media reference ({named}); expected http://, https://, data: or file://"
            )
        return cls(kind=kind, url=s.strip())

    @classmethod
    def from_bytes(cls, b: bytes) -> MediaRef:
        """Builds a ref for bytes given in-process."""
        return cls(kind="bytes", data=bytes(b))

    def routing_key(self) -> bytes:
        """Returns a 16-byte blake2b digest: of the raw bytes for data/bytes refs (a data URI and
        `from_bytes` of its payload agree), of the URL string for url/file refs.

        Raises MediaDecodeError for a malformed data URI.
        """
        if self.kind == "bytes":
            payload = self.data or b""
        elif self.kind == "data":
            payload, _ = parse_data_uri(self.url or "")
        else:
            payload = (self.url or "").encode("utf-8")
        return hashlib.blake2b(payload, digest_size=16).digest()


def _shorten(s: str, limit: int = 80) -> str:
    return s if len(s) <= limit else f"{s[:limit]}... ({len(s)} chars)"


@contextmanager
def _wrap_errors(what: str) -> Iterator[None]:
    """Re-raises anything but a MediaError from the block as MediaDecodeError("cannot decode <what>")."""
    try:
        yield
    except MediaError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:  # warning: if made an error
        raise MediaTooLargeError(f"{what} is too large: {e}") from e
    except Image.UnidentifiedImageError as e:  # its message is a repr of our BytesIO: useless to a client
        raise MediaDecodeError(f"cannot decode {what}: not an image in a format we can read") from e
    except Exception as e:  # decoder libraries raise arbitrary types on corrupt input
        raise MediaDecodeError(f"cannot decode {what}: {e or type(e).__name__}") from e


def _check_pixels(width: int, height: int, cfg: MediaConfig, what: str) -> None:
    """Raises MediaTooLargeError if width*height exceeds `cfg.max_image_pixels`."""
    if width * height > cfg.max_image_pixels:
        raise MediaTooLargeError(
            f"{what} is {width}x{height} = {width * height} pixels, more than the limit of {cfg.max_image_pixels}"
        )


# --- images -----------------------------------------------------------------------------------------


def decode_image(
    data: bytes, cfg: MediaConfig, background: tuple[int, int, int] = (255, 255, 255)
) -> Image.Image:
    """Decodes image bytes (any format PIL sniffs) into an RGB image, EXIF orientation applied.

    For animated images (GIF, APNG, WebP) the first frame is used. Transparent pixels are composited
    on `background` (white unless a request sets vLLM's `rgba_background_color`). Raises MediaTooLargeError
    (declared pixels over `max_image_pixels`, checked before the pixel data is decompressed), MediaDecodeError
    (not an image, truncated, degenerate or too extreme aspect ratio).
    """
    with _wrap_errors("image"):
        # Opening only parses the header; PIL's own bomb check may also refuse here.
        img = Image.open(io.BytesIO(data))
        width, height = img.size
        _check_pixels(width, height, cfg, "image")
        if width < 1 or height < 1:
            raise MediaDecodeError(f"image has degenerate size {width}x{height}")
        ratio = max(width, height) / min(width, height)
        if ratio > cfg.max_image_aspect_ratio:
            raise MediaDecodeError(
                f"image aspect ratio {ratio:.1f} ({width}x{height}) exceeds the limit of {cfg.max_image_aspect_ratio}"
            )
        img.load()  # truncated data raises here: LOAD_TRUNCATED_IMAGES is deliberately left off
        ImageOps.exif_transpose(img, in_place=True)
        return _to_rgb(img, background)


def _to_rgb(img: Image.Image, background: tuple[int, int, int]) -> Image.Image:
    """Converts any PIL mode to a new RGB image; alpha / transparency is composited on `background`."""
    if img.mode.startswith("I;16"):
        # PIL's I;16 -> RGB conversion clips at 255; scale the 16-bit range down instead.
        scaled = (np.asarray(img, dtype=np.uint32) >> 8).astype(np.uint8)
        return Image.fromarray(scaled, mode="L").convert("RGB")
    has_alpha = "A" in img.getbands() or img.mode == "RGBa"
    if has_alpha or "transparency" in img.info:
        rgba = img.convert("RGBA")
        canvas = Image.new("RGBA", rgba.size, (*background, 255))
        return Image.alpha_composite(canvas, rgba).convert("RGB")
    return img.convert("RGB")


# --- video ------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class DecodedVideo:
    """Sampled video frames.

    `frames` is uint8 (T, H, W, 3) RGB; `timestamps_s` the presentation time of each kept frame;
    `fps` the rate at which the kept frames are spaced (for temporal positions); `duration_s` the
    duration of the whole video; `audio` its audio track as float32 mono samples, only when the decoder was
    asked for it (`decode_video(..., audio_rate_hz=...)`) and the video has one, else None.
    """

    frames: np.ndarray = field(repr=False)
    fps: float
    duration_s: float
    timestamps_s: tuple[float, ...] = field(repr=False)
    audio: np.ndarray | None = field(default=None, repr=False)


def decode_video(data: bytes, cfg: MediaConfig, audio_rate_hz: int | None = None) -> DecodedVideo:
    """Decodes video bytes with PyAV and samples frames; with `audio_rate_hz`, also its first audio track (all
    of it, mono at that rate, under the audio limits), if it has one.

    With `cfg.video_fps` frames are kept at that rate by timestamp, else uniformly over the video; at
    most `cfg.max_video_frames` are kept (uniformly subsampled). Raises MediaTooLargeError (declared
    or actual duration over `max_video_seconds`, frame size over `max_image_pixels`, both checked before
    decoding), MediaDecodeError (not a video, no video frames).
    """
    with _wrap_errors("video"):
        with av.open(io.BytesIO(data), metadata_errors="ignore") as container:
            times, duration = _probe_video(container, cfg)
        keep = _select_frames(times, cfg)
        with av.open(io.BytesIO(data), metadata_errors="ignore") as container:
            frames = _decode_frames(container, keep, cfg)
    if not frames:
        raise MediaDecodeError("video has no frames")
    kept_times = tuple(times[i] for i in keep[: len(frames)])
    span = kept_times[-1] - kept_times[0]
    fps = (len(frames) - 1) / span if len(frames) > 1 and span > 0 else (cfg.video_fps or 1.0)
    audio = None
    if audio_rate_hz is not None and _has_audio_stream(data):
        mono, rate = _read_pyav(data, cfg)
        with _wrap_errors("audio track"):
            audio = _resample(mono, rate, audio_rate_hz)
    return DecodedVideo(np.stack(frames), float(fps), float(duration), kept_times, audio)


def _has_audio_stream(data: bytes) -> bool:
    with _wrap_errors("video"), av.open(io.BytesIO(data), metadata_errors="ignore") as container:
        return bool(container.streams.audio)


def _probe_video(container: Any, cfg: MediaConfig) -> tuple[list[float], float]:
    """Checks the limits from the headers, then demuxes (without decoding) to get the frame times.

    Returns (sorted presentation times in s, duration in s). Raises MediaTooLargeError, MediaDecodeError.
    """
    if not container.streams.video:
        raise MediaDecodeError("video has no frames (no video stream)")
    stream = container.streams.video[0]
    declared = _declared_duration(container, stream)
    if declared is not None and declared > cfg.max_video_seconds:
        raise MediaTooLargeError(
            f"video lasts {declared:.1f} s, more than the limit of {cfg.max_video_seconds} s"
        )
    _check_pixels(stream.codec_context.width, stream.codec_context.height, cfg, "video frame")
    times = _frame_times(container, stream)
    if not times:
        raise MediaDecodeError("video has no frames")
    if times[-1] - times[0] > cfg.max_video_seconds:
        raise MediaTooLargeError(f"video spans more than the limit of {cfg.max_video_seconds} s")
    step = 1.0 / float(stream.average_rate) if stream.average_rate else 0.0
    return times, declared if declared is not None else times[-1] - times[0] + step


def _declared_duration(container: Any, stream: Any) -> float | None:
    """Returns the duration in seconds the headers declare, or None if they do not."""
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return container.duration / av.time_base
    return None


def _frame_times(container: Any, stream: Any) -> list[float]:
    """Returns the sorted presentation times (s) of all frames, from demuxing alone (no decoding)."""
    rate = float(stream.average_rate) if stream.average_rate else 25.0
    times: list[float] = []
    for packet in container.demux(stream):
        if packet.size == 0:
            continue  # the flush packet at the end
        if packet.pts is not None and packet.time_base is not None:
            times.append(float(packet.pts * packet.time_base))
        else:
            times.append(len(times) / rate)
    return sorted(times)


def _select_frames(times: list[float], cfg: MediaConfig) -> list[int]:
    """Returns the sorted indices of the frames to keep (see `decode_video`)."""
    n = len(times)
    if cfg.video_fps:
        start, span = times[0], times[-1] - times[0]
        targets = start + np.arange(int(span * cfg.video_fps) + 1) / cfg.video_fps
        picked = np.searchsorted(np.asarray(times), targets - 1e-6)
        indices = np.unique(np.clip(picked, 0, n - 1))
    else:
        indices = np.arange(n)
    if len(indices) > cfg.max_video_frames:
        indices = indices[
            np.unique(np.linspace(0, len(indices) - 1, cfg.max_video_frames).round().astype(int))
        ]
    return [int(i) for i in indices]


def _decode_frames(container: Any, keep: list[int], cfg: MediaConfig) -> list[np.ndarray]:
    """Decodes the frames at presentation-order positions `keep` into RGB arrays of one common size."""
    stream = container.streams.video[0]
    wanted = set(keep)
    frames: list[np.ndarray] = []
    size: tuple[int, int] | None = None
    stream.thread_type = "AUTO"
    for index, frame in enumerate(container.decode(stream)):
        if index in wanted:
            _check_pixels(frame.width, frame.height, cfg, "video frame")
            size = size or (frame.width, frame.height)
            frames.append(frame.to_ndarray(format="rgb24", width=size[0], height=size[1]))
        if index >= keep[-1]:
            break
    return frames


# --- audio ------------------------------------------------------------------------------------------

_RESAMPLE_CHUNK = 1 << 16


def decode_audio(data: bytes, cfg: MediaConfig, sample_rate_hz: int | None = None) -> np.ndarray:
    """Decodes audio bytes into float32 mono at `sample_rate_hz or cfg.audio_sample_rate_hz`.

    Tries soundfile (WAV, FLAC, OGG, ...) and falls back to PyAV (MP3, M4A, ...). Channels are
    averaged. Raises MediaTooLargeError (over `max_audio_seconds`, from the header when it declares a
    length), MediaDecodeError (not audio, no samples), UnsupportedMediaError (no decoder for the codec).
    """
    target = sample_rate_hz or cfg.audio_sample_rate_hz
    decoded = _read_soundfile(data, cfg)
    if decoded is None:
        decoded = _read_pyav(data, cfg)
    mono, rate = decoded
    if mono.size == 0:
        raise MediaDecodeError("audio has no samples")
    with _wrap_errors("audio"):
        return _resample(mono, rate, target)


def _check_seconds(seconds: float, cfg: MediaConfig) -> None:
    """Raises MediaTooLargeError if `seconds` exceeds `cfg.max_audio_seconds`."""
    if seconds > cfg.max_audio_seconds:
        raise MediaTooLargeError(
            f"audio lasts {seconds:.1f} s, more than the limit of {cfg.max_audio_seconds} s"
        )


def _read_soundfile(data: bytes, cfg: MediaConfig) -> tuple[np.ndarray, int] | None:
    """Decodes with libsndfile into (mono float32, rate), or returns None if it cannot open the format."""
    try:
        sound = sf.SoundFile(io.BytesIO(data))
    except Exception:  # libsndfile does not know the format: let PyAV try
        return None
    with sound, _wrap_errors("audio"):
        if sound.frames > 0:  # some formats do not declare a length
            _check_seconds(sound.frames / sound.samplerate, cfg)
        samples = sound.read(
            frames=int(cfg.max_audio_seconds * sound.samplerate) + 1, dtype="float32", always_2d=True
        )
        _check_seconds(len(samples) / sound.samplerate, cfg)
        return samples.mean(axis=1, dtype=np.float32), int(sound.samplerate)


def _read_pyav(data: bytes, cfg: MediaConfig) -> tuple[np.ndarray, int]:
    """Decodes with PyAV into (mono float32, rate). Raises as `decode_audio`."""
    try:
        container = av.open(io.BytesIO(data), metadata_errors="ignore")
    except Exception as e:
        raise MediaDecodeError("cannot decode audio: not a recognised audio format") from e
    with container, _wrap_errors("audio"):
        if not container.streams.audio:
            raise MediaDecodeError("cannot decode audio: no audio stream found")
        stream = container.streams.audio[0]
        if stream.codec_context is None:
            raise UnsupportedMediaError("no decoder for the codec of the audio stream")
        declared = _declared_duration(container, stream)
        if declared is not None:
            _check_seconds(declared, cfg)
        # Converts to float planar at the source rate and layout; mixing and resampling happen after.
        converter = av.AudioResampler(format="fltp")
        chunks: list[np.ndarray] = []
        rate, total = stream.codec_context.sample_rate or 0, 0
        for frame in container.decode(stream):
            rate = frame.sample_rate
            for out in converter.resample(frame):
                chunks.append(out.to_ndarray().mean(axis=0, dtype=np.float32))
                total += out.samples
            _check_seconds(total / rate, cfg)
        chunks.extend(out.to_ndarray().mean(axis=0, dtype=np.float32) for out in converter.resample(None))
    if not chunks:
        raise MediaDecodeError("audio has no samples")
    return np.concatenate(chunks), int(rate)


def _resample(mono: np.ndarray, rate: int, target: int) -> np.ndarray:
    """Resamples float32 mono audio with FFmpeg's swresample; the result has round(n * target / rate)
    samples (the resampler's edge effects are trimmed or zero-padded)."""
    if rate == target:
        return np.ascontiguousarray(mono, dtype=np.float32)
    resampler = av.AudioResampler(format="flt", layout="mono", rate=target)
    out: list[np.ndarray] = []
    for start in range(0, len(mono), _RESAMPLE_CHUNK):
        frame = av.AudioFrame.from_ndarray(
            np.ascontiguousarray(mono[None, start : start + _RESAMPLE_CHUNK]), format="flt", layout="mono"
        )
        frame.sample_rate = rate
        out.extend(f.to_ndarray()[0] for f in resampler.resample(frame))
    out.extend(f.to_ndarray()[0] for f in resampler.resample(None))
    result = np.concatenate(out) if out else np.zeros(0, dtype=np.float32)
    expected = round(len(mono) * target / rate)
    if len(result) < expected:
        result = np.pad(result, (0, expected - len(result)))
    return np.ascontiguousarray(result[:expected], dtype=np.float32)


# --- convenience ------------------------------------------------------------------------------------


def load_image(
    ref: MediaRef,
    cfg: MediaConfig,
    *,
    resolver: Resolver | None = None,
    transport: httpx.BaseTransport | None = None,
) -> Image.Image:
    """`load_bytes` then `decode_image`; raises as those."""
    return decode_image(load_bytes(ref, cfg, resolver=resolver, transport=transport), cfg)


def load_video(
    ref: MediaRef,
    cfg: MediaConfig,
    *,
    resolver: Resolver | None = None,
    transport: httpx.BaseTransport | None = None,
) -> DecodedVideo:
    """`load_bytes` then `decode_video`; raises as those."""
    return decode_video(load_bytes(ref, cfg, resolver=resolver, transport=transport), cfg)


def load_audio(
    ref: MediaRef,
    cfg: MediaConfig,
    *,
    sample_rate_hz: int | None = None,
    resolver: Resolver | None = None,
    transport: httpx.BaseTransport | None = None,
) -> np.ndarray:
    """`load_bytes` then `decode_audio`; raises as those."""
    data = load_bytes(ref, cfg, resolver=resolver, transport=transport)
    return decode_audio(data, cfg, sample_rate_hz)
