"""Qwen3.5 / Qwen3.6 (`qwen3_5`, and `qwen3_5_moe` with sparse MoE blocks): Qwen3-VL's preprocessing, placeholder
expansion (timestamped video frames) and interleaved M-RoPE, a tower without DeepStack levels, and a hybrid
language model: three of every four decoder layers are Gated DeltaNet (linear attention, whose per-request conv
window and recurrent state live in the engine's state pool), every fourth gated full attention.

The layer kinds come from the text config's `layer_types` (`mmserve.models.layer_specs`); the engine runs the
linear layers through `mmserve.engine.layers.linear_state` and checkpoints their state for prefix hits. The
MoE checkpoints on the hub store one tensor per expert: they load through transformers' own expert fusion
(`mmserve.models.weights.load_parts`)."""

from __future__ import annotations

from mmserve.models import qwen3_vl

# The transformers class of each model type's linear-attention layers.
LINEAR_ATTENTION = {"qwen3_5": "Qwen3_5GatedDeltaNet", "qwen3_5_moe": "Qwen3_5MoeGatedDeltaNet"}


class Family(qwen3_vl.Family):
    tool_call_parser = "qwen3_coder"  # the XML calls of Qwen3.5's and Qwen3.6's chat templates

    @property
    def linear_attention_class(self) -> str:
        return LINEAR_ATTENTION[self.hf_config.model_type]


hf_processor = qwen3_vl.hf_processor
