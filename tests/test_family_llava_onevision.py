"""LLaVA-OneVision family: preprocessing, token counts and greedy tokens against transformers' own code.

The oracle is HF's `LlavaOnevisionProcessor` (PIL image processor, its placeholder expansion) and HF
`generate` on the same tiny checkpoint. HF's video processor needs torchvision, which cannot run beside this
CPU torch: video pixels for the oracle come from our preprocessing, which is checked here against the PIL
image processor applied frame by frame.
"""

from __future__ import annotations

import base64
import json
import os
import shutil

import msgspec
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from transformers import LlavaOnevisionImageProcessorPil

from mmserve import LLM
from mmserve.config import MediaConfig
from mmserve.models import llava_onevision
from mmserve.models.family import load_family
from mmserve.models.loader import load_hf_config
from mmserve.multimodal.errors import UnsupportedMediaError
from mmserve.multimodal.items import MAIN, Modality, MultimodalItem
from mmserve.multimodal.media import DecodedVideo, decode_image, decode_video
from mmserve.multimodal.messages import parse_messages
from mmserve.sampling_params import SamplingParams
from mmserve.testing.reference import HFReference
from mmserve.testing.tiny_models import build_tiny_model
from tests.engine_helpers import mp4_bytes, png_bytes

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


# -- media --------------------------------------------------------------------------------------------
def random_image(seed: int, width: int, height: int) -> Image.Image:
    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(height, width, 3) * 255).astype("uint8"))


def conversation(media: list[tuple[Modality, bytes]], text: str) -> tuple[list, list]:
    """(OpenAI-style messages for mmserve, decoded media for the HF oracle: what the server decodes)."""
    parts = []
    for modality, data in media:
        kind, mime = ("image_url", "image/png") if modality == Modality.IMAGE else ("video_url", "video/mp4")
        parts.append({"type": kind, kind: {"url": f"data:{mime};base64," + base64.b64encode(data).decode()}})
    content = [*parts, {"type": "text", "text": text}] if media else text
    cfg = MediaConfig()
    decoded = [(m, decode_image(d, cfg) if m == Modality.IMAGE else decode_video(d, cfg)) for m, d in media]
    return [{"role": "user", "content": content}], decoded


# -- fixtures -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("llava_onevision")), arch="llava_onevision")


@pytest.fixture(scope="module")
def family(model_dir):
    return load_family(model_dir)


@pytest.fixture(scope="module")
def hf_proc(model_dir, family):
    return llava_onevision.hf_processor(model_dir, family)


@pytest.fixture(scope="module")
def reference(model_dir):
    return HFReference(model_dir)


CASES = {
    "text": ([], "Describe the image in one sentence."),
    "image": ([(Modality.IMAGE, png_bytes(random_image(1, 64, 48)))], "What is in this picture?"),
    "two_images": (
        [
            (Modality.IMAGE, png_bytes(random_image(2, 50, 30))),
            (Modality.IMAGE, png_bytes(random_image(3, 20, 70))),
        ],
        "Compare the two images.",
    ),
    "video": ([(Modality.VIDEO, mp4_bytes(4))], "The video shows"),
    "image_video": (
        [(Modality.IMAGE, png_bytes(random_image(5, 40, 90))), (Modality.VIDEO, mp4_bytes(6))],
        "Numbers",
    ),
}


@pytest.fixture(scope="module")
def expected(reference) -> dict[str, list[int]]:
    out = {}
    for name, (media, text) in CASES.items():
        messages, decoded = conversation(media, text)
        out[name] = reference.generate(
            parse_messages(messages)[0], decoded, max_new_tokens=GREEDY.max_tokens
        ).token_ids
    return out


def hf_inputs(hf_proc, text: str, images=(), videos=()):
    kwargs = {"text": [text], "return_tensors": "pt"}
    if images:
        kwargs["images"] = [list(images)]  # one sample: HF counts its images (batch_num_images)
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


