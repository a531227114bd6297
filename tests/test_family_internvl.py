"""InternVL's own mechanisms against transformers' code (the conformance suite, tests/test_conformance.py, runs every
mode): its tiling equal to `InternVLProcessor`'s pixels, video frames equal to the image processor frame by frame,
`max_dynamic_patch` honoured (HF parity with another tile budget) and part of the content hash, and the negative
controls: the tile budget left out of the hash makes two settings share a hash; the `<img>` wrappers left out
change the tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import GotOcr2ImageProcessorPil

from mmserve.models import internvl
from mmserve.models.family import load_family
from mmserve.multimodal.items import Modality
from tests.engine_helpers import image_case, png_bytes, reference, template_messages, video_case
from tests.test_engine_parity import MAX_NEW, greedy, make_llm, run_and_compare


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("internvl")


def test_tiling_and_pixels_equal_transformers_processor(model_dir, references):
    ref, family = references("internvl"), load_family(model_dir)
    case = image_case([3, 4], "Compare them.", sizes=[(64, 48), (40, 96)])
    hf = ref.inputs(template_messages(case.messages), case.media)
    ours = [family.process(Modality.IMAGE, image, {}) for _, image in case.media]
    assert torch.equal(torch.cat([t.tensors["pixel_values"] for t in ours]), hf["pixel_values"])
    assert min(t.cost for t in ours) > 1  # both tiled: a grid and its thumbnail
    contexts = (hf["input_ids"][0] == family.context_token).sum().item()
    assert contexts == sum(t.num_tokens for t in ours) == sum(t.cost for t in ours) * family.tokens_per_tile


def test_video_frames_equal_the_image_processor_frame_by_frame(model_dir):
    family = load_family(model_dir)
    video = video_case(5, "What happens?").media[0][1]
    frames = family.frame_pixels(video.frames)
    proc = GotOcr2ImageProcessorPil.from_pretrained(model_dir)
    for i, frame in enumerate(video.frames):
        from PIL import Image

        one = proc(images=[Image.fromarray(frame)], crop_to_patches=False, return_tensors="pt")[
            "pixel_values"
        ]
        assert torch.equal(frames[i : i + 1], one), i
    assert family.process(Modality.VIDEO, video, {}).num_tokens == len(video.frames) * family.tokens_per_tile


def test_max_dynamic_patch_matches_hf_and_enters_the_hash(model_dir):
    from mmserve.testing.reference import HFReference

    two = {"max_dynamic_patch": 2}
    ref = HFReference(model_dir, mm_processor_kwargs=two)
    llm = make_llm(model_dir, two)
    case = image_case([6], "Describe it.", sizes=[(64, 48)])
    out = run_and_compare(llm, lambda c: reference(ref, c, MAX_NEW), [case])[0]
    six = make_llm(model_dir, {})
    [full] = six.chat([case.messages], greedy())
    assert sum(t >= 2**62 for t in out.prompt_token_ids) < sum(t >= 2**62 for t in full.prompt_token_ids)
    data = png_bytes(case.media[0][1])
    assert llm.encoder.item_hash(Modality.IMAGE, data, {}) != six.encoder.item_hash(Modality.IMAGE, data, {})
    with pytest.raises(ValueError, match="max_dynamic_patch"):
        load_family(model_dir, mm_processor_kwargs={"max_tiles": 2})


def test_negative_control_tile_budget_left_out_of_the_hash(model_dir, monkeypatch):
    real = internvl.Family.hash_settings

    def without_budget(self, modality, settings):
        return {k: v for k, v in real(self, modality, settings).items() if k != "max_patches"}

    monkeypatch.setattr(internvl.Family, "hash_settings", without_budget)
    data = png_bytes(image_case([6], "x").media[0][1])
    one, six = make_llm(model_dir, {"max_dynamic_patch": 1}), make_llm(model_dir, {})
    # two tilings (1 tile, 7 tiles) of one image would share an embedding cache entry and a pad value
    assert one.encoder.item_hash(Modality.IMAGE, data, {}) == six.encoder.item_hash(Modality.IMAGE, data, {})


def test_negative_control_without_the_img_wrappers(model_dir, references, monkeypatch):
    case = image_case([7], "What is in it?")
    want = reference(references("internvl"), case, MAX_NEW).token_ids
    real = internvl.Family.render

    def bare(self, item):
        tok = self.tokenizer
        return real(self, item).replace(tok.start_image_token, "").replace(tok.end_image_token, "")

    monkeypatch.setattr(internvl.Family, "render", bare)
    [out] = make_llm(model_dir, {}).chat([case.messages], greedy())
    assert out.token_ids != want


def test_a_request_sets_its_own_tile_budget(model_dir, tiny_model):
    from mmserve.multimodal.errors import UnsupportedMediaError

    family = load_family(model_dir)
    image = image_case([8], "x", sizes=[(64, 48)]).media[0][1]
    [settings, none] = family.request_item_settings(
        [Modality.IMAGE, Modality.VIDEO], {"max_dynamic_patch": 2}
    )
    assert settings == {"max_patches": 2} and none == {}
    ours = family.process(Modality.IMAGE, image, settings)
    hf = GotOcr2ImageProcessorPil.from_pretrained(model_dir)(
        images=[image], crop_to_patches=True, max_patches=2, return_tensors="pt"
    )["pixel_values"]
    assert (
        torch.equal(ours.tensors["pixel_values"], hf)
        and ours.cost < family.process(Modality.IMAGE, image, {}).cost
    )
    llm = make_llm(model_dir, {})
    data = png_bytes(image)
    assert llm.encoder.item_hash(Modality.IMAGE, data, settings) != llm.encoder.item_hash(
        Modality.IMAGE, data, {}
    )
    for bad in ({"max_tiles": 2}, {"max_dynamic_patch": 0}, {"max_dynamic_patch": "2"}):
        with pytest.raises(ValueError):
            family.request_item_settings([Modality.IMAGE], bad)
    with pytest.raises(UnsupportedMediaError):
        family.process(Modality.VIDEO, video_case(5, "x").media[0][1], {"max_patches": 2})
