"""Qwen-VL family processors (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): token counts, expansion, spans, video layout,
content-hash settings, M-RoPE positions against transformers, expansion against transformers' processors."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import numpy as np
import pytest
import torch

from mmserve.models.family import load_family
from mmserve.models.loader import load_hf_config, load_model
from mmserve.multimodal.errors import MediaDecodeError
from mmserve.multimodal.items import Modality, MultimodalItem, content_hash
from mmserve.testing.reference import HFReference
from tests.conftest import random_image


def video(frames: np.ndarray, fps: float = 2.0) -> SimpleNamespace:
    """A DecodedVideo stand-in: frames at 0, 1/fps, 2/fps ... seconds."""
    return SimpleNamespace(frames=frames, fps=fps, timestamps_s=tuple(i / fps for i in range(len(frames))))


def item(family, tower_input, seed: int) -> MultimodalItem:
    digest = content_hash(tower_input.modality, bytes([seed]), {})
    return MultimodalItem(tower_input.modality, digest, tower_input.num_tokens, tower_input.metadata)


def frames(seed: int, n: int, h: int, w: int) -> np.ndarray:
    return (np.random.RandomState(seed).rand(n, h, w, 3) * 255).astype("uint8")


@pytest.fixture(scope="module")
def qwen2(tiny_qwen2_vl):
    return load_family(
        tiny_qwen2_vl, mm_processor_kwargs={"video_min_pixels": 56 * 56, "video_max_pixels": 56 * 112}
    )


def test_image_token_count_follows_grid(qwen2):
    out = qwen2.process(Modality.IMAGE, random_image(0, width=112, height=56), {})
    assert qwen2.meta(out.metadata).grid_thw == (1, 4, 8)
    assert out.num_tokens == 8 and out.cost == 32
    assert out.tensors["pixel_values"].shape == (32, 3 * 2 * 14 * 14)


def test_expand_sets_offsets_and_spans_for_several_items_and_modalities(qwen2):
    img, vid = qwen2.placeholders[Modality.IMAGE], qwen2.placeholders[Modality.VIDEO]
    a = item(qwen2, qwen2.process(Modality.IMAGE, random_image(1, 56, 56), {}), 1)  # 4 tokens
    v = item(qwen2, qwen2.process(Modality.VIDEO, video(frames(0, 2, 56, 112)), {}), 2)  # 8 tokens
    b = item(qwen2, qwen2.process(Modality.IMAGE, random_image(3, 112, 56), {}), 3)  # 8 tokens
    prompt = [1, img, 2, 3, vid, 4, img, 5]
    ex = qwen2.expand(prompt, [a, b, v])  # items of a modality are taken in order; modalities interleave
    assert [(it.offset, it.end) for it in ex.items] == [(1, 5), (7, 15), (16, 24)]
    assert [it.span for it in ex.items] == [4, 8, 8] and ex.items == [a, v, b]
    assert len(ex.token_ids) == len(ex.hf_token_ids) == 8 - 3 + 4 + 8 + 8
    assert ex.token_ids[1:5] == [a.pad_value] * 4 and ex.hf_token_ids[1:5] == [img] * 4
    assert ex.token_ids[7:15] == [v.pad_value] * 8 and ex.hf_token_ids[7:15] == [vid] * 8
    assert ex.token_ids[0] == 1 and ex.token_ids[-1] == 5


def test_expand_rejects_count_mismatch(qwen2):
    img = qwen2.placeholders[Modality.IMAGE]
    a = item(qwen2, qwen2.process(Modality.IMAGE, random_image(1, 56, 56), {}), 1)
    with pytest.raises(ValueError, match="2 image placeholder"):
        qwen2.expand([img, img], [a])
    v = item(qwen2, qwen2.process(Modality.VIDEO, video(frames(0, 2, 56, 56)), {}), 2)
    with pytest.raises(ValueError, match="0 video placeholder"):
        qwen2.expand([img], [a, v])


def test_video_layout_matches_hf_video_formula(tiny_qwen2_vl):
    """No-resize frames (56x56), so the expected pixels follow from the published layout formula."""
    family = load_family(
        tiny_qwen2_vl, mm_processor_kwargs={"video_min_pixels": 56 * 56, "video_max_pixels": 56 * 56}
    )
    clip = frames(0, 3, 56, 56)  # odd: last frame repeated
    out = family.process(Modality.VIDEO, video(clip), {})
    meta = family.meta(out.metadata)
    assert meta.grid_thw == (2, 4, 4) and out.num_tokens == 8
    assert meta.second_per_grid_t == pytest.approx(1.0)  # temporal_patch_size / fps
    cfg = family.cfg
    padded = np.concatenate([clip, clip[-1:]])
    x = torch.from_numpy(padded).float().permute(0, 3, 1, 2) / 255.0
    x = (x - torch.tensor(cfg.image_mean).view(1, 3, 1, 1)) / torch.tensor(cfg.image_std).view(1, 3, 1, 1)
    t, p, m, tp = 2, 14, 2, 2
    gh = gw = 4
    # HF Qwen2VLVideoProcessor: (t, tp, C, gh/m, m, p, gw/m, m, p) -> (t, gh/m, gw/m, m, m, C, tp, p, p)
    x = x.reshape(t, tp, 3, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    expected = x.reshape(t * gh * gw, 3 * tp * p * p)
    torch.testing.assert_close(out.tensors["pixel_values"], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen3_vl"])
def test_two_identical_frames_equal_the_image_path(arch, tiny_qwen2_vl, tiny_qwen3_vl):
    """Frame by frame, video pixels are the family's image processor's pixels (HF's video processors need
    torchvision, so this is how our video preprocessing is checked)."""
    family = load_family(
        tiny_qwen2_vl if arch == "qwen2_vl" else tiny_qwen3_vl,
        mm_processor_kwargs={"video_min_pixels": 32 * 32, "video_max_pixels": 28 * 28 * 1280},
    )
    img = random_image(3, width=128, height=64)  # a multiple of both families' resize factors: no resampling
    clip = family.process(Modality.VIDEO, video(np.stack([np.asarray(img)] * 2)), {})
    image = family.process(Modality.IMAGE, img, {})
    assert family.meta(clip.metadata).grid_thw == family.meta(image.metadata).grid_thw
    assert torch.equal(clip.tensors["pixel_values"], image.tensors["pixel_values"])


def test_video_with_no_frames_is_a_media_error(qwen2):
    with pytest.raises(MediaDecodeError, match="no frames"):
        qwen2.process(Modality.VIDEO, video(np.zeros((0, 8, 8, 3), "uint8")), {})


def test_hash_settings_differ_with_output_relevant_settings(tiny_qwen2_vl):
    from mmserve.config import MediaConfig
    from mmserve.encoder.runner import MultimodalEncoder

    def digest(modality, media_cfg=None, **kwargs):
        media_cfg = media_cfg or MediaConfig()
        encoder = MultimodalEncoder(
            load_family(tiny_qwen2_vl, mm_processor_kwargs=kwargs), None, None, media_cfg
        )
        return encoder.item_hash(modality, b"same bytes", {})

    base = digest(Modality.IMAGE)
    assert digest(Modality.IMAGE, image_max_pixels=256 * 28 * 28) != base
    assert (
        digest(Modality.IMAGE, video_max_pixels=64 * 28 * 28) == base
    )  # video-only settings: same image key
    video_key = digest(Modality.VIDEO)
    assert digest(Modality.VIDEO, video_max_pixels=64 * 28 * 28) != video_key
    # Video sampling changes the frames the tower sees: other frame cap or rate, other hash (and pad value).
    assert digest(Modality.VIDEO, MediaConfig(max_video_frames=8)) != video_key
    assert digest(Modality.VIDEO, MediaConfig(video_fps=1.0)) != video_key
    assert digest(Modality.IMAGE, MediaConfig(max_video_frames=8)) == base


def test_mm_processor_kwargs_override(tiny_qwen2_vl):
    family = load_family(tiny_qwen2_vl, mm_processor_kwargs={"max_pixels": 56 * 56})
    out = family.process(Modality.IMAGE, random_image(0, width=224, height=224), {})
    assert family.meta(out.metadata).grid_thw == (1, 4, 4)
    with pytest.raises(ValueError, match="unknown mm processor setting"):
        load_family(tiny_qwen2_vl, mm_processor_kwargs={"bogus": 1})


def test_unknown_item_settings_are_refused(qwen2):
    from mmserve.multimodal.errors import MediaError

    with pytest.raises(MediaError, match="unknown item settings"):
        qwen2.process(Modality.IMAGE, random_image(0), {"anyres": True})


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_mrope_positions_equal_hf_get_rope_index(arch, request):
    model_dir = request.getfixturevalue(f"tiny_{arch}")
    hf_config = load_hf_config(model_dir)
    kwargs = {"video_min_pixels": 32 * 32, "video_max_pixels": 128 * 128}
    family = load_family(model_dir, hf_config, kwargs)
    model = load_model(model_dir)
    img = family.process(Modality.IMAGE, random_image(1, 84, 56), {})
    img2 = family.process(Modality.IMAGE, random_image(2, 56, 112), {})
    vid = family.process(Modality.VIDEO, video(frames(0, 4, 64, 96), fps=1.0), {})
    items = [item(family, p, i) for i, p in enumerate([img, vid, img2])]
    im, vi = hf_config.image_token_id, hf_config.video_token_id
    tokens = [5, 6, im, 7, vi, 8, 9, im, 10, 11, 12]
    ex = family.expand(tokens, [items[0], items[2], items[1]])
    positions, delta = family.positions(ex)
    ids = torch.tensor([ex.hf_token_ids])
    types = torch.tensor([[1 if t == im else 2 if t == vi else 0 for t in ex.hf_token_ids]])
    grids = {
        key: torch.tensor([family.meta(p.metadata).grid_thw for p in ps])
        for key, ps in (("image_grid_thw", [img, img2]), ("video_grid_thw", [vid]))
    }
    if arch == "qwen2_5_vl":
        grids["second_per_grid_ts"] = torch.tensor([family.meta(vid.metadata).second_per_grid_t])
    ref, ref_delta = model.model.get_rope_index(ids, mm_token_type_ids=types, **grids)
    assert torch.equal(positions, ref[:, 0])
    assert delta == int(ref_delta)


def test_text_only_positions_are_plain(qwen2):
    ex = qwen2.expand([1, 2, 3], [])
    positions, delta = qwen2.positions(ex)
    assert torch.equal(positions, torch.arange(3).expand(3, -1)) and delta == 0


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_expansion_equals_transformers_processor(arch, request):
    """Our placeholder expansion (timestamps and all) gives exactly the input ids of transformers' own
    processor class; images also give its pixels."""
    from tests.engine_helpers import image_case, template_messages, video_case

    model_dir = request.getfixturevalue(f"tiny_{arch}")
    kwargs = {"video_min_pixels": 32 * 32, "video_max_pixels": 128 * 128}
    ref = HFReference(model_dir, mm_processor_kwargs=kwargs)
    family = ref.family
    for case in (image_case([1, 2], "Two.", sizes=[(64, 48), (96, 32)]), video_case(3, "A clip.")):
        messages = template_messages(case.messages)
        hf = ref.inputs(messages, case.media)
        text = ref.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = ref.tokenizer(text, add_special_tokens=False)["input_ids"]
        processed = [family.process(mod, obj, {}) for mod, obj in case.media]
        ex = family.expand(ids, [item(family, p, i) for i, p in enumerate(processed)])
        assert ex.hf_token_ids == hf["input_ids"][0].tolist()
        if case.media[0][0] == Modality.IMAGE:
            ours = torch.cat([p.tensors["pixel_values"] for p in processed])
            assert torch.equal(ours, hf["pixel_values"])


def test_qwen3_video_grid_follows_transformers_formula(tiny_qwen3_vl):
    """The clip-wide resize (one size for every frame, from the total pixel budget) gives the number of
    patches of transformers' Qwen3-VL video processor, and timestamps average each frame pair."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    family = load_family(tiny_qwen3_vl)
    hf = Qwen3VLVideoProcessor.from_pretrained(tiny_qwen3_vl)
    for n, h, w in ((4, 48, 64), (6, 200, 120), (3, 64, 64), (8, 300, 500)):
        out = family.process(Modality.VIDEO, video(frames(n, n, h, w), fps=2.0), {})
        meta = family.meta(out.metadata)
        t, gh, gw = meta.grid_thw
        assert t * gh * gw == hf.get_num_of_video_patches(n, h, w), (n, h, w)
        assert out.tensors["pixel_values"].shape[0] == t * gh * gw
        assert meta.timestamps == tuple(
            (2 * i + (2 * i + 1 if 2 * i + 1 < n else 2 * i)) / 4 for i in range(t)
        )


def test_metadata_is_compact_msgpack(qwen2):
    out = qwen2.process(Modality.IMAGE, random_image(0), {})
    assert msgspec.msgpack.decode(out.metadata) == [[1, 4, 4], 1.0]