# -- preprocessing and token counts ---------------------------------------------------------------------
@pytest.mark.parametrize("size", [(64, 48), (50, 30), (20, 70), (33, 97), (100, 10), (5, 5), (32, 32)])
def test_single_image_anyres_matches_hf(family, hf_proc, size):
    image = random_image(sum(size), *size)
    (settings,) = family.item_settings([Modality.IMAGE])
    assert settings == {"anyres": True}
    ours = family.process(Modality.IMAGE, image, settings)
    text = "Look: <image>\nwhat is it?"
    theirs = hf_inputs(hf_proc, text, images=[image])
    tiles = ours.tensors["pixel_values"].shape[0]
    assert tiles > 1  # base tile + grid
    assert torch.equal(ours.tensors["pixel_values"], theirs["pixel_values"][0])
    assert our_ids(family, hf_proc, text, [ours]) == theirs["input_ids"][0].tolist()


def test_several_images_are_padded_base_tiles(family, hf_proc):
    images = [random_image(7, 50, 30), random_image(8, 20, 70), random_image(9, 32, 32)]
    settings = family.item_settings([Modality.IMAGE, Modality.VIDEO, Modality.IMAGE, Modality.IMAGE])
    assert settings == [{"anyres": False}, {}, {"anyres": False}, {"anyres": False}]
    ours = [family.process(Modality.IMAGE, im, {"anyres": False}) for im in images]
    text = "a <image>\n b <image>\n c <image>\n d"
    theirs = hf_inputs(hf_proc, text, images=images)
    for i, item in enumerate(ours):
        assert item.tensors["pixel_values"].shape[0] == 1
        assert torch.equal(item.tensors["pixel_values"], theirs["pixel_values"][i][:1])
        assert item.num_tokens == 16 + 1  # base tile + one newline
    assert our_ids(family, hf_proc, text, ours) == theirs["input_ids"][0].tolist()


def test_video_frames_match_image_processor_and_hf_tokens(model_dir, family, hf_proc):
    frames = (np.random.RandomState(0).rand(3, 48, 64, 3) * 255).astype("uint8")
    ours = family.process(Modality.VIDEO, DecodedVideo(frames, 2.0, 1.5, (0.0, 0.5, 1.0)), {})
    # The image processor's base tile of an anyres image is that image resized (stretched) to the tile size,
    # rescaled and normalized: what HF's video processor does to every frame.
    proc = LlavaOnevisionImageProcessorPil.from_pretrained(model_dir)
    per_frame = proc(
        [Image.fromarray(f) for f in frames], image_grid_pinpoints=[[32, 32]], return_tensors="pt"
    )
    assert torch.equal(ours.tensors["pixel_values"], per_frame["pixel_values"][:, 0])
    assert ours.num_tokens == 3 * 2 * 2 + 1  # frames x ceil(4 / 2)^2 + one newline
    video = DecodedVideo(frames, 2.0, 1.5, (0.0, 0.5, 1.0))
    text = "clip <video>\n and <image>\n"
    image = random_image(10, 30, 40)
    theirs = hf_inputs(hf_proc, text, images=[image], videos=[video])
    assert theirs["pixel_values_videos"].shape == (1, 3, 3, 32, 32)
    items = [ours, family.process(Modality.IMAGE, image, {"anyres": True})]
    assert our_ids(family, hf_proc, text, items) == theirs["input_ids"][0].tolist()


def test_anyres_max_downscale_counts_match_hf(model_dir):
    """`anyres_max_1` shrinks every grid above about one tile: the token formula and the packed rows agree."""
    hf_config = load_hf_config(model_dir)
    hf_config.vision_aspect_ratio = "anyres_max_1"
    family = load_family(model_dir, hf_config)
    hf_proc = llava_onevision.hf_processor(model_dir, family)
    hf_proc.vision_aspect_ratio = "anyres_max_1"
    tower = family.load_tower(torch.float32)
    for size in [(64, 48), (96, 30), (40, 90), (64, 64)]:
        image = random_image(11, *size)
        ours = family.process(Modality.IMAGE, image, {"anyres": True})
        theirs = hf_inputs(hf_proc, "<image>", images=[image])
        assert [ours.num_tokens] == [theirs["input_ids"].shape[1]]
        (rows,) = family.encode(tower, [ours])
        assert rows[MAIN].shape == (ours.num_tokens, family.hidden_size)
    assert ours.num_tokens == 16 + 4 * (4 + 1)  # 64x64: the 8x8 grid shrunk to 4x4, each row + a newline


