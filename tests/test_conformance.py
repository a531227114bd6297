"""The family conformance suite: every entry of the family table (`mmserve.models.family.FAMILIES`) passes every
mode here, in fp32 against HF `generate` with inputs from HF's own processor classes (greedy tokens equal, logits
within 5e-4), the pools and caches clean after each.

In process, per family: text only; one and two items of each still modality (`FamilyCases.others` beside the
main one) and a video where the family takes one, each with the expanded prompt equal to HF's `input_ids` and
the prompt and decode positions equal to those HF's model computes; chunk budgets of 1, 7 and 64 tokens (cuts
inside items); a prefix-cached repeat and a hit that ends right after an item; 8 concurrent requests; retraction
under KV pressure; an embedding that does not fit refused for its request only; one case in bf16 against HF in
bf16. Through real processes, per family: the whole E/P/D pipeline (two encoder workers, round robin, whose
`/health` probes encode the family's modalities; a prefill server cutting every item across 16-token chunks; the
KV handed to a decode server over ZMQ or Mooncake; the router in front), streaming and a cached repeat included;
it costs ~30 s a family on CI's two cores, so each commit runs it on a rotating seventh of the table (three
families; `pipeline_archs`; MMSERVE_CONFORMANCE_ALL=1 runs it on all).

Adding a family = its file, its kit entry, its line in `FAMILIES` and one `FamilyCases` line in
tests/families.py; `test_the_suite_covers_the_whole_family_table` fails until the last is there.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess

import httpx
import pytest
import torch

from mmserve.models.family import FAMILIES as TABLE
from mmserve.models.family import EmbeddingMismatch
from mmserve.testing.server_process import start_server
from tests.engine_helpers import Case, reference, reference_text
from tests.families import FAMILIES
from tests.test_engine_parity import MAX_NEW, assert_idle_and_clean, greedy, make_llm, run_and_compare
from tests.test_quantized_parity import run_bf16

ARCHS = sorted(FAMILIES)
PAD = 2**62  # engine ids at and above this are items' pad values


def llm_for(tiny_model, arch: str, **kwargs):
    return make_llm(tiny_model(arch), FAMILIES[arch].mm_kwargs, **kwargs)


def item_end(prompt_ids: list[int]) -> int:
    return max(i for i, t in enumerate(prompt_ids) if t >= PAD) + 1


def with_system(case: Case, text: str) -> Case:
    return Case([{"role": "system", "content": text}, *case.messages], case.media)


def test_the_suite_covers_the_whole_family_table():
    assert sorted(TABLE) == ARCHS, (
        "every family of mmserve.models.family.FAMILIES needs its tests/families.py line"
    )


# -- single requests: tokens, expansion and positions ------------------------------------------------------------
def language_model_of(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack of an HF model (the module that holds `embed_tokens` and `layers`)."""
    return next(m for _, m in model.named_modules() if hasattr(m, "embed_tokens") and hasattr(m, "layers"))


def hf_positions(ref, case: Case):
    """(ReferenceOutput, position ids of the prompt (rows, L), of the first decode step (rows,)) as HF's model
    passes them to its decoder stack; None there means 0..L-1, then L."""
    seen: list = []
    hook = language_model_of(ref.model).register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs.get("position_ids")), with_kwargs=True
    )
    try:
        out = reference(ref, case, MAX_NEW)
    finally:
        hook.remove()
    length = len(out.input_ids)
    prompt, step = seen[0], seen[1]
    prompt = torch.arange(length).view(1, -1) if prompt is None else prompt.reshape(-1, length)
    step = torch.tensor([length]) if step is None else step.reshape(-1)
    return out, prompt, step


SINGLE = [(arch, name) for arch in ARCHS for name in FAMILIES[arch].cases()]


@pytest.mark.parametrize(("arch", "case"), SINGLE, ids=[f"{a}-{c}" for a, c in SINGLE])
def test_single_request_expansion_and_positions(arch, case, tiny_model, references, monkeypatch):
    llm = llm_for(tiny_model, arch)
    family, seen = llm.engine.family, []
    real = family.positions
    monkeypatch.setattr(
        family, "positions", lambda expanded: seen.append((expanded, *real(expanded))) or seen[-1][1:]
    )
    the_case = FAMILIES[arch].cases()[case]
    ref, hf_prompt, hf_step = hf_positions(references(arch), the_case)
    out = run_and_compare(llm, lambda c: ref, [the_case])[0]
    [(expanded, positions, delta)] = seen
    assert expanded.hf_token_ids == ref.input_ids  # the expansion is HF's processor's, token for token
    assert [t if t < PAD else None for t in out.prompt_token_ids] == [
        None if t >= PAD else h for t, h in zip(expanded.token_ids, ref.input_ids, strict=True)
    ]
    rows = positions.shape[0]  # HF may put a text-position row above its M-RoPE rows
    assert torch.equal(positions, hf_prompt[-rows:].to(positions.dtype)), "prompt positions differ from HF's"
    assert torch.equal(torch.full((rows,), len(ref.input_ids) + delta), hf_step[-rows:].to(torch.int64))
    assert_idle_and_clean(llm)


