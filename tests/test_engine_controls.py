"""Negative controls (each deliberate bug must change the tokens) and user-facing sampling behaviour."""

from __future__ import annotations

import pytest
import torch

from mmserve import LLM, SamplingParams
from mmserve.engine.layers import attention
from mmserve.multimodal.items import PAD_BASE, MultimodalItem
from tests.engine_helpers import image_case
from tests.test_engine_parity import assert_idle_and_clean, greedy, make_llm, make_oracle

CASES = [image_case([60, 61], "Compare the two images.", sizes=[(64, 48), (96, 64)])]


@pytest.fixture(scope="module")
def oracle(tiny_qwen2_vl):
    return make_oracle(tiny_qwen2_vl)


def tokens(llm: LLM, cases=CASES) -> list[list[int]]:
    return [o.token_ids for o in llm.chat([c.messages for c in cases], [greedy() for _ in cases])]


def test_control_top_left_causal_mask_for_a_chunk(tiny_qwen2_vl, oracle, monkeypatch):
    llm = make_llm(tiny_qwen2_vl, max_num_batched_tokens=7)
    assert tokens(llm) == [oracle(CASES[0]).token_ids]  # the real path is right...
    # ...and dropping the bottom-right mask makes chunks use SDPA's top-left `is_causal`.
    monkeypatch.setattr(attention.SeqAttention, "make", staticmethod(
        lambda q_start, q_len, kv_slots: attention.SeqAttention(q_start, q_len, kv_slots, None)))  # fmt: skip
    assert tokens(make_llm(tiny_qwen2_vl, max_num_batched_tokens=7)) != [oracle(CASES[0]).token_ids]


def test_control_decode_group_ignoring_padding(tiny_qwen2_vl, oracle, monkeypatch):
    # Requests of different lengths decode in one attention call over slots padded to the longest; without
    # the key mask (SDPA) or the lengths (mmserve's CPU kernel) the shorter ones would attend to the padding.
    cases = [image_case([90 + i], "Describe it." + " Really." * 3 * i) for i in range(3)]
    assert tokens(make_llm(tiny_qwen2_vl), cases) == [oracle(c).token_ids for c in cases]
    real = attention.DecodeGroup.make

    def unmasked(rows, kv_slots, device):
        group = real(rows, kv_slots, device)
        group.mask = None
        group.lengths = torch.full_like(group.lengths, group.slots.shape[1])
        return group

    monkeypatch.setattr(attention.DecodeGroup, "make", staticmethod(unmasked))
    outs = make_llm(tiny_qwen2_vl).chat([c.messages for c in cases], [greedy() for _ in cases])
    assert all(o.finish_reason == "length" for o in outs)  # wrong tokens, not a failed forward
    assert [o.token_ids for o in outs] != [oracle(c).token_ids for c in cases]


def test_control_missing_rope_delta(tiny_qwen2_vl, oracle, monkeypatch):
    from mmserve.models.qwen2_vl import Family

    real = Family.positions
    monkeypatch.setattr(Family, "positions", lambda self, ex: (real(self, ex)[0], 0))
    assert tokens(make_llm(tiny_qwen2_vl)) != [oracle(CASES[0]).token_ids]


def test_control_prefix_reused_across_different_images(tiny_qwen2_vl, oracle, monkeypatch):
    a, b = image_case([70], "Describe the image."), image_case([71], "Describe the image.")
    llm = make_llm(tiny_qwen2_vl)
    # If every image had the same pad value, the radix tree would hand b the KV of a's image.
    monkeypatch.setattr(MultimodalItem, "pad_value", property(lambda self: PAD_BASE + 1))
    tokens(llm, [a])
    out_b = tokens(llm, [b])[0]
    assert out_b != oracle(b).token_ids
    assert llm.engine.scheduler.stats.prefix_hit_tokens > 0


