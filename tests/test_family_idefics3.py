"""Idefics3 / SmolVLM family: tiles, expansion and video preprocessing against transformers' own code, and the
negative control of the global image.

The oracle is transformers' `Idefics3Processor` / `SmolVLMProcessor` (PIL image processors, their text
expansion) and HF `generate` on the same tiny checkpoints (the session's, `tiny_model`). SmolVLM's video processor
needs torchvision: its frame sampling is checked here against its own `sample_frames`, and each sampled frame
against the image processor with the video processor's settings, frame by frame.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from PIL import Image

from mmserve import LLM
from mmserve.config import MediaConfig
from mmserve.encoder.runner import MultimodalEncoder
from mmserve.models import idefics3
from mmserve.models.family import load_family
from mmserve.multimodal.errors import UnsupportedMediaError
from mmserve.multimodal.items import MAIN, Modality, MultimodalItem
from mmserve.multimodal.media import DecodedVideo
from mmserve.sampling_params import SamplingParams
from tests.engine_helpers import image_case, png_bytes, reference

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
VIDEO_PROMPT = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "The video shows"}]}]


def random_image(seed: int, width: int, height: int) -> Image.Image:
    return Image.fromarray((np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8"))


def random_video(seed: int, frames: int, fps: float) -> DecodedVideo:
    pixels = (np.random.RandomState(seed).rand(frames, 40, 56, 3) * 255).astype("uint8")
    return DecodedVideo(pixels, fps, frames / fps, tuple(i / fps for i in range(frames)))


@pytest.fixture(scope="module")
def setup(tiny_model):
    """arch -> (model dir, family, HF's own processor)."""
    made = {}

    def get(arch: str, **kwargs):
        key = (arch, tuple(sorted(kwargs)))
        if key not in made:
            family = load_family(tiny_model(arch), mm_processor_kwargs=kwargs)
            made[key] = (tiny_model(arch), family, idefics3.hf_processor(tiny_model(arch), family))
        return made[key]

    return get


def ours_and_hf(family, hf_proc, messages, media):
    """(our expanded HF ids, our tower inputs, HF's processor outputs) for template messages and decoded media."""
    text = family.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = [family.process(m, obj, {}) for m, obj in media]
    items = [
        MultimodalItem(t.modality, bytes([i]) * 16, t.num_tokens, t.metadata) for i, t in enumerate(inputs)
    ]
    ids = family.tokenizer(text, add_special_tokens=False)["input_ids"]
    kwargs = {"text": [text], "return_tensors": "pt"}
    images = [obj for m, obj in media if m == Modality.IMAGE]
    videos = [obj for m, obj in media if m == Modality.VIDEO]
    if images:
        kwargs["images"] = [images]
    if videos:
        hf_proc.video_processor.videos = videos
        kwargs["videos"] = [v.frames for v in videos]
    return family.expand(ids, items).hf_token_ids, inputs, hf_proc(**kwargs)


# -- images: tiles and expansion ------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["idefics3", "smolvlm"])
@pytest.mark.parametrize("size", [(64, 48), (20, 70), (200, 30), (24, 24)])
def test_image_tiles_and_expansion_match_hf(setup, arch, size):
    _, family, hf_proc = setup(arch)
    image = random_image(sum(size), *size)
    ids, (ours,), theirs = ours_and_hf(family, hf_proc, PROMPT, [(Modality.IMAGE, image)])
    assert torch.equal(ours.tensors["pixel_values"], theirs["pixel_values"][0])
    assert ids == theirs["input_ids"][0].tolist()
    meta = family.meta(ours.metadata)
    assert ours.num_tokens == (meta.rows * meta.cols + 1) * family.tokens_per_tile == ours.cost * 4
    row_col = family.tokenizer.convert_tokens_to_ids(f"<row_{meta.rows}_col_{meta.cols}>")
    assert (row_col in ids) == (meta.rows > 0)  # the last tile's marker sits inside the item's text


def test_tile_settings_match_hf_and_enter_the_content_hash(setup):
    """`do_image_splitting` and `size` (`--mm-processor-kwargs`) choose the tiles: HF's processor with the same
    settings agrees, and each gives the same image another content hash."""
    image = random_image(3, 64, 48)
    data, hashes, tiles = png_bytes(image), set(), []
    for kwargs in ({}, {"do_image_splitting": False}, {"size": {"longest_edge": 64}}):
        _, family, hf_proc = setup("idefics3", **kwargs)
        ids, (ours,), theirs = ours_and_hf(family, hf_proc, PROMPT, [(Modality.IMAGE, image)])
        assert torch.equal(ours.tensors["pixel_values"], theirs["pixel_values"][0])
        assert ids == theirs["input_ids"][0].tolist()
        tiles.append(ours.cost)
        hashes.add(MultimodalEncoder(family, None, None, MediaConfig()).item_hash(Modality.IMAGE, data, {}))
    assert tiles == [10, 1, 5] and len(hashes) == 3
    with pytest.raises(ValueError, match="unknown mm processor settings"):
        load_family(setup("idefics3")[0], mm_processor_kwargs={"max_image_size": {"longest_edge": 64}})
    with pytest.raises(UnsupportedMediaError):
        setup("idefics3")[1].hash_settings(Modality.IMAGE, {"tiles": 4})


# -- SmolVLM2 video ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("frames", "fps"), [(4, 2.0), (30, 2.0), (1, 1.0), (9, 3.0)])
def test_video_frames_are_sampled_and_preprocessed_as_hf(setup, frames, fps):
    """Frame indices as `SmolVLMVideoProcessor.sample_frames` (its own code) picks them, and every kept frame is the
    image processor's global image under the video processor's settings, frame by frame."""
    from transformers import SmolVLMImageProcessorPil
    from transformers.models.smolvlm.video_processing_smolvlm import SmolVLMVideoProcessor
    from transformers.video_utils import VideoMetadata

    model_dir, family, _ = setup("smolvlm")
    s = family.video_settings
    video = random_video(frames, frames, fps)
    hf_self = types.SimpleNamespace(num_frames=s["num_frames"], fps=s["fps"])
    metadata = VideoMetadata(total_num_frames=frames, fps=fps, duration=video.duration_s)
    want = SmolVLMVideoProcessor.sample_frames(hf_self, metadata, num_frames=s["num_frames"], fps=s["fps"])
    ours = family.process(Modality.VIDEO, video, {})
    meta = family.meta(ours.metadata)
    assert meta.timestamps == tuple(video.timestamps_s[i] for i in want)
    if frames == 30:  # a long video: a second skipped at each end
        assert want[0] == int(fps) and len(want) == s["num_frames"]
    proc = SmolVLMImageProcessorPil.from_pretrained(model_dir)
    settings = {k: s[k] for k in ("size", "max_image_size", "resample", "image_mean", "image_std")}
    for pixels, i in zip(ours.tensors["pixel_values"], want, strict=True):
        one = proc(
            Image.fromarray(video.frames[i]), do_image_splitting=False, return_tensors="pt", **settings
        )
        assert torch.equal(pixels, one["pixel_values"][0, 0])
    assert ours.num_tokens == len(want) * family.tokens_per_tile


def test_video_expansion_matches_hf(setup):
    """HF's processor writes the video's text (frame count in words, duration, a timestamp per frame) from the
    metadata of our frames; the expansion is token for token its own, beside an image in the same prompt."""
    _, family, hf_proc = setup("smolvlm")
    video = random_video(5, 30, 2.0)
    ids, (item,), theirs = ours_and_hf(family, hf_proc, VIDEO_PROMPT, [(Modality.VIDEO, video)])
    assert ids == theirs["input_ids"][0].tolist()
    assert torch.equal(item.tensors["pixel_values"], theirs["pixel_values"][0])
    text = family.tokenizer.decode(ids)
    assert "series of three frames from a 0:00:15 [H:MM:SS] video" in text and "Frame from 00:14:" in text


def test_encode_equals_hf_features(setup, references):
    _, family, _ = setup("smolvlm")
    batch = [
        family.process(Modality.IMAGE, random_image(1, 64, 48), {}),
        family.process(Modality.VIDEO, random_video(2, 4, 2.0), {}),
        family.process(Modality.IMAGE, random_image(3, 20, 20), {}),
    ]
    model = references("smolvlm").model.model
    with torch.no_grad():
        fused = family.encode(family.load_tower(torch.float32), batch)
        for item, ours in zip(batch, fused, strict=True):
            want = model.get_image_features(item.tensors["pixel_values"][None]).pooler_output[0]
            assert ours[MAIN].shape == (item.num_tokens, family.hidden_size)
            torch.testing.assert_close(ours[MAIN], want, rtol=1e-5, atol=1e-5)  # fp32 rows differ in a batch


# -- negative control --------------------------------------------------------------------------------------------
def test_without_the_global_image_the_tokens_differ(setup, references, monkeypatch):
    """SmolVLM with the global image replaced by the first tile (its rows no longer the whole image's) gives
    other greedy tokens than HF: the tokens do depend on the global image."""
    model_dir, _, _ = setup("smolvlm")
    case = image_case([7], "What is in this picture?", sizes=[(64, 48)])
    want = reference(references("smolvlm"), case, GREEDY.max_tokens).token_ids
    assert LLM(model_dir, kv_cache_mb=8).chat([case.messages], GREEDY)[0].token_ids == want
    real = idefics3.split_image

    def no_global(processor, images, **settings):
        pixels, rows, cols = real(processor, images, **settings)
        if rows:
            pixels = pixels.clone()
            pixels[-1] = pixels[0]
        return pixels, rows, cols

    monkeypatch.setattr(idefics3, "split_image", no_global)
    assert LLM(model_dir, kv_cache_mb=8).chat([case.messages], GREEDY)[0].token_ids != want
