"""Shared fixtures: tiny offline checkpoints built once per test session."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from mmserve.testing.tiny_models import build_tiny_model


@pytest.fixture(scope="session")
def tiny_qwen2_vl(tmp_path_factory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny_qwen2_vl")), arch="qwen2_vl")


@pytest.fixture(scope="session")
def tiny_qwen2_5_vl(tmp_path_factory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny_qwen2_5_vl")), arch="qwen2_5_vl")


@pytest.fixture(scope="session", params=["qwen2_vl", "qwen2_5_vl"])
def tiny_model_dir(request, tiny_qwen2_vl, tiny_qwen2_5_vl) -> str:
    return tiny_qwen2_vl if request.param == "qwen2_vl" else tiny_qwen2_5_vl


def random_image(seed: int, width: int = 64, height: int = 48) -> Image.Image:
    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(height, width, 3) * 255).astype("uint8"))