def test_same_seed_same_sample_different_seed_differs(tiny_qwen2_vl):
    llm = make_llm(tiny_qwen2_vl)
    case = image_case([80], "Write something.")

    def sample(seed):
        params = SamplingParams(
            temperature=1.0, top_p=0.95, top_k=50, seed=seed, max_tokens=24, ignore_eos=True
        )
        return llm.chat([case.messages], params)[0].token_ids

    first = sample(7)
    assert sample(7) == first
    # Seeded sampling does not depend on what else is in the batch.
    both = llm.chat([case.messages, case.messages],
                    [SamplingParams(temperature=1.0, seed=7, top_p=0.95, top_k=50, max_tokens=24, ignore_eos=True),
                     SamplingParams(temperature=1.0, seed=8, max_tokens=24, ignore_eos=True)])  # fmt: skip
    assert both[0].token_ids == first
    assert sample(8) != first
    assert_idle_and_clean(llm)


def test_stop_string_never_in_output_and_ends_request(tiny_qwen2_vl):
    llm = make_llm(tiny_qwen2_vl)
    case = image_case([90], "Describe the image.")
    full = llm.chat([case.messages], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    assert len(full.text) > 6
    stop = full.text[3:6]  # a substring of what the model would say
    out = llm.chat(
        [case.messages], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
    )[0]
    assert stop not in out.text
    assert full.text.startswith(out.text) and out.text == full.text[: full.text.index(stop)]
    assert out.finish_reason == "stop"
    assert len(out.token_ids) < len(full.token_ids)
    assert_idle_and_clean(llm)


def test_stop_token_ids_and_eos(tiny_qwen2_vl):
    llm = make_llm(tiny_qwen2_vl)
    case = image_case([91], "Describe the image.")
    full = llm.chat([case.messages], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    stop_id = full.token_ids[4]
    out = llm.chat([case.messages], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id]))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == full.token_ids[: full.token_ids.index(stop_id) + 1]


def test_generate_with_raw_prompt_and_multimodal_data(tiny_qwen2_vl, oracle):
    from tests.conftest import random_image

    llm = make_llm(tiny_qwen2_vl)
    case = image_case([60, 61], "Compare the two images.", sizes=[(64, 48), (96, 64)])
    text = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Compare the two images."}]}],
        add_generation_prompt=True, tokenize=False,
    )  # fmt: skip
    images = [random_image(60, 64, 48), random_image(61, 96, 64)]
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, greedy())[0]
    assert out.token_ids == oracle(case).token_ids


def test_bad_inputs_raise_clear_errors_and_leave_engine_clean(tiny_qwen2_vl):
    from mmserve.multimodal.errors import MediaError

    llm = make_llm(tiny_qwen2_vl)
    bad = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}],
        }
    ]
    with pytest.raises(MediaError, match="base64"):
        llm.chat([bad], greedy())
    with pytest.raises(ValueError, match="unsupported content part"):
        llm.chat([[{"role": "user", "content": [{"type": "hologram"}]}]], greedy())
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    assert_idle_and_clean(llm)


