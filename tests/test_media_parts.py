"""Media parts as vLLM's clients send them: a `uuid` on a part (the item's identity, and a reference to an
item sent before), an image's `detail`, the request's `media_io_kwargs`, and keys of a part this server
ignores or refuses. The mechanism on the CPU (options, hashes, a reference on an empty cache), then two real
servers over HTTP: the plain monolithic one and the language-only EPD one with two encoder workers (both
shared with other modules, tests/conftest.py). Every uuid, salt and image here is this module's own, so a hit
can only come from a request of this module.
"""

from __future__ import annotations

import base64
import io
import itertools

import av
import httpx
import numpy as np
import pytest
from PIL import Image

from mmserve.config import MediaConfig
from mmserve.encoder.runner import MediaInput, MultimodalEncoder
from mmserve.models.family import load_family
from mmserve.multimodal import media_options
from mmserve.multimodal.cache import EmbeddingCache
from mmserve.multimodal.errors import MediaNotCachedError
from mmserve.multimodal.items import Modality
from mmserve.multimodal.media_options import (
    LOW_DETAIL_PIXELS,
    MAX_MEDIA_UUID_CHARS,
    low_detail,
    low_detail_size,
)
from mmserve.multimodal.messages import parse_messages
from tests.conftest import random_image
from tests.engine_helpers import png_bytes, png_uri

MAX_NEW = 6
_ids = itertools.count()


def fresh(name: str) -> str:
    """A uuid or salt no other request of the session uses."""
    return f"media-parts-{name}-{next(_ids)}"


def image_part(image: Image.Image | None, uuid: str | None = None, detail: str | None = None) -> dict:
    url = None if image is None else {"url": png_uri(image)}
    if url is not None and detail is not None:
        url["detail"] = detail
    part = {"type": "image_url", "image_url": url}
    return part if uuid is None else {**part, "uuid": uuid}


def lossless_video(frames: np.ndarray, fps: int) -> bytes:
    """FFV1 in Matroska: the server decodes exactly these RGB frames, at these times."""
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="matroska") as container:
        stream = container.add_stream("ffv1", rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "bgr0"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return buf.getvalue()


def video_part(data: bytes) -> dict:
    uri = "data:video/x-matroska;base64," + base64.b64encode(data).decode()
    return {"type": "video_url", "video_url": {"url": uri}}


def chat(url: str, parts: list[dict], text: str = "Describe.", **extra) -> httpx.Response:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}],
        "max_tokens": MAX_NEW,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120)


def ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def refused(r: httpx.Response, *names: str) -> str:
    """The 400's message, which names each of `names`."""
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert all(n in message for n in names), message
    return message


def hits(body: dict) -> int:
    return body["mmserve"]["mm_cache_hits"]


def answer(body: dict) -> str:
    return body["choices"][0]["message"]["content"]


def prompt_tokens(body: dict) -> int:
    return body["usage"]["prompt_tokens"]


def cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


# -- the mechanism, without a server ---------------------------------------------------------------------
@pytest.mark.parametrize("size", [(1024, 1024), (640, 480), (8000, 40), (513, 512), (512, 512), (30, 20)])
def test_low_detail_size_keeps_the_aspect_within_512x512_pixels(size):
    w, h = size
    lw, lh = low_detail_size(w, h)
    assert lw * lh <= LOW_DETAIL_PIXELS
    if w * h <= LOW_DETAIL_PIXELS:
        assert (lw, lh) == (w, h)
    else:
        assert abs(lw / lh - w / h) / (w / h) < 0.02  # aspect kept, up to rounding to whole pixels
        assert (lw + 1) * (lh + 1) > LOW_DETAIL_PIXELS  # the largest such size (rounded down)
    assert low_detail_size(1024, 1024) == (512, 512)
    assert low_detail(random_image(1, 1024, 768)).size == low_detail_size(1024, 768)


