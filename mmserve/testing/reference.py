"""Parity oracle: Hugging Face `generate` (greedy) on the same model and inputs.

Every serving mode is compared token for token with `hf_reference(...)`. The oracle uses only HF's model
code plus our processor's tower inputs and placeholder expansion (HF's own Qwen2-VL processor needs
torchvision); M-RoPE positions are computed by HF's `get_rope_index` inside `generate`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mmserve.multimodal.items import Modality, MultimodalItem, content_hash
from mmserve.multimodal.processors.base import ExpandedPrompt, ProcessedItem


@dataclass
class ReferenceOutput:
    prompt: ExpandedPrompt
    token_ids: list[int]
    logits: torch.Tensor  # (num_generated, vocab) fp32, the scores each greedy token was chosen from


def prepare_prompt(
    tokenizer, processor, messages: list[dict[str, Any]], media: list[tuple[Modality, Any]]
) -> tuple[ExpandedPrompt, list[ProcessedItem]]:
    """Render the chat template, preprocess `media` (decoded items in prompt order) and expand."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    token_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    processed = [processor.process(modality, obj) for modality, obj in media]
    items = [
        MultimodalItem(
            p.modality,
            content_hash(p.modality, p.pixel_values.numpy().tobytes(), processor.hash_settings(p.modality)),
            p.num_tokens,
            p.grid_thw,
            second_per_grid_t=p.second_per_grid_t,
        )
        for p in processed
    ]
    return processor.expand(token_ids, items), processed


def hf_generate(model, prompt: ExpandedPrompt, processed: list[ProcessedItem], max_new_tokens: int = 16,
                streamer=None) -> ReferenceOutput:  # fmt: skip
    """Greedy `generate` with HF's inputs for `prompt`; returns the new tokens and their logits."""
    input_ids = torch.tensor([prompt.hf_token_ids])
    types = {Modality.IMAGE: 1, Modality.VIDEO: 2}
    kind = {tid: types[m] for m, tid in model_placeholders(model).items()}
    inputs: dict[str, Any] = {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "mm_token_type_ids": torch.tensor([[kind.get(t, 0) for t in prompt.hf_token_ids]]),
    }
    images = [p for p in processed if p.modality == Modality.IMAGE]
    videos = [p for p in processed if p.modality == Modality.VIDEO]
    if images:
        inputs["pixel_values"] = torch.cat([p.pixel_values for p in images]).to(model.dtype)
        inputs["image_grid_thw"] = torch.tensor([p.grid_thw for p in images])
    if videos:
        inputs["pixel_values_videos"] = torch.cat([p.pixel_values for p in videos]).to(model.dtype)
        inputs["video_grid_thw"] = torch.tensor([p.grid_thw for p in videos])
        if model.config.model_type == "qwen2_5_vl":
            inputs["second_per_grid_ts"] = torch.tensor([p.second_per_grid_t for p in videos])
    with torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=max_new_tokens, do_sample=False, output_logits=True, streamer=streamer,
            return_dict_in_generate=True, eos_token_id=None, pad_token_id=model.generation_config.pad_token_id,
        )  # fmt: skip
    new_tokens = out.sequences[0, input_ids.shape[1] :].tolist()
    logits = torch.cat([step.float() for step in out.logits], dim=0)
    return ReferenceOutput(prompt, new_tokens, logits)


def model_placeholders(model) -> dict[Modality, int]:
    return {Modality.IMAGE: model.config.image_token_id, Modality.VIDEO: model.config.video_token_id}
