"""Parity oracle: Hugging Face `generate` (greedy) on the same model and inputs, prepared by transformers.

Every serving mode is compared token for token with `HFReference.generate(...)`. The oracle shares no
preprocessing code with mmserve: the prompt is expanded, and pixels / audio features are computed, by
transformers' own processor class of the family (its PIL image processor or feature extractor, built by the
family module's `hf_processor`), so a bug in our processor fails parity. One exception, stated where it
applies: transformers' video processors need torchvision, which cannot run beside this CPU torch, so video
pixels come from our preprocessing through `PrecomputedVideos` (HF's processor still expands the
placeholders, timestamps included, from them); that preprocessing is checked on its own against the
family's image processor and the published layout formulas (tests/test_processor*.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mmserve.models.family import family_module, load_family
from mmserve.models.loader import load_hf_config, load_model, load_tokenizer
from mmserve.multimodal.items import Modality


@contextlib.contextmanager
def allow_any_video_processor():
    """Let an HF processor class be built with a video processor of another class (HF's need torchvision):
    its constructor checks each part's class."""
    from transformers import processing_utils as pu

    original = pu.ProcessorMixin.check_argument_for_proper_class

    def check(self, name, arg):
        return type(arg) if name == "video_processor" else original(self, name, arg)

    pu.ProcessorMixin.check_argument_for_proper_class = check
    try:
        yield
    finally:
        pu.ProcessorMixin.check_argument_for_proper_class = original


def _base_video_processor():
    from transformers.video_processing_utils import BaseVideoProcessor

    return BaseVideoProcessor


class PrecomputedVideos(_base_video_processor()):
    """Stands in for an HF video processor: returns `compute(videos)` for the decoded videos set in
    `videos` before the processor call (our own video preprocessing, see the module docstring).
    Attributes the HF processor reads (merge_size, temporal_patch_size ...) are given as keywords."""

    def __init__(self, compute: Callable[[list], dict] | None = None, **attributes: Any) -> None:
        super().__init__()
        self.compute = compute
        self.videos: list = []
        for key, value in attributes.items():
            setattr(self, key, value)

    def __call__(self, videos, **kwargs):
        from transformers.image_processing_utils import BatchFeature

        return BatchFeature(self.compute(self.videos), tensor_type=None)


@dataclass
class ReferenceOutput:
    token_ids: list[int]
    logits: torch.Tensor  # (num_generated, vocab) fp32, the scores each greedy token was chosen from
    input_ids: list[int]  # HF's expanded prompt


class HFReference:
    """The full HF model of a checkpoint with HF's own processor class."""

    def __init__(
        self,
        model_dir: str,
        dtype: str = "float32",
        mm_processor_kwargs: dict | None = None,
        kv_cache_dtype: str = "auto",
    ) -> None:
        hf_config = load_hf_config(model_dir)
        # An 8-bit KV cache's oracle: HF's own cache with every K and V row rounded to fp8 or int8 as it is
        # stored (mmserve.engine.cache.kv_dtype), so attention reads exactly what an 8-bit pool holds.
        self.kv_cache_dtype = kv_cache_dtype
        module = family_module(hf_config.model_type)
        # The part of HF's model that generates text (Qwen-Omni: its thinker; most families: the whole model).
        self.model = getattr(module, "hf_generation_model", lambda model: model)(load_model(model_dir, dtype=dtype))
        self.tokenizer = load_tokenizer(model_dir)
        # Our family only prepares what HF cannot (video pixels); see PrecomputedVideos.
        self.family = load_family(model_dir, hf_config, mm_processor_kwargs)
        self.processor = module.hf_processor(model_dir, self.family)

    def inputs(self, messages: list[dict[str, Any]], media: list[tuple[Modality, Any]]):
        """HF model inputs for template messages (one placeholder part per item) and decoded media."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        images = [obj for mod, obj in media if mod == Modality.IMAGE]
        videos = [obj for mod, obj in media if mod == Modality.VIDEO]
        audio = [obj for mod, obj in media if mod == Modality.AUDIO]
        kwargs: dict[str, Any] = {"text": [text], "return_tensors": "pt"}
        if images:
            kwargs["images"] = [images]  # one sample holding all its images (LLaVA-OneVision counts them)
        if videos:
            self.processor.video_processor.videos = videos
            kwargs["videos"] = [v.frames for v in videos]
        if audio:
            kwargs["audio"] = audio
            kwargs["sampling_rate"] = self.family.audio_sample_rate_hz
        return self.processor(**kwargs)

    def generate(
        self,
        messages: list[dict[str, Any]],
        media: list[tuple[Modality, Any]],
        max_new_tokens: int = 16,
        streamer=None,
    ) -> ReferenceOutput:
        return self.generate_from(self.inputs(messages, media), max_new_tokens, streamer)

    def generate_from(self, inputs, max_new_tokens: int = 16, streamer=None) -> ReferenceOutput:
        """Greedy `generate` on processor outputs (`inputs`), possibly extended by the caller (a later turn)."""
        model = self.model
        for (
            key,
            value,
        ) in inputs.items():  # pixels / audio features in the model's dtype, as HF users pass them
            if torch.is_tensor(value) and value.is_floating_point():
                inputs[key] = value.to(model.dtype)
        cache = {} if self.kv_cache_dtype == "auto" else {"cache": self._rounding_cache()}
        with torch.no_grad():
            out = model.generate(
                **inputs,
                **cache,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                output_logits=True,
                streamer=streamer,
                return_dict_in_generate=True,
                eos_token_id=None,
                pad_token_id=model.generation_config.pad_token_id,
            )
        prompt_len = inputs["input_ids"].shape[1]
        new_tokens = out.sequences[0, prompt_len:].tolist()
        logits = torch.cat([step.float() for step in out.logits], dim=0)
        return ReferenceOutput(new_tokens, logits, inputs["input_ids"][0].tolist())

    def _rounding_cache(self):
        from transformers import DynamicCache

        from mmserve.engine.cache.kv_dtype import STORED, round_trip

        cache = DynamicCache(config=self.model.config)
        dtype = STORED[self.kv_cache_dtype]
        for layer in cache.layers:
            update = layer.update
            layer.update = lambda k, v, *args, _update=update, **kwargs: _update(
                round_trip(k, dtype), round_trip(v, dtype), *args, **kwargs
            )
        return cache

    def extend(self, inputs, token_ids: list[int]):
        """`inputs` (processor outputs of one prompt) with text tokens `token_ids` appended: the next turn."""
        out = dict(inputs)
        tail = torch.tensor([token_ids], dtype=inputs["input_ids"].dtype)
        out["input_ids"] = torch.cat([inputs["input_ids"], tail], dim=1)
        for key in ("attention_mask", "mm_token_type_ids", "token_type_ids"):
            if key in inputs:
                fill = 1 if key == "attention_mask" else 0
                out[key] = torch.cat([inputs[key], torch.full_like(tail, fill, dtype=inputs[key].dtype)], dim=1)
        return out
