"""Faults under steady load: an encoder killed or hung mid-load, clients leaving mid-stream, an exhausted KV
pool. Every request ends (none hangs, none is lost) with the right answer, and the engine's pools and caches
are consistent afterwards. Engine death is tests/test_engine_death.py."""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import httpx
import pytest

from mmserve.testing.load import Call, Outcome, run_closed_loop, summarize
from mmserve.testing.probes import metric, settled_integrity
from mmserve.testing.process_group import EncoderSpec, start_together, start_with_encoders, stop_all
from mmserve.testing.server_process import start_server
from tests.engine_helpers import image_case, reference_text

MAX_NEW = 8


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return str(tmp_path_factory.mktemp("faults-logs"))


@pytest.fixture(scope="module")
def expected(tiny_qwen2_vl):
    """Greedy HF reference text of `image_case([seed], text)`."""
    text_of = reference_text(tiny_qwen2_vl, MAX_NEW)
    return lambda seed, text, max_new=MAX_NEW: text_of(image_case([seed], text), max_new)


def chat_call(seed: int, text: str, max_tokens: int = MAX_NEW, stream: bool = False, **extra) -> Call:
    body = {"messages": image_case([seed], text).messages, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}  # fmt: skip
    if stream:
        body["stream_options"] = {"include_usage": True}
    return Call("/v1/chat/completions", body, stream=stream, tag=f"{seed}", **extra)


def answer(o: Outcome) -> str:
    assert o.ok, (o.status, o.error_code, o.body)
    if o.body.get("choices") is None:  # a stream's summary
        assert o.body["done"] and o.body["finish_reason"] == "length"
        return o.body["text"]
    assert o.body["choices"][0]["finish_reason"] == "length"
    return o.body["choices"][0]["message"]["content"]


def tokens(o: Outcome) -> int:
    return o.body["usage"]["completion_tokens"]


# -- encoder faults: two standalone encoders, a language-only server -------------------------------------
def assert_all_answered(outs: list[Outcome], num_requests: int, first_seed: int, expected) -> None:
    assert len(outs) == num_requests and all(o.status != 0 for o in outs), summarize(outs)  # none hangs
    assert all(o.status == 200 for o in outs), [(o.status, o.body) for o in outs if o.status != 200][:3]
    for i, o in enumerate(outs):  # none lost, none mixed up: each is its own request's greedy answer
        assert answer(o) == expected(first_seed + i, f"Under load {i % 5}."), i
        assert tokens(o) == MAX_NEW


def run_with_fault(url: str, fault, at_request: int, num_requests: int, first_seed: int) -> list[Outcome]:
    """Fresh images (no cache hides a broken encoder), 8 at a time; `fault()` runs when request
    `at_request` starts, so 8 requests are in flight around it."""
    fired = threading.Event()

    def make_call(i: int) -> Call:
        if i == at_request and not fired.is_set():
            fired.set()
            fault()
        return chat_call(first_seed + i, f"Under load {i % 5}.")

    outs = run_closed_loop(url, make_call, concurrency=8, num_requests=num_requests, timeout_s=90)
    assert fired.is_set()
    return outs


def encoder_state(url: str, encoder_url: str) -> dict:
    (state,) = [
        e for e in httpx.get(url + "/encoders", timeout=10).json()["encoders"] if e["url"] == encoder_url
    ]
    return state


