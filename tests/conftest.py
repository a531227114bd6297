"""Shared fixtures: tiny offline checkpoints of every model family, built once per test session."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from mmserve.testing.tiny_models import KIT, build_tiny_model

ARCHS = tuple(KIT)  # every family in mmserve.models.family.FAMILIES


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """arch -> directory of its tiny checkpoint (built on first use, shared by the whole session)."""
    built: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in built:
            built[arch] = build_tiny_model(str(tmp_path_factory.mktemp(f"tiny_{arch}")), arch=arch)
        return built[arch]

    return get


@pytest.fixture(scope="session")
def tiny_qwen2_vl(tiny_model) -> str:
    return tiny_model("qwen2_vl")


@pytest.fixture(scope="session")
def tiny_qwen2_5_vl(tiny_model) -> str:
    return tiny_model("qwen2_5_vl")


@pytest.fixture(scope="session")
def tiny_qwen3_vl(tiny_model) -> str:
    return tiny_model("qwen3_vl")


@pytest.fixture(scope="session")
def tiny_llava_onevision(tiny_model) -> str:
    return tiny_model("llava_onevision")


@pytest.fixture(scope="session")
def tiny_qwen2_audio(tiny_model) -> str:
    return tiny_model("qwen2_audio")


@pytest.fixture(scope="session", params=["qwen2_vl", "qwen2_5_vl"])
def tiny_model_dir(request, tiny_model) -> str:
    return tiny_model(request.param)


def random_image(seed: int, width: int = 64, height: int = 48) -> Image.Image:
    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(height, width, 3) * 255).astype("uint8"))
