"""The language-model wing for hybrid and MoE models (Qwen3.5, Qwen3.5-MoE, Qwen3-VL-MoE), in fp32 against HF
`generate`, beyond the conformance suite (tests/test_conformance.py): a prefix hit right after an image, n = 3 with
a seed, a second conversation turn, retraction under KV and under state pressure; and the negative controls that
show these tests see what they claim to (the state dropped between chunks, a checkpoint restored from the wrong
position, an MoE routing with the wrong top-k). Pools and caches are clean after each."""

from __future__ import annotations

import pytest
import torch

from mmserve import SamplingParams
from mmserve.engine.cache.radix_cache import RadixCache
from mmserve.engine.layers import UnsupportedLayerKind
from mmserve.multimodal.items import Modality
from mmserve.testing.reference import HFReference
from tests.engine_helpers import image_case, template_messages, text_case
from tests.families import FAMILIES
from tests.test_conformance import llm_for
from tests.test_engine_parity import (
    MAX_NEW,
    assert_idle_and_clean,
    greedy,
    make_llm,
    run_and_compare,
)

HYBRIDS = ["qwen3_5", "qwen3_5_moe", "minicpmv4_6"]
MOES = ["qwen3_5_moe", "qwen3_vl_moe", "glm4v_moe", "qwen3_omni_moe"]


def item_end(prompt_ids: list[int]) -> int:
    return max(i for i, t in enumerate(prompt_ids) if t >= 2**62) + 1


@pytest.mark.parametrize("arch", HYBRIDS)
def test_a_hit_right_after_an_image_resumes_from_its_checkpoint(arch, tiny_model, oracles):
    llm = llm_for(tiny_model, arch)
    first = image_case([80], "What is in it?", system="You look at pictures.")
    second = image_case([80], "Which colours?", system="You look at pictures.")
    run_and_compare(llm, oracles(arch), [first])
    out = run_and_compare(llm, oracles(arch), [second])[0]
    # the system prompt and the image from the checkpoint at the image's end; the other question recomputed
    assert out.num_cached_tokens == item_end(out.prompt_token_ids)
    assert_idle_and_clean(llm)


