"""Offline kit entry for Mistral 3 (Mistral Small 3.x, HF format): a Mistral language model, a two-layer Pixtral
tower (2-D RoPE) over 8 x 8 patches of images resized to at most 64 pixels a side, merged 2 x 2 by the
projector; a byte-level BPE tokenizer whose control tokens sit at Tekken's ids (`[IMG]` 10, `[IMG_BREAK]` 12,
`[IMG_END]` 13, as Mistral3Config's default `image_token_index`), Mistral's `[INST]` chat format with one
`[IMG]` per image, and the PIL image processor / `PixtralProcessor` configs HF's own classes read.

`mistral_tokenizer(tool_template=True)` is the tokenizer with a real Mistral 3 chat template with tools:
Ministral-3-14B-Instruct-2512's (`data/ministral3_chat_template.jinja`, verbatim: tokenizer v13 calls
`[TOOL_CALLS]NAME[ARGS]{...}`, results in `[TOOL_RESULTS]`) and the `[ARGS]` control token: the tool-call
parser tests read calls in what it renders. The checkpoints keep the cut-down template: the real one writes
a 2.5 KB default system prompt into every conversation without a system message."""

from __future__ import annotations

import json
import os

from mmserve.testing.kit_base import _CORPUS, KitModel, tiny_only, token_ids

# Tekken's first control tokens, in its order (ids 0..18).
MISTRAL_TOKENS = (
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    "[TOOL_CALLS]",
    "[IMG]",
    "<pad>",
    "[IMG_BREAK]",
    "[IMG_END]",
    "[PREFIX]",
    "[MIDDLE]",
    "[SUFFIX]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
)
# Mistral's v7 chat format, cut to what the kit needs: a system prompt in [SYSTEM_PROMPT], user turns in
# [INST] ... [/INST] with one [IMG] per image, assistant turns closed by </s>; no generation prompt (the
# assistant's turn starts right after [/INST]).
MISTRAL_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{ content }}{%- else -%}{%- for part in content -%}"
    "{%- if part['type'] in ('image', 'image_url') -%}[IMG]"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}[SYSTEM_PROMPT]{{ render(message['content']) }}[/SYSTEM_PROMPT]"
    "{%- elif message['role'] == 'user' -%}[INST]{{ render(message['content']) }}[/INST]"
    "{%- elif message['role'] == 'assistant' -%}{{ render(message['content']) }}{{ eos_token }}"
    "{%- endif -%}"
    "{%- endfor -%}"
)
_MISTRAL_CORPUS = [
    *_CORPUS,
    "[INST]Describe it.[/INST]A red square.</s>[INST]What is in this picture?[/INST]",
]
PATCH, MERGE, LONGEST_EDGE = 8, 2, 64
CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]


MINISTRAL3_TEMPLATE_PATH = os.path.join(os.path.dirname(__file__), "data", "ministral3_chat_template.jinja")


def ministral3_chat_template() -> str:
    with open(MINISTRAL3_TEMPLATE_PATH) as f:
        return f.read().removesuffix("\n")  # the file's last line break is not the template's


def mistral_tokenizer(vocab_size: int = 384, tool_template: bool = False):
    """A byte-level BPE trained in milliseconds with Mistral's control tokens first (Tekken's ids). It adds no
    BOS of its own: the chat template writes it, as mmserve and HF's processor both tokenize the rendered text.
    `tool_template`: the real template with tools and the `[ARGS]` control token (see the module docstring)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(MISTRAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_MISTRAL_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=[t for t in MISTRAL_TOKENS if t not in ("<unk>", "<s>", "</s>", "<pad>")],
    )
    fast.chat_template = ministral3_chat_template() if tool_template else MISTRAL_TEMPLATE
    if tool_template:
        fast.add_tokens(["[ARGS]"], special_tokens=True)
    return fast


def mistral3_kit(size: str) -> KitModel:
    from transformers import Mistral3Config, PixtralImageProcessorPil

    tiny_only("mistral3", size)
    tokenizer = mistral_tokenizer()
    ids = token_ids(tokenizer, MISTRAL_TOKENS)
    text = dict(
        model_type="mistral",
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=None,  # Mistral Small 3.x: full attention
        initializer_range=0.5,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=ids["<s>"],
        eos_token_id=ids["</s>"],
        pad_token_id=ids["<pad>"],
    )
    vision = dict(
        model_type="pixtral",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,  # head size 16: 4 rotary frequencies per axis
        image_size=LONGEST_EDGE,
        patch_size=PATCH,
        initializer_range=0.5,
    )
    config = Mistral3Config(
        text_config=text,
        vision_config=vision,
        image_token_index=ids["[IMG]"],
        spatial_merge_size=MERGE,
        vision_feature_layer=-1,
        tie_word_embeddings=True,
    )
    config.eos_token_id = ids["</s>"]
    config.pad_token_id = ids["<pad>"]

    def save(out_dir: str) -> None:
        PixtralImageProcessorPil(
            size={"longest_edge": LONGEST_EDGE},
            patch_size={"height": PATCH, "width": PATCH},
            image_mean=CLIP_MEAN,
            image_std=CLIP_STD,
        ).save_pretrained(out_dir)
        processor = {
            "processor_class": "PixtralProcessor",
            "patch_size": PATCH,
            "spatial_merge_size": MERGE,
            "image_token": "[IMG]",
            "image_break_token": "[IMG_BREAK]",
            "image_end_token": "[IMG_END]",
        }
        with open(os.path.join(out_dir, "processor_config.json"), "w") as f:
            json.dump(processor, f, indent=2)

    return KitModel(config, tokenizer, save)
