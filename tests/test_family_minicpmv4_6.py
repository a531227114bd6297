"""MiniCPM-V 4.6 family: sliced preprocessing, the placeholder text and the tower against transformers' own code,
and the negative controls of what the family adds (the windowed merger, `max_slice_nums` in the content hash).

The oracle is HF's `MiniCPMV4_6Processor` (its PIL image processor and its placeholder text) and HF `generate` on the
tiny checkpoint. HF's video processor needs torchvision, which cannot run beside this CPU torch: video pixels come
from our preprocessing, checked here frame by frame against the image processor with the video processor's
settings, and the frames' units against the video processor's own size formulas. Positions (plain 0..L-1) are
checked against HF's model on image and video prompts by tests/test_conformance.py.
"""

from __future__ import annotations

import json

import msgspec
import numpy as np
import pytest
import torch
from PIL import Image
from transformers import MiniCPMV4_6ImageProcessorPil
from transformers.models.minicpmv4_6.modeling_minicpmv4_6 import MiniCPMV4_6ViTWindowAttentionMerger
from transformers.models.minicpmv4_6.video_processing_minicpmv4_6 import MiniCPMV4_6VideoProcessor

from mmserve.config import MediaConfig
from mmserve.encoder.runner import MultimodalEncoder
from mmserve.models import minicpmv4_6
from mmserve.models.family import EmbeddingMismatch, load_family
from mmserve.multimodal.errors import UnsupportedMediaError
from mmserve.multimodal.items import MAIN, ItemEmbedding, Modality, MultimodalItem
from mmserve.multimodal.media import DecodedVideo
from mmserve.testing.reference import HFReference
from tests.conftest import random_image
from tests.engine_helpers import image_case, png_bytes, reference
from tests.test_engine_parity import MAX_NEW, greedy, make_llm, run_and_compare

ARCH = "minicpmv4_6"


@pytest.fixture(scope="module")
def model_dir(tiny_model) -> str:
    return tiny_model(ARCH)


@pytest.fixture(scope="module")
def family(model_dir):
    return load_family(model_dir)


@pytest.fixture(scope="module")
def hf_proc(model_dir, family):
    return minicpmv4_6.hf_processor(model_dir, family)


def clip(seed: int, frames: int = 3, width: int = 64, height: int = 48) -> DecodedVideo:
    pixels = (np.random.RandomState(seed).rand(frames, height, width, 3) * 255).astype("uint8")
    return DecodedVideo(pixels, 2.0, frames / 2, tuple(i / 2 for i in range(frames)))


def hf_inputs(hf_proc, text: str, images=(), videos=()):
    kwargs = {"text": [text], "return_tensors": "pt"}
    if images:
        kwargs["images"] = [list(images)]
    if videos:
        hf_proc.video_processor.videos = list(videos)
        kwargs["videos"] = [v.frames for v in videos]
    return hf_proc(**kwargs)


def our_ids(family, hf_proc, text: str, tower_inputs) -> list[int]:
    ids = hf_proc.tokenizer(text)["input_ids"]
    items = [
        MultimodalItem(t.modality, bytes([i]) * 16, t.num_tokens, t.metadata)
        for i, t in enumerate(tower_inputs)
    ]
    return family.expand(ids, items).hf_token_ids


