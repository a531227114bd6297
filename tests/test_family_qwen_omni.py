"""Qwen2.5-Omni and Qwen3-Omni thinkers: preprocessing and expansion equal HF's own `Qwen2_5OmniProcessor` /
`Qwen3OmniMoeProcessor`, TMRoPE positions equal transformers' `get_rope_index` (image, audio, video,
audio-in-video), audio-in-video greedy tokens equal the thinker's `generate` (fp32), one identity for a video with
its audio track, malformed combinations refused, the request-level switch over HTTP, and the negative control:
the audio shifted by one chunk must change the tokens.

The tiny models' audio window is 4 s. The audio-in-video clip: 8 frames at 2 fps (4 temporal grid steps of 1 s)
with ~3.6 s of noise. Qwen2.5-Omni: grid steps 25 position ids apart, two 2-second chunks of video, 90 audio tokens
in chunks of 50 and 40. Qwen3-Omni: grid steps 13 ids apart, 47 audio tokens (13 a second), merged row by row by
time.
"""

from __future__ import annotations

import base64
import io
import json

import av
import httpx
import numpy as np
import pytest
import torch

from mmserve import LLM, SamplingParams
from mmserve.config import MediaConfig
from mmserve.encoder.runner import MediaInput
from mmserve.models import qwen_omni
from mmserve.models.family import load_family
from mmserve.multimodal.errors import MediaDecodeError
from mmserve.multimodal.items import Modality, MultimodalItem
from mmserve.multimodal.media import MediaRef, decode_video
from mmserve.multimodal.messages import parse_messages
from mmserve.testing.reference import HFReference
from tests.engine_helpers import audio_case, image_case, mp4_bytes, video_case
from tests.families import FAMILIES

pytestmark = pytest.mark.timeout(180)

RATE = 16_000
MAX_NEW = 8
AV = {qwen_omni.AUDIO_IN_VIDEO: True}


def av_mp4(seed: int, audio_seed: int | None = None, frames: int = 8, seconds: float = 3.5) -> bytes:
    """An mp4 with `frames` random frames at 2 fps and `seconds` of noise (drawn from `audio_seed`) as AAC."""
    rng = np.random.RandomState(seed)
    noise = np.random.RandomState(seed if audio_seed is None else audio_seed + 1000)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        video = container.add_stream("mpeg4", rate=2)
        video.width, video.height, video.pix_fmt = 64, 48, "yuv420p"
        audio = container.add_stream("aac", rate=RATE)
        audio.layout = "mono"
        for _ in range(frames):
            image = (rng.rand(48, 64, 3) * 255).astype("uint8")
            container.mux(video.encode(av.VideoFrame.from_ndarray(image, format="rgb24")))
        container.mux(video.encode())
        samples = (noise.randn(int(seconds * RATE)) * 0.3).astype(np.float32)
        for start in range(0, len(samples), 1024):
            frame = av.AudioFrame.from_ndarray(
                samples[None, start : start + 1024], format="fltp", layout="mono"
            )
            frame.sample_rate = RATE
            container.mux(audio.encode(frame))
        container.mux(audio.encode())
    return buf.getvalue()


def video_messages(data: bytes, text: str = "What happens?") -> list[dict]:
    uri = "data:video/mp4;base64," + base64.b64encode(data).decode()
    return [
        {
            "role": "user",
            "content": [{"type": "video_url", "video_url": {"url": uri}}, {"type": "text", "text": text}],
        }
    ]


AV_CLIP = av_mp4(0)


ARCHS = ("qwen2_5_omni", "qwen3_omni_moe")


@pytest.fixture(scope="module", params=ARCHS)
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def family(tiny_model, arch):
    return load_family(tiny_model(arch), mm_processor_kwargs=FAMILIES[arch].mm_kwargs)


@pytest.fixture(scope="module")
def ref(references, arch) -> HFReference:
    return references(arch)  # the session's oracle, with tests/families.py's settings


@pytest.fixture(scope="module")
def llm(tiny_model, arch):
    return LLM(tiny_model(arch), kv_cache_mb=8, mm_processor_kwargs={**FAMILIES[arch].mm_kwargs, **AV})


def decoded_av(data: bytes = AV_CLIP):
    return decode_video(data, MediaConfig(), RATE)