# -- engine modes ------------------------------------------------------------------------------------------------
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
    assert out.num_cached_tokens >= item_end(out.prompt_token_ids)  # the system prompt and both items
    assert_idle_and_clean(llm)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_hit_right_after_an_item(arch, tiny_model, oracles):
    # Same system prompt and item, another question: the hit must end right after the item (a hybrid resumes
    # from the checkpoint there, a windowed model from the window rows kept there) and the rest is recomputed.
    spec = FAMILIES[arch]
    llm = llm_for(tiny_model, arch)
    first = with_system(spec.one(80, "What is in it?"), "You look closely.")
    second = with_system(spec.one(80, "Describe the colours."), "You look closely.")
    run_and_compare(llm, oracles(arch), [first])
    out = run_and_compare(llm, oracles(arch), [second])[0]
    assert item_end(out.prompt_token_ids) <= out.num_cached_tokens < len(out.prompt_token_ids)
    assert_idle_and_clean(llm)


@pytest.mark.parametrize("arch", ARCHS)
def test_eight_concurrent_requests(arch, tiny_model, oracles):
    spec = FAMILIES[arch]
    llm = llm_for(tiny_model, arch)
    cases = [
        spec.one(10 + i, "Describe the image." + " Be precise." * i, (40 + 8 * i, 48 + 4 * (i % 3)))
        for i in range(6)
    ]
    cases += [spec.two([50, 51]), spec.cases()["text"]]
    run_and_compare(llm, oracles(arch), cases)
    assert_idle_and_clean(llm)


