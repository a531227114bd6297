"""Precomputed embeddings as input (`--enable-mm-embeds`): the same image as pixels and as its embedding gives
the same greedy tokens (real servers, monolithic and EPD, mixed requests; the offline LLM for families with
extras and metadata), and every malformed part is refused before admission with a 400 (413 over the size cap)
naming the problem, the server staying healthy."""

from __future__ import annotations

import base64
import functools

import httpx
import pytest
import torch
from safetensors.torch import save

from mmserve.config import MediaConfig
from mmserve.encoder.runner import MediaInput, build_encoder
from mmserve.llm import LLM
from mmserve.models.family import load_family
from mmserve.multimodal import precomputed
from mmserve.multimodal.items import Modality
from mmserve.multimodal.media import MediaRef
from mmserve.sampling_params import SamplingParams
from mmserve.testing.server_process import start_server
from tests.conftest import random_image
from tests.engine_helpers import mp4_bytes, png_bytes, png_uri, wav_bytes

MAX_NEW = 8
MAX_MEDIA_MB = 1
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


# -- fixtures ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def servers(shared_server_process, tiny_qwen2_vl, tmp_path_factory):
    """Two real tiny Qwen2-VL servers.

    "on": --enable-mm-embeds, one encoder worker, and --encoder-dispatch-min-items 2, so one server runs both
    paths: a request with one item to encode is encoded by the engine itself (monolithic), one with two or
    more goes to the encoder (EPD); `encoded_by` in each answer tells which. "off": without the flag (the
    plain server shared with other modules, tests/conftest.py), started beside "on" if it is not up yet.
    """
    logs = str(tmp_path_factory.mktemp("logs"))
    on = (
        *("--kv-cache-mb", "16", "--max-media-mb", str(MAX_MEDIA_MB)),
        *("--enable-mm-embeds", "--limit-mm-per-prompt", '{"image": 3, "video": 1}'),
        *("--encoder-workers", "1", "--encoder-dispatch-min-items", "2"),
    )
    off, handle = shared_server_process.get_beside(
        functools.partial(start_server, tiny_qwen2_vl, *on, log_dir=logs)
    )
    yield {"on": handle, "off": off}
    assert handle.stop() == 0


@pytest.fixture(scope="module")
def qwen2_vl_encoder(tiny_qwen2_vl):
    """mmserve's own encoder for the tiny Qwen2-VL, in this process: the source of the precomputed parts."""
    family = load_family(tiny_qwen2_vl)
    encoder = build_encoder(family, "float32", "cpu", 64, MediaConfig())
    yield family, encoder
    encoder.close()


@pytest.fixture(scope="module")
def embeds(qwen2_vl_encoder):
    """seed -> the precomputed content part of `random_image(seed)`."""
    family, encoder = qwen2_vl_encoder

    def part(seed: int) -> dict:
        data = png_bytes(random_image(seed))
        return precomputed.content_part(
            family, encoder.encode(MediaInput(Modality.IMAGE, MediaRef.from_bytes(data)))
        )

    return part


def pixels(seed: int) -> dict:
    return {"type": "image_url", "image_url": {"url": png_uri(random_image(seed))}}


def chat(url: str, parts: list[dict], **extra) -> httpx.Response:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "Describe it."}]}],
        "max_tokens": MAX_NEW,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60)


def content(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def encoded_by(r: httpx.Response) -> str:
    return r.json()["mmserve"]["encoded_by"]


IN_PROCESS = "engine (in-process)"


# -- parity through real servers ---------------------------------------------------------------------------
def test_pixels_and_precomputed_give_the_same_tokens(servers, embeds):
    url = servers["on"].url
    from_pixels = chat(url, [pixels(1)])
    first, again = chat(url, [embeds(1)]), chat(url, [embeds(1)])
    assert content(first) == content(from_pixels) == content(again)
    assert encoded_by(from_pixels) == IN_PROCESS  # monolithic: one item to encode
    assert first.json()["usage"]["prompt_tokens"] == from_pixels.json()["usage"]["prompt_tokens"]
    # The content hash covers the embedding's bytes: a repeated embedding reuses the prefix cache.
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_mixed_request_monolithic(servers, embeds):
    url = servers["on"].url
    expected = content(chat(url, [pixels(2), pixels(3)]))
    mixed = chat(url, [pixels(2), embeds(3)])
    assert content(mixed) == expected and encoded_by(mixed) == IN_PROCESS
    assert content(chat(url, [embeds(2), pixels(3)])) == expected


def test_mixed_request_epd_sends_only_pixel_items_to_the_encoder(servers, embeds):
    """Parts index only the items still to encode (here prompt items 0 and 2); a precomputed item sent to an
    encoder would fail (it has no URL), one misplaced would change the tokens."""
    url = servers["on"].url
    all_pixels = chat(url, [pixels(4), pixels(5), pixels(6)])
    mixed = chat(url, [pixels(4), embeds(5), pixels(6)])
    assert content(mixed) == content(all_pixels)
    assert "http://127.0.0.1" in encoded_by(mixed) and "http://127.0.0.1" in encoded_by(all_pixels)
    assert content(chat(url, [embeds(4), embeds(5), embeds(6)])) == content(all_pixels)


def test_flag_off_refuses_precomputed_parts(servers, embeds):
    r = chat(servers["off"].url, [embeds(7)])
    assert r.status_code == 400
    assert "--enable-mm-embeds" in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "embeds_disabled"


# -- malformed parts: 400 before admission, naming the problem --------------------------------------------
GRID = torch.tensor([1, 4, 4])  # the tiny Qwen2-VL: 4 merged rows of 64
ROWS = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))