def test_parts_carry_uuid_and_detail_and_refuse_what_is_not_taken():
    uri = png_uri(random_image(1))
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": uri, "detail": "low"}, "uuid": "a"},
                {"type": "image_url", "image_url": None, "uuid": "b", "cache_control": {"type": "ephemeral"}},
                # `detail` beside the url object, where vLLM reads it too
                {"type": "image_url", "image_url": {"url": uri}, "detail": "high"},
                {"type": "input_audio", "input_audio": None, "uuid": "c"},
                {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}},
            ],
        }
    ]
    template, media = parse_messages(messages)
    assert [p["type"] for p in template[0]["content"]] == ["image", "image", "image", "audio", "text"]
    parts = [part for _, part in media]
    assert [(p.ref is None, p.uuid, p.options) for p in parts] == [
        (False, "a", {"detail": "low"}),
        (True, "b", {}),
        (False, None, {}),  # "high" (and "auto") keep the processor's own sizing: no option at all
        (True, "c", {}),
    ]

    def error(part: dict) -> str:
        with pytest.raises(ValueError) as e:
            parse_messages([{"role": "user", "content": [part]}])
        return str(e.value)

    assert "'url'" in error({"type": "image_url", "image_url": None})  # no media and no uuid
    assert "detail" in error({"type": "image_url", "image_url": {"url": uri, "detail": "ultra"}})
    assert "detail" in error({"type": "video_url", "video_url": {"url": uri, "detail": "low"}})
    twice = {"type": "image_url", "image_url": {"url": uri, "detail": "low"}, "detail": "low"}
    assert "give it once" in error(twice)
    for bad in ("", "x" * (MAX_MEDIA_UUID_CHARS + 1), "tab\there", 7, ["a"]):
        assert "uuid" in error({"type": "image_url", "image_url": {"url": uri}, "uuid": bad})
    assert "'min_pixels'" in error({"type": "image_url", "image_url": {"url": uri}, "min_pixels": 4})
    assert "uuid" in error({"type": "image_embeds", "image_embeds": "AAAA", "uuid": "a"})
    assert "uuid" in error({"type": "text", "text": "hi", "uuid": "a"})


def test_media_io_kwargs_are_checked_and_canonical():
    cfg = MediaConfig()  # 32 frames at most
    assert media_options.request_options(None, cfg) == {}
    opts = media_options.request_options(
        {"video": {"num_frames": 4, "fps": -1}, "image": {"rgba_background_color": [0, 0, 0]}}, cfg
    )
    assert opts == {
        Modality.VIDEO: {"num_frames": 4, "fps": None},
        Modality.IMAGE: {"rgba_background_color": [0, 0, 0]},
    }
    # Defaults are never written: such a request is the same item as one without them.
    defaults = {"video": {"num_frames": -1}, "image": {"rgba_background_color": [255, 255, 255]}}
    assert media_options.request_options(defaults, cfg) == {Modality.VIDEO: {}, Modality.IMAGE: {}}
    for bad, named in (
        ({"video": {"video_backend": "opencv"}}, "video_backend"),
        ({"video": {"num_frames": 33}}, "num_frames"),
        ({"video": {"num_frames": 0}}, "num_frames"),
        ({"video": {"num_frames": True}}, "num_frames"),
        ({"video": {"fps": 0}}, "fps"),
        ({"video": {"fps": "2"}}, "fps"),
        ({"image": {"rgba_background_color": [0, 0, 256]}}, "rgba_background_color"),
        ({"image": {"detail": "low"}}, "detail"),  # a part's own, not a request's
        ({"audio": {"sample_rate": 8000}}, "sample_rate"),
        ({"depth": {}}, "depth"),
        ({"video": 4}, "video"),
        ([1], "media_io_kwargs"),
    ):
        with pytest.raises(ValueError, match=named):
            media_options.request_options(bad, cfg)


def test_hash_identity_of_uuid_options_and_salt(tiny_qwen2_vl):
    encoder = MultimodalEncoder(load_family(tiny_qwen2_vl), None, EmbeddingCache(16), MediaConfig())
    image, video = Modality.IMAGE, Modality.VIDEO

    def h(modality=image, data=b"bytes", salt=None, options=None, uuid=None):
        return encoder.item_hash(modality, data, {}, salt, options, uuid)

    assert h() == encoder.item_hash(image, b"bytes", {})  # no options, no uuid: as before
    assert h(uuid="u") == h(data=b"other", uuid="u")  # the uuid stands for the bytes
    distinct = [
        h(),
        h(uuid="u"),
        h(uuid="v"),
        h(uuid="u", salt="a"),
        h(uuid="u", salt="b"),
        h(uuid="u", options={"detail": "low"}),
        h(options={"detail": "low"}),
        h(options={"rgba_background_color": [0, 0, 0]}),
    ]
    assert len(set(distinct)) == len(distinct)
    assert h(options={"detail": "high"}) == h()
    # Video options hash as the sampling they give: the server's own cap is the same item.
    assert h(video, options={"num_frames": 32}) == h(video) != h(video, options={"num_frames": 4})
    assert h(video, options={"fps": 2.0}) == h(video) != h(video, options={"fps": None})


