"""Sliding windows, bidirectional image blocks, KV sharing, per-layer embeddings and the logit soft-cap (Gemma 3 and
Gemma 4), in fp32 against HF `generate`, beyond the conformance suite (tests/test_conformance.py): prompts far
longer than the window with the window rows behind it freed, a hit right after an image, a second turn,
retraction under pressure, Gemma 3's pan-and-scan, Gemma 4's audio and soft-token budget, the expansion through
the tokenizer; and the negative controls that show these tests see what they claim to. Pools and caches are
clean after each."""

from __future__ import annotations

import pytest
import torch

from mmserve.engine.request import Request
from mmserve.models.text_expansion import expand_by_text
from mmserve.multimodal.items import Modality, MultimodalItem
from mmserve.testing.reference import HFReference
from tests.engine_helpers import (
    RecordingSampler,
    audio_case,
    image_case,
    template_messages,
    text_case,
)
from tests.families import FAMILIES
from tests.test_conformance import llm_for
from tests.test_engine_parity import (
    MAX_NEW,
    assert_idle_and_clean,
    greedy,
    make_llm,
    make_oracle,
    run_and_compare,
)

GEMMAS = ["gemma3", "gemma4"]
LONG = "Describe the image in one sentence. The quick brown fox jumps over the lazy dog near the river bank. " * 6


def item_end(prompt_ids: list[int]) -> int:
    return max(i for i, t in enumerate(prompt_ids) if t >= 2**62) + 1


def chat_tokens(llm, cases, params=None):
    return [o.token_ids for o in llm.chat([c.messages for c in cases], params or [greedy() for _ in cases])]


@pytest.mark.parametrize("budget", [7, 64])
@pytest.mark.parametrize("arch", GEMMAS)
def test_prompts_far_longer_than_the_window_hold_only_its_rows(arch, budget, tiny_model, oracles):
    """A 300-token prompt with an image in the middle, windows of 6: exact, and a running request holds at most
    its window, a chunk and the rows kept before where later requests resume (around the image, before its last
    prompt token), never the whole prompt's."""
    llm = llm_for(tiny_model, arch, max_num_batched_tokens=budget)
    engine, window = llm.engine, llm.engine.window
    held: list[int] = []
    real_step = engine.step

    def step():
        out = real_step()
        held.extend(int((r.window_buffer >= 0).sum()) for r in engine.scheduler.running)
        return out

    engine.step = step
    case = image_case([5], LONG, system=LONG)
    out = run_and_compare(llm, oracles(arch), [case])[0]
    pads = [i for i, t in enumerate(out.prompt_token_ids) if t >= 2**62]
    # its own window, the rows kept before the image, after it and before its last token, a chunk (or a block)
    bound = (window - 1) * (1 + 3) + max(budget, len(pads))
    assert len(out.prompt_token_ids) > 250 and 0 < max(held) <= bound
    # the prefix cache keeps the window rows where a hit may resume, not the whole prompt's
    assert engine.scheduler.prefix_cache.window_rows < len(out.prompt_token_ids) // 2
    again = run_and_compare(llm, oracles(arch), [case])[0]
    assert again.num_cached_tokens == len(again.prompt_token_ids) - 1
    assert_idle_and_clean(llm)


@pytest.mark.parametrize("arch", GEMMAS)
def test_a_hit_right_after_an_image(arch, tiny_model, oracles):
    llm = llm_for(tiny_model, arch, max_num_batched_tokens=7)
    first = image_case([80], "What is in it?", system="You look at pictures.")
    second = image_case([80], "Which colours?", system="You look at pictures.")
    run_and_compare(llm, oracles(arch), [first])
    out = run_and_compare(llm, oracles(arch), [second])[0]
    # the system prompt and the image from the cache (the window rows before the image's end were kept)
    assert out.num_cached_tokens >= item_end(out.prompt_token_ids)
    other = run_and_compare(llm, oracles(arch), [image_case([81], "What is in it?", system="You look at pictures.")])
    assert 0 < other[0].num_cached_tokens < item_end(other[0].prompt_token_ids)  # the text before the image only
    assert_idle_and_clean(llm)


@pytest.mark.parametrize("arch", GEMMAS)
def test_retraction_under_kv_pressure_resumes_exactly(arch, tiny_model, oracles):
    probe = llm_for(tiny_model, arch)
    per_token = probe.engine.pool.token_bytes + probe.engine.window_pool.token_bytes
    cases = [image_case([83 + i], "Describe the image in detail.") for i in range(4)]
    prompt = len(probe.chat([cases[0].messages], greedy())[0].prompt_token_ids)
    # Room for two prompts and a few tokens: two are admitted together and run out while decoding
    llm = llm_for(tiny_model, arch, kv_cache_mb=(2 * prompt + 6) * per_token / 2**20, disable_prefix_cache=True)
    run_and_compare(llm, oracles(arch), cases, check_logits=False)
    assert llm.engine.scheduler.stats.retractions > 0
    assert_idle_and_clean(llm)


