"""Load checkpoints: a local directory or a hub id, through transformers.

Tests only ever pass local directories built by `mmserve.testing.tiny_models`; a hub id is resolved with
`huggingface_hub.snapshot_download` (which honours HF_HUB_OFFLINE and the local cache) for users who
have one.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from mmserve.config import ModelConfig

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}  # fmt: skip


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":  # a config holds a concrete dtype: "auto" is resolved once, when the config is built
        raise ValueError("dtype 'auto' must be resolved first: resolve_dtype(model_path, 'auto', device)")
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)} or 'auto'")
    return _DTYPES[name]


def resolve_dtype(model_path: str, dtype: str, device: str = "cpu") -> str:
    """The concrete dtype name ("float32", "bfloat16", "float16") to run `model_path` in on `device`.

    "auto" (like vLLM's): the checkpoint's own dtype (config.json `dtype` / `torch_dtype`, at the top level or
    in `text_config`), float32 when it names none or float32. A half-precision checkpoint runs in bfloat16 on
    a CPU with native bf16 (float16 there has no fast kernels) and in float32 on one without; on a GPU in its
    own dtype, bfloat16 falling back to float16 where the GPU lacks bf16. Any other name is checked and
    spelled out."""
    if dtype != "auto":
        return str(parse_dtype(dtype)).removeprefix("torch.")
    wanted = checkpoint_dtype(model_path)
    if wanted in (None, torch.float32):
        return "float32"
    kind = torch.device(device).type
    if kind == "cpu":
        return "bfloat16" if cpu_has_bf16() else "float32"
    if wanted == torch.bfloat16 and kind == "cuda" and not torch.cuda.is_bf16_supported():
        return "float16"
    return str(wanted).removeprefix("torch.")


def checkpoint_dtype(model_path: str) -> torch.dtype | None:
    """The dtype config.json names, or None (no config, no dtype, or one we do not run)."""
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    for section in (config, config.get("text_config") if isinstance(config, dict) else None):
        if not isinstance(section, dict):
            continue
        name = section.get("dtype") or section.get("torch_dtype")
        if isinstance(name, str) and name in _DTYPES:
            return _DTYPES[name]
    return None


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bf16 natively (x86 AVX512-BF16 or AMX-BF16, Arm BF16). Without it torch
    converts around every bf16 matmul, slower than float32. torch.backends.cpu.get_cpu_capability() names
    only the vector width, so the kernel's flags are read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):  # x86, Arm; every core lists the same
                    return bool({"avx512_bf16", "amx_bf16", "bf16"} & set(line.split(":", 1)[-1].split()))
    except OSError:
        pass
    return False  # not Linux, or no flags line: float32 is always correct


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
