"""Load checkpoints: a local directory or a hub id, through transformers.

Tests only ever pass local directories built by `mmserve.testing.tiny_models`; a hub id is resolved to its
local snapshot first (`mmserve.models.resolve.resolve_model_path`, for users who have one).
"""

from __future__ import annotations

from typing import Any

import torch

from mmserve.config import ModelConfig
from mmserve.models.resolve import dtype_name


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """The torch dtype of a (canonical or alias) name; "auto" must have been resolved (models.resolve)."""
    return name if isinstance(name, torch.dtype) else getattr(torch, dtype_name(name))


def load_hf_config(path: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def load_model_config(path: str, max_model_len: int | None = None) -> ModelConfig:
    return ModelConfig.from_hf(path, load_hf_config(path), max_model_len=max_model_len)


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def load_model(path: str, dtype: str | torch.dtype = "float32", device: str = "cpu",
               attn_implementation: str | dict | None = None):  # fmt: skip
    """The full Hugging Face model (towers and language model) in eval mode: the parity oracle and the
    `hf` bench baseline. Serving loads the halves on their own (see mmserve.models.family)."""
    from transformers import AutoModelForMultimodalLM

    kwargs: dict[str, Any] = {"dtype": parse_dtype(dtype)}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForMultimodalLM.from_pretrained(path, **kwargs)
    return model.to(device).eval()
