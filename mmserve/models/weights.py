"""Load part of a safetensors checkpoint into a module, by key prefix, failing loudly on mismatches.

Used to load only the language model (language-only engines) or only the tower (encoder services):
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


def build_empty(config, dtype: torch.dtype, attn_implementation: str, cls=None) -> torch.nn.Module:
    """An HF module for `config` (of `cls`, default transformers' AutoModel class for the config) with
    uninitialised weights (they are loaded next), in `dtype`."""
    from transformers.initialization import no_init_weights

    if cls is None:
        from transformers.models.auto.modeling_auto import MODEL_MAPPING

        cls = MODEL_MAPPING[type(config)]
    config._attn_implementation = attn_implementation
    with no_init_weights():
        return cls._from_config(config, dtype=dtype)


def tied_embeddings(hf_config) -> bool:
    """Whether the head shares the input embedding (the top-level or the text config says so)."""
    return bool(
        getattr(hf_config, "tie_word_embeddings", False)
        or getattr(hf_config.get_text_config(), "tie_word_embeddings", False)
    )


def load_language_model(
    path: str,
    hf_config,
    dtype: torch.dtype,
    attn_implementation: str,
    prefixes: Sequence[str],
    exclude: Sequence[str],
    head_prefixes: Sequence[str],
    text_cls=None,
):
    """The text model (of `text_cls`, default its AutoModel class) and its head, from the checkpoint in `path`.

    `prefixes` locate the text model's tensors (first match wins; keys under `exclude` are skipped),
    `head_prefixes` the head's. Without a head in the checkpoint and with tied embeddings, the head shares the
    input embedding. Raises ValueError on any missing or unexpected tensor.
    """
    from mmserve.models.family import LanguageModel

    text_model = build_empty(hf_config.get_text_config(), dtype, attn_implementation, text_cls)
    load_into(text_model, dict(iter_prefixed(path, prefixes, exclude=exclude)), "language model")
    emb = text_model.get_input_embeddings().weight  # (vocab, hidden)
    head = dict(iter_prefixed(path, head_prefixes))
    if head:
        lm_head = torch.nn.Linear(emb.shape[1], emb.shape[0], bias=False, dtype=emb.dtype)
        load_into(lm_head, head, "lm_head")
    elif tied_embeddings(hf_config):
        lm_head = torch.nn.Linear(emb.shape[1], emb.shape[0], bias=False, dtype=emb.dtype, device="meta")
        lm_head.weight = emb
    else:
        raise ValueError("checkpoint has no lm_head.weight and the model does not tie embeddings")
    return LanguageModel(text_model.eval(), lm_head.eval())


def renamed(tensors: Iterator[tuple[str, torch.Tensor]], strip: Sequence[str]) -> dict[str, torch.Tensor]:
    """Drop the first of `strip` that starts each key (older checkpoint layouts nest a module one level
    deeper, e.g. `vision_model.` inside a SigLIP tower)."""
    out = {}
    for key, tensor in tensors:
        for prefix in strip:
            if key.startswith(prefix):
                key = key[len(prefix) :]
                break
        out[key] = tensor
    return out


# The language model of composite checkpoints (LLaVA, Qwen2-Audio): published under `language_model.`,
# re-saved by transformers 5 under `model.language_model.` with the head at the top.
NESTED_LM_PREFIXES = ("model.language_model.", "language_model.model.")
NESTED_HEAD_PREFIXES = ("lm_head.", "language_model.lm_head.")


def load_nested_language_model(path: str, hf_config, dtype: torch.dtype, attn_implementation: str):
    """`load_language_model` for a checkpoint whose text model (of its AutoModel class) sits under
    `language_model` in either layout."""
    return load_language_model(
        path,
        hf_config,
        dtype,
        attn_implementation,
        prefixes=NESTED_LM_PREFIXES,
        exclude=(),
        head_prefixes=NESTED_HEAD_PREFIXES,
    )
