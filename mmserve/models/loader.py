"""Load checkpoints: a local directory or a hub id, through transformers.

Tests only ever pass local directories built by `mmserve.testing.tiny_models`; a hub id is resolved with
`huggingface_hub.snapshot_download` (which honours HF_HUB_OFFLINE and the local cache) for users who
have one.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from mmserve.config import ModelConfig

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}  # fmt: skip


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)} or 'auto'")
    return _DTYPES[name]


def resolve_model_path(path_or_id: str) -> str:
    """A local directory holding the checkpoint: `path_or_id` itself, or the hub snapshot of that id."""
    if os.path.isdir(path_or_id):
        return os.path.abspath(path_or_id)
    if path_or_id.startswith((".", "/", "~")) or path_or_id.count("/") != 1:
        raise FileNotFoundError(f"model directory {path_or_id!r} does not exist")
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(path_or_id, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.jinja",
                                                             "*.model", "*.tiktoken"])  # fmt: skip
    except Exception as e:  # no network, unknown repo, gated model...
        raise FileNotFoundError(f"cannot find model {path_or_id!r} locally or on the hub: {e}") from e


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
