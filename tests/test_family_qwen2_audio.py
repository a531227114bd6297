"""Qwen2-Audio family: features and expansion equal HF's processor, the window limit, loading both key layouts,
and greedy tokens of the whole engine equal HF `generate` (fp32), with a negative control that must fail.

The tiny model's window is 2 s (200 mel frames); 0.6 s of noise is 60 frames -> 15 LM tokens, 1.3 s of a tone
130 frames -> 32 tokens.
"""

from __future__ import annotations

import base64
import io
import os
import shutil

import msgspec
import numpy as np
import pytest
import soundfile as sf
import torch
from safetensors.torch import load_file, save_file

from mmserve import LLM, SamplingParams
from mmserve.models import qwen2_audio
from mmserve.models.family import load_family
from mmserve.multimodal.errors import MediaDecodeError, MediaTooLargeError, UnsupportedMediaError
from mmserve.multimodal.items import ItemEmbedding, Modality, MultimodalItem
from mmserve.multimodal.messages import parse_messages
from mmserve.testing.reference import HFReference
from tests.engine_helpers import RecordingSampler

pytestmark = pytest.mark.timeout(120)

RATE = 16_000
MAX_NEW = 10


def noise(seconds: float, seed: int = 0) -> np.ndarray:
    return (np.random.RandomState(seed).randn(int(seconds * RATE)) * 0.3).astype(np.float32)


def tone(seconds: float, hz: float = 440.0) -> np.ndarray:
    return (0.5 * np.sin(2 * np.pi * hz * np.arange(int(seconds * RATE)) / RATE)).astype(np.float32)


CLIP_A = noise(0.6)
CLIP_B = tone(1.3)


def wav_b64(samples: np.ndarray) -> str:
    buf = io.BytesIO()
    sf.write(buf, samples, RATE, format="WAV", subtype="FLOAT")  # float32 WAV: the samples round-trip exactly
    return base64.b64encode(buf.getvalue()).decode()


def input_audio(samples: np.ndarray) -> dict:
    return {"type": "input_audio", "input_audio": {"data": wav_b64(samples), "format": "wav"}}


def audio_url(samples: np.ndarray) -> dict:
    return {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64," + wav_b64(samples)}}


def conversation(clips: list[np.ndarray], text: str, part=input_audio) -> list[dict]:
    return [{"role": "user", "content": [*(part(c) for c in clips), {"type": "text", "text": text}]}]


CASES = {
    "text": ([], "Tell me a story about a cat."),
    "one_clip": ([CLIP_A], "What sound is this?"),
    "two_clips": ([CLIP_A, CLIP_B], "Compare the two sounds."),
}


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tiny_qwen2_audio) -> str:
    return tiny_qwen2_audio


@pytest.fixture(scope="module")
def family(model_dir):
    return load_family(model_dir)


@pytest.fixture(scope="module")
def ref(model_dir) -> HFReference:
    return HFReference(model_dir)


@pytest.fixture(scope="module")
def expected(ref):
    """Case name -> HF's greedy output for it."""
    out = {}
    for name, (clips, text) in CASES.items():
        template = parse_messages(conversation(clips, text))[0]
        out[name] = ref.generate(template, [(Modality.AUDIO, c) for c in clips], max_new_tokens=MAX_NEW)
    return out


def hf_inputs(ref: HFReference, clips: list[np.ndarray], text: str = "Hi"):
    template = parse_messages(conversation(clips, text))[0]
    return ref.inputs(template, [(Modality.AUDIO, c) for c in clips])


# -- processor ------------------------------------------------------------------------------------------
def test_features_and_expansion_equal_hf_processor(family, ref):
    inputs = hf_inputs(ref, [CLIP_A, CLIP_B])
    processed = [family.process(Modality.AUDIO, c, {}) for c in (CLIP_A, CLIP_B)]
    window = inputs["input_features"].shape[-1]
    for i, item in enumerate(processed):
        num_frames = family.meta(item.metadata).num_frames
        assert torch.equal(item.tensors["input_features"], inputs["input_features"][i])
        mask = (torch.arange(window) < num_frames).to(inputs["feature_attention_mask"].dtype)
        assert torch.equal(mask, inputs["feature_attention_mask"][i])
    assert [p.num_tokens for p in processed] == [15, 32]
    prompt = ref.tokenizer.apply_chat_template(
        parse_messages(conversation([CLIP_A, CLIP_B], "Hi"))[0], add_generation_prompt=True, tokenize=False
    )
    ids = ref.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    items = [
        MultimodalItem(Modality.AUDIO, bytes([i]) * 16, p.num_tokens, p.metadata)
        for i, p in enumerate(processed)
    ]
    expanded = family.expand(ids, items)
    assert expanded.hf_token_ids == inputs["input_ids"][0].tolist()
    positions, delta = family.positions(expanded)
    assert positions.tolist() == [list(range(len(expanded.token_ids)))] and delta == 0