def blob(**tensors) -> str:
    return base64.b64encode(
        save({k.replace("__", "."): v.contiguous().clone() for k, v in tensors.items()})
    ).decode()


def with_value(index: tuple, value: float) -> torch.Tensor:
    rows = ROWS.clone()
    rows[index] = value
    return rows


def image_embeds(value) -> dict:
    return {"type": "image_embeds", "image_embeds": value}


MALFORMED = {
    "bad_base64": (image_embeds("@@ not base64 @@"), 400, "not valid base64"),
    "not_safetensors": (
        image_embeds(base64.b64encode(b"\x00 hello" * 16).decode()),
        400,
        "not a safetensors",
    ),
    "not_a_string": (image_embeds(12345), 400, "base64 string"),
    "empty_string": (image_embeds(""), 400, "base64 string"),
    "no_tensors": (image_embeds(blob()), 400, "holds no tensors"),
    "missing_embeds": (image_embeds(blob(image_grid_thw=GRID)), 400, "no 'image_embeds' tensor"),
    "wrong_rank": (image_embeds(blob(image_embeds=ROWS[None], image_grid_thw=GRID)), 400, "(1, 4, 64)"),
    "int_dtype": (image_embeds(blob(image_embeds=ROWS.int(), image_grid_thw=GRID)), 400, "must be float32"),
    "float64": (image_embeds(blob(image_embeds=ROWS.double(), image_grid_thw=GRID)), 400, "torch.float64"),
    "hidden_size": (image_embeds(blob(image_embeds=ROWS[:, :32], image_grid_thw=GRID)), 400, "(rows, 64)"),
    "row_count": (image_embeds(blob(image_embeds=ROWS[:3], image_grid_thw=GRID)), 400, "3 rows"),
    "zero_rows": (image_embeds(blob(image_embeds=ROWS[:0], image_grid_thw=GRID)), 400, "no rows"),
    "nan": (
        image_embeds(blob(image_embeds=with_value((1, 2), float("nan")), image_grid_thw=GRID)),
        400,
        "NaN or Inf",
    ),
    "inf": (
        image_embeds(blob(image_embeds=with_value((3, 0), float("inf")), image_grid_thw=GRID)),
        400,
        "NaN or Inf",
    ),
    "missing_grid": (image_embeds(blob(image_embeds=ROWS)), 400, "no 'image_grid_thw' tensor"),
    "zero_grid": (
        image_embeds(blob(image_embeds=ROWS, image_grid_thw=torch.tensor([1, 0, 4]))),
        400,
        "[1, 0, 4]; every value must be",
    ),
    "negative_grid": (
        image_embeds(blob(image_embeds=ROWS, image_grid_thw=torch.tensor([1, -4, -4]))),
        400,
        "every value must be",
    ),
    "grid_length": (
        image_embeds(blob(image_embeds=ROWS, image_grid_thw=torch.tensor([4, 4]))),
        400,
        "must hold 3 integer(s)",
    ),
    "grid_floats": (
        image_embeds(blob(image_embeds=ROWS, image_grid_thw=GRID.float())),
        400,
        "must hold integers",
    ),
    "grid_not_mergeable": (
        image_embeds(blob(image_embeds=ROWS, image_grid_thw=torch.tensor([1, 3, 4]))),
        400,
        "multiples of 2",
    ),
    "image_with_frames": (
        image_embeds(blob(image_embeds=ROWS, image_grid_thw=torch.tensor([2, 4, 4]))),
        400,
        "an image has t = 1",
    ),
    "unexpected_extra": (
        image_embeds(blob(image_embeds=ROWS, image_grid_thw=GRID, deepstack__0=ROWS)),
        400,
        "unexpected tensor(s) ['deepstack.0']",
    ),
    "video_without_its_grid": (
        {"type": "video_embeds", "video_embeds": blob(video_embeds=ROWS, image_grid_thw=GRID)},
        400,
        "no 'video_grid_thw' tensor",
    ),
    "over_size": (image_embeds("A" * (MAX_MEDIA_MB * 2**20 * 4 // 3 + 8)), 413, "(--max-media-mb)"),
    "modality_not_taken": (
        {"type": "audio_embeds", "audio_embeds": blob(audio_embeds=ROWS)},
        400,
        "takes no audio input",
    ),
    "unknown_part_key": (
        {**image_embeds(blob(image_embeds=ROWS, image_grid_thw=GRID)), "grid": [1, 4, 4]},
        400,
        "'grid' not supported",
    ),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_part_is_refused_naming_the_problem(servers, name):
    part, status, fragment = MALFORMED[name]
    r = chat(servers["on"].url, [part])
    assert r.status_code == status, r.text
    message = r.json()["error"]["message"]
    assert fragment in message
    if r.json()["error"]["code"] in ("invalid_embeds", "media_too_large"):
        assert message.startswith("messages[0].content[0] (")  # names the part


def test_too_many_precomputed_items_count_against_the_limit(servers):
    part = image_embeds(blob(image_embeds=ROWS, image_grid_thw=GRID))
    r = chat(servers["on"].url, [part] * 4)
    assert r.status_code == 400 and "--limit-mm-per-prompt" in r.json()["error"]["message"]


def test_server_stays_healthy_after_malformed_parts(servers):
    url = servers["on"].url
    health = httpx.get(url + "/health", params={"check_integrity": "true"}, timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok", health.text
    # A well-formed hand-made part (random rows) is admitted and generates.
    r = chat(url, [image_embeds(blob(image_embeds=ROWS.half(), image_grid_thw=GRID[None]))])
    assert r.json()["usage"]["completion_tokens"] == MAX_NEW, r.text


# -- families with extras and metadata: the offline LLM -----------------------------------------------------
FAMILY_MEDIA = {
    "qwen3_vl": [(Modality.IMAGE, png_bytes(random_image(7))), (Modality.VIDEO, mp4_bytes(8))],
    "llava_onevision": [(Modality.IMAGE, png_bytes(random_image(9, 80, 40)))],
    "qwen2_audio": [(Modality.AUDIO, wav_bytes(10, 0.8))],
    "gemma3": [(Modality.IMAGE, png_bytes(random_image(9, 80, 40)))],
    "idefics3": [(Modality.IMAGE, png_bytes(random_image(9, 80, 40)))],
    "smolvlm": [(Modality.IMAGE, png_bytes(random_image(9, 80, 40))), (Modality.VIDEO, mp4_bytes(8))],
    "internvl": [(Modality.IMAGE, png_bytes(random_image(9, 80, 40))), (Modality.VIDEO, mp4_bytes(8))],
    "mistral3": [(Modality.IMAGE, png_bytes(random_image(9, 80, 40)))],
    "glm4v": [(Modality.IMAGE, png_bytes(random_image(7))), (Modality.VIDEO, mp4_bytes(8))],
    "minicpmv4_6": [(Modality.IMAGE, png_bytes(random_image(9, 80, 40))), (Modality.VIDEO, mp4_bytes(8))],
    "gemma4": [
        (Modality.IMAGE, png_bytes(random_image(7))),
        (Modality.VIDEO, mp4_bytes(8)),
        (Modality.AUDIO, wav_bytes(10, 0.8)),
    ],
    "qwen2_5_omni": [
        (Modality.IMAGE, png_bytes(random_image(7))),
        (Modality.VIDEO, mp4_bytes(8)),
        (Modality.AUDIO, wav_bytes(10, 0.8)),
    ],
    "qwen3_omni_moe": [
        (Modality.IMAGE, png_bytes(random_image(7))),
        (Modality.VIDEO, mp4_bytes(8)),
        (Modality.AUDIO, wav_bytes(10, 0.8)),
    ],
}
URL_PARTS = {
    Modality.IMAGE: ("image_url", "image/png"),
    Modality.VIDEO: ("video_url", "video/mp4"),
    Modality.AUDIO: ("audio_url", "audio/wav"),
}


def conversation(parts: list[dict]) -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "What is it?"}]}]


@pytest.mark.parametrize("arch", list(FAMILY_MEDIA))
def test_llm_pixels_and_precomputed_give_the_same_tokens(tiny_model, arch):
    llm = LLM(tiny_model(arch), kv_cache_mb=16)
    media = FAMILY_MEDIA[arch]
    pixel_parts = []
    for modality, data in media:
        kind, mime = URL_PARTS[modality]
        pixel_parts.append(
            {"type": kind, kind: {"url": f"data:{mime};base64,{base64.b64encode(data).decode()}"}}
        )
    items, _ = llm.encode([(modality, MediaRef.from_bytes(data)) for modality, data in media])
    embeds_parts = [precomputed.content_part(llm.engine.family, item) for item in items]
    from_pixels, from_embeds = llm.chat([conversation(pixel_parts), conversation(embeds_parts)], GREEDY)
    assert from_embeds.token_ids == from_pixels.token_ids and len(from_pixels.token_ids) == MAX_NEW
    # Other pad values (the hash of the embedding, not of the media bytes), the same expanded length.
    assert from_embeds.prompt_token_ids != from_pixels.prompt_token_ids
    assert len(from_embeds.prompt_token_ids) == len(from_pixels.prompt_token_ids)
    llm.check_integrity()


# -- the family checks of extras and metadata -------------------------------------------------------------
@pytest.fixture(scope="module")
def family_items(tiny_model):
    """(arch, modality) -> (family, mmserve's own embedding of a seeded item), computed once."""
    built = {}

    def get(arch: str, modality: Modality, settings: dict):
        if (arch, modality) not in built:
            family = load_family(tiny_model(arch))
            encoder = build_encoder(family, "float32", "cpu", 16, MediaConfig())
            try:
                ref = MediaRef.from_bytes(MEDIA_OF[modality]())
                built[arch, modality] = family, encoder.encode(MediaInput(modality, ref, settings))
            finally:
                encoder.close()
        return built[arch, modality]

    return get


def rebuilt(family, item, settings, edit) -> None:
    """build_item on `item`'s content part after `edit(tensors)`."""
    from safetensors.torch import load

    part = precomputed.content_part(family, item)
    tensors = load(base64.b64decode(part[part["type"]]))
    edit(tensors)
    ref = precomputed.EmbedsRef(base64.b64encode(save(tensors)).decode(), "part")
    precomputed.build_item(family, item.modality, ref, settings, 2**24)


def _set(name, value):
    return lambda t: t.__setitem__(name, value(t) if callable(value) else value)


BAD_FAMILY_FIELDS = {
    # Qwen3-VL: DeepStack levels are required, row-aligned, of the main dtype; video timestamps per grid step.
    "deepstack_missing": ("qwen3_vl", Modality.IMAGE, lambda t: t.pop("deepstack.1"), "no 'deepstack.1'"),
    "deepstack_misaligned": (
        "qwen3_vl",
        Modality.IMAGE,
        _set("deepstack.0", lambda t: t["deepstack.0"][:-1]),
        "extras must match 'image_embeds'",
    ),
    "deepstack_dtype": (
        "qwen3_vl",
        Modality.IMAGE,
        _set("deepstack.0", lambda t: t["deepstack.0"].half()),
        "extras must match",
    ),
    "timestamps_count": (
        "qwen3_vl",
        Modality.VIDEO,
        _set("video_timestamps", torch.tensor([0.5])),
        "must hold 2 float(s)",
    ),
    "timestamps_nan": (
        "qwen3_vl",
        Modality.VIDEO,
        _set("video_timestamps", torch.tensor([0.5, float("nan")])),
        "NaN or Inf",
    ),
    # LLaVA-OneVision: the original size decides the anyres grid, hence the rows.
    "image_sizes_missing": (
        "llava_onevision",
        Modality.IMAGE,
        lambda t: t.pop("image_sizes"),
        "no 'image_sizes'",
    ),
    "image_sizes_other_grid": (
        "llava_onevision",
        Modality.IMAGE,
        _set("image_sizes", torch.tensor([30, 200])),
        "rows; its metadata needs",
    ),
    "video_rows": (
        "llava_onevision",
        Modality.VIDEO,
        _set("video_embeds", lambda t: t["video_embeds"][:-2]),
        "a video has frames x",
    ),
    # Qwen2-Audio: valid mel frames within the window, and the rows they imply.
    "audio_lengths_missing": (
        "qwen2_audio",
        Modality.AUDIO,
        lambda t: t.pop("audio_feature_lengths"),
        "no 'audio_feature_lengths'",
    ),
    "audio_beyond_window": (
        "qwen2_audio",
        Modality.AUDIO,
        _set("audio_feature_lengths", torch.tensor([10**6])),
        "this model takes 3 to",
    ),
    "audio_rows": (
        "qwen2_audio",
        Modality.AUDIO,
        _set("audio_feature_lengths", lambda t: t["audio_feature_lengths"] * 2),
        "rows; its metadata needs",
    ),
    # Qwen2.5-Omni: audio frames within its 4 s window; a video's grid step in (0, 3600] s.
    "omni_audio_beyond_window": (
        "qwen2_5_omni",
        Modality.AUDIO,
        _set("audio_feature_lengths", torch.tensor([10**6])),
        "this model takes 3 to",
    ),
    "omni_video_seconds": (
        "qwen2_5_omni",
        Modality.VIDEO,
        _set("second_per_grid_t", torch.tensor([0.0])),
        "must be in (0, 3600]",
    ),
    # Gemma 3: rows are whole tiles; Gemma 4: a video's timestamps, one per frame, its rows split among them.
    "gemma3_rows": ("gemma3", Modality.IMAGE, _set("image_embeds", lambda t: t["image_embeds"][:-3]), "rows"),
    "gemma4_frames": (
        "gemma4",
        Modality.VIDEO,
        _set("num_frames_per_video", torch.tensor([5])),
        "cannot have",
    ),
    "gemma4_timestamps": (
        "gemma4",
        Modality.VIDEO,
        _set("video_timestamps", torch.tensor([0.5])),
        "must hold 4 float(s)",
    ),
    # GLM-4.1V: the grid's h and w in whole merge blocks; a video's time per temporal patch (written as text).
    "glm4v_grid": ("glm4v", Modality.IMAGE, _set("image_grid_thw", torch.tensor([1, 6, 7])), "multiples of 2"),
    "glm4v_timestamps": (
        "glm4v",
        Modality.VIDEO,
        _set("video_timestamps", torch.tensor([0.5])),
        "must hold 2 float(s)",
    ),
    # Idefics3 / SmolVLM: an image's tile grid (`rows` x `cols` + the global image); a video's frame times.
    "idefics3_cols_missing": ("idefics3", Modality.IMAGE, lambda t: t.pop("cols"), "no 'cols'"),
    "idefics3_other_grid": ("idefics3", Modality.IMAGE, _set("rows", torch.tensor([1])), "are not"),
    "smolvlm_timestamps": (
        "smolvlm",
        Modality.VIDEO,
        _set("video_timestamps", torch.tensor([0.5])),
        "must hold 3 float(s)",
    ),
    # Mistral 3: the resized image's sides, multiples of patch x merge (16), decide rows x (cols + breaks).
    "mistral3_sizes_missing": ("mistral3", Modality.IMAGE, lambda t: t.pop("image_sizes"), "no 'image_sizes'"),
    "mistral3_sizes_off_grid": ("mistral3", Modality.IMAGE, _set("image_sizes", torch.tensor([40, 64])), "of 16"),
    # MiniCPM-V 4.6: a frame's decoded size decides its slices, hence its rows (a video: frames x those).
    "minicpmv4_6_sizes_missing": ("minicpmv4_6", Modality.IMAGE, lambda t: t.pop("image_sizes"), "no 'image_sizes'"),
    "minicpmv4_6_other_slices": (
        "minicpmv4_6",
        Modality.IMAGE,
        _set("image_sizes", torch.tensor([200, 30])),
        "the image of 200 x 30 pixels makes",
    ),
    "minicpmv4_6_video_rows": (
        "minicpmv4_6",
        Modality.VIDEO,
        _set("video_embeds", lambda t: t["video_embeds"][:-2]),
        "(a video: frames x those)",
    ),
    "mistral3_sizes_other_grid": (
        "mistral3",
        Modality.IMAGE,
        _set("image_sizes", torch.tensor([64, 64])),
        "rows; its metadata needs",
    ),
}
MEDIA_OF = {
    Modality.IMAGE: lambda: png_bytes(random_image(11)),
    Modality.VIDEO: lambda: mp4_bytes(12),
    Modality.AUDIO: lambda: wav_bytes(13, 0.6),
}


@pytest.mark.parametrize("name", list(BAD_FAMILY_FIELDS))
def test_family_fields_are_checked(family_items, name):
    arch, modality, edit, fragment = BAD_FAMILY_FIELDS[name]
    settings = {"anyres": True} if arch == "llava_onevision" and modality == Modality.IMAGE else {}
    family, item = family_items(arch, modality, settings)
    rebuilt(family, item, settings, lambda t: None)  # the untouched part is accepted
    with pytest.raises(precomputed.InvalidEmbedsError, match="part") as e:
        rebuilt(family, item, settings, edit)
    assert fragment in str(e.value)