def test_a_second_turn_resumes_where_the_first_ended(tiny_model):
    arch = "gemma3"
    ref = HFReference(tiny_model(arch), mm_processor_kwargs={})
    llm = llm_for(tiny_model, arch)
    first = image_case([85], "Describe it.")
    template = template_messages(first.messages)
    text = llm.tokenizer.apply_chat_template(template, add_generation_prompt=True, tokenize=False)
    ids = llm.tokenizer(text, add_special_tokens=False)["input_ids"]
    image = first.media[0][1]
    one = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": image}}, greedy())[0]
    hf_inputs = ref.inputs(template, first.media)
    assert one.token_ids == ref.generate_from(ref.extend(hf_inputs, []), MAX_NEW).token_ids
    tail = one.token_ids + llm.tokenizer("<end_of_turn>\n<start_of_turn>user\nAnd?<end_of_turn>\n")["input_ids"]
    prompt = ids + tail
    two = llm.generate({"prompt_token_ids": prompt, "multi_modal_data": {"image": image}}, greedy())[0]
    assert two.token_ids == ref.generate_from(ref.extend(hf_inputs, tail), MAX_NEW).token_ids
    assert two.num_cached_tokens == len(one.prompt_token_ids) + len(one.token_ids) - 1
    assert_idle_and_clean(llm)


# -- Gemma 3: pan-and-scan -----------------------------------------------------------------------------------
PAN_AND_SCAN = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 16}  # crops of tiny images too


def test_gemma3_pan_and_scan_crops_wide_images_as_transformers_does(tiny_model):
    model = tiny_model("gemma3")
    oracle = make_oracle(model, PAN_AND_SCAN)
    llm = make_llm(model, PAN_AND_SCAN, max_num_batched_tokens=7)
    wide = image_case([7, 8], "Compare them.", sizes=[(160, 48), (48, 48)])  # 3 crops and none
    out = run_and_compare(llm, oracle, [wide, image_case([9], "What?", sizes=[(48, 120)])])
    # the wide image is its tile and 3 crops, the square one a single tile: 5 tiles of 16 soft tokens
    assert sum(t >= 2**62 for t in out[0].prompt_token_ids) == 5 * 16
    assert_idle_and_clean(llm)


# -- Gemma 4: audio, the soft-token budget ---------------------------------------------------------------------
def test_gemma4_audio_alone_and_beside_an_image(tiny_model, oracles):
    llm = llm_for(tiny_model, "gemma4", max_num_batched_tokens=7)
    clips = audio_case([4, 5], "What are they?", seconds=[0.7, 1.3])
    one = audio_case([6], "What is it?", seconds=[2.0])
    run_and_compare(llm, oracles("gemma4"), [clips, one])
    both = image_case([9], "And the sound?")
    both.messages[0]["content"].insert(1, clips.messages[0]["content"][0])
    both.media.append(clips.media[0])
    run_and_compare(llm, oracles("gemma4"), [both])
    assert_idle_and_clean(llm)


def test_gemma4_soft_token_budget_is_a_setting_of_the_image(tiny_model):
    model = tiny_model("gemma4")
    more = {"max_soft_tokens": 140}
    llm = make_llm(model, more)
    out = run_and_compare(llm, make_oracle(model, more), [image_case([3], "What?")])[0]
    default = llm_for(tiny_model, "gemma4").chat([image_case([3], "What?").messages], greedy())[0]
    assert sum(t >= 2**62 for t in out.prompt_token_ids) > sum(t >= 2**62 for t in default.prompt_token_ids)
    assert_idle_and_clean(llm)


# -- the expansion through the tokenizer -----------------------------------------------------------------------
@pytest.mark.parametrize("arch", GEMMAS)
def test_the_expansion_is_transformers_and_splicing_tokens_would_not_be(arch, tiny_model):
    """Gemma's tokenizer merges "\\n" and the expansion's text with the prompt around it, so the family expands
    through the tokenizer: its ids equal transformers' processor's, where splicing each item's own tokens (what
    it does for ids that are not the tokenizer's encoding of their text, a client's own ids) gives other ids."""
    model = tiny_model(arch)
    ref = HFReference(model, mm_processor_kwargs={})
    family = ref.family
    case = image_case([3], "What?") if arch == "gemma3" else FAMILIES[arch].cases()["video"]
    if arch == "gemma4":  # text right before the video: its first timestamp merges with it ("▁00")
        case.messages[0]["content"].insert(0, {"type": "text", "text": "Look at "})
    template = template_messages(case.messages)
    hf_ids = ref.inputs(template, case.media)["input_ids"][0].tolist()
    text = ref.tokenizer.apply_chat_template(template, add_generation_prompt=True, tokenize=False)
    ids = ref.tokenizer(text, add_special_tokens=False)["input_ids"]  # one placeholder per item
    items = []
    for modality, media in case.media:
        tower_input = family.process(modality, media, {})
        items.append(MultimodalItem(modality, bytes(16), tower_input.num_tokens, tower_input.metadata))
    assert family.expand(ids, items).hf_token_ids == hf_ids
    spliced = expand_by_text(_NoRoundTrip(ref.tokenizer), ids, items, family.placeholders, family.render,
                             family.runs, family.soft_tokens)  # fmt: skip
    assert spliced.hf_token_ids != hf_ids