def test_a_failing_batch_ends_only_its_requests_and_caches_no_garbage(tiny_qwen2_vl, oracle, monkeypatch):
    """An exception in the forward ends that batch's requests ("error"); the engine, its pools and its
    prefix cache stay sound, and the same request afterwards gets exactly the reference tokens."""
    llm = make_llm(tiny_qwen2_vl, max_num_seqs=1)  # one request per batch: the failure hits only the target
    runner, real = llm.engine.runner, llm.engine.runner.forward
    target = {"rid": None, "failures": 0}

    def flaky(chunks, pool, states=None, window_pool=None):
        for c in chunks:
            if c.request.request_id == target["rid"] and c.start >= c.request.prompt_len + 2:
                target["failures"] += 1
                raise RuntimeError("injected kernel failure")
        return real(chunks, pool, states, window_pool)

    monkeypatch.setattr(runner, "forward", flaky)
    other = image_case([62], "Another request.")
    target["rid"] = "llm-0"  # the id LLM gives its first request
    outs = llm.chat([CASES[0].messages, other.messages], [greedy(), greedy()])
    assert target["failures"] == 1
    assert outs[0].finish_reason == "error" and len(outs[0].token_ids) == 3  # two decodes, then the failure
    assert outs[0].token_ids == oracle(CASES[0]).token_ids[:3]
    assert outs[1].token_ids == oracle(other).token_ids and outs[1].finish_reason == "length"
    # Only KV written by successful steps is cached: the prompt and the two decoded tokens, not the failed one.
    prompt = outs[0].prompt_token_ids
    cached = llm.engine.scheduler.prefix_cache.match(prompt + outs[0].token_ids).num_tokens
    assert cached == len(prompt) + 2
    target["rid"] = None
    again = tokens(llm)[0]  # its prompt is in the prefix cache: the cached KV must be the good one
    assert again == oracle(CASES[0]).token_ids
    assert llm.engine.scheduler.stats.prefix_hit_tokens > 0
    assert_idle_and_clean(llm)


def test_pixel_limit_per_request_stops_encoding_at_the_item_that_crosses_it(tiny_qwen2_vl):
    from mmserve.multimodal.errors import MediaTooLargeError

    probe = make_llm(tiny_qwen2_vl)
    case = image_case([90, 91, 92], "Three images.")
    modality, image = case.media[0]
    family = probe.engine.family
    per_image = family.input_pixels(modality, family.process(modality, image, {}).metadata)
    llm = make_llm(tiny_qwen2_vl, max_mm_pixels_per_prompt=int(per_image * 1.5))
    with pytest.raises(MediaTooLargeError, match="--max-mm-pixels-per-prompt"):
        llm.chat([case.messages], [greedy()])
    assert llm.encoder.cache.stats.queries == 2  # the third image was never fetched or encoded
    assert tokens(llm, [image_case([90], "One image.")])  # under the limit: served
    assert_idle_and_clean(llm)


# -- Qwen3-VL DeepStack: the features must enter, and at the right layers -----------------------------
@pytest.fixture(scope="module")
def qwen3(tiny_qwen3_vl):
    from tests.families import FAMILIES

    kwargs = FAMILIES["qwen3_vl"].mm_kwargs
    cases = [image_case([s], "What is in the picture?") for s in range(65, 71)]
    cases += [image_case([s, s + 1], "Compare.", sizes=[(64, 48), (96, 64)]) for s in (65, 75)]
    oracle = make_oracle(tiny_qwen3_vl, kwargs)
    return tiny_qwen3_vl, kwargs, cases, [oracle(c).token_ids for c in cases]


def changed(qwen3) -> int:
    """How many of the cases' greedy tokens differ from HF's (the engine's path as currently patched)."""
    model_dir, kwargs, cases, want = qwen3
    return sum(got != ref for got, ref in zip(tokens(make_llm(model_dir, kwargs), cases), want, strict=True))


def test_control_deepstack_features_dropped(qwen3, monkeypatch):
    from mmserve.models.qwen3_vl import Family

    assert changed(qwen3) == 0  # the real path is right...
    monkeypatch.setattr(
        Family, "lm_inputs", lambda self, n, positions, rows: {}
    )  # ...without DeepStack it is not
    assert changed(qwen3) >= 3


def test_control_deepstack_features_on_the_wrong_layer(qwen3, monkeypatch):
    from mmserve.models.qwen3_vl import Family

    real = Family.lm_inputs

    def one_layer_late(self, n, positions, rows):
        out = real(self, n, positions, rows)
        levels = out["deepstack_visual_embeds"]
        out["deepstack_visual_embeds"] = [
            torch.zeros_like(levels[0]),
            *levels[:-1],
        ]  # level k after layer k+1
        return out

    monkeypatch.setattr(Family, "lm_inputs", one_layer_late)
    assert changed(qwen3) >= 3