@pytest.mark.parametrize("arch", HYBRIDS)
def test_n3_seeded_equals_three_requests_without_the_prefix_cache(arch, tiny_model, oracles):
    case = image_case([81], "Tell me more.")
    cached = llm_for(tiny_model, arch)
    sampled = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=MAX_NEW, ignore_eos=True)
    choices = cached.chat([case.messages], sampled)[0]
    # the siblings hit the first choice's checkpoint one token before the prompt's end
    hits = cached.engine.scheduler.stats.prefix_hit_tokens
    assert hits == 2 * (len(choices.prompt_token_ids) - 1)
    plain = llm_for(tiny_model, arch, disable_prefix_cache=True)
    alone = [
        plain.chat([case.messages], SamplingParams(temperature=1.0, seed=7 + i, max_tokens=MAX_NEW, ignore_eos=True))
        for i in range(3)
    ]
    assert [c.token_ids for c in choices.outputs] == [a[0].token_ids for a in alone]
    assert len({tuple(c.token_ids) for c in choices.outputs}) == 3  # the seeds differ, and so do the samples
    greedy_three = cached.chat([case.messages], SamplingParams(n=3, temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    assert all(c.token_ids == oracles(arch)(case).token_ids for c in greedy_three[0].outputs)
    assert_idle_and_clean(cached)
    assert_idle_and_clean(plain)


@pytest.mark.parametrize("arch", HYBRIDS)
def test_a_second_conversation_turn_resumes_from_the_first_turns_donated_state(arch, tiny_model):
    """Turn 2 is turn 1's prompt, its answer and a new question, token for token (what the chat template renders
    for a real model's answer): it resumes from the state turn 1 left when it finished."""
    model_dir, spec = tiny_model(arch), FAMILIES[arch]
    ref = HFReference(model_dir, mm_processor_kwargs=spec.mm_kwargs)
    llm = llm_for(tiny_model, arch)
    first = image_case([85], "Describe it.")  # a seed whose answer holds no media placeholder token
    template = template_messages(first.messages)
    text = llm.tokenizer.apply_chat_template(template, add_generation_prompt=True, tokenize=False)
    ids = llm.tokenizer(text, add_special_tokens=False)["input_ids"]  # one placeholder per item
    image = first.media[0][1]
    one = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": image}}, greedy())[0]
    assert not set(one.token_ids) & set(llm.engine.family.placeholders.values()), "pick another seed"
    hf_inputs = ref.inputs(template, first.media)
    assert one.token_ids == ref.generate_from(ref.extend(hf_inputs, []), MAX_NEW).token_ids
    follow = llm.tokenizer("<|im_end|>\n<|im_start|>user\nAnd in one word?<|im_end|>\n<|im_start|>assistant\n")
    tail = one.token_ids + follow["input_ids"]
    two = llm.generate({"prompt_token_ids": ids + tail, "multi_modal_data": {"image": image}}, greedy())[0]
    assert two.token_ids == ref.generate_from(ref.extend(hf_inputs, tail), MAX_NEW).token_ids
    # everything turn 1 computed: its prompt and its answer but the last token (sampled, never computed)
    assert two.num_cached_tokens == len(one.prompt_token_ids) + len(one.token_ids) - 1
    assert_idle_and_clean(llm)


@pytest.mark.parametrize("arch", HYBRIDS)
def test_retraction_under_kv_pressure_resumes_exactly(arch, tiny_model, oracles):
    # Room for exactly two prompts that share their text before the image (Qwen3.5: 90 tokens for its 61-token
    # prompts), 10 more each: two are admitted together, run out while decoding, and the newer one is retracted,
    # donates its state and resumes from it later.
    cases = [image_case([83 + i], "Describe the image in detail.") for i in range(4)]
    probe = llm_for(tiny_model, arch, kv_cache_mb=1, disable_prefix_cache=True)
    prompt = probe.chat([cases[0].messages], greedy())[0].prompt_token_ids
    room = 2 * len(prompt) - prompt.index(next(t for t in prompt if t >= 2**62))
    llm = llm_for(tiny_model, arch, kv_cache_mb=room / probe.engine.pool.num_slots)
    run_and_compare(llm, oracles(arch), cases, check_logits=False)
    assert llm.engine.scheduler.stats.retractions > 0
    assert_idle_and_clean(llm)


@pytest.mark.parametrize("arch", HYBRIDS)
def test_state_pressure_limits_admission_and_evicts_checkpoints(arch, tiny_model, oracles):
    llm = llm_for(tiny_model, arch, max_num_seqs=2)
    states = llm.engine.states
    per = states.slot_bytes / 2**20
    # Four states: two running, two for checkpoints, which keep replacing each other (least recently used).
    llm = llm_for(tiny_model, arch, max_num_seqs=2, state_cache_mb=4 * per + 1e-6)
    assert llm.engine.states.num_slots == 4
    cases = [image_case([90 + i], "Name one colour.") for i in range(5)] + [text_case("Count to three.")]
    run_and_compare(llm, oracles(arch), cases)
    assert llm.engine.scheduler.stats.checkpoints > 4  # more than the pool holds: old ones made room
    last = image_case([96], "Name two colours.")
    run_and_compare(llm, oracles(arch), [last])
    again = run_and_compare(llm, oracles(arch), [last])[0]  # the newest checkpoints are the last to go
    assert again.num_cached_tokens == len(again.prompt_token_ids) - 1
    assert_idle_and_clean(llm)


@pytest.mark.parametrize("text_steps", [0, 2, 100], ids=["not-started", "half-done", "done"])
def test_an_overlap_stage_hands_its_state_to_the_request(arch_hybrid, tiny_model, oracles, text_steps):
    """Encode-prefill overlap on a hybrid: the text stage's state, donated when it ends, is where the request
    resumes; it computes none of the text again."""
    from tests.test_encode_prefill_overlap import SYSTEM, prompt_and_items, record_chunk_starts, run

    llm = llm_for(tiny_model, arch_hybrid, max_num_batched_tokens=8)
    case = image_case([103, 104], "What changed?", system=SYSTEM)
    ids, items = prompt_and_items(llm, case)
    engine = llm.engine
    assert engine.overlap.prefill_before("r", ids)
    for _ in range(text_steps):
        assert engine.step() == []
    req = engine.add_request("r", ids, greedy(), items)
    text_len = ids.index(engine.family.placeholders[Modality.IMAGE])
    starts = record_chunk_starts(engine, req)
    assert run(llm, "r") == oracles(arch_hybrid)(case).token_ids
    assert min(starts) == text_len and req.own_prefill_tokens == text_len
    assert_idle_and_clean(llm)


@pytest.fixture(params=HYBRIDS)
def arch_hybrid(request) -> str:
    return request.param


# -- negative controls: each breaks the engine one way, and the comparison with HF must see it ------------------
def _mismatch(llm, oracle, cases) -> bool:
    outputs = llm.chat([c.messages for c in cases], [greedy() for _ in cases])
    return any(o.token_ids != oracle(c).token_ids for o, c in zip(outputs, cases, strict=True))


@pytest.mark.parametrize("arch", HYBRIDS)
def test_negative_control_state_dropped_between_chunks(arch, tiny_model, oracles, monkeypatch):
    llm = llm_for(tiny_model, arch, max_num_batched_tokens=7)
    scheduler, states = llm.engine.scheduler, llm.engine.states
    real = scheduler.finish_step

    def drop(chunks):
        real(chunks)
        for c in chunks:
            if c.end < c.request.prompt_len:  # a prefill chunk that another chunk continues
                for layer in states.layers:
                    states.conv[layer][c.request.state_slot].zero_()
                    states.recurrent[layer][c.request.state_slot].zero_()

    monkeypatch.setattr(scheduler, "finish_step", drop)
    assert _mismatch(llm, oracles(arch), [image_case([100], "Describe it."), text_case("Tell me a story.")])


@pytest.mark.parametrize("arch", HYBRIDS)
def test_negative_control_checkpoint_restored_from_the_wrong_position(arch, tiny_model, oracles, monkeypatch):
    llm = llm_for(tiny_model, arch)
    real = RadixCache.insert

    def one_token_early(self, tokens, slots, state=None):  # the state after p tokens, filed under p - 1
        if state is not None and len(tokens) > 1:
            return real(self, tokens[:-1], slots[:-1], state)
        return real(self, tokens, slots, state)

    monkeypatch.setattr(RadixCache, "insert", one_token_early)
    case = image_case([101], "What is there?")
    assert not _mismatch(llm, oracles(arch), [case])  # the first run hits nothing
    assert _mismatch(llm, oracles(arch), [case])  # the repeat resumes from a state one token late


@pytest.mark.parametrize("arch", MOES)
def test_negative_control_moe_routing_with_the_wrong_top_k(arch, tiny_model, oracles):
    llm = llm_for(tiny_model, arch)
    routers = [m for m in llm.engine.runner.language_model.modules() if hasattr(m, "top_k")]
    assert routers
    case = image_case([102], "Describe it.")
    assert not _mismatch(llm, oracles(arch), [case])
    for router in routers:
        router.top_k = 1
    assert _mismatch(llm, oracles(arch), [case])


def test_an_unsupported_layer_kind_is_refused_at_load_naming_it(tmp_path):
    from mmserve.testing.tiny_models import build_tiny_model

    def chunked(config):
        config.text_config.layer_types = ["chunked_attention", "full_attention"]

    model = build_tiny_model(str(tmp_path / "chunked"), "qwen2_vl", edit_config=chunked)
    with pytest.raises(UnsupportedLayerKind, match=r"layer 0 is 'chunked_attention', a layer kind .* does not run"):
        make_llm(model)


def test_state_pool_bytes_match_transformers_cache(tiny_model):
    """The state pool keeps per request exactly what transformers' cache keeps for one sequence."""
    from transformers import DynamicCache

    from mmserve.models.loader import load_model

    llm = llm_for(tiny_model, "qwen3_5")
    states = llm.engine.states
    hf = load_model(tiny_model("qwen3_5"))
    cache = DynamicCache(config=hf.config.get_text_config())
    with torch.no_grad():
        hf.model.language_model(input_ids=torch.tensor([[1, 2, 3, 4, 5]]), cache=cache, use_cache=True)
    hf_bytes = sum(
        layer.conv_states[0].nbytes + layer.recurrent_states[0].nbytes
        for layer in cache.layers
        if hasattr(layer, "conv_states")
    )
    assert states.slot_bytes == hf_bytes
    assert all(layer.recurrent_states[0].dtype == torch.float32 for layer in cache.layers if hasattr(layer, "conv_states"))
