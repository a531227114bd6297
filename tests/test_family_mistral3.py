"""Mistral 3 family: preprocessing, expansion and tower features against transformers' own code; the 2-D vision
positions as a negative control; Mistral-native checkpoints refused at load.

The oracle is HF's `PixtralProcessor` (its PIL image processor, its `[IMG]` / `[IMG_BREAK]` / `[IMG_END]`
expansion) and HF's `Mistral3ForConditionalGeneration` on the same tiny checkpoint (longest edge 64, 8-pixel
patches merged 2 x 2: up to 4 x 4 tokens an image).
"""

from __future__ import annotations

import json
import os

import msgspec
import numpy as np
import pytest
import torch
from PIL import Image

from mmserve.models import mistral3
from mmserve.models.family import EmbeddingMismatch, load_family
from mmserve.models.layer_specs import AttentionSpec
from mmserve.models.loader import load_hf_config
from mmserve.models.resolve import resolve_model_path
from mmserve.multimodal.errors import UnsupportedMediaError
from mmserve.multimodal.items import MAIN, ItemEmbedding, Modality, MultimodalItem
from tests.engine_helpers import image_case, reference
from tests.test_engine_parity import MAX_NEW, greedy, make_llm, run_and_compare

# (width, height): within the longest edge, beyond it (shrunk), not multiples of 16 (rounded up), tall, tiny
SIZES = [(64, 48), (48, 80), (100, 30), (33, 97), (20, 20), (17, 64), (64, 64)]


def random_image(seed: int, width: int, height: int) -> Image.Image:
    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(height, width, 3) * 255).astype("uint8"))


@pytest.fixture(scope="module")
def model_dir(tiny_model) -> str:
    return tiny_model("mistral3")


@pytest.fixture(scope="module")
def family(model_dir):
    return load_family(model_dir)


@pytest.fixture(scope="module")
def ref(references):
    return references("mistral3")


def hf_inputs(ref, text: str, images: list):
    return ref.processor(text=[text], images=[images] if images else None, return_tensors="pt")


def our_expansion(family, ref, text: str, tower_inputs):
    ids = ref.processor.tokenizer(text)["input_ids"]
    items = [
        MultimodalItem(t.modality, bytes([i + 1]) * 16, t.num_tokens, t.metadata)
        for i, t in enumerate(tower_inputs)
    ]
    return family.expand(ids, items)


