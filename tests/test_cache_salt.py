"""Tenant-scoped caches (`cache_salt`): the radix-level mechanism on the CPU, the salted content hash, and two
real servers on loopback (monolithic, and EPD with --cache-salt-required) driven over HTTP.

Every salt used against a server is fresh (`salt()`), so a hit can only come from a request of this test.
"""

from __future__ import annotations

import functools
import itertools
import json

import httpx
import pytest
import torch

from mmserve.config import MediaConfig
from mmserve.encoder.runner import MultimodalEncoder
from mmserve.engine.cache.kv_pool import KVPool
from mmserve.engine.cache.radix_cache import RadixCache
from mmserve.engine.cache_salt import (
    MAX_CACHE_SALT_CHARS,
    SALT_KEY_BASE,
    check_cache_salt,
    prefix_key,
    salted_key,
)
from mmserve.engine.request import Request
from mmserve.engine.scheduler import Scheduler, SchedulerConfig
from mmserve.models.family import load_family
from mmserve.multimodal.items import PAD_BASE, Modality, content_hash
from mmserve.sampling_params import SamplingParams
from mmserve.testing.probes import settled_integrity
from mmserve.testing.reference import HFReference
from mmserve.testing.server_process import start_server
from tests.engine_helpers import image_case, reference, text_case

MAX_NEW = 6
_salts = itertools.count()


def salt(name: str) -> str:
    return f"{name}-{next(_salts)}"


# -- the mechanism, without a model --------------------------------------------------------------------
def test_prefix_key_differs_only_in_the_first_position_in_a_reserved_range():
    ids = [5, 6, PAD_BASE + 9, 7]
    assert prefix_key(ids, None) == ids and prefix_key(ids, None) is not ids
    salted = prefix_key(ids, "tenant-a")
    assert salted[1:] == ids[1:]
    assert SALT_KEY_BASE <= salted[0] < 2**63  # above every vocabulary id and pad value, still int64
    assert SALT_KEY_BASE >= PAD_BASE + 2**61
    assert salted == prefix_key(ids, "tenant-a")  # deterministic (across processes too: blake2b)
    assert salted[0] != prefix_key(ids, "tenant-b")[0]
    # The first token stays in the key: same salt, other first token -> other key.
    assert salted_key("tenant-a", 5) != salted_key("tenant-a", 6)
    assert prefix_key([], "tenant-a") == []


@pytest.mark.parametrize("bad", [5, "", "x" * (MAX_CACHE_SALT_CHARS + 1), ["a"], b"a", "\ud800"])
def test_check_cache_salt_refuses_bad_values(bad):
    with pytest.raises(ValueError, match="cache_salt"):
        check_cache_salt(bad)
    check_cache_salt(None)
    check_cache_salt("x" * MAX_CACHE_SALT_CHARS)


def make_scheduler(num_slots: int = 256) -> Scheduler:
    pool = KVPool.uniform(num_slots, 1, 1, 2, torch.float32)
    return Scheduler(SchedulerConfig(64, 8, max_model_len=1000), pool, RadixCache(pool))


def run_one(sched: Scheduler, prompt: list[int], cache_salt: str | None, max_tokens: int = 3) -> Request:
    """Admit one request and step it to completion as the engine does (prompt cached after its prefill);
    checks every invariant after each step. Returns the finished request."""
    req = Request(
        f"r{next(_salts)}",
        prompt,
        SamplingParams(temperature=0, max_tokens=max_tokens),
        cache_salt=cache_salt,
    )
    sched.add(req)
    for _ in range(len(prompt) + max_tokens):  # bounded: one token per step at worst
        for chunk in sched.schedule():
            if chunk.start < req.prompt_len <= chunk.end:
                sched.cache_prompt(req)
            if chunk.samples:
                req.append_output(11)
                if len(req.output_ids) == max_tokens:
                    sched.finish(req, "length")
        sched.check_integrity()
        if req.finished:
            return req
    raise AssertionError("request did not finish")


