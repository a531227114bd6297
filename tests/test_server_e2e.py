"""The real server as a subprocess, driven with the official `openai` client and raw HTTP."""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import openai
import pytest

from mmserve.testing.probes import metric
from mmserve.testing.reference import HFReference
from tests.conftest import API_KEY
from tests.engine_helpers import image_case, reference

MAX_NEW = 10


@pytest.fixture(scope="module")
def server(shared_server):
    """The plain server shared with other modules (tests/conftest.py): counters and its log as differences."""
    return shared_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def expected(tiny_qwen2_vl):
    """HF reference text and prompt length for a case, via the parity oracle."""
    ref = HFReference(tiny_qwen2_vl)

    def run(case):
        out = reference(ref, case, MAX_NEW)
        return ref.tokenizer.decode(out.token_ids, skip_special_tokens=True), len(out.input_ids)

    return run


def chat(client, case, **kwargs):
    kwargs.setdefault("max_tokens", MAX_NEW)
    return client.chat.completions.create(
        model="tiny", messages=case.messages, temperature=0, extra_body={"ignore_eos": True}, **kwargs
    )


@pytest.mark.parametrize("seeds", [[1], [2, 3]], ids=["one_image", "two_images"])
def test_chat_equals_hf_reference(client, expected, seeds):
    case = image_case(seeds, "Describe what you see.")
    text, prompt_len = expected(case)
    out = chat(client, case)
    assert out.choices[0].message.content == text
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == prompt_len  # image tokens counted
    assert out.usage.completion_tokens == MAX_NEW
    assert out.usage.total_tokens == prompt_len + MAX_NEW
    timings = out.model_extra["mmserve"]["timings"]
    assert set(timings) >= {"queue_s", "encode_s", "prefill_s", "decode_s"}


