"""Every model family, every engine mode, against HF `generate` (fp32): greedy tokens equal, logits within
1e-4 (+1e-5 relative), and the pools and caches clean afterwards.

Per family: text only, one and two items of its modality (and video where it has one), chunk budgets of 1,
7 and 64 tokens (boundaries inside items), a prefix-cached repeat, and 8 concurrent requests. EPD with two
encoder workers and bf16 are in tests/test_family_epd.py.
"""

from __future__ import annotations

import pytest

from tests.families import FAMILIES
from tests.test_engine_parity import assert_idle_and_clean, make_llm, run_and_compare

ARCHS = sorted(FAMILIES)


def llm_for(tiny_model, arch: str, **kwargs):
    return make_llm(tiny_model(arch), FAMILIES[arch].mm_kwargs, **kwargs)


SINGLE = [(arch, name) for arch in ARCHS for name in FAMILIES[arch].cases()]


@pytest.mark.parametrize(("arch", "case"), SINGLE, ids=[f"{a}-{c}" for a, c in SINGLE])
def test_single_request(arch, case, tiny_model, oracles):
    llm = llm_for(tiny_model, arch)
    run_and_compare(llm, oracles(arch), [FAMILIES[arch].cases()[case]])
    assert_idle_and_clean(llm)


@pytest.mark.parametrize("budget", [1, 7, 64])
@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_budgets(arch, budget, tiny_model, oracles):
    # Chunk boundaries fall inside item spans: every item is many tokens and the budget cuts anywhere.
    spec = FAMILIES[arch]
    llm = llm_for(tiny_model, arch, max_num_batched_tokens=budget)
    run_and_compare(llm, oracles(arch), [spec.two([20, 21]), spec.one(22, "What is it?")])
    assert_idle_and_clean(llm)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_cached_repeat_reuses_the_items(arch, tiny_model, oracles):
    spec = FAMILIES[arch]
    llm = llm_for(tiny_model, arch)
    first, again = spec.two([30, 31], "What is there?"), spec.two([30, 31], "What is there?")
    run_and_compare(llm, oracles(arch), [first])
    out = run_and_compare(llm, oracles(arch), [again])[0]
    items_end = max(i for i, t in enumerate(out.prompt_token_ids) if t >= 2**62) + 1
    assert out.num_cached_tokens >= items_end  # the system prompt and both items came from the cache
    assert_idle_and_clean(llm)


@pytest.mark.parametrize("arch", ARCHS)
def test_eight_concurrent_requests(arch, tiny_model, oracles):
    spec = FAMILIES[arch]
    llm = llm_for(tiny_model, arch)
    cases = [
        spec.one(10 + i, "Describe the image." + " Be precise." * i, (40 + 8 * i, 48 + 4 * (i % 3)))
        for i in range(6)
    ]
    cases += [spec.two([50, 51]), FAMILIES[arch].cases()["text"]]
    run_and_compare(llm, oracles(arch), cases)
    assert_idle_and_clean(llm)