def test_settings_enter_the_hash_and_unknown_ones_are_refused(family):
    tiled = family.hash_settings(Modality.IMAGE, {"anyres": True})
    assert tiled != family.hash_settings(Modality.IMAGE, {"anyres": False})
    assert tiled["image_grid_pinpoints"] and tiled["vision_feature_layer"] == -1
    json.dumps(tiled)  # plain data
    for modality, bad in [
        (Modality.IMAGE, {"anyres": 1}),
        (Modality.IMAGE, {"tiles": 4}),
        (Modality.VIDEO, {"anyres": True}),
    ]:
        with pytest.raises(UnsupportedMediaError):
            family.hash_settings(modality, bad)
        with pytest.raises(UnsupportedMediaError):
            family.process(modality, random_image(0, 8, 8), bad)


def mixed_batch(family) -> list:
    video = DecodedVideo(
        (np.random.RandomState(1).rand(2, 40, 40, 3) * 255).astype("uint8"), 2.0, 1.0, (0.0, 0.5)
    )
    return [
        family.process(Modality.IMAGE, random_image(12, 64, 48), {"anyres": True}),
        family.process(Modality.VIDEO, video, {}),
        family.process(Modality.IMAGE, random_image(13, 20, 70), {"anyres": False}),
    ]


def hf_features(model, item) -> torch.Tensor:
    """HF's own `get_image_features` / `get_video_features` for one tower input."""
    pixels = item.tensors["pixel_values"][None]
    if item.modality == Modality.VIDEO:
        return model.get_video_features(pixels).pooler_output[0]
    meta = msgspec.msgpack.decode(item.metadata, type=llava_onevision.VisionMeta)
    num_images = torch.tensor([1 if meta.anyres else 2])  # HF tiles a sample's only image
    return model.get_image_features(
        pixels, torch.tensor([meta.original_hw]), batch_num_images=num_images
    ).pooler_output[0]


def test_fused_encode_equals_hf_features(family, reference):
    batch = mixed_batch(family)
    with torch.no_grad():
        fused = family.encode(family.load_tower(torch.float32), batch)
        theirs = [hf_features(reference.model.model, item) for item in batch]
    assert len({out[MAIN].untyped_storage().data_ptr() for out in fused}) == len(batch)  # own storage each
    for item, ours, want in zip(batch, fused, theirs, strict=True):
        assert ours[MAIN].shape == (item.num_tokens, family.hidden_size)
        torch.testing.assert_close(
            ours[MAIN], want, rtol=1e-5, atol=1e-5
        )  # fp32 GEMM rows differ in the batch


def test_feature_layer_list_matches_hf(model_dir):
    """`vision_feature_layer` as a list concatenates those hidden states (the projector is wider)."""
    from transformers import LlavaOnevisionModel

    hf_config = load_hf_config(model_dir)
    hf_config.vision_feature_layer = [-2, -1]
    family = load_family(model_dir, hf_config)
    torch.manual_seed(0)
    model = LlavaOnevisionModel(hf_config).eval()
    tower = llava_onevision.Tower(hf_config, torch.float32)
    tower.load_state_dict(
        {k: v for k, v in model.state_dict().items() if not k.startswith("language_model.")}
    )
    batch = mixed_batch(family)
    with torch.no_grad():
        for item, ours in zip(batch, family.encode(tower, batch), strict=True):
            torch.testing.assert_close(ours[MAIN], hf_features(model, item), rtol=1e-5, atol=1e-5)


