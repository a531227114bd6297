"""Offline kit entries for Gemma 3 and Gemma 4: tiny checkpoints whose windows bite (prompts far longer than the
sliding window), whose image blocks change the tokens when made causal, and a tokenizer built like Gemma's
(SentencePiece-style byte-fallback BPE that merges across newlines and words, so an expansion spliced at the
token level would differ from transformers'); and Gemma 3's proportions as `small`."""

from __future__ import annotations

import json

from mmserve.testing.kit_base import _CORPUS, KitModel, tiny_only, token_ids

GEMMA_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>")
TURN_TOKENS = ("<start_of_turn>", "<end_of_turn>")
GEMMA3_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")
GEMMA4_TOKENS = ("<|image>", "<image|>", "<|image|>", "<|video|>", "<|audio>", "<audio|>", "<|audio|>")
GEMMA3_EXTRA = {
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
    "image_token": "<image_soft_token>",
}
GEMMA4_EXTRA = {
    "boi_token": "<|image>",
    "eoi_token": "<image|>",
    "image_token": "<|image|>",
    "boa_token": "<|audio>",
    "eoa_token": "<audio|>",
    "audio_token": "<|audio|>",
}
# Gemma's chat format: no system role (a system message opens the first user turn), the assistant is "model".
_TURNS = (
    "{{ bos_token }}{% set ns = namespace(system='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% set ns.system = message['content'] + '\\n\\n' %}{% else %}"
    "<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if loop.index0 == 1 or (loop.first and message['role'] != 'system') %}{{ ns.system }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
)
_TURNS_END = (
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
GEMMA3_TEMPLATE = _TURNS + "{% if content['type'] in ('image', 'image_url') %}<start_of_image>" + _TURNS_END
GEMMA4_TEMPLATE = (
    _TURNS + "{% if content['type'] in ('image', 'image_url') %}<|image|>"
    "{% elif content['type'] in ('video', 'video_url') %}<|video|>"
    "{% elif content['type'] in ('audio', 'input_audio', 'audio_url') %}<|audio|>" + _TURNS_END
)
# Newlines, turns and timestamps as Gemma prompts have them, so the tokenizer learns merges across them.
_GEMMA_CORPUS = [
    *_CORPUS,
    "<start_of_turn>user\n\n\nDescribe it.<end_of_turn>\n<start_of_turn>model\nA red square.\n\n",
    "Here is the original image \n\n and here are some crops to help you see better \n\n \n\n",
    "00:00 00:01 00:02 00:03 01:00 12:30 user\nmodel\n\n\n\n",
    "Look at 00:00 then at 00:01 and\n00:02 or\n00:03 at 01:00. Look at 00:00 or at 00:00 at 00:00",
]


def gemma_tokenizer(special: tuple[str, ...], extra: dict[str, str], template: str, vocab_size: int = 420):
    """A byte-fallback BPE trained in milliseconds, normalized and decoded as Gemma's (spaces as "▁", no
    pre-tokenizer: merges cross words and newlines), with the family's special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(special),
        special_tokens=[*GEMMA_TOKENS, *byte_tokens],
        show_progress=False,
    )
    tok.train_from_iterator(_GEMMA_CORPUS * 4, trainer=trainer)
    tok.add_special_tokens([*TURN_TOKENS, *special])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<end_of_turn>",
        pad_token="<pad>",
        unk_token="<unk>",
        extra_special_tokens=extra,
    )
    fast.chat_template = template
    return fast


def _gemma3_text(size: str, tokenizer) -> dict:
    ids = token_ids(tokenizer, ("<pad>", "<bos>", "<end_of_turn>"))
    common = dict(
        pad_token_id=ids["<pad>"],
        bos_token_id=ids["<bos>"],
        eos_token_id=ids["<end_of_turn>"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
        },
    )
    if size == "tiny":
        # Sliding layers around a full one, a window of 6: far below every prompt, so windows bite.
        layers = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
        return dict(
            vocab_size=len(tokenizer),
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=6,
            layer_types=layers,
            initializer_range=0.2,
            max_position_embeddings=4096,
            **common,
        )
    # Gemma 3 1B's language model (26 layers, 5 sliding : 1 full, window 512, head size 256, one KV head) and
    # the 262,144-row embedding every Gemma 3 has; ids past the kit tokenizer decode to nothing.
    layers = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(26)]
    return dict(
        vocab_size=262_144,
        hidden_size=1152,
        intermediate_size=6912,
        num_hidden_layers=26,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        query_pre_attn_scalar=256,
        sliding_window=512,
        layer_types=layers,
        initializer_range=0.02,
        max_position_embeddings=32_768,
        **common,
    )


def gemma3_kit(size: str) -> KitModel:
    from transformers import Gemma3Config, Gemma3ImageProcessorPil

    tokenizer = gemma_tokenizer(GEMMA3_TOKENS, GEMMA3_EXTRA, GEMMA3_TEMPLATE)
    ids = token_ids(tokenizer, GEMMA3_TOKENS)
    text = _gemma3_text(size, tokenizer)
    if size == "tiny":  # 64x64 tiles in 8x8 patches, pooled 2x2: 16 soft tokens a tile
        vision = dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=64,
            patch_size=8,
        )
        tokens, tile = 16, 64
    else:  # a SigLIP-B-sized tower on 448x448 tiles in 14x14 patches, pooled 2x2: 256 soft tokens, as Gemma 3's
        vision = dict(
            hidden_size=768,
            intermediate_size=3072,
            num_hidden_layers=12,
            num_attention_heads=12,
            image_size=448,
            patch_size=14,
        )
        tokens, tile = 256, 448
    config = Gemma3Config(
        text_config=text,
        vision_config={**vision, "model_type": "siglip_vision_model", "vision_use_head": False},
        mm_tokens_per_image=tokens,
        image_token_index=ids["<image_soft_token>"],
        boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"],
        initializer_range=0.2 if size == "tiny" else 0.02,
        tie_word_embeddings=True,
    )
    config.eos_token_id = text["eos_token_id"]
    config.pad_token_id = text["pad_token_id"]

    def save(out_dir: str) -> None:
        # Pan-and-scan settings left null, as Gemma 3's checkpoints have them (the processor's defaults apply)
        Gemma3ImageProcessorPil(
            size={"height": tile, "width": tile}, image_mean=[0.5] * 3, image_std=[0.5] * 3
        ).save_pretrained(out_dir)

    return KitModel(config, tokenizer, save, louder_branches if size == "tiny" else _keep)


def _keep(model) -> None:
    """Real proportions: the random init as transformers draws it."""


def louder_branches(model) -> None:
    """Gemma norms each attention and MLP output before adding it to the residual stream ((1 + w) x, w drawn as
    0). In a tiny model the scaled token embedding then dwarfs every branch, and the greedy tokens depend on the
    last token alone; with w around 8 the branches carry the context, so a window off by one, an image attended
    causally or a position shifted changes the tokens (the negative controls)."""
    import torch

    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "language_model" in name and (
                "post_attention_layernorm" in name or "post_feedforward_layernorm" in name
            ):
                weight.copy_(torch.empty(weight.shape).uniform_(7.0, 9.0, generator=generator))
            elif name.endswith("mm_input_projection_weight"):  # Gemma 3 draws it as zeros: images unseen
                weight.copy_(torch.randn(weight.shape, generator=generator))


# Gemma 4 in miniature, every feature at once: sliding / full layers with wider full heads (32 against 16), the
# last two layers reading the KV of earlier ones, per-layer embeddings, a MoE block beside the MLP, image and video
# blocks attended both ways on sliding layers, a final logit soft-cap, and an audio tower.
# A full layer that writes its own KV after the first: what the first's item blocks change reaches the last token.
GEMMA4_LAYERS = [
    "sliding_attention",
    "sliding_attention",
    "full_attention",
    "sliding_attention",
    "full_attention",
    "sliding_attention",
    "full_attention",
]


def gemma4_kit(size: str) -> KitModel:
    from transformers import Gemma4AudioFeatureExtractor, Gemma4Config, Gemma4ImageProcessorPil

    from mmserve.models.gemma4 import VIDEO_DEFAULTS

    tiny_only("gemma4", size)
    tokenizer = gemma_tokenizer(GEMMA4_TOKENS, GEMMA4_EXTRA, GEMMA4_TEMPLATE)
    ids = token_ids(tokenizer, (*GEMMA4_TOKENS, "<pad>", "<bos>", "<end_of_turn>"))
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=7,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        sliding_window=6,
        layer_types=GEMMA4_LAYERS,
        num_kv_shared_layers=2,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=len(tokenizer),
        use_bidirectional_attention="vision",
        final_logit_softcapping=8.0,
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=32,
        initializer_range=0.2,
        max_position_embeddings=4096,
        pad_token_id=ids["<pad>"],
        bos_token_id=ids["<bos>"],
        eos_token_id=ids["<end_of_turn>"],
    )
    # 4-pixel patches pooled 2x2: a 64x48 image is 63 soft tokens at the smallest budget transformers allows (70)
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        patch_size=4,
        pooling_kernel_size=2,
        position_embedding_size=64,
        initializer_range=0.2,
    )
    # transformers sizes the projection after the subsampling as if the first conv had one channel per mel bin
    audio = dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        subsampling_conv_channels=[16, 4],
        output_proj_dims=32,
        conv_kernel_size=3,
        initializer_range=0.2,
    )
    config = Gemma4Config(
        text_config=text,
        vision_config=vision,
        audio_config=audio,
        image_token_id=ids["<|image|>"],
        video_token_id=ids["<|video|>"],
        audio_token_id=ids["<|audio|>"],
        boi_token_id=ids["<|image>"],
        eoi_token_id=ids["<image|>"],
        boa_token_id=ids["<|audio>"],
        eoa_token_index=ids["<audio|>"],
        initializer_range=0.2,
        tie_word_embeddings=True,
    )
    config.eos_token_id = text["eos_token_id"]
    config.pad_token_id = text["pad_token_id"]

    def save(out_dir: str) -> None:
        # As `Gemma4Processor.save_pretrained` writes them: one processor_config.json holding each part's settings
        # (the image processor and the feature extractor would both be preprocessor_config.json). The video
        # processor needs torchvision to be built, so its part is written as it saves itself.
        image = Gemma4ImageProcessorPil(patch_size=4, max_soft_tokens=70, pooling_kernel_size=2)
        video = {
            "video_processor_type": "Gemma4VideoProcessor",
            **VIDEO_DEFAULTS,
            "patch_size": 4,
            "pooling_kernel_size": 2,
            "do_sample_frames": False,
        }
        parts = {
            "processor_class": "Gemma4Processor",
            "image_processor": image.to_dict(),
            "feature_extractor": Gemma4AudioFeatureExtractor(feature_size=16).to_dict(),
            "video_processor": video,
            "image_seq_length": 70,
        }
        with open(f"{out_dir}/processor_config.json", "w") as f:
            json.dump(parts, f, indent=2, default=str)

    return KitModel(config, tokenizer, save, louder_branches)
