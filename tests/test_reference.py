"""The HF parity oracle: transformers' own processor classes, deterministic, and it reacts to the media."""

from __future__ import annotations

import pytest

from mmserve.testing.reference import HFReference
from tests.engine_helpers import reference
from tests.families import FAMILIES


def hf_processor_class(arch: str) -> str:
    """The processor class transformers' AutoProcessor picks for the model type."""
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    return PROCESSOR_MAPPING_NAMES[arch]


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_reference_uses_transformers_processor_and_reacts_to_media(arch, tiny_model):
    spec = FAMILIES[arch]
    ref = HFReference(tiny_model(arch), mm_processor_kwargs=spec.mm_kwargs)
    assert type(ref.processor).__name__ == hf_processor_class(arch)
    assert type(ref.processor).__module__.startswith("transformers.")
    first, again, other = (reference(ref, spec.one(seed), 8) for seed in (0, 0, 1))
    vocab = ref.model.config.get_text_config().vocab_size
    assert len(first.token_ids) == 8 and first.logits.shape == (8, vocab)
    assert first.token_ids == again.token_ids  # deterministic
    assert first.token_ids != other.token_ids  # the media matter
    assert first.logits.argmax(-1).tolist() == first.token_ids  # greedy tokens are the logits' argmax