def test_both_checkpoint_layouts_load_the_same_weights(model_dir, tmp_path):
    """transformers 5's layout (`model.*`, flat SigLIP) and the original one (`vision_tower.vision_model.*`,
    `language_model.lm_head`), with an untied head, load into equal modules."""
    saved = load_file(os.path.join(model_dir, "model.safetensors"))
    head = torch.randn_like(saved["language_model.model.embed_tokens.weight"])
    layouts = {
        "new": {
            "language_model.model.": "model.language_model.",
            "vision_tower.": "model.vision_tower.",
            "multi_modal_projector.": "model.multi_modal_projector.",
            "image_newline": "model.image_newline",
            "lm_head.": "lm_head.",
        },
        "old": {
            "language_model.model.": "language_model.model.",
            "vision_tower.": "vision_tower.vision_model.",
            "multi_modal_projector.": "multi_modal_projector.",
            "image_newline": "image_newline",
            "lm_head.": "language_model.lm_head.",
        },
    }
    loaded = {}
    for name, renames in layouts.items():
        out = str(tmp_path / name)
        shutil.copytree(model_dir, out, ignore=shutil.ignore_patterns("model.safetensors"))
        tensors = {**saved, "lm_head.weight": head}
        renamed = {}
        for key, tensor in tensors.items():
            old = next(p for p in renames if key.startswith(p))
            renamed[renames[old] + key[len(old) :]] = tensor.contiguous()
        save_file(renamed, os.path.join(out, "model.safetensors"))
        family = load_family(out)
        lm = family.load_language_model(torch.float32, "sdpa")
        loaded[name] = (
            {**family.load_tower(torch.float32).state_dict(), **lm.model.state_dict()},
            lm.lm_head.weight,
        )
    (new, new_head), (old, old_head) = loaded["new"], loaded["old"]
    assert new.keys() == old.keys() and all(torch.equal(new[k], old[k]) for k in new)
    assert torch.equal(new_head, head) and torch.equal(old_head, head)


# -- greedy tokens against HF generate ------------------------------------------------------------------
@pytest.mark.parametrize("max_num_batched_tokens", [2048, 7, 1])
def test_greedy_tokens_equal_hf(model_dir, expected, max_num_batched_tokens):
    llm = LLM(model_dir, kv_cache_mb=8, max_num_batched_tokens=max_num_batched_tokens)
    outputs = llm.chat([conversation(*case)[0] for case in CASES.values()], GREEDY)
    assert {name: out.token_ids for name, out in zip(CASES, outputs, strict=True)} == expected
    llm.check_integrity()


def compressed_positions(expanded):
    """Qwen-style M-RoPE compression on one row: an item's tokens share one position, text resumes after it."""
    starts = {it.offset: it.span for it in expanded.items}
    values, index, pos = [], 0, 0
    while index < len(expanded.token_ids):
        span = starts.get(index, 1)
        values += [pos] * span
        index, pos = index + span, pos + 1
    positions = torch.tensor(values).view(1, -1)
    return positions, int(positions.max()) + 1 - len(values)


def test_mrope_like_positions_change_tokens(model_dir, reference, monkeypatch):
    """Negative control: LLaVA item tokens advance positions one by one; sharing one position fails parity."""
    media, text = [(Modality.IMAGE, png_bytes(random_image(21, 64, 48)))], "What is in this picture?"
    messages, decoded = conversation(media, text)
    want = reference.generate(
        parse_messages(messages)[0], decoded, max_new_tokens=GREEDY.max_tokens
    ).token_ids
    llm = LLM(model_dir, kv_cache_mb=8)
    assert llm.chat([messages], GREEDY)[0].token_ids == want
    monkeypatch.setattr(llm.engine.family, "positions", compressed_positions)
    media, text = [(Modality.IMAGE, png_bytes(random_image(22, 64, 48)))], "What is in this picture?"
    messages, decoded = conversation(media, text)
    want = reference.generate(
        parse_messages(messages)[0], decoded, max_new_tokens=GREEDY.max_tokens
    ).token_ids
    assert llm.chat([messages], GREEDY)[0].token_ids != want


def test_check_item_refuses_mismatched_embeddings(family):
    from mmserve.models.family import EmbeddingMismatch
    from mmserve.multimodal.items import ItemEmbedding

    item = family.process(Modality.IMAGE, random_image(14, 64, 48), {"anyres": True})
    rows = torch.zeros(item.num_tokens, family.hidden_size)
    family.check_item(ItemEmbedding(Modality.IMAGE, b"h" * 16, {MAIN: rows}, item.metadata))
    bad_meta = msgspec.msgpack.encode(llava_onevision.VisionMeta(5, (0, 32), (48, 64), True))
    for tensors, metadata in [
        ({MAIN: rows[1:]}, item.metadata),
        ({MAIN: rows}, b"junk"),
        ({MAIN: rows}, bad_meta),
    ]:
        with pytest.raises(EmbeddingMismatch):
            family.check_item(ItemEmbedding(Modality.IMAGE, b"h" * 16, tensors, metadata))
