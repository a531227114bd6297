"""Small generators of valid and deliberately broken media bytes, for tests that feed a server bad input.

Everything is built in memory with PIL, PyAV, numpy and soundfile (no downloads). Each function returns the
encoded bytes; `data_uri` wraps them for a chat request.
"""

from __future__ import annotations

import base64
import io
import struct
import zlib
from fractions import Fraction

import av
import numpy as np
import soundfile as sf
from PIL import Image


def data_uri(data: bytes, mime: str = "image/png") -> str:
    """`data:<mime>;base64,<data>`; the MIME type is whatever the caller claims, true or not."""
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def image(width: int = 64, height: int = 48, fmt: str = "PNG", mode: str = "RGB", seed: int = 0) -> bytes:
    """A valid image of random pixels in `mode` (e.g. "CMYK" with fmt "JPEG"), encoded as `fmt`."""
    rng = np.random.default_rng(seed)
    rgb = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")
    buf = io.BytesIO()
    rgb.convert(mode).save(buf, format=fmt)
    return buf.getvalue()


def flat_image(width: int, height: int, fmt: str = "PNG") -> bytes:
    """A one-colour image: large in pixels, tiny in bytes (compresses to almost nothing)."""
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (120, 30, 200)).save(buf, format=fmt)
    return buf.getvalue()


def truncated(data: bytes, keep: float = 0.5) -> bytes:
    """The first `keep` fraction of `data`: a header that parses, pixel data that ends early."""
    return data[: max(1, int(len(data) * keep))]


def png_bomb(width: int = 30_000, height: int = 30_000) -> bytes:
    """A ~100-byte PNG whose IHDR declares width x height pixels (a decompression bomb's header).

    A small valid PNG with its IHDR size rewritten and the chunk CRC fixed, so the header parses cleanly;
    only decoding the pixel data would fail (or, for a real bomb, exhaust memory).
    """
    data = flat_image(8, 8)
    assert data[12:16] == b"IHDR"
    ihdr = b"IHDR" + struct.pack(">II", width, height) + data[24:29]
    return data[:12] + ihdr + struct.pack(">I", zlib.crc32(ihdr)) + data[33:]


def animated_gif(num_frames: int = 3, size: int = 32) -> bytes:
    """An animated GIF whose frames are distinct solid colours."""
    frames = [Image.new("RGB", (size, size), (80 * i % 256, 40, 200 - 50 * i)) for i in range(num_frames)]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    return buf.getvalue()


def _video_codec() -> str:
    return "mpeg4" if "mpeg4" in av.codecs_available else "libx264"


def video(num_frames: int = 4, rate: int = 2, width: int = 64, height: int = 48) -> bytes:
    """A valid MP4 of `num_frames` grey frames at `rate` fps."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream(_video_codec(), rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(num_frames):
            frame = av.VideoFrame.from_ndarray(np.full((height, width, 3), 30 * i, np.uint8), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return buf.getvalue()


def video_without_frames() -> bytes:
    """An AVI with a video stream header and not a single frame."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="avi") as container:
        stream = container.add_stream(_video_codec(), rate=10)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        container.start_encoding()
    return buf.getvalue()


def video_claiming_hours(seconds: int = 36_000) -> bytes:
    """A two-frame MP4 whose second frame is stamped `seconds` after the first: ~100 bytes of content,
    a container declaring a duration of hours."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream(_video_codec(), rate=1)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        stream.codec_context.time_base = Fraction(1, 1)
        for pts in (0, seconds):
            frame = av.VideoFrame.from_ndarray(np.zeros((32, 32, 3), np.uint8), format="rgb24")
            frame.pts, frame.time_base = pts, Fraction(1, 1)
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return buf.getvalue()


def wav(seconds: float = 0.5, rate: int = 16_000, subtype: str = "PCM_16", channels: int = 1) -> bytes:
    """A sine tone as WAV with the given libsndfile `subtype` ("PCM_U8", "FLOAT", "DOUBLE", "ULAW", ...)."""
    t = np.arange(int(seconds * rate)) / rate
    tone = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    buf = io.BytesIO()
    sf.write(buf, np.repeat(tone[:, None], channels, axis=1), rate, subtype=subtype, format="WAV")
    return buf.getvalue()


def garbage(num_bytes: int = 512, seed: int = 0) -> bytes:
    """Random bytes: no known magic number, not an image, video or audio."""
    return np.random.default_rng(seed).integers(0, 256, num_bytes, dtype=np.uint8).tobytes()