def hf_inputs(ref: HFReference, messages: list, media: list, audio_in_video: bool = False):
    """HF's processor on a conversation; with `audio_in_video` every video's audio track goes with it."""
    if not audio_in_video:
        return ref.inputs(parse_messages(messages)[0], media)
    template = parse_messages(messages)[0]
    text = ref.tokenizer.apply_chat_template(template, add_generation_prompt=True, tokenize=False)
    videos = [m for mod, m in media if mod == Modality.VIDEO]
    ref.processor.video_processor.videos = videos
    return ref.processor(
        text=[text], videos=[v.frames for v in videos], audio=[v.audio for v in videos],
        audio_from_video_indices=list(range(len(videos))), use_audio_in_video=True, return_tensors="pt",
    )  # fmt: skip


def ours(family, messages: list, media: list, settings: dict | None = None):
    """Our expansion and positions of a conversation (pad values from the item index)."""
    template = parse_messages(messages)[0]
    text = family.tokenizer.apply_chat_template(template, add_generation_prompt=True, tokenize=False)
    ids = family.tokenizer(text, add_special_tokens=False)["input_ids"]
    processed = [
        family.process(mod, m, settings if mod == Modality.VIDEO and settings else {}) for mod, m in media
    ]
    items = [
        MultimodalItem(p.modality, bytes([i + 1]) * 16, p.num_tokens, p.metadata)
        for i, p in enumerate(processed)
    ]
    return processed, family.expand(ids, items)


def hf_positions(ref: HFReference, inputs, audio_in_video: bool = False) -> tuple[list, int]:
    mask = inputs.get("feature_attention_mask")
    seconds = inputs.get("video_second_per_grid")
    positions, delta = ref.model.model.get_rope_index(
        inputs["input_ids"], image_grid_thw=inputs.get("image_grid_thw"), video_grid_thw=inputs.get("video_grid_thw"),
        attention_mask=inputs["attention_mask"], use_audio_in_video=audio_in_video,
        audio_seqlens=None if mask is None else mask.sum(-1),
        second_per_grids=None if seconds is None else torch.as_tensor(seconds),
    )  # fmt: skip
    assert torch.equal(positions, positions.round())  # Qwen3-Omni's are floats: whole numbers here
    return positions[:, 0].long().tolist(), int(delta)