def test_window_limit_and_bad_audio(family):
    window = family.cfg.n_samples  # 2 s
    assert family.process(Modality.AUDIO, np.zeros(window, np.float32), {}).num_tokens == 50
    with pytest.raises(MediaTooLargeError, match="at most 2 s") as err:
        family.process(Modality.AUDIO, np.zeros(window + 1, np.float32), {})
    assert err.value.status == 413
    with pytest.raises(MediaDecodeError, match="no samples"):
        family.process(Modality.AUDIO, np.zeros(0, np.float32), {})
    with pytest.raises(MediaDecodeError, match="too short"):  # 2 mel frames give 0 tokens in HF's formula
        family.process(Modality.AUDIO, np.zeros(2 * family.cfg.hop_length, np.float32), {})
    with pytest.raises(UnsupportedMediaError):
        family.hash_settings(Modality.AUDIO, {"fps": 2})


def test_hash_settings_cover_the_feature_extractor(family):
    settings = family.hash_settings(Modality.AUDIO, {})
    assert settings["sampling_rate"] == family.audio_sample_rate_hz == RATE
    for key in ("feature_size", "hop_length", "n_fft", "chunk_length", "padding_value", "dither"):
        assert settings[key] == getattr(family.feature_extractor, key)


def test_audio_url_part():
    template, media = parse_messages(conversation([CLIP_A], "Hi", part=audio_url))
    assert template[0]["content"][0] == {"type": "audio"}
    assert [m for m, _ in media] == [Modality.AUDIO]


# -- weights --------------------------------------------------------------------------------------------
def test_tower_and_language_model_load_from_either_layout_alone(family, model_dir, tmp_path):
    """v5 key layout, and each half loads from a checkpoint that lacks the other half."""
    legacy = load_file(os.path.join(model_dir, "model.safetensors"))
    renames = [
        ("audio_tower.", "model.audio_tower."),
        ("multi_modal_projector.", "model.multi_modal_projector."),
        ("language_model.model.", "model.language_model."),
        ("language_model.lm_head.", "lm_head."),
    ]

    def new_key(key: str) -> str:
        return next(new + key[len(old) :] for old, new in renames if key.startswith(old))

    v5 = {new_key(k): v for k, v in legacy.items()}
    tower_ref, lm_ref = family.load_tower(torch.float32), family.load_language_model(torch.float32, "sdpa")
    for name, keep in (
        ("tower_only", ("model.audio_tower.", "model.multi_modal_projector.")),
        ("lm_only", ("model.language_model.", "lm_head.")),
        ("both", ("",)),
    ):
        d = tmp_path / name
        shutil.copytree(model_dir, d)
        save_file({k: v for k, v in v5.items() if k.startswith(keep)}, str(d / "model.safetensors"))
        fam = load_family(str(d))
        if name != "lm_only":
            tower = fam.load_tower(torch.float32)
            for key, value in tower_ref.state_dict().items():
                assert torch.equal(tower.state_dict()[key], value), key
        if name != "tower_only":
            lm = fam.load_language_model(torch.float32, "sdpa")
            assert torch.equal(lm.lm_head.weight, lm_ref.lm_head.weight)
            for key, value in lm_ref.model.state_dict().items():
                assert torch.equal(lm.model.state_dict()[key], value), key


