"""Tests for mmserve.multimodal.media: references, byte loading, file:// policy, decoding of images, video and
audio. Fetching over http(s) and its SSRF policy: tests/test_media_fetch.py.

All fixtures are generated in memory.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import struct
import zlib
from pathlib import Path

import av
import numpy as np
import pytest
import soundfile as sf
from PIL import Image

from mmserve.config import MediaConfig
from mmserve.multimodal.errors import (
    MediaDecodeError,
    MediaError,
    MediaFetchError,
    MediaForbiddenError,
    MediaTooLargeError,
)
from mmserve.multimodal.media import (
    MediaRef,
    decode_audio,
    decode_image,
    decode_video,
    load_audio,
    load_bytes,
    load_image,
    load_media,
    load_video,
)

pytestmark = pytest.mark.timeout(60)

CFG = MediaConfig()

# --- fixtures: images -------------------------------------------------------------------------------


def _encode(img: Image.Image, fmt: str, **kw: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def _gradient(w: int = 32, h: int = 24) -> Image.Image:
    x = np.arange(w, dtype=np.uint8)[None, :, None] * 7
    y = np.arange(h, dtype=np.uint8)[:, None, None] * 5
    return Image.fromarray((x + y + np.array([0, 60, 120], dtype=np.uint8)).astype(np.uint8), "RGB")


def _noise(w: int = 128, h: int = 128) -> Image.Image:
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")


@pytest.fixture(scope="module")
def png() -> bytes:
    return _encode(_gradient(), "PNG")


def _data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def _patch_png_size(data: bytes, width: int, height: int) -> bytes:
    """Rewrites the IHDR width/height of a PNG and recomputes the chunk CRC."""
    assert data[12:16] == b"IHDR"
    ihdr = b"IHDR" + struct.pack(">II", width, height) + data[24:29]
    return data[:12] + ihdr + struct.pack(">I", zlib.crc32(ihdr)) + data[33:]


# --- MediaRef ---------------------------------------------------------------------------------------


def test_same_image_from_data_file_bytes_decodes_equal_with_equal_routing_keys(
    png: bytes, tmp_path: Path
) -> None:
    path = tmp_path / "img.png"
    path.write_bytes(png)
    cfg = MediaConfig(allowed_local_media_path=str(tmp_path))
    data_ref = MediaRef.parse(_data_uri(png))
    bytes_ref = MediaRef.from_bytes(png)
    file_ref = MediaRef.parse(path.as_uri())
    assert (data_ref.kind, bytes_ref.kind, file_ref.kind) == ("data", "bytes", "file")
    arrays = [np.asarray(load_image(r, cfg)) for r in (data_ref, bytes_ref, file_ref)]
    assert arrays[0].shape == (24, 32, 3)
    np.testing.assert_array_equal(arrays[0], arrays[1])
    np.testing.assert_array_equal(arrays[0], arrays[2])
    assert data_ref.routing_key() == bytes_ref.routing_key()
    assert len(data_ref.routing_key()) == 16
    assert file_ref.routing_key() != bytes_ref.routing_key()
    assert (
        MediaRef.parse("https://a.test/x.png").routing_key()
        == MediaRef.parse("https://a.test/x.png").routing_key()
    )


@pytest.mark.parametrize(
    "s", ["ftp://host/x.png", "gopher://x", "javascript:alert(1)", "/etc/passwd", "img.png"]
)
def test_parse_rejects_other_schemes(s: str) -> None:
    with pytest.raises(MediaError, match="scheme"):
        MediaRef.parse(s)


def test_parse_kinds_and_short_repr(png: bytes) -> None:
    assert MediaRef.parse("HTTP://a.test/x").kind == "url"
    assert MediaRef.parse("https://a.test/x").kind == "url"
    assert len(repr(MediaRef.parse(_data_uri(png * 100)))) < 200
    assert "bytes" in repr(MediaRef.from_bytes(png))


def test_data_uri_mime_is_recorded_but_not_trusted(png: bytes) -> None:
    media = load_media(MediaRef.parse(_data_uri(png, "audio/wav")), CFG)
    assert media.mime == "audio/wav" and media.data == png and media.source == "data URI"
    assert load_image(MediaRef.parse(_data_uri(png, "audio/wav")), CFG).size == (32, 24)
    assert load_media(MediaRef.parse("data:,hello%20world"), CFG).data == b"hello world"


def test_malformed_base64() -> None:
    with pytest.raises(MediaDecodeError, match="malformed base64"):
        load_bytes(MediaRef.parse("data:image/png;base64,@@not*base64@@"), CFG)
    with pytest.raises(MediaDecodeError, match="malformed base64"):
        MediaRef.parse("data:image/png;base64,abc").routing_key()


def test_too_large_bytes(png: bytes, tmp_path: Path) -> None:
    path = tmp_path / "img.png"
    path.write_bytes(png)
    cfg = MediaConfig(max_media_bytes=len(png) - 1, allowed_local_media_path=str(tmp_path))
    for ref in (MediaRef.from_bytes(png), MediaRef.parse(_data_uri(png)), MediaRef.parse(path.as_uri())):
        with pytest.raises(MediaTooLargeError):
            load_bytes(ref, cfg)
    # A huge base64 payload is refused from its encoded length, before decoding.
    with pytest.raises(MediaTooLargeError):
        load_bytes(
            MediaRef.parse("data:image/png;base64," + "A" * 4_000_000), MediaConfig(max_media_bytes=1000)
        )


# --- file:// ----------------------------------------------------------------------------------------


def test_file_refused_without_allowed_dir(png: bytes, tmp_path: Path) -> None:
    (tmp_path / "img.png").write_bytes(png)
    with pytest.raises(MediaForbiddenError):
        load_bytes(MediaRef.parse((tmp_path / "img.png").as_uri()), CFG)


def test_file_outside_allowed_dir_refused(png: bytes, tmp_path: Path) -> None:
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    outside = tmp_path / "secret.png"
    outside.write_bytes(png)
    (allowed / "link.png").symlink_to(outside)
    (tmp_path / "allowed2").mkdir()
    (tmp_path / "allowed2" / "x.png").write_bytes(png)  # shares the "allowed" prefix as a string
    cfg = MediaConfig(allowed_local_media_path=str(allowed))
    for url in (
        outside.as_uri(),
        f"file://{allowed}/../secret.png",
        (allowed / "link.png").as_uri(),
        (tmp_path / "allowed2" / "x.png").as_uri(),
    ):
        with pytest.raises(MediaForbiddenError) as e:
            load_bytes(MediaRef.parse(url), cfg)
        assert url.endswith("secret.png") or "secret" not in str(e.value)  # a symlink's target stays hidden


def test_file_missing_and_directory(tmp_path: Path) -> None:
    cfg = MediaConfig(allowed_local_media_path=str(tmp_path))
    with pytest.raises(MediaFetchError):
        load_bytes(MediaRef.parse((tmp_path / "nope.png").as_uri()), cfg)
    (tmp_path / "sub").mkdir()
    with pytest.raises(MediaFetchError):
        load_bytes(MediaRef.parse((tmp_path / "sub").as_uri()), cfg)


# --- image decoding ---------------------------------------------------------------------------------


def test_not_an_image() -> None:
    with pytest.raises(MediaDecodeError):
        decode_image(b"this is not an image at all", CFG)
    with pytest.raises(MediaDecodeError):
        decode_image(b"", CFG)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_truncated_image(fmt: str) -> None:
    data = _encode(_noise(), fmt)
    with pytest.raises(MediaDecodeError):
        decode_image(data[: len(data) // 2], CFG)


def test_decompression_bomb_refused_before_decoding(png: bytes) -> None:
    with pytest.raises(MediaTooLargeError):
        decode_image(_patch_png_size(png, 100_000, 100_000), CFG)
    # Below PIL's own bomb threshold, our limit still applies.
    with pytest.raises(MediaTooLargeError, match="5000x5000"):
        decode_image(_patch_png_size(png, 5000, 5000), CFG)


def test_extreme_aspect_ratio() -> None:
    data = _encode(Image.new("L", (1, 100_000), 128), "PNG")
    with pytest.raises(MediaDecodeError, match="aspect ratio"):
        decode_image(data, CFG)


def test_exif_orientation_applied() -> None:
    img = Image.new("RGB", (40, 20), (255, 0, 0))
    img.paste((0, 0, 255), (20, 0, 40, 20))  # left red, right blue
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    out = np.asarray(decode_image(_encode(img, "JPEG", exif=exif.tobytes(), quality=95), CFG))
    assert out.shape == (40, 20, 3)
    assert out[5, 10, 0] > 200 and out[5, 10, 2] < 60  # top is the former left (red)
    assert out[35, 10, 2] > 200 and out[35, 10, 0] < 60  # bottom is the former right (blue)


def _transparent(mode: str) -> bytes:
    img = Image.new("RGBA", (4, 4), (0, 0, 0, 0))
    img.putpixel((0, 0), (10, 20, 30, 255))
    if mode == "RGBA":
        return _encode(img, "PNG")
    if mode == "LA":
        return _encode(img.convert("LA"), "PNG")
    p = Image.new("P", (4, 4), 1)
    p.putpalette([10, 20, 30, 0, 0, 0] + [0] * 762)
    p.putpixel((0, 0), 0)
    return _encode(p, "PNG", transparency=1)


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P"])
def test_transparency_composited_on_white(mode: str) -> None:
    out = decode_image(_transparent(mode), CFG)
    assert out.mode == "RGB" and out.size == (4, 4)
    assert out.getpixel((3, 3)) == (255, 255, 255)
    assert out.getpixel((0, 0)) != (255, 255, 255)


@pytest.mark.parametrize(
    ("mode", "fmt"),
    [("L", "PNG"), ("P", "PNG"), ("CMYK", "JPEG"), ("CMYK", "TIFF"), ("1", "PNG"), ("I;16", "PNG")],
)
def test_modes_converted_to_rgb(mode: str, fmt: str) -> None:
    src = (
        _gradient().convert(mode) if mode != "I;16" else Image.fromarray(np.full((24, 32), 40000, np.uint16))
    )
    out = decode_image(_encode(src, fmt), CFG)
    assert out.mode == "RGB" and out.size == (32, 24)
    if mode == "I;16":
        assert out.getpixel((0, 0)) == (156, 156, 156)  # 40000 / 256, not clipped to 255


def test_animated_gif_uses_first_frame() -> None:
    frames = [Image.new("RGB", (16, 16), c) for c in ((255, 0, 0), (0, 0, 255), (0, 255, 0))]
    data = _encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    assert Image.open(io.BytesIO(data)).n_frames == 3
    out = decode_image(data, CFG)
    r, g, b = out.getpixel((8, 8))
    assert r > 200 and g < 50 and b < 50


# --- video ------------------------------------------------------------------------------------------

VIDEO_FRAMES, VIDEO_RATE = 30, 10


def _video_codec() -> str:
    return "mpeg4" if "mpeg4" in av.codecs_available else "libx264"


@pytest.fixture(scope="module")
def video() -> bytes:
    """3 s at 10 fps, 64x48; frame i is uniformly gray at level 8 * i."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream(_video_codec(), rate=VIDEO_RATE)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for i in range(VIDEO_FRAMES):
            frame = av.VideoFrame.from_ndarray(np.full((48, 64, 3), 8 * i, np.uint8), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return buf.getvalue()


def _frame_levels(frames: np.ndarray) -> list[int]:
    return [round(float(f.mean()) / 8) for f in frames]


def test_video_fps_sampling(video: bytes) -> None:
    out = decode_video(video, dataclasses.replace(CFG, video_fps=2.0))
    assert out.frames.dtype == np.uint8 and out.frames.shape == (6, 48, 64, 3)
    assert _frame_levels(out.frames) == [0, 5, 10, 15, 20, 25]
    assert out.fps == pytest.approx(2.0)
    assert out.duration_s == pytest.approx(3.0, abs=0.15)
    assert out.timestamps_s == pytest.approx((0.0, 0.5, 1.0, 1.5, 2.0, 2.5))


def test_video_uniform_sampling_and_cap(video: bytes) -> None:
    out = decode_video(video, dataclasses.replace(CFG, video_fps=None, max_video_frames=4))
    assert out.frames.shape == (4, 48, 64, 3)
    assert _frame_levels(out.frames) == [0, 10, 19, 29]
    assert out.fps == pytest.approx(3 / 2.9)
    all_frames = decode_video(video, dataclasses.replace(CFG, video_fps=None, max_video_frames=100))
    assert all_frames.frames.shape[0] == VIDEO_FRAMES and all_frames.fps == pytest.approx(VIDEO_RATE)
    capped = decode_video(video, dataclasses.replace(CFG, video_fps=10.0, max_video_frames=5))
    assert capped.frames.shape[0] == 5


def test_video_limits(video: bytes) -> None:
    with pytest.raises(MediaTooLargeError):
        decode_video(video, dataclasses.replace(CFG, max_video_seconds=1.0))
    with pytest.raises(MediaTooLargeError):
        decode_video(video, dataclasses.replace(CFG, max_image_pixels=64 * 48 - 1))
    assert load_video(MediaRef.from_bytes(video), CFG).frames.shape[0] == 6


def test_video_without_frames(wav_stereo: bytes) -> None:
    with pytest.raises(MediaDecodeError, match="no frames"):
        decode_video(wav_stereo, CFG)  # audio stream only
    buf = io.BytesIO()
    with av.open(buf, "w", format="avi") as container:
        stream = container.add_stream(_video_codec(), rate=10)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        container.start_encoding()
    with pytest.raises(MediaDecodeError, match="no frames"):
        decode_video(buf.getvalue(), CFG)
    with pytest.raises(MediaDecodeError):
        decode_video(b"\x00" * 1000, CFG)


# --- audio ------------------------------------------------------------------------------------------


def _tone(rate: int, seconds: float, channels: int) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    mono = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    return np.stack([mono] * channels, axis=1)


@pytest.fixture(scope="module")
def wav_stereo() -> bytes:
    buf = io.BytesIO()
    sf.write(buf, _tone(44_100, 1.0, 2), 44_100, format="WAV", subtype="FLOAT")
    return buf.getvalue()


def test_audio_resampled_to_16k_mono(wav_stereo: bytes) -> None:
    out = decode_audio(wav_stereo, CFG)
    assert out.dtype == np.float32 and out.ndim == 1 and out.shape == (16_000,)
    assert np.abs(out[1000:-1000]).max() == pytest.approx(0.5, abs=0.02)
    assert decode_audio(wav_stereo, CFG, sample_rate_hz=8000).shape == (8000,)
    assert load_audio(MediaRef.from_bytes(wav_stereo), CFG, sample_rate_hz=44_100).shape == (44_100,)


def test_audio_channels_averaged() -> None:
    stereo = np.zeros((16_000, 2), np.float32)
    stereo[:, 0] = 0.8
    buf = io.BytesIO()
    sf.write(buf, stereo, 16_000, format="WAV", subtype="FLOAT")
    np.testing.assert_allclose(decode_audio(buf.getvalue(), CFG), 0.4, atol=1e-6)


def test_audio_pyav_fallback_for_aac() -> None:
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("aac", rate=22_050, layout="stereo")
        samples = np.ascontiguousarray(_tone(22_050, 1.0, 2).T)
        frame = av.AudioFrame.from_ndarray(samples, format="fltp", layout="stereo")
        frame.sample_rate = 22_050
        container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    out = decode_audio(buf.getvalue(), CFG)
    assert out.dtype == np.float32 and out.ndim == 1
    assert abs(len(out) - 16_000) < 1600  # AAC priming/padding changes the length a little
    assert np.abs(out[2000:-2000]).max() == pytest.approx(0.5, abs=0.05)


def test_audio_too_long(wav_stereo: bytes) -> None:
    with pytest.raises(MediaTooLargeError):
        decode_audio(wav_stereo, dataclasses.replace(CFG, max_audio_seconds=0.5))


def test_unsupported_audio_bytes(png: bytes) -> None:
    with pytest.raises(MediaDecodeError):
        decode_audio(b"definitely not audio " * 50, CFG)
    with pytest.raises(MediaError):
        decode_audio(png, CFG)
