"""Qwen2-VL family processor: token counts, expansion, offsets, video layout, M-RoPE vs HF."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mmserve.config import VisionPreprocessConfig
from mmserve.models.loader import load_hf_config, load_model, load_processor
from mmserve.multimodal.items import Modality, MultimodalItem, content_hash
from mmserve.multimodal.processors.qwen2_vl import QwenVLProcessor
from tests.conftest import random_image

IMG, VID = 900, 901  # placeholder ids for the standalone processor


def standalone(**cfg) -> QwenVLProcessor:
    return QwenVLProcessor(
        VisionPreprocessConfig(**cfg), image_token_id=IMG, video_token_id=VID, spatial_merge_size=2
    )


def item(modality: Modality, seed: int, num_tokens: int, grid=(1, 4, 4)) -> MultimodalItem:
    return MultimodalItem(modality, content_hash(modality, bytes([seed]), {}), num_tokens, grid)


def test_image_token_count_follows_grid():
    proc = standalone()
    out = proc.process(Modality.IMAGE, random_image(0, width=112, height=56))
    assert out.grid_thw == (1, 4, 8)
    assert out.num_tokens == 8
    assert out.pixel_values.shape == (32, 3 * 2 * 14 * 14)


def test_expand_sets_offsets_for_several_items_and_modalities():
    proc = standalone()
    a, v, b = item(Modality.IMAGE, 1, 4), item(Modality.VIDEO, 2, 8, (2, 4, 8)), item(Modality.IMAGE, 3, 2)
    prompt = [1, IMG, 2, 3, VID, 4, IMG, 5]
    ex = proc.expand(prompt, [a, b, v])  # items of a modality are taken in order; modalities interleave
    assert [it.offset for it in ex.items] == [1, 7, 16]
    assert [(it.offset, it.end) for it in ex.items] == [(1, 5), (7, 15), (16, 18)]
    assert ex.items == [a, v, b]
    assert len(ex.token_ids) == len(ex.hf_token_ids) == 8 - 3 + 4 + 8 + 2
    assert ex.token_ids[1:5] == [a.pad_value] * 4 and ex.hf_token_ids[1:5] == [IMG] * 4
    assert ex.token_ids[7:15] == [v.pad_value] * 8 and ex.hf_token_ids[7:15] == [VID] * 8
    assert ex.token_ids[0] == 1 and ex.token_ids[-1] == 5


def test_expand_rejects_count_mismatch():
    proc = standalone()
    with pytest.raises(ValueError, match="2 image placeholder"):
        proc.expand([IMG, IMG], [item(Modality.IMAGE, 1, 4)])
    with pytest.raises(ValueError, match="0 video placeholder"):
        proc.expand([IMG], [item(Modality.IMAGE, 1, 4), item(Modality.VIDEO, 2, 4)])


def test_video_layout_matches_hf_video_formula():
    """No-resize frames (56x56), so the expected pixels follow from the published layout formula."""
    proc = standalone(video_min_pixels=56 * 56, video_max_pixels=56 * 56)
    rng = np.random.RandomState(0)
    frames = (rng.rand(3, 56, 56, 3) * 255).astype("uint8")  # odd: last frame repeated
    out = proc.process(Modality.VIDEO, SimpleNamespace(frames=frames, fps=2.0))
    assert out.grid_thw == (2, 4, 4) and out.num_tokens == 8
    assert out.second_per_grid_t == pytest.approx(1.0)  # temporal_patch_size / fps
    cfg = proc.cfg
    padded = np.concatenate([frames, frames[-1:]])
    x = torch.from_numpy(padded).float().permute(0, 3, 1, 2) / 255.0
    x = (x - torch.tensor(cfg.image_mean).view(1, 3, 1, 1)) / torch.tensor(cfg.image_std).view(1, 3, 1, 1)
    t, p, m, tp = 2, 14, 2, 2
    gh = gw = 4
    # HF Qwen2VLVideoProcessor: (t, tp, C, gh/m, m, p, gw/m, m, p) -> (t, gh/m, gw/m, m, m, C, tp, p, p)
    x = x.reshape(t, tp, 3, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    expected = x.reshape(t * gh * gw, 3 * tp * p * p)
    torch.testing.assert_close(out.pixel_values, expected, atol=1e-5, rtol=1e-5)


def test_two_identical_frames_equal_the_image_path():
    proc = standalone(video_min_pixels=56 * 56, video_max_pixels=28 * 28 * 1280)
    img = random_image(3, width=84, height=56)
    video = proc.process(Modality.VIDEO, SimpleNamespace(frames=np.stack([np.asarray(img)] * 2), fps=1.0))
    image = proc.process(Modality.IMAGE, img)
    assert video.grid_thw == image.grid_thw
    assert torch.equal(video.pixel_values, image.pixel_values)


def test_video_with_no_frames_is_a_media_error():
    from mmserve.multimodal.errors import MediaDecodeError

    with pytest.raises(MediaDecodeError, match="no frames"):
        standalone().process(Modality.VIDEO, SimpleNamespace(frames=np.zeros((0, 8, 8, 3), "uint8"), fps=1.0))


def test_hash_settings_differ_with_output_relevant_settings():
    a, b = standalone(), standalone(image_max_pixels=256 * 28 * 28)
    data = b"same bytes"
    ha = content_hash(Modality.IMAGE, data, a.hash_settings(Modality.IMAGE))
    hb = content_hash(Modality.IMAGE, data, b.hash_settings(Modality.IMAGE))
    assert ha != hb
    # video-only settings do not split the image cache
    c = standalone(video_max_pixels=64 * 28 * 28)
    assert content_hash(Modality.IMAGE, data, c.hash_settings(Modality.IMAGE)) == ha


def test_mm_processor_kwargs_override(tiny_qwen2_vl):
    proc = load_processor(tiny_qwen2_vl, mm_processor_kwargs={"max_pixels": 56 * 56})
    out = proc.process(Modality.IMAGE, random_image(0, width=224, height=224))
    assert out.grid_thw == (1, 4, 4)
    with pytest.raises(ValueError, match="unknown mm processor setting"):
        load_processor(tiny_qwen2_vl, mm_processor_kwargs={"bogus": 1})


def test_mrope_positions_equal_hf_get_rope_index(tiny_model_dir):
    hf_config = load_hf_config(tiny_model_dir)
    proc = load_processor(
        tiny_model_dir, hf_config, {"video_min_pixels": 56 * 56, "video_max_pixels": 112 * 112}
    )
    model = load_model(tiny_model_dir)
    img = proc.process(Modality.IMAGE, random_image(1, 84, 56))
    img2 = proc.process(Modality.IMAGE, random_image(2, 56, 112))
    frames = (np.random.RandomState(0).rand(4, 64, 96, 3) * 255).astype("uint8")
    vid = proc.process(Modality.VIDEO, SimpleNamespace(frames=frames, fps=1.0))
    items = [MultimodalItem(p.modality, content_hash(p.modality, bytes([i]), {}), p.num_tokens, p.grid_thw,
                            second_per_grid_t=p.second_per_grid_t) for i, p in enumerate([img, vid, img2])]  # fmt: skip
    im, vi = hf_config.image_token_id, hf_config.video_token_id
    tokens = [5, 6, im, 7, vi, 8, 9, im, 10, 11, 12]
    ex = proc.expand(tokens, [items[0], items[2], items[1]])
    positions, delta = proc.positions(ex)
    ids = torch.tensor([ex.hf_token_ids])
    types = torch.tensor([[1 if t == im else 2 if t == vi else 0 for t in ex.hf_token_ids]])
    kwargs = {}
    if hf_config.model_type == "qwen2_5_vl":
        kwargs["second_per_grid_ts"] = torch.tensor([vid.second_per_grid_t])
    ref, ref_delta = model.model.get_rope_index(
        ids, mm_token_type_ids=types, image_grid_thw=torch.tensor([img.grid_thw, img2.grid_thw]),
        video_grid_thw=torch.tensor([vid.grid_thw]), **kwargs,
    )  # fmt: skip
    assert torch.equal(positions, ref[:, 0])
    assert delta == int(ref_delta)


def test_text_only_positions_are_plain():
    proc = standalone()
    ex = proc.expand([1, 2, 3], [])
    positions, delta = proc.positions(ex)
    assert torch.equal(positions, torch.arange(3).expand(3, -1)) and delta == 0