@pytest.mark.parametrize("arch", ARCHS)
def test_retraction_under_kv_pressure(arch, tiny_model, oracles):
    # A KV pool that admits two of these prompts together but not their answers: the newer one is retracted
    # while decoding and recomputed (or resumed from its donated state) later.
    spec = FAMILIES[arch]
    cases = [spec.one(83 + i, "Describe it in detail.") for i in range(4)]
    probe = llm_for(tiny_model, arch, kv_cache_mb=1, disable_prefix_cache=True)
    prompt_len = len(probe.chat([cases[0].messages], greedy())[0].prompt_token_ids)
    mb_per_slot = 1 / probe.engine.pool.num_slots
    llm = llm_for(tiny_model, arch, kv_cache_mb=mb_per_slot * (2 * prompt_len + MAX_NEW // 2))
    run_and_compare(llm, oracles(arch), cases, check_logits=False)
    assert llm.engine.scheduler.stats.retractions > 0
    assert_idle_and_clean(llm)


@pytest.mark.parametrize("arch", ARCHS)
def test_an_embedding_that_does_not_fit_ends_only_its_request(arch, tiny_model, oracles, monkeypatch):
    # What an encoder serving another model sends (one row short, one column too wide) is refused by the family's
    # `check_item` before anything is queued; the engine serves the next request as if nothing happened.
    spec = FAMILIES[arch]
    llm = llm_for(tiny_model, arch)
    real = llm.encode
    for edit in (lambda t: t[:-1], lambda t: torch.cat([t, t[:, :1]], dim=1)):

        def bad(media, cache_salt=None, edit=edit):
            items, timings = real(media, cache_salt)
            return [
                dataclasses.replace(it, tensors={k: edit(v) for k, v in it.tensors.items()}) for it in items
            ], timings

        monkeypatch.setattr(llm, "encode", bad)
        with pytest.raises(EmbeddingMismatch):
            llm.chat([spec.one(90).messages], greedy())
        monkeypatch.setattr(llm, "encode", real)
        assert_idle_and_clean(llm)
    run_and_compare(llm, oracles(arch), [spec.one(90)])


@pytest.mark.parametrize("arch", ARCHS)
def test_the_health_probe_encodes_every_modality(arch, tiny_model):
    llm = llm_for(tiny_model, arch)
    family = llm.engine.family
    assert {modality for modality, _ in family.probe_items()} == family.modalities
    llm.encoder.health_probe(timeout_s=30)
    assert_idle_and_clean(llm)


@pytest.mark.parametrize("arch", ARCHS)
def test_bfloat16_matches_hf_bfloat16(arch, tiny_model):
    # Tokens equal up to a step where HF's two best bf16 logits tie at bf16's precision (another split into
    # GEMMs, other bf16 bits, may pick the other one); fp32 above is exact everywhere.
    from mmserve.testing.reference import HFReference

    spec = FAMILIES[arch]
    ref = HFReference(tiny_model(arch), dtype="bfloat16", mm_processor_kwargs=spec.mm_kwargs)
    llm = llm_for(tiny_model, arch, dtype="bfloat16")
    run_bf16(llm, lambda case: reference(ref, case, MAX_NEW), [spec.two([70, 71], "What is there?")])
    assert_idle_and_clean(llm)


# -- the whole pipeline through real processes ----------------------------------------------------------------
def chat(url: str, case: Case, stream: bool = False) -> httpx.Response:
    body = {
        "messages": case.messages,
        "max_tokens": MAX_NEW,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120)


def answer(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def route(r: httpx.Response) -> dict[str, str]:
    return dict(part.strip().split("=", 1) for part in r.headers["x-mmserve-route"].split(";"))


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return str(tmp_path_factory.mktemp("conformance-logs"))


PIPELINE_SHARES = 7


def pipeline_archs() -> list[str]:
    """The families whose pipeline this run starts. Five processes start on two cores for each (~30 s on CI), so a
    run takes a seventh of the table (three families), rotating with the commit under test (`git rev-parse HEAD`);
    with MMSERVE_CONFORMANCE_ALL=1, or outside a git checkout, every family."""
    if os.environ.get("MMSERVE_CONFORMANCE_ALL") == "1":
        return ARCHS
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=os.path.dirname(__file__),
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        head = ""
    if len(head) < 8:
        return ARCHS
    turn = int(head[:8], 16) % PIPELINE_SHARES
    return [arch for i, arch in enumerate(ARCHS) if i % PIPELINE_SHARES == turn]


PIPELINE_ARCHS = pipeline_archs()


@pytest.mark.parametrize("arch", ARCHS)
def test_epd_pipeline_with_two_encoder_workers_matches_hf(arch, tiny_model, logs):
    if arch not in PIPELINE_ARCHS:
        pytest.skip("another commit's seventh of the families (MMSERVE_CONFORMANCE_ALL=1 runs every one)")
    spec, model_dir = FAMILIES[arch], tiny_model(arch)
    backend = ("zmq", "mooncake")[ARCHS.index(arch) % 2]  # each family over one of the two KV backends
    expected = reference_text(model_dir, MAX_NEW, spec.mm_kwargs)
    server = start_server(
        model_dir,
        *("--language-only", "--encoder-workers", "2", "--encoder-routing", "round_robin"),
        *("--prefill-workers", "1", "--decode-workers", "1", "--kv-transfer-backend", backend),
        *("--max-num-batched-tokens", "16", "--kv-cache-mb", "16"),
        *(["--mm-processor-kwargs", json.dumps(spec.mm_kwargs)] if spec.mm_kwargs else []),
        log_dir=logs,
    )
    try:
        encoders = set()
        for name, case in spec.cases().items():
            r = chat(server.url, case)
            assert answer(r) == expected(case), name
            path = route(r)
            assert (
                path["backend"] == backend and int(path["kv_bytes"]) > 0 and path["prefill"] != path["decode"]
            )
            if name != "text":  # the encoder services that did it (the header's list, sanitised)
                encoders.update(re.findall(r"http://127\.0\.0\.1:\d+", path["encoded_by"]))
        assert len(encoders) == 2, encoders  # round robin over both workers
        for url in encoders:  # each worker's health probe encodes every modality of the family
            assert httpx.get(url + "/health", timeout=30).status_code == 200, url
        one = spec.one(0)
        again = chat(server.url, one)  # the prompt is in the prefill server's prefix cache
        assert answer(again) == expected(one)
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        streamed = chat(server.url, spec.two([1, 2]), stream=True)
        assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
        deltas = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
        assert "".join(c["delta"].get("content") or "" for d in deltas for c in d["choices"]) == expected(
            spec.two([1, 2])
        )
    finally:
        assert server.stop() == 0