# -- preprocessing and expansion --------------------------------------------------------------------------------
def test_pixels_sizes_and_expansion_match_pixtral_processor(family, ref):
    images = [random_image(i, *wh) for i, wh in enumerate(SIZES)]
    text = "<s>[INST]" + "".join(f"look [IMG] {i} " for i in range(len(images))) + "now?[/INST]"
    theirs = hf_inputs(ref, text, images)
    ours = [family.process(Modality.IMAGE, im, {}) for im in images]
    for i, item in enumerate(ours):
        height, width = family.meta(item.metadata).image_hw
        assert [height, width] == theirs["image_sizes"][i].tolist()
        assert height % 16 == 0 and width % 16 == 0 and max(height, width) <= 64
        # HF pads a request's images to its largest sides; ours keeps each image's own.
        assert torch.equal(item.tensors["pixel_values"], theirs["pixel_values"][i, :, :height, :width])
        assert item.num_tokens == (height // 16) * (width // 16)
    expanded = our_expansion(family, ref, text, ours)
    assert expanded.hf_token_ids == theirs["input_ids"][0].tolist()
    # Pad values only where HF has [IMG]; the breaks and the end are the item's text, inside its span.
    img, brk, end = (
        ref.processor.tokenizer.convert_tokens_to_ids(t) for t in ("[IMG]", "[IMG_BREAK]", "[IMG_END]")
    )
    for item, tower_input in zip(expanded.items, ours, strict=True):
        rows, cols = family.grid(family.meta(tower_input.metadata))
        engine = expanded.token_ids[item.offset : item.end]
        hf = expanded.hf_token_ids[item.offset : item.end]
        assert item.span == rows * (cols + 1) and engine.count(item.pad_value) == item.num_tokens
        assert [t == item.pad_value for t in engine] == [t == img for t in hf]
        assert hf[-1] == end and hf.count(brk) == rows - 1
        assert all(hf[(r + 1) * (cols + 1) - 1] == brk for r in range(rows - 1))


def test_settings_enter_the_hash_and_unknown_ones_are_refused(family, model_dir):
    settings = family.hash_settings(Modality.IMAGE, {})
    assert settings["size"] == {"longest_edge": 64} and settings["patch_size"] == 8
    assert settings["spatial_merge_size"] == 2
    json.dumps(settings)
    for modality, bad in [(Modality.IMAGE, {"anyres": True}), (Modality.VIDEO, {})]:
        with pytest.raises(UnsupportedMediaError):
            family.hash_settings(modality, bad)
        with pytest.raises(UnsupportedMediaError):
            family.process(modality, random_image(0, 8, 8), bad)
    with pytest.raises(ValueError, match="takes none"):
        load_family(model_dir, mm_processor_kwargs={"longest_edge": 32})


def test_check_item_refuses_mismatched_embeddings(family):
    item = family.process(Modality.IMAGE, random_image(3, 64, 48), {})
    rows = torch.zeros(item.num_tokens, family.hidden_size)
    family.check_item(ItemEmbedding(Modality.IMAGE, b"h" * 16, {MAIN: rows}, item.metadata))
    off_grid = msgspec.msgpack.encode(mistral3.ImageMeta((40, 64)))
    for tensors, metadata in [
        ({MAIN: rows[1:]}, item.metadata),
        ({MAIN: rows}, b"junk"),
        ({MAIN: rows}, off_grid),
    ]:
        with pytest.raises(EmbeddingMismatch):
            family.check_item(ItemEmbedding(Modality.IMAGE, b"h" * 16, tensors, metadata))


def test_mistral_sliding_window_applies_to_every_layer(model_dir):
    hf_config = load_hf_config(model_dir)
    assert all(s.window is None for s in load_family(model_dir, hf_config).layer_specs)
    hf_config.text_config.sliding_window = 6
    specs = load_family(model_dir, hf_config).layer_specs
    text = hf_config.text_config
    assert (
        specs == (AttentionSpec(text.num_key_value_heads, text.head_dim, window=6),) * text.num_hidden_layers
    )


# -- the tower ---------------------------------------------------------------------------------------------------
def test_fused_encode_equals_hf_image_features(family, ref):
    """One fused forward over images of several sizes (one sequence, block-diagonal mask, 2-D positions) equals
    HF's `get_image_features` on the padded batch HF's processor makes; the rows of each image alone too."""
    images = [random_image(10 + i, *wh) for i, wh in enumerate(SIZES[:4])]
    batch = [family.process(Modality.IMAGE, im, {}) for im in images]
    theirs = hf_inputs(ref, "[IMG]" * len(images), images)
    tower = family.load_tower(torch.float32)
    with torch.no_grad():
        fused = family.encode(tower, batch)
        want = ref.model.model.get_image_features(theirs["pixel_values"], theirs["image_sizes"]).pooler_output
        alone = [family.encode(tower, [item])[0] for item in batch]
    assert len({out[MAIN].untyped_storage().data_ptr() for out in fused}) == len(batch)  # own storage each
    for item, ours, solo, hf in zip(batch, fused, alone, want, strict=True):
        assert ours[MAIN].shape == (item.num_tokens, family.hidden_size)
        torch.testing.assert_close(ours[MAIN], hf, rtol=1e-5, atol=1e-5)  # fp32 GEMM rows differ in the batch
        torch.testing.assert_close(solo[MAIN], hf, rtol=1e-5, atol=1e-5)


def test_a_one_token_image_encodes(family):
    """A 16 x 16 image is one LM token; transformers' `get_image_features` cannot split a lone token's rows."""
    item = family.process(Modality.IMAGE, random_image(5, 16, 16), {})
    assert item.num_tokens == 1
    with torch.no_grad():
        (out,) = family.encode(family.load_tower(torch.float32), [item])
    assert out[MAIN].shape == (1, family.hidden_size)


# -- greedy tokens ------------------------------------------------------------------------------------------------
def test_images_of_many_shapes_with_small_chunks_equal_hf(model_dir, ref):
    cases = [
        image_case([31, 32, 33], "Compare them.", sizes=[(100, 30), (33, 97), (20, 20)]),
        image_case([34], "Describe it.", system="Answer briefly.", sizes=[(17, 64)]),
    ]
    run_and_compare(
        make_llm(model_dir, {}, max_num_batched_tokens=7), lambda c: reference(ref, c, MAX_NEW), cases
    )


def one_d_positions(module, args):
    """A forward pre-hook on Pixtral's rotary embedding: each patch's (row, column) replaced by its row-major index
    on both axes, i.e. 1-D positions as a plain ViT would number its patches."""
    embeds, positions = args
    width = int(positions[:, 1].max()) + 1
    flat = positions[:, 0] * width + positions[:, 1]
    return embeds, torch.stack([flat, flat], dim=-1)


def test_one_d_vision_positions_change_tokens(model_dir, ref, monkeypatch):
    """Negative control: the tower fed 1-D instead of 2-D patch positions no longer matches HF."""
    case = image_case([41], "What is in this picture?", sizes=[(64, 48)])
    want = reference(ref, case, MAX_NEW).token_ids
    assert make_llm(model_dir, {}).chat([case.messages], greedy())[0].token_ids == want
    load_tower = mistral3.Family.load_tower

    def one_d_tower(self, dtype):
        tower = load_tower(self, dtype)
        tower.vision_tower.patch_positional_embedding.register_forward_pre_hook(one_d_positions)
        return tower

    monkeypatch.setattr(mistral3.Family, "load_tower", one_d_tower)
    assert make_llm(model_dir, {}).chat([case.messages], greedy())[0].token_ids != want


# -- Mistral-native checkpoints ----------------------------------------------------------------------------------
def test_mistral_native_checkpoints_are_refused_at_load(tmp_path, model_dir):
    from mmserve import LLM

    native = tmp_path / "native"
    native.mkdir()
    (native / "params.json").write_text(json.dumps({"dim": 5120, "vision_encoder": {}}))
    (native / "consolidated.safetensors").write_bytes(b"")
    (native / "tekken.json").write_text("{}")
    for load in (resolve_model_path, LLM):
        with pytest.raises(ValueError, match="Mistral-native checkpoint") as e:
            load(str(native))
        assert "mistral-common" in str(e.value) and "config.json" in str(e.value)
    (native / "params.json").unlink()  # consolidated weights alone say the same
    with pytest.raises(ValueError, match="Mistral-native"):
        resolve_model_path(str(native))
    # A directory with both formats is an HF-format checkpoint: its native weights are never read.
    os.symlink(os.path.join(model_dir, "config.json"), native / "config.json")
    assert resolve_model_path(str(native)) == str(native)