# -- preprocessing, units and the placeholder text ----------------------------------------------------------------
@pytest.mark.parametrize("size", [(64, 48), (48, 80), (16, 16), (130, 20), (5, 90), (100, 100)])
def test_image_pixels_units_and_ids_match_hf(family, hf_proc, size):
    image = random_image(sum(size), *size)
    ours = family.process(Modality.IMAGE, image, {})
    text = "Look:<|image_pad|>\nwhat is it?"
    theirs = hf_inputs(hf_proc, text, images=[image])
    assert torch.equal(ours.tensors["pixel_values"], theirs["pixel_values"])
    assert torch.equal(ours.tensors["target_sizes"], theirs["target_sizes"])
    assert our_ids(family, hf_proc, text, [ours]) == theirs["input_ids"][0].tolist()
    meta = family.meta(ours.metadata)
    assert (
        family.layout(Modality.IMAGE, meta.original_hw) == meta
    )  # what a precomputed embedding's size implies
    assert ours.num_tokens == sum(h * w // 16 for h, w in meta.sizes)


def test_images_and_videos_number_their_ids_per_modality(family, hf_proc):
    """`<image_id>k</image_id>` counts the prompt's images and its videos apart, in prompt order."""
    images = [random_image(1, 64, 48), random_image(2, 48, 80), random_image(3, 16, 16)]
    videos = [clip(4), clip(5, frames=2, width=40, height=90)]
    text = "a <|image_pad|> b<|video_pad|>\nc <|image_pad|>d<|video_pad|><|image_pad|>"
    theirs = hf_inputs(hf_proc, text, images=images, videos=videos)
    ours = [family.process(Modality.IMAGE, im, {}) for im in images]
    vids = [family.process(Modality.VIDEO, v, {}) for v in videos]
    in_order = [ours[0], vids[0], ours[1], vids[1], ours[2]]
    assert our_ids(family, hf_proc, text, in_order) == theirs["input_ids"][0].tolist()
    decoded = hf_proc.tokenizer.decode(theirs["input_ids"][0])
    assert decoded.count("<image_id>1</image_id>") == 2 and decoded.count("<image_id>2</image_id>") == 1


def test_video_frames_are_the_image_processor_with_the_video_settings(model_dir, family):
    video = clip(6)
    ours = family.process(Modality.VIDEO, video, {})
    with open(f"{model_dir}/video_preprocessor_config.json") as f:
        raw = json.load(f)
    settings = {k: raw[k] for k in ("max_slice_nums", "scale_resolution", "patch_size", "slice_mode")}
    assert settings["max_slice_nums"] == 2  # the kit's frames slice apart from its images (9)
    proc = MiniCPMV4_6ImageProcessorPil.from_pretrained(model_dir)
    per_frame = [proc([Image.fromarray(f)], return_tensors="pt", **settings) for f in video.frames]
    assert torch.equal(
        ours.tensors["pixel_values"], torch.cat([o["pixel_values"] for o in per_frame], dim=-1)
    )
    assert torch.equal(ours.tensors["target_sizes"], torch.cat([o["target_sizes"] for o in per_frame]))
    # The units are the ones HF's video processor computes for these frames (its formulas need no torchvision).
    vp = MiniCPMV4_6VideoProcessor.from_pretrained(model_dir)
    hw = video.frames.shape[1:3]
    grid = vp.get_sliced_grid(hw, vp.max_slice_nums, vp.scale_resolution)
    source = vp.find_best_resize(hw, vp.scale_resolution, vp.patch_size, allow_upscale=grid is None)
    refine = vp.get_refine_size(hw, grid, vp.scale_resolution, vp.patch_size, allow_upscale=True)
    meta = family.meta(ours.metadata)
    p = vp.patch_size
    slice_hw = (refine[0] // grid[0] // p, refine[1] // grid[1] // p)
    assert meta.grid == tuple(grid) == (1, 2) and meta.frames == 3
    assert meta.sizes == ((source[0] // p, source[1] // p), *[slice_hw] * 2)
    assert ours.num_tokens == 3 * (4 + 2 * 4)


def test_fused_encode_equals_hf_features(family, references):
    model = references(ARCH).model.model
    batch = [
        family.process(Modality.IMAGE, random_image(7, 64, 48), {}),
        family.process(Modality.VIDEO, clip(8), {}),
        family.process(Modality.IMAGE, random_image(9, 20, 20), {}),
    ]
    with torch.no_grad():
        fused = family.encode(family.load_tower(torch.float32), batch)
        for item, ours in zip(batch, fused, strict=True):
            t = item.tensors
            if item.modality == Modality.VIDEO:
                want = model.get_video_features(t["pixel_values"], t["target_sizes"]).pooler_output
            else:
                want = model.get_image_features(t["pixel_values"], t["target_sizes"]).pooler_output
            assert ours[MAIN].shape == (item.num_tokens, family.hidden_size)
            torch.testing.assert_close(ours[MAIN], torch.cat(want), rtol=1e-5, atol=1e-5)
    assert len({out[MAIN].untyped_storage().data_ptr() for out in fused}) == len(batch)


# -- settings: max_slice_nums -----------------------------------------------------------------------------------
def test_max_slice_nums_setting_matches_hf_and_stays_apart_in_the_hash(model_dir, family, monkeypatch):
    two = load_family(model_dir, mm_processor_kwargs={"max_slice_nums": 3})
    image = random_image(10, 64, 48)
    nine, fewer = family.process(Modality.IMAGE, image, {}), two.process(Modality.IMAGE, image, {})
    assert (family.meta(nine.metadata).grid, two.meta(fewer.metadata).grid) == ((2, 2), (1, 2))
    theirs = hf_inputs(minicpmv4_6.hf_processor(model_dir, two), "<|image_pad|>", images=[image])
    assert torch.equal(fewer.tensors["pixel_values"], theirs["pixel_values"])
    assert (
        our_ids(two, minicpmv4_6.hf_processor(model_dir, two), "<|image_pad|>", [fewer])
        == theirs["input_ids"][0].tolist()
    )

    data = png_bytes(image)

    def digest(fam, modality=Modality.IMAGE):
        return MultimodalEncoder(fam, None, None, MediaConfig()).item_hash(modality, data, {})

    for modality in (Modality.IMAGE, Modality.VIDEO):
        assert digest(family, modality) != digest(two, modality)
    # Negative control: without max_slice_nums in the hash, the two settings' embeddings collide.
    real = minicpmv4_6.Family.hash_settings
    monkeypatch.setattr(
        minicpmv4_6.Family,
        "hash_settings",
        lambda self, m, s: {k: v for k, v in real(self, m, s).items() if k != "max_slice_nums"},
    )
    assert digest(family) == digest(two)
    with pytest.raises(ValueError, match="max_slice_nums"):
        load_family(model_dir, mm_processor_kwargs={"tiles": 2})


def test_settings_are_plain_data_and_unknown_item_settings_are_refused(family):
    image, video = family.hash_settings(Modality.IMAGE, {}), family.hash_settings(Modality.VIDEO, {})
    json.dumps([image, video])
    assert (image["max_slice_nums"], video["max_slice_nums"]) == (9, 2)
    for call in (family.hash_settings, lambda m, s: family.process(m, random_image(0, 8, 8), s)):
        with pytest.raises(UnsupportedMediaError):
            call(Modality.IMAGE, {"max_slice_nums": 1})


def test_check_item_refuses_mismatched_embeddings(family):
    item = family.process(Modality.IMAGE, random_image(14, 64, 48), {})
    rows = torch.zeros(item.num_tokens, family.hidden_size)
    family.check_item(ItemEmbedding(Modality.IMAGE, b"h" * 16, {MAIN: rows}, item.metadata))
    bad_meta = msgspec.msgpack.encode(minicpmv4_6.VisionMeta((48, 64), (2, 2), ((8, 8),)))
    for tensors, metadata in [
        ({MAIN: rows[1:]}, item.metadata),
        ({MAIN: rows}, b"junk"),
        ({MAIN: rows}, bad_meta),
    ]:
        with pytest.raises(EmbeddingMismatch):
            family.check_item(ItemEmbedding(Modality.IMAGE, b"h" * 16, tensors, metadata))


# -- negative control: the windowed merger -------------------------------------------------------------------------
def test_negative_control_merger_with_full_attention_changes_the_tokens(model_dir, oracles, monkeypatch):
    """The window merger attends within each 2x2 window; attending across the whole unit instead must fail parity."""
    llm = make_llm(model_dir, {})
    run_and_compare(llm, oracles(ARCH), [image_case([60], "Describe it.")])
    cases = [image_case([61], "Describe it."), image_case([62], "What is it?", sizes=[(48, 80)])]
    want = [oracles(ARCH)(c).token_ids for c in cases]
    real = MiniCPMV4_6ViTWindowAttentionMerger.forward

    def whole_units(self, hidden_states, target_sizes, **kwargs):
        # the merger's attention over each unit's tokens at once instead of each 2x2 window (the windows of a
        # unit are contiguous in the merger's order, so the units' bounds stay the same)
        sizes = target_sizes[:, 0] * target_sizes[:, 1]
        units = torch.nn.functional.pad(torch.cumsum(sizes, dim=0, dtype=torch.int32), (1, 0))
        attention = self.self_attn
        attend = type(attention).forward
        attention.forward = lambda hidden_states, cu_seqlens, max_seqlen, **kw: attend(
            attention, hidden_states, units, None, **kw
        )
        try:
            return real(self, hidden_states, target_sizes, **kwargs)
        finally:
            del attention.forward

    monkeypatch.setattr(MiniCPMV4_6ViTWindowAttentionMerger, "forward", whole_units)
    outputs = llm.chat([c.messages for c in cases], [greedy() for _ in cases])
    assert [o.token_ids for o in outputs] != want


def test_max_slice_nums_setting_gives_hf_tokens(model_dir, oracles):
    """The setting reaches both sides: an engine with 3 agrees with HF's processor with 3, whose prompt is
    shorter than with the kit's 9 (fewer slices)."""
    case = image_case([63], "Describe it.")
    ref = HFReference(model_dir, mm_processor_kwargs={"max_slice_nums": 3})
    fewer = reference(ref, case, MAX_NEW)
    llm = make_llm(model_dir, {"max_slice_nums": 3})
    run_and_compare(llm, lambda c: fewer, [case])
    assert len(fewer.input_ids) < len(oracles(ARCH)(case).input_ids)
