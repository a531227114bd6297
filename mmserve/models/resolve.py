"""Which dtype and which checkpoint directory a server runs: decided from names and files, without torch.

The CLI resolves `--dtype` and `--model` before it starts anything; keeping this torch-free lets `mmserve
serve` spawn its engine process (which imports torch anyway) before its own API process has imported
torch, instead of one after the other (~4 s of each start-up on two cores).
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os

from mmserve.cpu_info import cpu_flags

log = logging.getLogger(__name__)

# Accepted spellings -> the canonical name that configs carry (and torch.<name> is).
DTYPE_NAMES = {
    **{"float32": "float32", "fp32": "float32"},
    **{"bfloat16": "bfloat16", "bf16": "bfloat16"},
    **{"float16": "float16", "fp16": "float16", "half": "float16"},
}


def dtype_name(name: str) -> str:
    """The canonical name of a dtype spelling; "auto" must have been resolved (see `resolve_dtype`)."""
    if name == "auto":  # a config holds a concrete dtype: "auto" is resolved once, when the config is built
        raise ValueError("dtype 'auto' must be resolved first: resolve_dtype(model_path, 'auto', device)")
    if name not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(DTYPE_NAMES)} or 'auto'")
    return DTYPE_NAMES[name]


def resolve_dtype(model_path: str, dtype: str, device: str = "cpu") -> str:
    """The concrete dtype name ("float32", "bfloat16", "float16") to run `model_path` in on `device`.

    "auto" (like vLLM's): the checkpoint's own dtype (config.json `dtype` / `torch_dtype`, at the top level or
    in `text_config`), float32 when it names none or float32. A half-precision checkpoint runs in bfloat16 on
    a CPU with native bf16 (float16 there has no fast kernels) and in float32 on one without; on a GPU in its
    own dtype, bfloat16 falling back to float16 where the GPU lacks bf16. Any other name is checked and
    spelled out; an explicit bfloat16 on a CPU without native bf16 is kept, with a warning."""
    if dtype != "auto":
        name = dtype_name(dtype)
        if name == "bfloat16" and device.split(":", 1)[0] == "cpu" and not cpu_has_bf16():
            log.warning(
                "bfloat16 on a CPU without native bf16 (AVX512-BF16 / AMX): its matmuls take a slow fallback, "
                "several times slower than float32 (what --dtype auto picks on this CPU)"
            )
        return name
    wanted = checkpoint_dtype(model_path)
    if wanted in (None, "float32"):
        return "float32"
    kind = device.split(":", 1)[0]
    if kind == "cpu":
        return "bfloat16" if cpu_has_bf16() else "float32"
    if wanted == "bfloat16" and kind == "cuda":
        import torch  # a GPU server loads torch anyway; only CUDA can say whether it has bf16

        if not torch.cuda.is_bf16_supported():
            return "float16"
    return wanted


def checkpoint_dtype(model_path: str) -> str | None:
    """The canonical dtype name config.json names, or None (no config, no dtype, or one we do not run)."""
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    for section in (config, config.get("text_config") if isinstance(config, dict) else None):
        if not isinstance(section, dict):
            continue
        name = section.get("dtype") or section.get("torch_dtype")
        if isinstance(name, str) and name in DTYPE_NAMES:
            return DTYPE_NAMES[name]
    return None


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bf16 natively (x86 AVX512-BF16 or AMX-BF16, Arm BF16). Without it torch
    converts around every bf16 matmul, slower than float32. torch.backends.cpu.get_cpu_capability() names
    only the vector width, so the kernel's flags are read."""
    # No flags read (not Linux): float32, which is always right.
    return bool({"avx512_bf16", "amx_bf16", "bf16"} & cpu_flags())


def resolve_model_path(path_or_id: str) -> str:
    """A local directory holding the checkpoint: `path_or_id` itself, or the hub snapshot of that id. Raises
    FileNotFoundError when there is none, ValueError for a Mistral-native checkpoint (`check_hf_format`)."""
    if os.path.isdir(path_or_id):
        return check_hf_format(os.path.abspath(path_or_id))
    if path_or_id.startswith((".", "/", "~")) or path_or_id.count("/") != 1:
        raise FileNotFoundError(f"model directory {path_or_id!r} does not exist")
    from huggingface_hub import snapshot_download

    try:
        patterns = ["*.json", "*.safetensors", "*.txt", "*.jinja", "*.model", "*.tiktoken"]
        # Mistral's repositories may carry their native weights beside the HF-format shards: never read here.
        path = snapshot_download(
            path_or_id, allow_patterns=patterns, ignore_patterns=[MISTRAL_NATIVE_WEIGHTS]
        )
    except Exception as e:  # no network, unknown repo, gated model...
        raise FileNotFoundError(f"cannot find model {path_or_id!r} locally or on the hub: {e}") from e
    return check_hf_format(path)


MISTRAL_NATIVE_WEIGHTS = "consolidated*.safetensors"


def check_hf_format(path: str) -> str:
    """`path`, unless it holds a Mistral-native checkpoint (`params.json`, `consolidated*.safetensors`, no
    `config.json`): that format needs `mistral-common`, which mmserve does not use, so it is refused (ValueError)
    naming the Hugging Face format to use instead."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    native = os.path.exists(os.path.join(path, "params.json")) or bool(
        fnmatch.filter(os.listdir(path), MISTRAL_NATIVE_WEIGHTS)
    )
    if native:
        raise ValueError(
            f"{path} holds a Mistral-native checkpoint (params.json, consolidated*.safetensors, no config.json), "
            "which needs mistral-common; mmserve loads the Hugging Face format (config.json + model*.safetensors, "
            "e.g. Mistral3ForConditionalGeneration for Mistral Small 3.x). Use a repository or revision that "
            "ships that format (many of Mistral's ship both), or convert the checkpoint with transformers' "
            "mistral3 conversion script"
        )
    return path
