"""The towers' activations in bf16 by table (encoder.activation_table, `bf16_lookup` in csrc/vision_ops.cpp): the
module's bits for every bf16 value and for tensors of any size; fp32 towers, other layouts and builds without
the kernels call the module; every family's encoder keeps its embeddings with them."""

from __future__ import annotations

import pytest
import torch
from transformers.activations import ACT2FN

from mmserve.config import MediaConfig
from mmserve.encoder.activation_table import TableActivation, bf16_table, tabulate_activations
from mmserve.encoder.runner import MediaInput, build_encoder
from mmserve.models.family import load_family
from mmserve.multimodal.items import Modality
from mmserve.multimodal.media import MediaRef
from tests.conftest import random_image
from tests.engine_helpers import png_bytes, wav_bytes
from tests.families import FAMILIES

ACTS = ["quick_gelu", "silu"]  # the towers' activations whose bits do not depend on where a value sits


@pytest.mark.parametrize("act", ACTS)
def test_the_table_gives_the_modules_bits_for_every_bf16_value(kernels, act):
    module = ACT2FN[act]
    table = bf16_table(module)
    every = (
        torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    )  # NaNs and infinities too
    out = TableActivation(module, table, kernels)(every)
    assert torch.equal(out.view(torch.int16), module(every).view(torch.int16))


@pytest.mark.parametrize("act", ACTS)
def test_lookups_of_any_size_are_the_modules(kernels, act):
    module = ACT2FN[act]
    table = TableActivation(module, bf16_table(module), kernels)
    torch.manual_seed(0)
    for shape in [(1,), (15,), (17, 3), (1024, 3072 + 5)]:  # vector tails and several threads' pieces
        x = (torch.randn(shape) * 6).to(torch.bfloat16)
        assert torch.equal(table(x), module(x)), shape
    wide = (torch.randn(8, 40) * 6).to(torch.bfloat16)
    strided = wide[:, ::2]  # not contiguous: the module itself
    assert torch.equal(table(strided), module(strided))
    assert torch.equal(table(wide.float()), module(wide.float()))  # fp32: the module itself


@pytest.mark.parametrize("act", ["gelu_pytorch_tanh", "gelu"])
def test_activations_whose_bits_depend_on_position_get_no_table(act):
    module = ACT2FN[act]
    assert bf16_table(module) is None
    x = torch.tensor([-5.125] * 15, dtype=torch.bfloat16)  # the scalar loop's -1.5e-7 in GELU-tanh, not -0
    padded = torch.cat([x, torch.zeros(49, dtype=torch.bfloat16)])  # the vectorized body's
    if act == "gelu_pytorch_tanh":
        assert not torch.equal(module(x).view(torch.int16), module(padded)[:15].view(torch.int16))


def test_only_bf16_towers_with_kernels_get_tables(kernels):
    tower = torch.nn.Sequential(
        torch.nn.Linear(4, 4), ACT2FN["quick_gelu"], torch.nn.SiLU(), ACT2FN["gelu_pytorch_tanh"]
    )
    assert tabulate_activations(tower, torch.float32, kernels) == 0
    assert tabulate_activations(tower, torch.bfloat16, None) == 0
    assert tabulate_activations(tower, torch.bfloat16, kernels) == 2
    assert isinstance(tower[1], TableActivation) and isinstance(tower[2], TableActivation)
    assert not isinstance(tower[3], TableActivation)
    assert not torch.equal(tower[1].table, tower[2].table)  # one table per kind and settings


TABLED = ("qwen2_vl", "qwen2_5_vl", "gemma4", "glm4v", "glm4v_moe", "qwen2_5_omni")


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_every_familys_encoder_keeps_its_bf16_embeddings(tiny_model, arch, kernels):
    family = load_family(tiny_model(arch))
    fused = build_encoder(family, "bfloat16", "cpu", 64, MediaConfig())
    plain = build_encoder(family, "bfloat16", "cpu", 64, MediaConfig(), cpu_kernels=False)
    try:
        tabled = any(isinstance(m, TableActivation) for m in fused.tower.modules())
        # QuickGELU, SiLU (Gemma 4's audio conformer, GLM's merger); the others' GELUs have none
        assert tabled == (arch in TABLED), arch
        assert not any(isinstance(m, TableActivation) for m in plain.tower.modules())
        items = []
        if Modality.AUDIO in family.modalities:
            items.append(MediaInput(Modality.AUDIO, MediaRef.from_bytes(wav_bytes(5, 0.6))))
        if Modality.IMAGE in family.modalities:
            items.append(MediaInput(Modality.IMAGE, MediaRef.from_bytes(png_bytes(random_image(4, 80, 64)))))
        for item in items:
            a, b = fused.encode(item), plain.encode(item)
            for name, tensor in a.tensors.items():
                assert torch.equal(tensor, b.tensors[name]), (item.modality, name)
    finally:
        fused.close()
        plain.close()