def test_radix_hits_stay_within_a_salt():
    sched = make_scheduler()
    prompt = list(range(100, 120))
    first = run_one(sched, prompt, "a")
    assert first.num_cached_tokens == 0
    assert run_one(sched, prompt, "a").num_cached_tokens == len(prompt) - 1  # the last token is computed
    assert run_one(sched, prompt, "b").num_cached_tokens == 0
    assert run_one(sched, prompt, None).num_cached_tokens == 0  # salted KV never serves an unsalted request
    assert run_one(sched, prompt, None).num_cached_tokens == len(prompt) - 1  # unsalted: as before
    assert run_one(sched, [99, *prompt[1:]], "a").num_cached_tokens == 0  # first token differs
    # A longer prompt of the same tenant reuses the prompt and the generated tokens stored at finish.
    longer = run_one(sched, [*prompt, 11, 11, 5, 6], "a")
    assert longer.num_cached_tokens == len(prompt) + 2
    # Four trees side by side in one: a, b, None, and a with another first token, all from the root.
    assert len(sched.prefix_cache._root.children) == 4
    assert sched.pool.num_used == sched.prefix_cache.total_tokens
    sched.prefix_cache.reset()
    sched.check_integrity()
    assert sched.pool.num_used == 0


def test_salted_requests_survive_eviction_and_retraction():
    sched = make_scheduler(num_slots=48)  # room for about two requests: forces eviction and retraction
    prompts = [[t, *range(200, 215)] for t in (1, 2, 3)]
    reqs = [
        Request(f"e{i}", p, SamplingParams(temperature=0, max_tokens=8), cache_salt=s)
        for i, (p, s) in enumerate(itertools.product(prompts, ["a", "b", None]))
    ]
    for r in reqs:
        sched.add(r)
    for _ in range(500):
        for chunk in sched.schedule():
            req = chunk.request
            if chunk.start < req.prompt_len <= chunk.end:
                sched.cache_prompt(req)
            if chunk.samples:
                req.append_output(11)
                if len(req.output_ids) == req.params.max_tokens:
                    sched.finish(req, "length")
        sched.check_integrity()
        if not sched.has_work:
            break
    assert all(r.finished for r in reqs) and sched.stats.retractions > 0
    assert sched.pool.num_used == sched.prefix_cache.total_tokens


def test_salt_enters_the_content_hash(tiny_qwen2_vl):
    encoder = MultimodalEncoder(load_family(tiny_qwen2_vl), None, None, MediaConfig())
    image = Modality.IMAGE
    unsalted = encoder.item_hash(image, b"bytes", {})
    hashed = encoder.family.hash_settings(image, {})
    assert unsalted == content_hash(image, b"bytes", {**hashed, "item": {}})  # unsalted hashes unchanged
    assert encoder.item_hash(image, b"bytes", {}, "a") == encoder.item_hash(image, b"bytes", {}, "a")
    assert (
        len(
            {
                unsalted,
                encoder.item_hash(image, b"bytes", {}, "a"),
                encoder.item_hash(image, b"bytes", {}, "b"),
            }
        )
        == 3
    )


# -- real servers ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def servers(shared_server_process, tiny_qwen2_vl, tmp_path_factory):
    """A monolithic server (the plain one shared with other modules, tests/conftest.py), and an EPD one (one
    encoder worker) with --cache-salt-required, started side by side when the shared one is not up yet."""
    logs = str(tmp_path_factory.mktemp("logs"))
    strict_args = ("--kv-cache-mb", "16", "--encoder-workers", "1", "--cache-salt-required")
    plain, strict = shared_server_process.get_beside(
        functools.partial(start_server, tiny_qwen2_vl, *strict_args, log_dir=logs)
    )
    yield {"plain": plain, "strict": strict}
    try:  # pool, radix tree and embedding cache consistent after it all (the shared one's: at its stop)
        settled_integrity(strict.url)
    finally:
        assert strict.stop() == 0


