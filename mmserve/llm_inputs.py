"""What the offline API (mmserve.llm) takes, turned into mmserve's own: `LLM(...)` keywords into an
EngineConfig, vLLM-shaped prompts into token ids + media references, and the checks every prompt of a call
passes before any of them runs."""

from __future__ import annotations

import operator
from collections import Counter
from dataclasses import dataclass
from typing import Any

from mmserve.config import EngineConfig, MediaConfig
from mmserve.models.resolve import resolve_dtype, resolve_model_path
from mmserve.multimodal.items import Modality
from mmserve.multimodal.media import MediaRef
from mmserve.multimodal.messages import MediaPart, pil_media_ref
from mmserve.multimodal.precomputed import EmbedsRef

# vLLM keywords with no mmserve equivalent, and what to use instead (in the TypeError).
_VLLM_HINTS = {
    "gpu_memory_utilization": "size the KV cache with kv_cache_memory_fraction (of the memory free after "
    "loading) or kv_cache_mb",
    "tensor_parallel_size": "an mmserve engine runs on one device",
    "trust_remote_code": "mmserve runs its own model families, never a checkpoint's code",
    "tokenizer": "the tokenizer is loaded from the model directory",
}
_MEDIA_KEYS = set(MediaConfig.__dataclass_fields__)
_ENGINE_KEYS = set(EngineConfig.__dataclass_fields__) - {"model", "media"}


def _frozen(value: Any) -> Any:
    """Config fields are tuples: a list becomes a tuple, a dict its items (mm_processor_kwargs ...)."""
    if isinstance(value, dict):
        return tuple(value.items())
    return tuple(value) if isinstance(value, list) else value


def engine_config(model: str, options: dict[str, Any]) -> EngineConfig:
    """EngineConfig from `LLM(...)` keywords: EngineConfig / MediaConfig field names (or `media=`), and vLLM's
    `enable_prefix_caching`. Raises TypeError naming unknown keywords (none is accepted and ignored)."""
    options = dict(options)
    if "enable_prefix_caching" in options:
        options["disable_prefix_cache"] = not options.pop("enable_prefix_caching")
    unknown = sorted(set(options) - _MEDIA_KEYS - _ENGINE_KEYS - {"media"})
    if unknown:
        hints = "".join(f"; {k}: {_VLLM_HINTS[k]}" for k in unknown if k in _VLLM_HINTS)
        raise TypeError(f"LLM() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}{hints}")
    media = options.pop("media", None)
    media_keys = sorted(_MEDIA_KEYS & set(options))
    if media is not None and media_keys:
        raise TypeError(
            f"pass media settings as media=MediaConfig(...) or as keywords, not both: {media_keys}"
        )
    if media is None:
        media = MediaConfig(**{k: _frozen(options.pop(k)) for k in media_keys})
    kwargs = {k: _frozen(v) for k, v in options.items()}
    path = resolve_model_path(model)
    kwargs["dtype"] = resolve_dtype(path, kwargs.get("dtype", "auto"), kwargs.get("device", "cpu"))
    return EngineConfig(model=path, media=media, **kwargs)


def check_mm_limits(limits: dict[str, int]) -> dict[str, int]:
    """vLLM's `limit_mm_per_prompt`: modality name -> most items of it in one prompt."""
    modalities = {m.value for m in Modality}
    for key, value in limits.items():
        if key not in modalities:
            raise ValueError(f"limit_mm_per_prompt: unknown modality {key!r} (one of {sorted(modalities)})")
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"limit_mm_per_prompt[{key!r}] must be an integer >= 0, got {value!r}")
    return dict(limits)


@dataclass
class Prompt:
    text: str | None  # as given (generate) or as the chat template wrote it; None for token ids
    token_ids: list[int]  # one placeholder token per media item
    media: list[tuple[Modality, MediaPart | EmbedsRef]]
    cache_salt: str | None = None


def media_ref(value: Any) -> MediaRef:
    """One `multi_modal_data` item: a URL string, bytes, a PIL image or `(samples, sample_rate)` audio."""
    if isinstance(value, MediaRef):
        return value
    if isinstance(value, str):
        return MediaRef.parse(value)
    if isinstance(value, bytes | bytearray):
        return MediaRef.from_bytes(bytes(value))
    if hasattr(value, "save"):  # a PIL image
        return pil_media_ref(value)
    if isinstance(value, tuple) and len(value) == 2:  # audio as vLLM takes it: (samples, sample rate)
        # Written as WAV: the encoder keys its cache on an item's bytes, and decodes / resamples them itself.
        import io

        import soundfile

        buf = io.BytesIO()
        soundfile.write(buf, value[0], int(value[1]), format="WAV", subtype="FLOAT")
        return MediaRef.from_bytes(buf.getvalue())
    raise ValueError(f"unsupported media value of type {type(value).__name__}")


def generate_prompt(index: int, prompt: Any, tokenizer: Any) -> Prompt:
    """One prompt of `LLM.generate`: a string, token ids, or {"prompt" | "prompt_token_ids",
    "multi_modal_data", "cache_salt"}."""
    if isinstance(prompt, str):
        prompt = {"prompt": prompt}
    elif isinstance(prompt, list | tuple):
        prompt = {"prompt_token_ids": prompt}
    if not isinstance(prompt, dict):
        raise ValueError(f"prompt {index} must be a string, a list of token ids or a dict")
    text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
    if ids is None:
        if not isinstance(text, str):
            raise ValueError(f"prompt {index} needs 'prompt' (a string) or 'prompt_token_ids'")
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    try:
        ids = [operator.index(t) for t in ids]
    except TypeError:
        raise ValueError(f"prompt {index}: prompt_token_ids must be a list of integers") from None
    media = []
    for key, values in (prompt.get("multi_modal_data") or {}).items():
        values = values if isinstance(values, list) else [values]
        media.extend((Modality(key), MediaPart(media_ref(v))) for v in values)
    return Prompt(text, ids, media, prompt.get("cache_salt"))


def check_prompts(prompts: list[Prompt], vocab_size: int, mm_limits: dict[str, int]) -> None:
    """Refuse a call before anything of it runs: an empty prompt, a token id outside the vocabulary (a media
    pad value included), too many items of a modality. Raises ValueError naming the prompt."""
    for i, prompt in enumerate(prompts):
        if not prompt.token_ids:
            raise ValueError(f"prompt {i} is empty")
        bad = next((t for t in prompt.token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt {i}: token id {bad} is outside the vocabulary [0, {vocab_size})")
        for modality, count in Counter(mod.value for mod, _ in prompt.media).items():
            limit = mm_limits.get(modality)
            if limit is not None and count > limit:
                raise ValueError(
                    f"prompt {i}: {count} {modality} item(s); at most {limit} allowed (limit_mm_per_prompt)"
                )
