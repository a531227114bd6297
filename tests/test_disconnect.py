"""Clients that go away: their engine requests end at once, streamed or not (a real server, tiny model)."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest

NUM_CLIENTS = 20
LONG = {
    "messages": [{"role": "user", "content": "Tell me everything."}],
    "max_tokens": 3000,  # tens of seconds of decoding on a CPU if nothing aborts them
    "ignore_eos": True,
    "temperature": 0,
}
SHORT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def server(shared_server):
    """The plain server shared with other modules (tests/conftest.py)."""
    return shared_server


def engine_load(server) -> dict:
    r = httpx.get(server.url + "/health", params={"check_integrity": "true"}, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def wait_until_idle(server, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        load = engine_load(server)
        if load["num_running"] == 0 and load["num_waiting"] == 0 and load["in_flight"] == 0:
            return load
        assert time.monotonic() < deadline, f"requests of departed clients still run: {load}"
        time.sleep(0.1)


def give_up_after(server, body: dict, patience_s: float, stream: bool = False) -> str:
    """POST `body` with a client that gives up (closes the connection) after `patience_s`: its read times out
    (no byte of a non-streamed answer comes before the end), or it stops reading a stream."""
    deadline = time.monotonic() + patience_s
    try:
        with httpx.Client(timeout=patience_s) as client:
            url = server.url + "/v1/chat/completions"
            with client.stream("POST", url, json={**body, "stream": stream}) as r:
                for _ in r.iter_bytes():
                    if time.monotonic() > deadline:
                        return "gave up"
    except httpx.TimeoutException:
        return "gave up"
    return f"answered {r.status_code}"


def run_clients(server, stream: bool) -> list[str]:
    with concurrent.futures.ThreadPoolExecutor(NUM_CLIENTS) as pool:
        futures = [pool.submit(give_up_after, server, LONG, 1.0, stream) for _ in range(NUM_CLIENTS)]
        return [f.result(timeout=60) for f in futures]


@pytest.mark.parametrize("stream", [False, True], ids=["non_streaming", "streaming"])
def test_departed_clients_are_aborted_at_once(server, stream):
    assert httpx.post(server.url + "/v1/chat/completions", json=SHORT, timeout=60).status_code == 200  # warm
    outcomes = run_clients(server, stream)
    assert outcomes == ["gave up"] * NUM_CLIENTS
    wait_until_idle(server, timeout_s=5.0)
    # The engine is free again: a new request is answered at once, not after the departed ones' tokens.
    r = httpx.post(server.url + "/v1/chat/completions", json=SHORT, timeout=10)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert engine_load(server)["status"] == "ok"  # aborted requests left the KV pool and caches intact