CASES = {
    "image": image_case([0, 1], "Compare them.", sizes=[(64, 48), (48, 80)]),
    "audio": audio_case([2, 3], "What sounds?", seconds=[0.6, 1.3]),
    "video": video_case(3, "Describe the video."),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_expansion_features_and_positions_equal_hf(family, ref, name):
    case = CASES[name]
    inputs = hf_inputs(ref, case.messages, case.media)
    processed, expanded = ours(family, case.messages, case.media)
    assert expanded.hf_token_ids == inputs["input_ids"][0].tolist()
    if name == "image":
        assert torch.equal(torch.cat([p.tensors["pixel_values"] for p in processed]), inputs["pixel_values"])
    if name == "audio":  # each clip as HF's processor computes it alone (see the test below for two at once)
        for (_, clip), p in zip(case.media, processed, strict=True):
            solo = hf_inputs(ref, audio_case([0], "x").messages, [(Modality.AUDIO, clip)])
            mask = solo["feature_attention_mask"][0].bool()
            assert torch.equal(p.tensors["input_features"], solo["input_features"][0][:, mask])
    positions, delta = family.positions(expanded)
    assert (positions.tolist(), delta) == hf_positions(ref, inputs)


def test_clips_of_a_prompt_are_featurized_alone(family, ref, arch):
    """Qwen2.5-Omni's processor pads every clip to the window, so a clip's features do not depend on the others.
    Qwen3-Omni's pads the raw audio of a call to its longest clip before the STFT: the shorter clip's last mel
    frame then sees zeros where a lone clip sees its own reflection. mmserve featurizes (and caches) every clip
    alone, as HF does for a one-clip prompt; with clips of unequal lengths HF's batch differs in that frame."""
    case = CASES["audio"]
    inputs = hf_inputs(ref, case.messages, case.media)
    short = family.process(Modality.AUDIO, case.media[0][1], {})
    mask = inputs["feature_attention_mask"][0].bool()
    differs = (short.tensors["input_features"] != inputs["input_features"][0][:, mask]).any(dim=0)
    assert torch.nonzero(differs).flatten().tolist() == (
        [short.tensors["input_features"].shape[1] - 1] if arch == "qwen3_omni_moe" else []
    )


def test_audio_in_video_expansion_and_positions_equal_hf(family, ref, arch):
    media = [(Modality.VIDEO, decoded_av())]
    inputs = hf_inputs(ref, video_messages(AV_CLIP), media, audio_in_video=True)
    processed, expanded = ours(family, video_messages(AV_CLIP), media, AV)
    (item,) = processed
    meta = family.meta(item.metadata)
    kinds = [kind for kind, _, _ in family.interleave(meta)]
    assert meta.grid_thw[0] == 4
    if arch == "qwen2_5_omni":  # two 2-second chunks of each
        assert kinds == ["video", "audio", "video", "audio"] and family.audio_tokens(meta.audio_frames) == 90
    else:  # each 1-second grid step, then the 13 audio tokens of its second
        assert kinds == ["video", "audio"] * 4 and family.audio_tokens(meta.audio_frames) == 47
    mask = inputs["feature_attention_mask"][0].bool()
    assert torch.equal(item.tensors["input_features"], inputs["input_features"][0][:, mask])
    assert expanded.hf_token_ids == inputs["input_ids"][0].tolist()
    positions, delta = family.positions(expanded)
    assert (positions.tolist(), delta) == hf_positions(ref, inputs, audio_in_video=True)


def av_reference(ref: HFReference, data: bytes = AV_CLIP) -> list[int]:
    inputs = hf_inputs(ref, video_messages(data), [(Modality.VIDEO, decoded_av(data))], audio_in_video=True)
    inputs["video_second_per_grid"] = torch.as_tensor(inputs["video_second_per_grid"])
    with torch.no_grad():
        out = ref.model.generate(**inputs, use_audio_in_video=True, max_new_tokens=MAX_NEW, do_sample=False,
                                 eos_token_id=None, pad_token_id=ref.model.generation_config.pad_token_id)  # fmt: skip
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


def test_audio_in_video_tokens_equal_hf_and_shifted_audio_changes_them(llm, ref, monkeypatch):
    expected = av_reference(ref)
    assert list(llm.chat(video_messages(AV_CLIP), greedy())[0].outputs[0].token_ids) == expected
    # Negative control: the audio one chunk late (its first chunk after the second video chunk).
    original = qwen_omni.Family.interleave

    def shifted(self, meta):  # v0 a0 v1 a1 ... -> v0 v1 a0 v2 a1 ...
        runs = original(self, meta)
        audio = [r for r in runs if r[0] == "audio"]
        video = [r for r in runs if r[0] == "video"]
        out = video[:1]
        for j in range(1, max(len(video), len(audio) + 1)):
            out += video[j : j + 1] + audio[j - 1 : j]
        assert sorted(out) == sorted(runs) and out != runs
        return out

    monkeypatch.setattr(qwen_omni.Family, "interleave", shifted)
    other = av_mp4(0, audio_seed=0)  # the same frames, other noise: a fresh cache entry under the patch
    assert list(llm.chat(video_messages(other), greedy())[0].outputs[0].token_ids) != av_reference(ref, other)


def test_video_and_its_audio_hash_as_one_item(llm):
    encoder = llm.encoder
    settings = {qwen_omni.AUDIO_IN_VIDEO: True}
    same_frames_other_audio = av_mp4(0, audio_seed=7)
    digests = {
        encoder.item_hash(Modality.VIDEO, AV_CLIP, settings),
        encoder.item_hash(Modality.VIDEO, AV_CLIP, {}),
        encoder.item_hash(Modality.VIDEO, same_frames_other_audio, settings),
    }
    assert len(digests) == 3
    # Encoded for real: no cross hit between the pair and the video alone, nor with another audio track.
    first = encoder.encode(MediaInput(Modality.VIDEO, MediaRef.from_bytes(AV_CLIP), settings, None))
    alone = encoder.encode(MediaInput(Modality.VIDEO, MediaRef.from_bytes(AV_CLIP), {}, None))
    other = encoder.encode(
        MediaInput(Modality.VIDEO, MediaRef.from_bytes(same_frames_other_audio), settings, None)
    )
    assert first.num_tokens > alone.num_tokens and first.content_hash != alone.content_hash
    assert other.content_hash != first.content_hash and not torch.equal(other.embedding, first.embedding)


def test_malformed_audio_in_video_is_refused(family, llm):
    silent = decode_video(mp4_bytes(3), MediaConfig(), RATE)
    assert silent.audio is None
    with pytest.raises(MediaDecodeError, match="no audio track") as err:
        family.process(Modality.VIDEO, silent, AV)
    assert err.value.status == 400
    with pytest.raises(ValueError, match="has no video"):
        family.request_item_settings([Modality.IMAGE], AV)
    with pytest.raises(ValueError, match="unknown mm_processor_kwargs"):
        family.request_item_settings([Modality.VIDEO], {"fps": 3})
    # Through the engine: a silent video with audio-in-video on ends the request with a clear media error.
    with pytest.raises(MediaDecodeError, match="no audio track"):
        llm.chat(video_messages(mp4_bytes(3)), greedy())


def test_thinker_only_is_read(family, arch):
    """Qwen2.5-Omni's checkpoint holds the talker's and token2wav's tensors too; only the thinker's are loaded."""
    from safetensors import safe_open

    with safe_open(f"{family.path}/model.safetensors", framework="pt") as f:
        roots = {key.split(".")[0] for key in f.keys()}
    assert roots == ({"thinker", "talker", "token2wav"} if arch == "qwen2_5_omni" else {"thinker"})
    lm = family.load_language_model(torch.float32, "sdpa")
    tower = family.load_tower(torch.float32)
    assert lm.lm_head.weight.shape[0] == family.hf_config.text_config.vocab_size
    assert {name for name, _ in tower.named_children()} == {"visual", "audio_tower"}


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    """A Qwen2.5-Omni server with audio-in-video off by default: requests turn it on with `mm_processor_kwargs`
    (the switch is the family's; its plumbing is generic)."""
    from mmserve.testing.server_process import start_server

    arch = "qwen2_5_omni"
    handle = start_server(
        tiny_model(arch), "--kv-cache-mb", "8", "--mm-processor-kwargs", json.dumps(FAMILIES[arch].mm_kwargs),
        log_dir=str(tmp_path_factory.mktemp("omni_logs")),
    )  # fmt: skip
    yield handle.url
    assert handle.stop() == 0


def post(url: str, messages: list, **extra):
    body = {
        "model": "tiny",
        "messages": messages,
        "max_tokens": MAX_NEW,
        "temperature": 0,
        "ignore_eos": True,
    }
    return httpx.post(f"{url}/v1/chat/completions", json={**body, **extra}, timeout=60)


def test_request_level_audio_in_video_over_http(server, references):
    ref = references("qwen2_5_omni")

    def text(response) -> str:
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["message"]["content"]

    def decoded(ids: list[int]) -> str:
        return ref.tokenizer.decode(ids, skip_special_tokens=True)

    on = post(server, video_messages(AV_CLIP), mm_processor_kwargs=AV)
    assert text(on) == decoded(av_reference(ref))
    off = post(server, video_messages(AV_CLIP))
    media = [(Modality.VIDEO, decode_video(AV_CLIP, MediaConfig()))]
    plain = ref.generate(parse_messages(video_messages(AV_CLIP))[0], media, max_new_tokens=MAX_NEW)
    assert text(off) == decoded(plain.token_ids) != text(on)
    assert on.json()["usage"]["prompt_tokens"] > off.json()["usage"]["prompt_tokens"]
    silent = post(server, video_messages(mp4_bytes(3)), mm_processor_kwargs=AV)
    assert silent.status_code == 400 and "no audio track" in silent.text
    no_video = post(server, [{"role": "user", "content": "Hi"}], mm_processor_kwargs=AV)
    assert no_video.status_code == 400 and "has no video" in no_video.text
    unknown = post(server, video_messages(AV_CLIP), mm_processor_kwargs={"fps": 1})
    assert unknown.status_code == 400 and "unknown mm_processor_kwargs" in unknown.text