def test_encoder_hung_then_another_killed_mid_load(tiny_qwen2_vl, logs, expected):
    """Phase 1: encoder A stops answering (SIGSTOP) mid-load; its jobs time out after encode_timeout_s / 3
    = 3 s and fail over to B. Phase 2: A resumes and is probed healthy again; then B is SIGKILLed mid-load
    and its jobs fail over to A. The server is language-only, so only a failover can save a request."""
    server, (a, b) = start_with_encoders(
        tiny_qwen2_vl,
        [
            *("--kv-cache-mb", "16", "--language-only", "--encoder-routing", "round_robin"),
            *("--encode-timeout-s", "9", "--encoder-probe-interval-s", "0.5"),
            "--enable-anonymous-registration",
        ],
        [EncoderSpec(), EncoderSpec()],
        log_dir=logs,
        probe_interval_s=0.5,
    )
    try:
        outs = run_with_fault(server.url, lambda: os.kill(a.proc.pid, signal.SIGSTOP), at_request=10,
                              num_requests=24, first_seed=1000)  # fmt: skip
        assert_all_answered(outs, 24, 1000, expected)
        failovers = httpx.get(server.url + "/encoders", timeout=10).json()["failovers"]
        assert failovers >= 1 and not encoder_state(server.url, a.url)["healthy"]

        os.kill(a.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while not encoder_state(server.url, a.url)["healthy"]:
            assert time.monotonic() < deadline, "the resumed encoder was not probed healthy again"
            time.sleep(0.2)
        outs = run_with_fault(server.url, b.proc.kill, at_request=10, num_requests=24, first_seed=1100)
        assert_all_answered(outs, 24, 1100, expected)
        encoded_by = [o.body["mmserve"]["encoded_by"] for o in outs]
        assert any(b.url in e for e in encoded_by[:8])  # B did serve before it died
        assert all(a.url in e for e in encoded_by[11:])  # sent after its death: A alone
        stats = httpx.get(server.url + "/encoders", timeout=10).json()
        # language-only: a failover to the other encoder is the only way out, never a local encode
        assert stats["failovers"] > failovers and stats["local_fallbacks"] == 0
        settled_integrity(server.url)
    finally:
        if a.proc.poll() is None:
            os.kill(a.proc.pid, signal.SIGCONT)
        assert stop_all([server, a, b])[0] == 0


# -- plain servers, one per test below, started side by side when the first of them is needed -------------
@pytest.fixture(scope="module")
def loners(tiny_qwen2_vl, logs):
    """ "no_prefix_cache": --disable-prefix-cache; "tiny_kv": a 0.3 MB KV pool."""
    handles = start_together(
        {
            "no_prefix_cache": lambda: start_server(
                tiny_qwen2_vl, "--kv-cache-mb", "16", "--disable-prefix-cache", log_dir=logs
            ),
            "tiny_kv": lambda: start_server(tiny_qwen2_vl, "--kv-cache-mb", "0.3", log_dir=logs),
        }
    )
    yield handles
    assert stop_all(handles.values()) == [0, 0]


# -- clients leaving mid-stream while others run ---------------------------------------------------------
def test_clients_disconnecting_mid_stream_under_load(loners, expected):
    server = loners["no_prefix_cache"]

    # Every third request is a long stream (2000 tokens) that the client drops after 3 chunks; the others
    # are short requests, half of them streamed, that must finish with their full, correct answer.
    def make_call(i: int) -> Call:
        if i % 3 == 0:
            return chat_call(
                1000 + i, "Talk for a long time.", max_tokens=2000, stream=True, close_after_chunks=3
            )
        return chat_call(1000 + i, f"Under load {i % 5}.", stream=i % 2 == 1)

    outs = run_closed_loop(server.url, make_call, concurrency=8, num_requests=30, timeout_s=90)
    assert len(outs) == 30 and all(o.status == 200 for o in outs), summarize(outs)
    for i, o in enumerate(outs):
        if i % 3 == 0:
            assert o.error_code == "client_closed" and o.body["finish_reason"] is None  # left mid-stream
        else:
            assert answer(o) == expected(1000 + i, f"Under load {i % 5}."), i
    body = settled_integrity(server.url)  # the dropped streams were aborted, not decoded to the end
    assert body["kv_slots_used"] == 0  # no prefix cache: nothing may hold a slot


# -- more requests than the KV pool holds --------------------------------------------------------------------
def test_kv_pool_exhaustion_retracts_and_every_request_completes(loners):
    server = loners["tiny_kv"]
    kv_tokens = int(re.search(r"KV cache (\d+) tokens", server.log()).group(1))
    n, max_new = 8, 250
    calls = [chat_call(2000 + i % 4, "Keep going.", max_tokens=max_new, stream=i % 2 == 1) for i in range(n)]
    peak, done = [0.0], threading.Event()

    def watch() -> None:  # bounded: the load below ends within its own timeouts
        while not done.wait(0.1):
            peak[0] = max(peak[0], metric(server.url, "kv_cache_usage_perc"))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        outs = run_closed_loop(server.url, calls.__getitem__, concurrency=n, num_requests=n, timeout_s=120)
    finally:
        done.set()
        watcher.join(15)
    prompt_len = outs[0].body["usage"]["prompt_tokens"]
    assert n * (prompt_len + max_new) > 2 * kv_tokens  # the pool holds well under half the work at once
    assert peak[0] > 0.5, peak  # and the load did fill it
    assert metric(server.url, "num_preemptions_total") > 0  # requests really were retracted
    assert all(o.status == 200 for o in outs), summarize(outs)
    assert all(tokens(o) == max_new for o in outs)  # retraction is invisible to the client
    texts = [answer(o) for o in outs]
    for i in range(4, n):  # identical requests, identical greedy answers, however often retracted
        assert texts[i] == texts[i - 4]
    settled_integrity(server.url)
