"""Qwen2-VL / Qwen2.5-VL: build and load the language model or the vision tower on their own.

Checkpoint keys come in two layouts: the original one (`model.layers...`, `visual....`, `lm_head.weight`) and
transformers 5's (`model.language_model...`, `model.visual...`); both are accepted. With tied embeddings the
checkpoint has no `lm_head.weight` and the head shares the input embedding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.initialization import no_init_weights

from mmserve.models.weights import iter_prefixed, load_into

LM_PREFIXES = ("model.language_model.", "model.")
VISION_PREFIXES = ("model.visual.", "visual.")


def _classes(model_type: str):
    if model_type == "qwen2_vl":
        from transformers.models.qwen2_vl.modeling_qwen2_vl import (
            Qwen2VisionTransformerPretrainedModel as Vision,
        )
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLTextModel as Text
    elif model_type == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel as Vision,
        )
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLTextModel as Text
    else:
        raise ValueError(f"unsupported model_type {model_type!r}")
    return Text, Vision


@dataclass
class LanguageModel:
    """The decoder stack and the output head: everything the engine runs."""

    model: torch.nn.Module  # HF text model: embed_tokens, layers, norm, rotary_emb
    lm_head: torch.nn.Linear


def load_language_model(path: str, hf_config, dtype: torch.dtype, attn_implementation: str) -> LanguageModel:
    text_cls, _ = _classes(hf_config.model_type)
    text_config = hf_config.text_config
    text_config._attn_implementation = attn_implementation
    with no_init_weights():
        model = text_cls._from_config(text_config, dtype=dtype)
        lm_head = torch.nn.Linear(text_config.hidden_size, text_config.vocab_size, bias=False, dtype=dtype)
    tensors = dict(iter_prefixed(path, LM_PREFIXES, exclude=VISION_PREFIXES + ("lm_head.",)))
    load_into(model, tensors, "language model")
    head = dict(iter_prefixed(path, ("lm_head.",)))
    if head:
        load_into(lm_head, head, "lm_head")
    elif getattr(hf_config, "tie_word_embeddings", False) or getattr(
        text_config, "tie_word_embeddings", False
    ):
        lm_head.weight = model.get_input_embeddings().weight
    else:
        raise ValueError("checkpoint has no lm_head.weight and the model does not tie embeddings")
    return LanguageModel(model.eval(), lm_head.eval())


def load_vision_tower(path: str, hf_config, dtype: torch.dtype) -> torch.nn.Module:
    _, vision_cls = _classes(hf_config.model_type)
    vision_config = hf_config.vision_config
    vision_config._attn_implementation = "sdpa"
    with no_init_weights():
        visual = vision_cls._from_config(vision_config, dtype=dtype)
    load_into(visual, dict(iter_prefixed(path, VISION_PREFIXES)), "vision tower")
    return visual.eval()
