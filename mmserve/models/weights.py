"""Load part of a safetensors checkpoint into a module, by key prefix, failing loudly on mismatches.

Used to load only the language model (language-only engines) or only the vision tower (encoder services):
the other half's tensors are never read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence

import torch
from safetensors import safe_open


def checkpoint_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, s) for s in shards]
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(single):
        return [single]
    raise FileNotFoundError(f"no safetensors weights in {path}")


def iter_prefixed(
    path: str, prefixes: Sequence[str], exclude: Sequence[str] = ()
) -> Iterator[tuple[str, torch.Tensor]]:
    """(key without its prefix, tensor) for every checkpoint key starting with one of `prefixes`.

    The first matching prefix wins (list longer, more specific prefixes first); keys starting with any of
    `exclude` are skipped.
    """
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                if any(key.startswith(e) for e in exclude):
                    continue
                for prefix in prefixes:
                    if key.startswith(prefix):
                        yield key[len(prefix) :], f.get_tensor(key)
                        break


def load_into(module: torch.nn.Module, tensors: dict[str, torch.Tensor], what: str) -> None:
    """Copy `tensors` into `module`'s parameters and buffers. Raises ValueError on missing / unexpected keys."""
    expected = set(module.state_dict())
    missing, unexpected = expected - set(tensors), set(tensors) - expected
    if missing or unexpected:
        raise ValueError(
            f"{what}: checkpoint does not match the model: missing {sorted(missing)[:5]} ({len(missing)}), "
            f"unexpected {sorted(unexpected)[:5]} ({len(unexpected)})"
        )
    module.load_state_dict(tensors, strict=True)
