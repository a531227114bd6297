"""GLM-4.1V family (`glm4v`, and GLM-4.5V's `glm4v_moe` sharing its module): preprocessing, expansion and 3-D
positions against transformers' own code, and negative controls that must change the greedy tokens.

The oracle is HF's `Glm4vProcessor` (its PIL image processor, its expansion of images and of timestamped
videos) and HF `generate` on the same tiny checkpoint. HF's video processor needs torchvision, which cannot
run beside this CPU torch: the frame sampling and the video pixels are ours, checked here against the GLM
video processor's own torchvision-free parts (`sample_frames`, `smart_resize`, `patchify`) and, frame by
frame, against the image processor.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Glm4vImageProcessorPil

# From the module itself: the `transformers.models.glm4v` namespace hands out a torchvision-guarded dummy.
from transformers.models.glm4v.video_processing_glm4v import Glm4vVideoProcessor, smart_resize
from transformers.video_utils import VideoMetadata

from mmserve.models import glm4v
from mmserve.multimodal.items import Modality, MultimodalItem
from mmserve.multimodal.media import DecodedVideo
from tests.conftest import random_image
from tests.engine_helpers import image_case, template_messages, video_case
from tests.families import FAMILIES
from tests.test_engine_parity import greedy, make_llm

ARCH = "glm4v"


@pytest.fixture(scope="module")
def ref(references):
    return references(ARCH)


@pytest.fixture(scope="module")
def family(ref):
    return ref.family


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model(ARCH)


def clip(seed: int, frames: int, width: int = 64, height: int = 48, fps: float = 2.0) -> DecodedVideo:
    rng = np.random.RandomState(seed)
    pixels = (rng.rand(frames, height, width, 3) * 255).astype("uint8")
    return DecodedVideo(pixels, fps, frames / fps, tuple(i / fps for i in range(frames)))


def hf_and_ours(ref, family, content: list[dict], images=(), videos=()):
    """(HF's processor outputs, our expanded prompt) for one user turn of template `content`."""
    text = ref.tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    kwargs = {"text": [text], "return_tensors": "pt"}
    if images:
        kwargs["images"] = [list(images)]
    if videos:
        ref.processor.video_processor.videos = list(videos)
        kwargs["videos"] = [v.frames for v in videos]
    theirs = ref.processor(**kwargs)
    inputs = [family.process(Modality.IMAGE, im, {}) for im in images]
    inputs += [family.process(Modality.VIDEO, v, {}) for v in videos]
    items = [
        MultimodalItem(t.modality, bytes([i]) * 16, t.num_tokens, t.metadata) for i, t in enumerate(inputs)
    ]
    ours = family.expand(ref.tokenizer(text)["input_ids"], items)
    return theirs, ours, inputs


# -- images -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("size", [(64, 48), (48, 80), (30, 200), (113, 57), (10, 10)])
def test_image_pixels_and_expansion_equal_hf(ref, family, size):
    image = random_image(sum(size), *size)
    theirs, ours, (item,) = hf_and_ours(
        ref, family, [{"type": "image"}, {"type": "text", "text": "What?"}], [image]
    )
    assert torch.equal(item.tensors["pixel_values"], theirs["pixel_values"])
    assert list(family.meta(item.metadata).grid_thw) == theirs["image_grid_thw"][0].tolist()
    assert ours.hf_token_ids == theirs["input_ids"][0].tolist()


# -- video: sampling, size, layout ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "frames, fps, duration, target",
    [(4, 2.0, 2.0, 2.0), (7, 2.0, 3.5, 2.0), (10, 5.0, 2.0, 2.0), (3, 2.0, 1.5, 1.0), (1, 1.0, 1.0, 2.0),
     (30, 1.0, 0.0, 2.0), (40, 0.1, 400.0, 0.05), (8, 1.0, 400.0, 0.05)],
)  # fmt: skip
def test_frame_sampling_is_the_glm_video_processors(frames, fps, duration, target):
    processor = Glm4vVideoProcessor(fps=target, max_duration=300)
    metadata = VideoMetadata(total_num_frames=frames, fps=fps, duration=duration or None)
    theirs = processor.sample_frames(metadata)
    assert glm4v.sample_frames(frames, fps, duration, target, 300) == theirs.tolist()


@pytest.mark.parametrize("frames, height, width", [(4, 48, 64), (6, 200, 90), (2, 20, 300), (8, 480, 640)])
def test_clip_size_is_the_glm_video_processors(family, frames, height, width):
    cfg = family.cfg
    video = clip(frames, frames, width, height)
    item = family.process(Modality.VIDEO, video, {})
    _, gh, gw = family.meta(item.metadata).grid_thw
    h, w = smart_resize(frames, height, width, 2, cfg.factor, cfg.video_min_pixels, cfg.video_max_pixels)
    assert (gh * cfg.patch_size, gw * cfg.patch_size) == (h, w)


