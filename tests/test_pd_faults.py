"""Prefill-decode disaggregation under faults, through `mmserve router` and real servers (tiny Qwen2-VL).

Servers: `prefill` and `spare_prefill`, `decode` (a small KV pool) and `victim` (frozen and killed here). Each
scenario has its own router, so which servers a request can reach is fixed:
- a decode server that cannot hold a request refuses it (503 `decode_at_capacity`): the router tries another
  decode server, or answers 503 when none can take it;
- a frozen decode server: the prefill server's KV transfer times out (504), both sides free their slots;
- a decode server killed mid-generation: the stream ends with an explicit error within seconds;
- a prefill server killed after handing off: decoding goes on to the right answer.
Every surviving server ends with zero leaked slots (`/health?check_integrity=true`). The servers run in
bfloat16: an image request through the router equals HF `generate` in bfloat16.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time

import httpx
import pytest

from mmserve.testing.probes import settled_integrity
from mmserve.testing.process_group import stop_all
from mmserve.testing.server_process import start_router, start_server
from mmserve.transport.cluster_auth import ClusterSecret
from tests.engine_helpers import image_case, reference_text

SECRET = "pd-faults-" + "x" * 24
ENV = {"MMSERVE_CLUSTER_SECRET": SECRET}
HEADERS = ClusterSecret(SECRET.encode()).headers
TEXT = [{"role": "user", "content": "Tell me a long story about a cat."}]


@pytest.fixture(scope="module")
def cluster(tiny_qwen2_vl, tmp_path_factory):
    logs = str(tmp_path_factory.mktemp("pd-faults"))
    common = ("--kv-cache-mb", "16", "--max-model-len", "2048", "--dtype", "bfloat16")
    specs = {
        "prefill": ("--disaggregation-mode", "prefill", "--kv-transfer-timeout-s", "2", *common),
        "spare_prefill": ("--disaggregation-mode", "prefill", *common),
        # 256 slots (256 bytes per token in bfloat16): a request of 300 tokens never fits here.
        "decode": (
            "--disaggregation-mode",
            "decode",
            "--kv-cache-mb",
            "0.0625",
            "--max-model-len",
            "2048",
            "--dtype",
            "bfloat16",
        ),
        "victim": ("--disaggregation-mode", "decode", *common),
    }
    with concurrent.futures.ThreadPoolExecutor(len(specs)) as pool:
        futures = {
            name: pool.submit(start_server, tiny_qwen2_vl, *args, log_dir=logs, env=ENV)
            for name, args in specs.items()
        }
        servers = {name: f.result() for name, f in futures.items()}
    yield servers, logs
    stop_all(servers.values())  # side by side (some were killed by the tests: their codes are not checked)


def router(cluster, prefill: list[str], decode: list[str], *args: str):
    servers, logs = cluster
    urls = [servers[n].url for n in prefill], [servers[n].url for n in decode]
    return start_router(*urls, *args, log_dir=logs, env=ENV)


def chat(url: str, max_tokens: int, stream: bool = False, timeout: float = 60) -> httpx.Response:
    body = {
        "messages": TEXT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=timeout)


def clean(cluster, *names: str) -> None:
    servers, _ = cluster
    for name in names:
        health = settled_integrity(servers[name].url)
        assert health["status"] == "ok" and health["kv_pending"] == 0, (name, health)


def test_decode_server_that_cannot_hold_a_request_refuses_it(cluster, tiny_qwen2_vl):
    small = router(cluster, ["prefill"], ["decode"])
    both = router(cluster, ["prefill"], ["decode", "victim"])
    try:
        info = httpx.get(cluster[0]["decode"].url + "/disagg/info", headers=HEADERS, timeout=10).json()
        assert (
            info["mode"] == "decode" and info["has_tower"] is False and info["bootstrap"].startswith("tcp://")
        )
        assert httpx.get(cluster[0]["decode"].url + "/disagg/info", timeout=10).status_code == 401  # no token
        case = image_case([5, 6], "Compare them.", sizes=[(64, 48), (48, 80)])
        expected = reference_text(tiny_qwen2_vl, 8, {}, dtype="bfloat16")(case)
        body = {"messages": case.messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        ok = httpx.post(small.url + "/v1/chat/completions", json=body, timeout=60)
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == expected, ok.text
        assert "decode=" in ok.headers["x-mmserve-route"]
        for name in ("prefill", "decode"):  # both ends count the handoff and its bytes
            text = httpx.get(cluster[0][name].url + "/metrics", timeout=10).text
            assert any(
                line.startswith("mmserve:kv_transfer_bytes_total") and float(line.split()[-1]) > 0
                for line in text.splitlines()
            ), name
        r = chat(small.url, 300)  # prompt + 300 never fits 256 slots: refused, no other decode server
        assert r.status_code == 503 and r.json()["error"]["code"] == "decode_at_capacity", r.text
        # A prefill error (bad media) is the client's answer; the router closes its decode request, and the
        # decode server forgets the room.
        bad = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}]
        r = httpx.post(
            small.url + "/v1/chat/completions",
            timeout=60,
            json={"messages": [{"role": "user", "content": bad}], "max_tokens": 4},
        )
        assert r.status_code == 400 and "cannot decode image" in r.json()["error"]["message"], r.text
        clean(cluster, "prefill", "decode")
        for _ in range(3):  # with a bigger decode server beside it, every such request is served there
            r = chat(both.url, 300)
            assert r.status_code == 200, r.text
            assert cluster[0]["victim"].url in r.headers["x-mmserve-route"]
        clean(cluster, "prefill", "decode", "victim")
    finally:
        stop_all([small, both])


def sse_events(response: httpx.Response):
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line[6:]


def test_frozen_then_killed_decode_server(cluster):
    servers, _ = cluster
    victim = servers["victim"]
    r = router(cluster, ["prefill"], ["victim"], "--health-interval-s", "30")
    try:
        expected = chat(r.url, 40).json()["choices"][0]["message"]["content"]
        # Frozen: the prefill server's reservation is never answered; its transfer times out (2 s) and the
        # client gets a 504 while both sides give back what they held.
        engines = victim.child_pids()  # the engine process holds the handoff socket
        assert engines
        for pid in engines:
            os.kill(pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            frozen = chat(r.url, 40, timeout=30)
            assert frozen.status_code == 504 and frozen.json()["error"]["code"] == "kv_transfer_timeout", (
                frozen.text
            )
            assert time.monotonic() - start < 15
        finally:
            for pid in engines:
                os.kill(pid, signal.SIGCONT)
        clean(cluster, "prefill", "victim")
        again = chat(r.url, 40)
        assert again.status_code == 200 and again.json()["choices"][0]["message"]["content"] == expected
        # Killed mid-generation: the stream ends with an explicit error (never a hang).
        body = {"messages": TEXT, "max_tokens": 1500, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", r.url + "/v1/chat/completions", json=body, timeout=60) as resp:
            assert resp.status_code == 200
            events = sse_events(resp)
            for _ in range(5):
                next(events)
            victim.proc.kill()
            killed = time.monotonic()
            rest = list(events)
        assert time.monotonic() - killed < 10
        assert rest[-1] == "[DONE]"
        error = json.loads(rest[-2])["error"]
        assert error["code"] == "decode_server_failed", error
        clean(cluster, "prefill")
    finally:
        r.stop()


def test_prefill_server_killed_after_handing_off(cluster):
    servers, _ = cluster
    spare = servers["spare_prefill"]
    r = router(cluster, ["spare_prefill"], ["decode"])
    try:
        expected = chat(r.url, 120).json()["choices"][0]["message"]["content"]
        body = {"messages": TEXT, "max_tokens": 120, "temperature": 0, "ignore_eos": True, "stream": True}
        text = []
        with httpx.stream("POST", r.url + "/v1/chat/completions", json=body, timeout=60) as resp:
            assert resp.status_code == 200
            for i, event in enumerate(sse_events(resp)):
                if i == 1:  # the decode server has the request: the prefill server is no longer needed
                    spare.proc.kill()
                if event != "[DONE]":
                    chunk = json.loads(event)
                    assert "error" not in chunk, chunk
                    text += [c["delta"].get("content") or "" for c in chunk["choices"]]
        assert "".join(text) == expected
        clean(cluster, "decode")
    finally:
        r.stop()
