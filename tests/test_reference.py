"""The HF parity oracle reacts to images: a different image gives different greedy tokens."""

from __future__ import annotations

from mmserve.models.loader import load_model, load_processor, load_tokenizer
from mmserve.multimodal.items import Modality
from mmserve.testing.reference import hf_generate, prepare_prompt
from tests.conftest import random_image

MESSAGES = [
    {"role": "user", "content": [{"type": "image_url"}, {"type": "text", "text": "Describe the image."}]}
]


def test_reference_output_changes_with_the_image(tiny_model_dir):
    model, tok, proc = (
        load_model(tiny_model_dir),
        load_tokenizer(tiny_model_dir),
        load_processor(tiny_model_dir),
    )
    out = {}
    for seed in (0, 1, 0):
        prompt, processed = prepare_prompt(tok, proc, MESSAGES, [(Modality.IMAGE, random_image(seed))])
        out.setdefault(seed, []).append(hf_generate(model, prompt, processed, max_new_tokens=8))
    first, again, other = out[0][0], out[0][1], out[1][0]
    assert len(first.token_ids) == 8 and first.logits.shape == (8, model.config.text_config.vocab_size)
    assert first.token_ids == again.token_ids  # deterministic
    assert first.token_ids != other.token_ids  # the image matters
    # the greedy tokens are the argmax of the returned logits
    assert first.logits.argmax(-1).tolist() == first.token_ids