def test_streamed_chat_equals_reference_and_reports_usage(client, expected):
    case = image_case([4, 5], "Compare them.")
    text, prompt_len = expected(case)
    stream = chat(client, case, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    last = chunks[-1]
    assert (
        last.choices == []
        and last.usage.prompt_tokens == prompt_len
        and last.usage.completion_tokens == MAX_NEW
    )


def test_prefix_cache_reuse_is_reported(client):
    case = image_case([6], "Describe the image.", system="You answer in haiku.")
    first = chat(client, case)
    second = chat(client, case)
    assert second.choices[0].message.content == first.choices[0].message.content
    assert second.usage.prompt_tokens_details.cached_tokens >= second.usage.prompt_tokens - 1 > 0


def test_seed_and_stop_strings(client, server):
    case = image_case([7], "Say something.")

    def sample(seed):
        return (
            client.chat.completions.create(
                model="tiny",
                messages=case.messages,
                temperature=1.0,
                seed=seed,
                max_tokens=16,
                extra_body={"ignore_eos": True},
            )
            .choices[0]
            .message.content
        )

    assert sample(11) == sample(11)
    full = chat(client, case, max_tokens=16).choices[0].message.content
    stop = full[4:7]
    body = {
        "model": "tiny",
        "messages": case.messages,
        "temperature": 0,
        "max_tokens": 16,
        "stop": [stop],
        "ignore_eos": True,
    }
    out = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
    assert out["choices"][0]["message"]["content"] == full[: full.index(stop)]
    assert out["choices"][0]["finish_reason"] == "stop"


def test_completions_endpoint(client, server):
    out = client.completions.create(
        model="tiny",
        prompt="The quick brown fox",
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 5
    streamed = client.completions.create(
        model="tiny",
        prompt="The quick brown fox",
        max_tokens=5,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == out.choices[0].text


def test_models_health_and_metrics_move(client, server):
    models = httpx.get(server.url + "/v1/models", timeout=10).json()
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 4096
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    before = {
        n: metric(server.url, n)
        for n in (
            "prompt_tokens_total",
            "generation_tokens_total",
            "mm_cache_queries_total",
            "time_to_first_token_seconds_count",
        )
    }
    chat(client, image_case([8], "Hi."))
    after = {n: metric(server.url, n) for n in before}
    assert all(after[n] > before[n] for n in before), (before, after)


def post(server, body, headers=None):
    return httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)


@pytest.mark.parametrize(
    "body,fragment",
    [
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}],
                    }
                ]
            },
            "base64",
        ),  # noqa: E501
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
                        ],
                    }
                ]
            },
            "image #1",
        ),  # noqa: E501
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:1/x.png"}}],
                    }
                ]
            },
            "127.0.0.1",
        ),  # noqa: E501
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}],
                    }
                ]
            },
            "file",
        ),  # noqa: E501
        ({"messages": [{"role": "user", "content": [{"type": "hologram"}]}]}, "hologram"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": 5}, "temperature"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**9}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, "top_p"),
        ({"messages": "hi"}, "messages"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}] * 9}
                ]
            },
            "at most 8",
        ),
    ],
)
def test_bad_requests_get_400_naming_the_problem(server, body, fragment):
    r = post(server, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert fragment in err["message"] and err["type"] == "invalid_request_error"
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_malformed_json_and_unknown_model(server):
    r = httpx.post(
        server.url + "/v1/chat/completions",
        content=b"{not json",
        timeout=10,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = post(server, {"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and "gpt-9" in r.json()["error"]["message"]


def test_32_concurrent_requests_all_complete(client):
    cases = [image_case([100 + i % 8], f"Request {i % 8}.") for i in range(32)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=32) as pool:
        outs = list(pool.map(lambda c: chat(client, c, max_tokens=6), cases, timeout=300))
    assert len(outs) == 32 and all(o.usage.completion_tokens == 6 for o in outs)
    assert len({o.id for o in outs}) == 32
    # Greedy answers do not depend on what else was in the batch: identical requests, identical answers.
    for i in range(8, 32):
        assert outs[i].choices[0].message.content == outs[i % 8].choices[0].message.content


# -- a second server: auth, body limit, capacity, disconnects --------------------------------------------
@pytest.fixture(scope="module")
def strict_server(shared_keyed_process):
    """The server with an API key and tight limits (body, item size, one sequence, no queue, no prefix cache),
    shared with test_endpoints (tests/conftest.py)."""
    return shared_keyed_process.get()


AUTH = {"Authorization": f"Bearer {API_KEY}"}
HELLO = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_api_key_required_on_v1_only(strict_server):
    assert post(strict_server, HELLO).status_code == 401
    assert post(strict_server, HELLO, {"Authorization": "Bearer wrong"}).status_code == 401
    assert post(strict_server, HELLO, AUTH).status_code == 200
    assert httpx.get(strict_server.url + "/health", timeout=10).status_code == 200
    assert httpx.get(strict_server.url + "/metrics", timeout=10).status_code == 200
    assert httpx.get(strict_server.url + "/v1/models", timeout=10).status_code == 401


def test_oversize_body_gets_413(strict_server):
    big = {"messages": [{"role": "user", "content": "x" * 100_000}]}
    r = post(strict_server, big, AUTH)
    assert r.status_code == 413 and "body" in r.json()["error"]["message"]


def _stream_a_long_request(server):
    body = {
        "messages": [{"role": "user", "content": "Tell me everything."}],
        "max_tokens": 3000,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
    }
    return httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60)


def test_queue_full_gets_503_with_retry_after(strict_server):
    with _stream_a_long_request(strict_server) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # keep a reference: a collected line iterator closes the connection
        next(lines)
        busy = post(strict_server, HELLO, AUTH)
        assert busy.status_code == 503 and busy.headers.get("retry-after") == "1", busy.text
        assert "capacity" in busy.json()["error"]["message"]
    deadline = time.monotonic() + 20
    while post(strict_server, HELLO, AUTH).status_code != 200:
        assert time.monotonic() < deadline, "server did not recover after the stream closed"
        time.sleep(0.2)


def test_client_disconnect_aborts_and_frees_kv(strict_server):
    with _stream_a_long_request(strict_server) as r:
        data_lines = (line for line in r.iter_lines() if line.startswith("data: "))
        for _ in range(5):
            assert json.loads(next(data_lines)[6:])["choices"][0]["finish_reason"] is None
        assert metric(strict_server.url, "num_requests_running") == 1
        assert metric(strict_server.url, "kv_cache_usage_perc") > 0
    deadline = time.monotonic() + 20
    while (
        metric(strict_server.url, "num_requests_running") != 0
        or metric(strict_server.url, "kv_cache_usage_perc") != 0
    ):
        assert time.monotonic() < deadline, "disconnected request still holds KV slots"
        time.sleep(0.2)
    body = json.loads(post(strict_server, HELLO, AUTH).text)
    assert body["choices"][0]["finish_reason"] in ("length", "stop")


def test_oversize_item_gets_413_naming_the_item(strict_server):
    case = image_case([9], "Too big.", sizes=[(100, 100)])  # random pixels: a ~30 KB PNG > 0.01 MB
    body = {"messages": case.messages, "max_tokens": 2}
    r = post(strict_server, body, AUTH)
    assert r.status_code == 413, r.text
    assert "image #1" in r.json()["error"]["message"] and "limit" in r.json()["error"]["message"]


def test_fields_are_implemented_refused_or_ignored_with_a_warning(client, server):
    """No request field is accepted and silently ignored: an unimplemented one is a 400 naming it (through
    the official client's extra_body too); the documented ignore list is served and logged."""
    with pytest.raises(openai.BadRequestError, match="best_of: not supported"):
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            extra_body={"best_of": 3},
        )
    logged = len(server.log())  # the shared server's log: only what this request adds counts
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2, user="someone"
    )
    assert out.choices[0].finish_reason == "length"
    deadline = time.monotonic() + 5
    while "accepted and ignored" not in server.log()[logged:] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "['user'] accepted and ignored" in server.log()[logged:]