@pytest.fixture(scope="module")
def expected(tiny_qwen2_vl):
    """Case -> (HF reference text of MAX_NEW greedy tokens, HF's expanded prompt ids)."""
    ref = HFReference(tiny_qwen2_vl)

    def run(case):
        out = reference(ref, case, MAX_NEW)
        return ref.tokenizer.decode(out.token_ids, skip_special_tokens=True), out.input_ids

    run.image_token_id = ref.model.config.image_token_id
    return run


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def chat(url: str, case, cache_salt: str | None = None) -> dict:
    body = {
        "model": "tiny",
        "messages": case.messages,
        "max_tokens": MAX_NEW,
        "temperature": 0,
        "ignore_eos": True,
    }
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    r = post(url, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


def cached(r: dict) -> int:
    return r["usage"]["prompt_tokens_details"]["cached_tokens"]


def prompt_tokens(r: dict) -> int:
    return r["usage"]["prompt_tokens"]


def hits(r: dict) -> int:
    return r["mmserve"]["mm_cache_hits"]


def text(r: dict) -> str:
    return r["choices"][0]["message"]["content"]


def test_image_hits_are_shared_within_a_salt_only(servers, expected):
    # An image no other module sends to the shared server: its first unsalted request is a miss.
    url, case = servers["plain"].url, image_case([301], "Describe the image.")
    reference_text, hf_ids = expected(case)
    image_offset = hf_ids.index(expected.image_token_id)
    a = salt("a")
    first, same, other = chat(url, case, a), chat(url, case, a), chat(url, case, salt("b"))
    unsalted, unsalted_again = chat(url, case), chat(url, case)
    assert (cached(first), hits(first)) == (0, 0)
    assert hits(same) == 1 and cached(same) == prompt_tokens(same) - 1
    assert (cached(other), hits(other)) == (0, 0)  # not even the chat template's text before the image
    # Salted KV never serves an unsalted request; it may share the template's text before the image with
    # other unsalted requests (those of other modules on the shared server too).
    assert hits(unsalted) == 0 and cached(unsalted) <= image_offset
    assert hits(unsalted_again) == 1 and cached(unsalted_again) == prompt_tokens(same) - 1  # as before
    assert [text(r) for r in (first, same, other, unsalted, unsalted_again)] == [reference_text] * 5


def test_text_only_prompts_share_no_prefix_across_salts(servers, expected):
    url = servers["plain"].url
    one, two = text_case("Name three rivers."), text_case("Name three mountains.")
    a = salt("a")
    chat(url, one)
    unsalted = chat(url, two)
    assert cached(unsalted) > 0  # unsalted prompts share the chat template's system prefix ...
    first = chat(url, one, a)
    assert cached(first) == 0  # ... which a salted prompt never reuses
    assert cached(chat(url, two, a)) == cached(unsalted)  # while the same tenant shares it
    assert cached(chat(url, two, salt("b"))) == 0
    assert text(first) == expected(one)[0] and text(unsalted) == expected(two)[0]
    # Completions take the field too; a prompt starting with its own word isolates the unsalted case.
    body = {
        "model": "tiny",
        "prompt": "Quokkas hop along",
        "max_tokens": 3,
        "temperature": 0,
        "ignore_eos": True,
    }
    c = salt("c")
    salts = (c, c, salt("d"), None, None)
    outs = [post(url, "/v1/completions", {**body, "cache_salt": s}).json() for s in salts]
    full = prompt_tokens(outs[0]) - 1
    assert [cached(o) for o in outs] == [0, full, 0, 0, full]
    assert len({o["choices"][0]["text"] for o in outs}) == 1


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_bad_salts_are_refused_with_400(servers, path):
    url = servers["plain"].url
    body = {"model": "tiny", "max_tokens": 2}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    for bad in (5, "", "x" * (MAX_CACHE_SALT_CHARS + 1), ["a"], {"a": "b"}, True):
        r = post(url, path, {**body, "cache_salt": bad})
        assert r.status_code == 400 and "cache_salt" in r.json()["error"]["message"], (bad, r.text)
    raw = json.dumps({**body, "cache_salt": "SURROGATE"}).replace("SURROGATE", "\\ud800")
    r = httpx.post(url + path, content=raw, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400 and "cache_salt" in r.json()["error"]["message"], r.text
    assert post(url, path, {**body, "cache_salt": None}).status_code == 200  # null: no salt


def test_salt_required_server_refuses_requests_without_one(servers):
    url = servers["strict"].url
    chat_body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    completion_body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    for path, body in (("/v1/chat/completions", chat_body), ("/v1/completions", completion_body)):
        error = post(url, path, body).json()["error"]
        assert error["code"] == "missing_cache_salt" and "cache_salt" in error["message"]
        assert post(url, path, {**body, "cache_salt": None}).json()["error"]["code"] == "missing_cache_salt"
        assert post(url, path, {**body, "cache_salt": salt("t")}).status_code == 200


def test_encoder_service_cache_is_scoped_by_salt(servers, expected):
    url, case = servers["strict"].url, image_case([2], "What is in it?")
    a = salt("a")
    outs = [chat(url, case, s) for s in (a, a, salt("b"))]
    assert all("127.0.0.1" in r["mmserve"]["encoded_by"] for r in outs)  # encoded by the encoder service
    # The encoder reports its hit to the dispatcher, normally long before the response (never waited for).
    assert [hits(r) for r in outs] == [0, 1, 0]
    assert [cached(r) for r in outs] == [0, prompt_tokens(outs[1]) - 1, 0]
    assert [text(r) for r in outs] == [expected(case)[0]] * 3
