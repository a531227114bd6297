"""Load part of a safetensors checkpoint, failing loudly on mismatches.

Used to load only the language model (language-only engines) or only the tower (encoder services): the other
half's tensors are never read. `load_parts` goes through transformers' own loading and conversion rules (renames of
older layouts, MoE expert fusion, transposes: what `from_pretrained` applies), for the language models of every
family and the towers that are transformers models; `iter_prefixed` / `load_into` load a family's own tower
modules by key prefix.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence

import torch
from safetensors import safe_open

from mmserve.quant.checkpoint import QuantizedTensors


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


def checkpoint_mappings() -> list[tuple[int, int]]:
    """Address ranges (start, end) this process has mapped from safetensors files (Linux; none elsewhere)."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.readlines()
    except OSError:
        return []
    ranges = []
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].strip().endswith(".safetensors"):
            start, end = parts[0].split("-")
            ranges.append((int(start, 16), int(end, 16)))
    return ranges


def own_checkpoint_memory(module: torch.nn.Module) -> int:
    """Copy every parameter and buffer of `module` that still lives in a checkpoint file's memory map into
    memory of its own; returns how many. transformers' loading hands out tensors backed by the safetensors
    mmap, and one such tensor (a norm, the embedding table) keeps the whole mapping, with every page ever read
    resident: the `small` int4 engine showed 1.1 GB of the file in its RSS after quantization had replaced the
    weights those pages held. Run after quantization, so the weights it replaced are never copied."""
    ranges = checkpoint_mappings()
    if not ranges:
        return 0
    copied = 0
    for sub in module.modules():
        for store in (sub._parameters, sub._buffers):
            for t in store.values():
                if t is not None and t.device.type == "cpu" and any(a <= t.data_ptr() < b for a, b in ranges):
                    t.data = t.data.clone()
                    copied += 1
    return copied


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


def composite_class(hf_config):
    """transformers' class of the whole checkpoint (towers and language model), as `AutoModelForMultimodalLM`
    picks it: the layout its conversion rules are written for."""
    from transformers import AutoModelForMultimodalLM

    return AutoModelForMultimodalLM._model_mapping[type(hf_config)]


def load_parts(
    path: str, hf_config, dtype: torch.dtype, parts: dict[str, str | None], model_cls=None
) -> tuple[torch.nn.Module, set[str]]:
    """Load only the submodules `parts` (path in the composite model -> attention implementation of a
    transformers model there, None for a plain module) of the checkpoint in `path`, through transformers' own
    loading: its renames of older layouts, expert fusion, transposes (`conversion_mapping`), so a checkpoint
    loads here exactly when `from_pretrained` loads it. Checkpoint keys that land outside `parts` are not read.

    Returns the composite model (`model_cls`, default `composite_class`), its other submodules on the meta
    device, and the keys of `parts` the checkpoint did not have (a tied head). Raises ValueError on unexpected,
    mismatched or unconvertible tensors."""
    import copy

    from safetensors import safe_open
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        convert_and_load_state_dict_in_model,
        rename_source_key,
    )
    from transformers.initialization import no_init_weights
    from transformers.modeling_utils import LoadStateDictConfig, PreTrainedModel

    config = copy.deepcopy(hf_config)
    cls = model_cls or composite_class(config)
    with torch.device("meta"):
        model = cls._from_config(config, dtype=dtype)  # the structure: no memory, no init
    for where, attn in parts.items():
        meta = model.get_submodule(where)
        if isinstance(meta, PreTrainedModel):
            real = build_empty(meta.config, dtype, attn, type(meta))
        else:
            with no_init_weights():
                real = meta.to_empty(device="cpu")
        parent, _, attr = where.rpartition(".")
        setattr(model.get_submodule(parent), attr, real)
    conversions = get_model_conversion_mapping(model)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    expected = model.state_dict()
    prefixes = tuple(p + "." for p in parts)
    files = [safe_open(f, framework="pt") for f in checkpoint_files(path)]
    rename = lambda key: rename_source_key(key, renamings, converters, model.base_model_prefix, expected)[0]  # noqa: E731
    quantized = QuantizedTensors.of(hf_config, files, rename, prefixes)
    state = {}
    for f in files:
        for key in f.keys():
            if key in quantized.keys:
                continue
            if rename(key).startswith(prefixes):
                state[key] = f.get_slice(key)
    load_config = LoadStateDictConfig(pretrained_model_name_or_path=path, dtype=dtype, weight_mapping=conversions)
    info, _ = convert_and_load_state_dict_in_model(model, state, load_config)
    problems = []
    if info.unexpected_keys:
        problems.append(f"unexpected {sorted(info.unexpected_keys)[:5]} ({len(info.unexpected_keys)})")
    if info.mismatched_keys:
        problems.append(f"mismatched shapes {sorted(info.mismatched_keys)[:3]}")
    if info.conversion_errors:
        problems.append(f"conversion errors {dict(list(info.conversion_errors.items())[:3])}")
    if problems:
        raise ValueError(f"{path}: checkpoint does not match {cls.__name__}: " + "; ".join(problems))
    missing = {k for k in info.missing_keys if k.startswith(prefixes)} - quantized.install(model, dtype)
    return model, missing


def load_tower_parts(path: str, hf_config, dtype: torch.dtype, parts: dict[str, str | None]) -> torch.nn.Module:
    """`load_parts` for a family's tower and projector: the composite model, every tensor of `parts` from the
    checkpoint (a tower has no tied weights). Raises ValueError naming the first missing tensors."""
    model, missing = load_parts(path, hf_config, dtype, parts)
    if missing:
        raise ValueError(f"{path}: the checkpoint lacks tower tensors {sorted(missing)[:5]}")
    return model


def load_language_model(path: str, hf_config, dtype: torch.dtype, attn_implementation: str, text_path: str):
    """The text model (at `text_path` in the composite model, its attention `attn_implementation`) and its head
    (`lm_head`), loaded by `load_parts`. Without a head in the checkpoint and with tied embeddings, the head
    shares the input embedding. Raises ValueError on any missing or unexpected tensor."""
    from mmserve.models.family import LanguageModel

    model, missing = load_parts(path, hf_config, dtype, {text_path: attn_implementation, "lm_head": None})
    text_model = model.get_submodule(text_path)
    lm_head = model.lm_head
    if "lm_head.weight" in missing and tied_embeddings(hf_config):
        lm_head.weight = text_model.get_input_embeddings().weight
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(
            f"{path}: the checkpoint lacks {len(missing)} tensor(s) of the language model: {sorted(missing)[:5]}"
        )
    return LanguageModel(text_model.eval(), lm_head.eval())


def load_submodule(path: str, hf_config, dtype: torch.dtype, where: str, attn_implementation: str = "sdpa"):
    """One transformers submodule of the composite model (a tower), loaded by `load_parts`. Raises ValueError on
    any missing or unexpected tensor."""
    model, missing = load_parts(path, hf_config, dtype, {where: attn_implementation})
    if missing:
        raise ValueError(f"{path}: the checkpoint lacks {len(missing)} tensor(s) of {where}: {sorted(missing)[:5]}")
    return model.get_submodule(where).eval()


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


def load_nested_language_model(path: str, hf_config, dtype: torch.dtype, attn_implementation: str):
    """`load_language_model` for a composite checkpoint whose text model sits at `model.language_model` (LLaVA,
    Qwen2-Audio: transformers' renames take the older `language_model.` layout there)."""
    return load_language_model(path, hf_config, dtype, attn_implementation, "model.language_model")