def test_a_uuid_reference_on_an_empty_cache_is_refused_and_not_cached(tiny_qwen2_vl):
    encoder = MultimodalEncoder(load_family(tiny_qwen2_vl), None, EmbeddingCache(16), MediaConfig())
    with pytest.raises(MediaNotCachedError, match="'nowhere'.*send the media"):
        encoder.encode(MediaInput(Modality.IMAGE, None, {}, None, "nowhere"))
    assert len(encoder.cache) == 0 and encoder.cache.stats.queries == 1


def test_background_color_composites_transparent_pixels():
    rgba = Image.new("RGBA", (8, 8), (10, 20, 30, 0))  # fully transparent
    data, cfg = png_bytes(rgba), MediaConfig()
    white = media_options.decode(None, Modality.IMAGE, data, {}, cfg, {})
    black = media_options.decode(None, Modality.IMAGE, data, {}, cfg, {"rgba_background_color": [0, 0, 0]})
    assert white.getpixel((0, 0)) == (255, 255, 255) and black.getpixel((0, 0)) == (0, 0, 0)


# -- real servers ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def servers(shared_server_process, shared_secured_epd_process):
    """The plain monolithic server and the language-only EPD one (two encoder workers, no tower of its own: a
    reference must reach the encoder that cached the item), started side by side."""
    plain, epd = shared_server_process.get_beside(shared_secured_epd_process.get)
    return {"plain": plain.url, "epd": epd.url}


@pytest.mark.parametrize("mode", ["plain", "epd"])
def test_uuid_keys_the_cache_and_a_reference_gives_the_same_tokens(servers, mode):
    url, uuid = servers[mode], fresh("uuid")
    image = random_image(9101 if mode == "plain" else 9102)
    plain = ok(chat(url, [image_part(image)]))  # its content hash: no uuid
    first = ok(chat(url, [image_part(image, uuid)]))
    again = ok(chat(url, [image_part(image, uuid)]))
    reference = ok(chat(url, [image_part(None, uuid)]))
    assert [hits(b) for b in (first, again, reference)] == [0, 1, 1]  # the uuid, not the bytes, is the key
    assert cached(reference) == prompt_tokens(reference) - 1  # pad values from the uuid: the same prefix
    assert answer(reference) == answer(first) == answer(plain)
    assert prompt_tokens(reference) == prompt_tokens(plain)
    if mode == "epd":
        assert "127.0.0.1" in reference["mmserve"]["encoded_by"]  # the encoder that holds it answered
    # Other forms of "no media" refer too (vLLM's): a url object without a url, an empty url.
    for media in ({}, {"url": ""}):
        assert answer(ok(chat(url, [{"type": "image_url", "image_url": media, "uuid": uuid}]))) == answer(
            first
        )
    # The caller vouches for the uuid: other bytes under it get the cached item (vLLM's semantics).
    assert answer(ok(chat(url, [image_part(random_image(9103), uuid)]))) == answer(first)

    unknown = fresh("unknown")
    refused(chat(url, [image_part(None, unknown)]), "image", unknown, "send the media")
    # Settings are part of the identity: the item referred to with another detail is another item.
    refused(chat(url, [{"type": "image_url", "image_url": {"detail": "low"}, "uuid": uuid}]), uuid)


def test_a_tenant_cannot_refer_to_another_tenants_uuid(servers):
    url, uuid, a = servers["plain"], fresh("tenant"), fresh("salt-a")
    first = ok(chat(url, [image_part(random_image(9111), uuid)], cache_salt=a))
    refused(chat(url, [image_part(None, uuid)], cache_salt=fresh("salt-b")), uuid)
    refused(chat(url, [image_part(None, uuid)]), uuid)  # unsalted neither
    same = ok(chat(url, [image_part(None, uuid)], cache_salt=a))
    assert hits(same) == 1 and answer(same) == answer(first)


def test_epd_tenants_and_bad_uuids(servers):
    url, uuid, a = servers["epd"], fresh("epd-tenant"), fresh("salt-a")
    ok(chat(url, [image_part(random_image(9121), uuid)], cache_salt=a))
    refused(chat(url, [image_part(None, uuid)], cache_salt=fresh("salt-b")), uuid)
    assert hits(ok(chat(url, [image_part(None, uuid)], cache_salt=a))) == 1
    for bad in ("", "x" * (MAX_MEDIA_UUID_CHARS + 1), "line\nbreak", 5):
        refused(chat(url, [image_part(random_image(9121), bad)]), "uuid")