# -- encode ---------------------------------------------------------------------------------------------
def test_batched_encode_equals_one_at_a_time(family, model_dir, expected):
    """One fused forward over two clips of different lengths: rows close to solo encodes, same greedy tokens."""
    tower = family.load_tower(torch.float32)
    items = [family.process(Modality.AUDIO, c, {}) for c in (CLIP_A, CLIP_B)]
    with torch.no_grad():
        batched = family.encode(tower, items)
        solo = [family.encode(tower, [it])[0] for it in items]
    for b, s, it in zip(batched, solo, items, strict=True):
        assert b["main"].shape == (it.num_tokens, family.hidden_size)
        assert b["main"].untyped_storage().nbytes() == b["main"].nbytes  # own storage
        torch.testing.assert_close(b["main"], s["main"], atol=1e-4, rtol=1e-5)
    # The batched embeddings through the engine give HF's tokens.
    llm = LLM(model_dir, kv_cache_mb=8)
    clips, text = CASES["two_clips"]
    template = parse_messages(conversation(clips, text))[0]
    prompt = llm.tokenizer.apply_chat_template(template, add_generation_prompt=True, tokenize=False)
    ids = llm.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    embeddings = [
        ItemEmbedding(Modality.AUDIO, bytes([i]) * 16, b, it.metadata)
        for i, (b, it) in enumerate(zip(batched, items, strict=True))
    ]
    req = llm.engine.add_request("batched", ids, greedy(), embeddings)
    while llm.engine.has_work:
        llm.engine.step()
    assert list(req.output_ids) == expected["two_clips"].token_ids


def test_health_probe(model_dir):
    llm = LLM(model_dir, kv_cache_mb=8)
    modality, samples = llm.engine.family.probe_item()
    assert modality == Modality.AUDIO and samples.dtype == np.float32 and samples.shape == (1600,)
    llm.encoder.health_probe()


# -- parity with HF generate ----------------------------------------------------------------------------
@pytest.mark.parametrize("budget", [2048, 7, 1])
def test_chat_parity(model_dir, expected, budget):
    """All cases at once (packed), prefill chunks of `budget` tokens: chunk boundaries fall inside audio spans."""
    llm = LLM(model_dir, kv_cache_mb=8, max_num_batched_tokens=budget)
    recorder = RecordingSampler()
    llm.engine.sampler = recorder
    params = [greedy() for _ in CASES]
    outputs = llm.chat([conversation(*case) for case in CASES.values()], params)
    for name, out, p in zip(CASES, outputs, params, strict=True):
        assert out.token_ids == expected[name].token_ids, name
        # fp32 rounding depends on the batch shape (one attention call for all decodes, padded to the
        # longest): up to 1.4e-4 here with equal tokens; the same bound as tests/test_engine_parity.py
        torch.testing.assert_close(recorder.logits_for(p), expected[name].logits, atol=5e-4, rtol=1e-5)
    llm.check_integrity()


def test_audio_url_and_generate_parity(model_dir, expected):
    llm = LLM(model_dir, kv_cache_mb=8)
    clips, text = CASES["two_clips"]
    [out] = llm.chat([conversation(clips, text, part=audio_url)], greedy())
    assert out.token_ids == expected["two_clips"].token_ids
    template = parse_messages(conversation(clips, text))[0]
    prompt = llm.tokenizer.apply_chat_template(template, add_generation_prompt=True, tokenize=False)
    [out] = llm.generate(
        {"prompt": prompt, "multi_modal_data": {"audio": [(c, RATE) for c in clips]}}, greedy()
    )
    assert out.token_ids == expected["two_clips"].token_ids


def test_clip_over_window_refused_by_llm(model_dir):
    llm = LLM(model_dir, kv_cache_mb=8)
    with pytest.raises(MediaTooLargeError, match="audio #1") as err:
        llm.chat([conversation([noise(2.5)], "Hi")], greedy())
    assert err.value.status == 413


def test_negative_control_one_mel_frame_dropped(model_dir, expected, monkeypatch):
    """Dropping the last valid mel frame of every clip (same token count) must change the tokens."""
    original = qwen2_audio.Family.process

    def truncated(self, modality, media, settings):
        item = original(self, modality, media, settings)
        num_frames = self.meta(item.metadata).num_frames
        features = item.tensors["input_features"].clone()
        features[:, num_frames - 1] = features[:, -1]  # a padding frame
        meta = msgspec.msgpack.encode(qwen2_audio.AudioMeta(num_frames - 1))
        assert qwen2_audio.num_audio_tokens(num_frames - 1) == item.num_tokens
        return type(item)(modality, {"input_features": features}, meta, item.num_tokens, item.cost)

    monkeypatch.setattr(qwen2_audio.Family, "process", truncated)
    llm = LLM(model_dir, kv_cache_mb=8)
    [out] = llm.chat([conversation(*CASES["two_clips"])], greedy())
    assert len(out.token_ids) == MAX_NEW
    assert out.token_ids != expected["two_clips"].token_ids
