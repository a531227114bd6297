"""Offline kit entries for Qwen3-VL (DeepStack), Qwen3-VL-MoE, Qwen3.5 (Gated DeltaNet hybrid) and Qwen3.5-MoE:
tiny checkpoints whose DeepStack levels, recurrent state and expert routing each change the greedy tokens, so
the negative controls can fail; and Qwen3.5-0.8B's proportions as `small`.

`thinking=True` (`mmserve make-tiny-model --thinking`) gives the Qwen3.5 entries the real thinking chat
template (`data/qwen3_6_chat_template.jinja`, Qwen3.6's, verbatim: the assistant turn opens with `<think>\n`
unless `enable_thinking` is false, which writes an empty `<think>\n\n</think>\n\n`) and Qwen's `<think>`,
`</think>`, `<tool_call>`, `</tool_call>` as added tokens that are not special, as in Qwen's tokenizer: they
stay in the decoded text for the reasoning and tool parsers."""

from __future__ import annotations

import os

from mmserve.testing.kit_base import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    KitModel,
    finish_config,
    make_tokenizer,
    qwen_vl_config,
    text_config,
    tiny_only,
)

THINKING_TEMPLATE_PATH = os.path.join(os.path.dirname(__file__), "data", "qwen3_6_chat_template.jinja")
THINK_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>")


def thinking_chat_template() -> str:
    with open(THINKING_TEMPLATE_PATH) as f:
        return f.read().removesuffix("\n")  # the file's last line break is not the template's

QWEN3_NORM = dict(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3)


def _save_qwen3_processors(out_dir: str) -> None:
    from transformers import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    Qwen2VLImageProcessorPil(
        size={"shortest_edge": 32 * 32, "longest_edge": 256 * 32 * 32}, **QWEN3_NORM
    ).save_pretrained(out_dir)
    Qwen3VLVideoProcessor(
        size={"shortest_edge": 4 * 32 * 32, "longest_edge": 64 * 32 * 32}, **QWEN3_NORM
    ).save_pretrained(out_dir)


def _qwen3_vision(hidden: int, **extra) -> dict:
    """The tiny Qwen3-VL / Qwen3.5 tower: 16-pixel patches merged 2x2 into `hidden`-wide rows."""
    return dict(
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=hidden,
        num_position_embeddings=64,
        initializer_range=0.5,
        **extra,
    )


def qwen3_vl_kit(arch: str, size: str) -> KitModel:
    from transformers import Qwen3VLConfig, Qwen3VLMoeConfig

    tiny_only(arch, size)
    tokenizer = make_tokenizer(size)
    # Three decoder layers and DeepStack into the first two: dropping the features or shifting them by a
    # layer changes the tokens (a negative control).
    text = text_config(size, tokenizer, [2, 3, 3], head_dim=16, num_hidden_layers=3)
    text["rope_parameters"]["mrope_interleaved"] = True
    if arch == "qwen3_vl_moe":  # every layer a sparse MoE block: 4 experts, top 2 (a negative control flips k)
        text.update(moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1)
    vision = _qwen3_vision(text["hidden_size"], depth=3, deepstack_visual_indexes=[0, 1])
    config_cls = Qwen3VLMoeConfig if arch == "qwen3_vl_moe" else Qwen3VLConfig
    config = qwen_vl_config(config_cls, tokenizer, text, vision, tie_word_embeddings=True)

    def louder_deepstack(model) -> None:
        # With the random init, the decoder's residual stream dwarfs the DeepStack levels and the greedy tokens
        # hardly depend on them; scaled up, dropping or moving them changes the tokens (negative controls).
        import torch

        with torch.no_grad():
            for merger in model.model.visual.deepstack_merger_list:
                merger.linear_fc2.weight.mul_(4.0)

    return KitModel(finish_config(config, tokenizer), tokenizer, _save_qwen3_processors, louder_deepstack)


# Qwen3.5's hybrid stack in miniature: Gated DeltaNet (linear attention with a conv window and a recurrent state)
# around one full-attention layer, whose gated attention rotates a quarter of its head (interleaved M-RoPE).
QWEN3_5_LAYERS = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]


def qwen3_5_kit(arch: str, size: str, thinking: bool = False) -> KitModel:
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig

    tokenizer = make_tokenizer(size, SPECIAL_TOKENS, thinking_chat_template() if thinking else CHAT_TEMPLATE)
    if thinking:
        tokenizer.add_tokens(list(THINK_TOKENS))  # plain added tokens (special=False), before the vocab size
    if size == "tiny":
        text = text_config(size, tokenizer, [2, 1, 1], head_dim=32, num_hidden_layers=4)
        text.update(
            layer_types=QWEN3_5_LAYERS,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
        )
        vision = _qwen3_vision(text["hidden_size"], depth=2)
    else:  # Qwen3.5-0.8B's language model (24 layers, 3 of 4 linear), Qwen2-VL's tokenizer
        text = text_config(size, tokenizer, [11, 11, 10], head_dim=256, num_hidden_layers=24)
        text.update(
            hidden_size=1024,
            intermediate_size=3584,
            num_attention_heads=8,
            num_key_value_heads=2,
            layer_types=[("full_attention" if (i + 1) % 4 == 0 else "linear_attention") for i in range(24)],
            linear_num_key_heads=16,
            linear_num_value_heads=16,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
        )
        vision = dict(
            depth=12, hidden_size=768, intermediate_size=3072, num_heads=12, patch_size=16, spatial_merge_size=2,
            temporal_patch_size=2, out_hidden_size=1024, num_position_embeddings=2304, initializer_range=0.02,
        )  # fmt: skip
    text["rope_parameters"].update(mrope_interleaved=True, partial_rotary_factor=0.25)
    if arch == "qwen3_5_moe":  # a routed MoE block (4 experts, top 2) and a gated shared expert in every layer
        text.pop("intermediate_size")
        width = 24 if size == "tiny" else 512
        text.update(
            moe_intermediate_size=width, shared_expert_intermediate_size=width, num_experts=4, num_experts_per_tok=2
        )
    config_cls = Qwen3_5MoeConfig if arch == "qwen3_5_moe" else Qwen3_5Config
    config = qwen_vl_config(config_cls, tokenizer, text, vision, tie_word_embeddings=(size == "tiny"))
    return KitModel(finish_config(config, tokenizer), tokenizer, _save_qwen3_processors, _long_memory)


def _long_memory(model) -> None:
    """Slow decays for the Gated DeltaNet layers. transformers draws A from U(0, 16): a tiny model's recurrent
    state then forgets a token within one step (decay e^-10), and nothing but the last few tokens (the conv
    window) reaches the output; with A in [0.02, 0.2] the state carries the whole prompt, so a state dropped,
    stale or not carried over changes the tokens (the negative controls)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "A_log") and hasattr(module, "dt_bias"):
                a = torch.empty(module.A_log.shape).uniform_(0.02, 0.2, generator=generator)
                module.A_log.copy_(a.log())
                module.dt_bias.zero_()