class _NoRoundTrip:
    """The kit tokenizer, except that the prompt's text never encodes back to the ids it came from."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.added_tokens_decoder = tokenizer.added_tokens_decoder

    def decode(self, ids, **kwargs):
        return self.tokenizer.decode(ids, **kwargs) + " "

    def __call__(self, text, **kwargs):
        return self.tokenizer(text, **kwargs)

    def convert_ids_to_tokens(self, tid):
        return self.tokenizer.convert_ids_to_tokens(tid)


# -- negative controls -----------------------------------------------------------------------------------------
def differs(llm, oracle, cases) -> bool:
    return chat_tokens(llm, cases) != [oracle(c).token_ids for c in cases]


@pytest.mark.parametrize("arch", GEMMAS)
def test_negative_control_image_attention_made_causal(arch, tiny_model, oracles):
    llm = llm_for(tiny_model, arch)
    llm.engine.family.bidirectional_blocks = lambda expanded: []
    assert differs(llm, oracles(arch), [FAMILIES[arch].two([1, 2]), FAMILIES[arch].one(3, "What?")])


@pytest.mark.parametrize("arch", GEMMAS)
def test_negative_control_the_window_off_by_one(arch, tiny_model, oracles, monkeypatch):
    from mmserve.engine.layers import attention_metadata as am

    chunk = am.SeqAttention.chunk
    llm = llm_for(tiny_model, arch)
    monkeypatch.setattr(
        am.SeqAttention, "chunk", staticmethod(lambda q, s, e, kv, w=None, b=None: chunk(q, s, e, kv, w and w - 1, b))
    )
    assert differs(llm, oracles(arch), [FAMILIES[arch].two([1, 2]), text_case("Tell me a story about a cat.")])


@pytest.mark.parametrize("arch", GEMMAS)
def test_negative_control_an_image_split_across_chunks(arch, tiny_model, oracles, monkeypatch):
    llm = llm_for(tiny_model, arch, max_num_batched_tokens=7)
    monkeypatch.setattr(Request, "chunk_end", lambda self, start, end: end)  # cut anywhere, blocks too
    assert differs(llm, oracles(arch), [FAMILIES[arch].two([1, 2])])


def first_logits_error(llm, oracle, case) -> float:
    recorder = RecordingSampler()
    llm.engine.sampler = recorder
    params = greedy()
    llm.chat([case.messages], params)
    return float((recorder.logits_for(params)[0] - oracle(case).logits[0]).abs().max())


def test_negative_control_gemma4_bidirectional_on_full_layers_too(tiny_model, oracles, monkeypatch):
    """transformers keeps Gemma 4's full layers causal: item blocks there change the logits."""
    from mmserve.engine.layers import attention_metadata as am

    case = FAMILIES["gemma4"].two([1, 2])
    assert first_logits_error(llm_for(tiny_model, "gemma4"), oracles("gemma4"), case) < 5e-4
    view = am.AttentionPlan._view
    monkeypatch.setattr(
        am.AttentionPlan, "_view", staticmethod(lambda kind, p, d, dev: view(am.ViewKind(kind.window, True), p, d, dev))
    )
    assert first_logits_error(llm_for(tiny_model, "gemma4"), oracles("gemma4"), case) > 0.05


def test_negative_control_gemma4_per_layer_embeddings_from_the_placeholder(tiny_model, oracles, monkeypatch):
    llm = llm_for(tiny_model, "gemma4")
    family = llm.engine.family
    family.pad_token_id = family.placeholders[Modality.IMAGE]  # media rows looked up as the image token
    assert differs(llm, oracles("gemma4"), [FAMILIES["gemma4"].two([1, 2]), FAMILIES["gemma4"].one(3, "What?")])


def test_negative_control_gemma4_soft_cap_left_out(tiny_model, oracles):
    """The cap is monotone, so greedy tokens cannot see it: the logits can."""
    llm = llm_for(tiny_model, "gemma4")
    case = text_case("Tell me a story about a cat.")
    expected = oracles("gemma4")(case)
    recorder = RecordingSampler()
    llm.engine.sampler = recorder
    params = greedy()
    llm.chat([case.messages], params)
    torch.testing.assert_close(recorder.logits_for(params), expected.logits, atol=5e-4, rtol=1e-5)
    llm.engine.runner.softcap = None
    params = greedy()
    llm.chat([case.messages], params)
    assert (recorder.logits_for(params) - expected.logits).abs().max() > 0.1
