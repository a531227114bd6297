"""Offline kit entries for GLM-4.1V (`glm4v`) and GLM-4.5V (`glm4v_moe`): GLM's special tokens and chat
format (`[gMASK]<sop>`, `<|user|>`, items wrapped in `<|begin_of_image|>` / `<|begin_of_video|>`), its tower
in miniature (14-pixel patches, 2-D rope, the conv downsample and the gated merger) and its language model:
sandwich norms and half-rotary 3-D RoPE (GLM-4.1V), sigmoid-routed experts with a shared one (GLM-4.5V: 4
experts, top 2).

`glm_tokenizer(tool_template=True)` is the tokenizer with zai-org's published GLM-V chat template with its
tool and thinking branches (`data/glm_v_chat_template.jinja`, verbatim as published with GLM-OCR, whose
tool calls, tool results and images render as GLM-4.5V's and GLM-4.6V's do) and GLM's tool tags as plain
added tokens: the tool-call parser tests read calls in what it renders. The checkpoints keep the cut-down
template (past assistant turns get no empty `<think></think>`, so prompts stay as the tests pin them)."""

from __future__ import annotations

import os

from mmserve.testing.kit_base import KitModel, tiny_only, token_ids, train_tokenizer

GLM_TOKENS = (
    "<|endoftext|>",
    "[gMASK]",
    "<sop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
    "<|image|>",
    "<|video|>",
)
# GLM-4.1V's chat format (its published template without the tool and thinking branches): one
# `<|begin_of_image|><|image|><|end_of_image|>` / `<|begin_of_video|><|video|><|end_of_video|>` per item.
GLM_TEMPLATE = (
    "[gMASK]<sop>{% for message in messages %}"
    "{% if message['role'] == 'system' %}<|system|>\n{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}<|user|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] in ('video', 'video_url') %}<|begin_of_video|><|video|><|end_of_video|>"
    "{% elif content['type'] in ('image', 'image_url') %}<|begin_of_image|><|image|><|end_of_image|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "{% elif message['role'] == 'assistant' %}<|assistant|>\n{{ message['content'] }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# Tiny preprocessing: GLM's pixel budgets (the shortest edge 112 x 112 counts two frames), 14-pixel patches.
GLM_NORM = dict(
    patch_size=14,
    temporal_patch_size=2,
    merge_size=2,
    image_mean=[0.48145466, 0.4578275, 0.40821073],
    image_std=[0.26862954, 0.26130258, 0.27577711],
)
IMAGE_SIZE = {"shortest_edge": 112 * 112, "longest_edge": 28 * 28 * 2 * 64}
VIDEO_SIZE = {"shortest_edge": 112 * 112, "longest_edge": 28 * 28 * 2 * 64}


GLM_V_TEMPLATE_PATH = os.path.join(os.path.dirname(__file__), "data", "glm_v_chat_template.jinja")
GLM_TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")


def glm_v_chat_template() -> str:
    with open(GLM_V_TEMPLATE_PATH) as f:
        return f.read().removesuffix("\n")  # the file's last line break is not the template's


def glm_tokenizer(vocab_size: int = 384, tool_template: bool = False):
    """A byte-level BPE with GLM's special tokens and chat template; the chat stops at `<|user|>` as GLM's
    generation config does. `tool_template`: the published template with tools (see the module docstring)."""
    template = glm_v_chat_template() if tool_template else GLM_TEMPLATE
    tokenizer = train_tokenizer(vocab_size, GLM_TOKENS, template, eos_token="<|user|>")
    if tool_template:
        tokenizer.add_tokens(list(GLM_TOOL_TOKENS))
    return tokenizer


def _save_processors(out_dir: str) -> None:
    from transformers import Glm4vImageProcessorPil
    from transformers.models.glm4v.video_processing_glm4v import Glm4vVideoProcessor

    Glm4vImageProcessorPil(size=IMAGE_SIZE, **GLM_NORM).save_pretrained(out_dir)
    Glm4vVideoProcessor(size=VIDEO_SIZE, fps=2, max_duration=300, **GLM_NORM).save_pretrained(out_dir)


def glm4v_kit(arch: str, size: str) -> KitModel:
    from transformers import Glm4vConfig, Glm4vMoeConfig

    tiny_only(arch, size)
    tokenizer = glm_tokenizer()
    ids = token_ids(tokenizer, GLM_TOKENS)
    # Four heads of 16: half of each rotates, in 4 frequencies split 2 / 1 / 1 over (t, h, w); a low theta so
    # that the height and width bands turn far enough over a few grid steps to change the tokens.
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.5,
        max_position_embeddings=4096,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 20.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [2, 1, 1],
        },
        bos_token_id=ids["[gMASK]"],
        eos_token_id=ids["<|user|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    if (
        arch == "glm4v_moe"
    ):  # a dense first layer, then routed MoE blocks: 4 experts, top 2, one shared expert
        text.update(
            attention_bias=True,
            moe_intermediate_size=24,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
        )
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=48,
        num_heads=2,
        patch_size=14,
        image_size=56,  # a 4 x 4 table of learned positions, interpolated to each grid
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=64,
        initializer_range=0.5,
    )
    config_cls = Glm4vMoeConfig if arch == "glm4v_moe" else Glm4vConfig
    config = config_cls(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image|>"],
        video_token_id=ids["<|video|>"],
        image_start_token_id=ids["<|begin_of_image|>"],
        image_end_token_id=ids["<|end_of_image|>"],
        video_start_token_id=ids["<|begin_of_video|>"],
        video_end_token_id=ids["<|end_of_video|>"],
        tie_word_embeddings=False,
    )
    config.eos_token_id = ids["<|user|>"]
    config.pad_token_id = ids["<|endoftext|>"]
    return KitModel(config, tokenizer, _save_processors)