def test_detail_low_is_its_own_item_and_equals_the_downscaled_image(servers):
    url = servers["plain"]
    image = random_image(9131, 640, 480)  # 307200 pixels: low gives 591x443
    auto = ok(chat(url, [image_part(image, detail="auto")]))
    low = ok(chat(url, [image_part(image, detail="low")]))
    low_again = ok(chat(url, [image_part(image, detail="low")]))
    high = ok(chat(url, [image_part(image, detail="high")]))
    assert [hits(b) for b in (auto, low, low_again, high)] == [0, 0, 1, 1]  # low and auto never share
    assert prompt_tokens(low) < prompt_tokens(auto)
    # Exactly what the client gets by downscaling itself and sending that with "auto".
    downscaled = ok(chat(url, [image_part(low_detail(image))]))
    assert hits(downscaled) == 0  # other bytes: another item, computed apart
    assert (answer(downscaled), prompt_tokens(downscaled)) == (answer(low), prompt_tokens(low))
    refused(chat(url, [image_part(image, detail="medium")]), "detail", "medium")
    # /tokenize counts the item as the engine expands it; a reference it cannot count.
    messages = [
        {"role": "user", "content": [image_part(image, detail="low"), {"type": "text", "text": "Describe."}]}
    ]
    counted = httpx.post(url + "/tokenize", json={"model": "tiny", "messages": messages}, timeout=60)
    assert counted.status_code == 200 and counted.json()["count"] == prompt_tokens(low), counted.text
    messages[0]["content"][0] = image_part(None, fresh("count"))
    refused(httpx.post(url + "/tokenize", json={"model": "tiny", "messages": messages}, timeout=60), "uuid")


def test_detail_low_over_epd_matches_monolithic(servers):
    image = random_image(9141, 640, 480)
    epd = ok(chat(servers["epd"], [image_part(image, detail="low")]))
    plain = ok(chat(servers["plain"], [image_part(image, detail="low")]))
    assert (answer(epd), prompt_tokens(epd)) == (answer(plain), prompt_tokens(plain))


@pytest.fixture(scope="module")
def clip():
    """Nine frames at 2 fps (0, 0.5, ..., 4 s), and the five of them at whole seconds as a 1 fps clip."""
    frames = (np.random.RandomState(9151).rand(9, 48, 64, 3) * 255).astype("uint8")
    return lossless_video(frames, 2), lossless_video(frames[::2], 1)


def test_num_frames_samples_the_video_as_the_same_frames_sent_otherwise(servers, clip):
    url, (video, five) = servers["plain"], clip
    default = ok(chat(url, [video_part(video)]))
    sampled = ok(chat(url, [video_part(video)], media_io_kwargs={"video": {"num_frames": 5}}))
    again = ok(chat(url, [video_part(video)], media_io_kwargs={"video": {"num_frames": 5}}))
    cap = ok(chat(url, [video_part(video)], media_io_kwargs={"video": {"num_frames": 32}}))  # the server's
    assert [hits(b) for b in (default, sampled, again, cap)] == [0, 0, 1, 1]
    assert prompt_tokens(sampled) < prompt_tokens(default)
    # Frames 0, 2, 4, 6, 8 at 1 s apart: the 1 fps clip of those frames is the same item's input.
    sent = ok(chat(url, [video_part(five)]))
    assert (answer(sent), prompt_tokens(sent)) == (answer(sampled), prompt_tokens(sampled))
    by_rate = ok(chat(url, [video_part(video)], media_io_kwargs={"video": {"fps": 1}}))
    assert (answer(by_rate), prompt_tokens(by_rate)) == (answer(sampled), prompt_tokens(sampled))
    for kwargs, named in (
        ({"video": {"video_backend": "opencv"}}, "video_backend"),
        ({"video": {"num_frames": 33}}, "num_frames"),
        ({"image": {"rgba_background_color": "black"}}, "rgba_background_color"),
        ({"depth": {}}, "depth"),
    ):
        refused(chat(url, [video_part(video)], media_io_kwargs=kwargs), "media_io_kwargs", named)


def test_part_keys_ignored_or_refused_as_documented(servers):
    url, image = servers["plain"], random_image(9161)
    plain = ok(chat(url, [image_part(image)]))
    hinted = ok(chat(url, [{**image_part(image), "cache_control": {"type": "ephemeral"}}]))
    assert answer(hinted) == answer(plain)
    refused(chat(url, [{**image_part(image), "min_pixels": 3136}]), "min_pixels")