def test_video_pixels_frame_by_frame_against_the_image_processor(model_dir, family):
    video = clip(5, 6)
    item = family.process(Modality.VIDEO, video, {})
    t, gh, gw = family.meta(item.metadata).grid_thw
    p, tp = family.cfg.patch_size, family.cfg.temporal_patch_size
    h, w = gh * p, gw * p
    assert t == 3
    frames = [np.asarray(Image.fromarray(f).resize((w, h), Image.Resampling.BICUBIC)) for f in video.frames]
    image_processor = Glm4vImageProcessorPil.from_pretrained(model_dir)
    per_frame = [
        image_processor(images=[Image.fromarray(f)], do_resize=False, return_tensors="pt")["pixel_values"]
        for f in frames
    ]
    # Each image patch holds its frame twice along the temporal patch axis; a video patch holds two frames.
    rows = item.tensors["pixel_values"].view(t, gh * gw, 3, tp, p, p)
    for k, frame in enumerate(per_frame):
        assert torch.equal(rows[k // tp, :, :, k % tp], frame.view(gh * gw, 3, tp, p, p)[:, :, 0])
    # The same rows as the GLM video processor's own patchify over the normalized frames.
    normalized = torch.stack(
        [
            torch.from_numpy(
                image_processor.normalize(
                    image_processor.rescale(f.transpose(2, 0, 1).astype(np.float32), 1 / 255),
                    image_processor.image_mean,
                    image_processor.image_std,
                )
            )
            for f in frames
        ]
    )[None]
    patches, *grid = Glm4vVideoProcessor().patchify(normalized, p, 2, tp)
    assert grid == [t, gh, gw]
    torch.testing.assert_close(item.tensors["pixel_values"], patches[0], atol=1e-6, rtol=0)


def test_video_expansion_holds_timestamps_as_hf(ref, family):
    video = clip(6, 7, fps=1.0)  # 7 frames at 1 fps: all kept, the last twice; pairs start at 0, 2, 4, 6 s
    content = [{"type": "video"}, {"type": "text", "text": "Describe."}]
    theirs, ours, (item,) = hf_and_ours(ref, family, content, videos=[video])
    assert ours.hf_token_ids == theirs["input_ids"][0].tolist()
    text = ref.tokenizer.decode(theirs["input_ids"][0])
    assert "<|end_of_image|>0<|begin_of_image|>" in text and "<|end_of_image|>6<|end_of_video|>" in text
    assert list(family.meta(item.metadata).grid_thw) == theirs["video_grid_thw"][0].tolist()


# -- 3-D positions ------------------------------------------------------------------------------------------
PROMPTS = {
    "image": ([{"type": "image"}, {"type": "text", "text": "What is it?"}], [(48, 80)], []),
    "video": ([{"type": "video"}, {"type": "text", "text": "And this?"}], [], [(6, 64, 48)]),
    "mixed": (
        [{"type": "image"}, {"type": "text", "text": "then"}, {"type": "video"}, {"type": "image"},
         {"type": "text", "text": "Compare."}],
        [(64, 48), (113, 57)],
        [(4, 90, 60)],
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(PROMPTS))
def test_positions_equal_transformers_get_rope_index(ref, family, name):
    content, image_sizes, video_shapes = PROMPTS[name]
    images = [random_image(i, *s) for i, s in enumerate(image_sizes)]
    videos = [clip(9 + i, n, w, h) for i, (n, w, h) in enumerate(video_shapes)]
    theirs, ours, _ = hf_and_ours(ref, family, content, images, videos)
    assert ours.hf_token_ids == theirs["input_ids"][0].tolist()
    expected, delta = ref.model.model.get_rope_index(
        theirs["input_ids"],
        mm_token_type_ids=theirs["mm_token_type_ids"],
        image_grid_thw=theirs.get("image_grid_thw"),
        video_grid_thw=theirs.get("video_grid_thw"),
    )
    positions, rope_delta = family.positions(ours)
    assert torch.equal(positions, expected[:, 0])
    assert rope_delta == int(delta)


# -- negative controls: each bug must change the greedy tokens -------------------------------------------
@pytest.fixture(scope="module")
def llm(model_dir):
    return make_llm(model_dir, FAMILIES[ARCH].mm_kwargs)


def tokens(llm, case) -> list[int]:
    llm.engine.scheduler.prefix_cache.reset()  # nothing computed by another variant is reused
    return llm.chat([case.messages], [greedy()])[0].token_ids


def oracle_tokens(ref, case) -> list[int]:
    return ref.generate(
        template_messages(case.messages), case.media, max_new_tokens=greedy().max_tokens
    ).token_ids


def test_control_image_positions_height_and_width_swapped(llm, ref, monkeypatch):
    case = image_case([70], "What is in it?", sizes=[(80, 48)])  # a 3 x 4 merged grid: the axes differ
    expected = oracle_tokens(ref, case)
    assert tokens(llm, case) == expected
    family = llm.engine.family
    real = type(family).grid_positions

    def swapped(grid_thw, interval=1.0):
        grid, advance = real(family, grid_thw, interval)
        return grid[[0, 2, 1]], advance

    monkeypatch.setattr(family, "grid_positions", swapped)
    assert tokens(llm, case) != expected


def test_control_image_with_1d_positions(llm, ref, monkeypatch):
    case = image_case([71], "Describe it.", sizes=[(64, 48)])
    expected = oracle_tokens(ref, case)
    assert tokens(llm, case) == expected
    family = llm.engine.family

    def sequential(expanded):
        length = len(expanded.token_ids)
        return torch.arange(length).view(1, -1).expand(3, -1), 0

    monkeypatch.setattr(family, "positions", sequential)
    assert tokens(llm, case) != expected


def test_control_video_without_timestamps(llm, ref, monkeypatch):
    case = video_case(72, "Describe the video.")
    expected = oracle_tokens(ref, case)
    assert tokens(llm, case) == expected
    monkeypatch.setattr(llm.engine.family, "timestamp_ids", lambda seconds: ())
    assert tokens(llm, case) != expected
