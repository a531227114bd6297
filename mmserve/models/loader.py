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


def load_processor(path: str, hf_config=None, mm_processor_kwargs: dict[str, Any] | None = None):
    """The model family's multimodal processor (see mmserve.multimodal.processors)."""
    from mmserve.multimodal.processors.base import processor_class

    hf_config = hf_config or load_hf_config(path)
    return processor_class(hf_config.model_type).from_pretrained(path, hf_config, mm_processor_kwargs or {})


def load_model(path: str, dtype: str | torch.dtype = "float32", device: str = "cpu",
               attn_implementation: str | dict | None = None):  # fmt: skip
    """The full image-text-to-text model in eval mode."""
    from transformers import AutoModelForImageTextToText

    kwargs: dict[str, Any] = {"dtype": parse_dtype(dtype)}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForImageTextToText.from_pretrained(path, **kwargs)
    return model.to(device).eval()


def _family(model_type: str):
    # Model-specific loading lives in the family's module; this table picks it.
    from mmserve.models import qwen2_vl

    families = {"qwen2_vl": qwen2_vl, "qwen2_5_vl": qwen2_vl}
    if model_type not in families:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {sorted(families)}")
    return families[model_type]


def load_language_model(path: str, hf_config, dtype: str | torch.dtype, attn_implementation: str,
                        device: str = "cpu"):  # fmt: skip
    """Only the language model and its head (no vision weights are read)."""
    lm = _family(hf_config.model_type).load_language_model(
        path, hf_config, parse_dtype(dtype), attn_implementation
    )
    lm.model.to(device)
    lm.lm_head.to(device)
    return lm


def load_vision_tower(path: str, hf_config, dtype: str | torch.dtype, device: str = "cpu") -> torch.nn.Module:
    """Only the vision tower (no language-model weights are read)."""
    return _family(hf_config.model_type).load_vision_tower(path, hf_config, parse_dtype(dtype)).to(device)
