"""Cluster secret: HMAC-signed embedding parts and the cluster token on internal HTTP routes."""

from __future__ import annotations

import time

import httpx
import pytest
import torch
import zmq

from mmserve.multimodal.items import MAIN, ItemEmbedding, Modality
from mmserve.testing.process_group import EncoderSpec, start_with_encoders, stop_all
from mmserve.transport.cluster_auth import ENV_VAR, HTTP_HEADER, ClusterSecret, PartRejected, PartVerifier
from mmserve.transport.embedding_wire import EmbeddingItem, encode_part
from mmserve.transport.zmq_channel import EmbeddingReceiver, EmbeddingSender
from tests.conftest import CLUSTER_SECRET
from tests.engine_helpers import image_case, reference_text

SECRET = CLUSTER_SECRET  # the shared secured EPD server's (tests/conftest.py)
OTHER = "another secret, sixteen+ bytes"
MAX_NEW = 6
CONTROL_PLANE = (("POST", "/register_encoder"), ("POST", "/unregister_encoder"), ("GET", "/encoders"))


def part(rid: str = "req-1", value: float = 1.0) -> list:
    item = EmbeddingItem(0, ItemEmbedding(Modality.IMAGE, bytes(16), {MAIN: torch.full((1, 8), value)}))
    return [bytes(f) for f in encode_part(rid, 0, 1, "enc", [item])]


# -- unit: MAC, freshness, replay ------------------------------------------------------------------
def test_signed_part_verifies_and_any_change_is_forged():
    secret = ClusterSecret(SECRET.encode())
    verifier = PartVerifier(secret)
    frames = secret.sign(part())
    assert verifier.check_mac(frames) == frames[2]
    header, payload, mac = frames
    flipped_payload = bytearray(payload)
    flipped_payload[-1] ^= 1
    flipped_header = bytearray(header)
    flipped_header[-1] ^= 1
    for bad in ([header, bytes(flipped_payload), mac], [bytes(flipped_header), payload, mac],
                [header, payload], [header, payload, bytes(32)],
                ClusterSecret(OTHER.encode()).sign([header, payload]),
                [header[:5], header[5:] + payload, mac]):  # fmt: skip
        with pytest.raises(PartRejected) as e:
            verifier.check_mac(bad)
        assert e.value.reason == "forged"


def test_large_payloads_hashed_in_parallel_still_catch_any_flipped_bit(monkeypatch):
    from mmserve.transport import cluster_auth

    secret = ClusterSecret(SECRET.encode())
    header, payload = b"header", bytes(range(256)) * (5 * 2**20 // 256 + 7)  # 5 MiB and a bit: 6 chunks
    parallel = secret.mac(header, payload)
    monkeypatch.setattr(cluster_auth, "PARALLEL_MIN_CHUNKS", 10**9)
    assert secret.mac(header, payload) == parallel  # the same MAC whichever way the chunks were hashed
    monkeypatch.undo()
    for pos in (0, 2**20 - 1, 2**20, 3 * 2**20 + 12345, len(payload) - 1):
        flipped = bytearray(payload)
        flipped[pos] ^= 0x80
        assert secret.mac(header, bytes(flipped)) != parallel, pos
    assert secret.mac(header, payload[:-1]) != parallel
    assert secret.mac(header + payload[:1], payload[1:]) != parallel  # bytes moved across the frame boundary


def test_replays_and_stale_timestamps_are_rejected():
    now = [1000.0]
    verifier = PartVerifier(ClusterSecret(SECRET.encode()), max_age_s=60, clock=lambda: now[0])
    verifier.check_fresh(b"a" * 32, 1000.0)
    with pytest.raises(PartRejected, match="already received") as e:
        verifier.check_fresh(b"a" * 32, 1000.0)
    assert e.value.reason == "replayed"
    with pytest.raises(PartRejected, match="freshness"):
        verifier.check_fresh(b"b" * 32, 900.0)  # older than max_age
    with pytest.raises(PartRejected, match="freshness"):
        verifier.check_fresh(b"c" * 32, 1100.0)  # from the future beyond the allowed skew
    now[0] = 1100.0  # remembered MACs expire with the window: memory stays bounded
    verifier.check_fresh(b"d" * 32, 1100.0)
    assert len(verifier._seen) == 1


def test_token_is_derived_and_short_secrets_are_refused():
    secret = ClusterSecret(SECRET.encode())
    assert SECRET not in secret.token and secret.check_token(secret.token)
    assert not secret.check_token(None) and not secret.check_token(SECRET)
    with pytest.raises(ValueError, match="16 bytes"):
        ClusterSecret(b"short")


def test_signed_channel_round_trip_counts_forgeries():
    secret = ClusterSecret(SECRET.encode())
    ctx = zmq.Context()
    with EmbeddingReceiver(ctx=ctx, verifier=PartVerifier(secret)) as rx, \
            EmbeddingSender(ctx=ctx, signer=secret) as good, EmbeddingSender(ctx=ctx) as unsigned:  # fmt: skip
        good.send(rx.endpoint, part("r1", 2.0))
        header, items = rx.recv_part(5)
        assert header.request_id == "r1" and torch.equal(items[0].item.embedding, torch.full((1, 8), 2.0))
        unsigned.send(rx.endpoint, part("r2"))
        with pytest.raises(PartRejected, match="frames"):
            rx.recv_part(5)
    # A receiver without a secret still accepts signed parts (mixed roll-outs), ignoring the MAC.
    with EmbeddingReceiver(ctx=ctx) as rx, EmbeddingSender(ctx=ctx, signer=secret) as good:
        good.send(rx.endpoint, part("r3"))
        assert rx.recv_part(5)[0].request_id == "r3"
    ctx.term()


# -- end to end: a server with two encoder workers, secret from the environment ------------------------
@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return str(tmp_path_factory.mktemp("auth-logs"))


@pytest.fixture(scope="module")
def secured(shared_secured_epd_process):
    """The language-only server with two encoder workers and the secret in its environment, shared with
    test_bench_cli (tests/conftest.py): its counters are read as differences."""
    return shared_secured_epd_process.get()


def chat(url: str, case) -> httpx.Response:
    body = {"messages": case.messages, "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60)


def auth_counts(url: str) -> dict:
    return httpx.get(url + "/health", params={"check_integrity": "true"}, timeout=10).json()


def test_secured_epd_matches_hf(secured, tiny_qwen2_vl):
    case = image_case([41], "Describe it.")
    want = reference_text(tiny_qwen2_vl, MAX_NEW)(case)
    before = auth_counts(secured.url)
    r = chat(secured.url, case)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == want
    assert "127.0.0.1" in r.json()["mmserve"]["encoded_by"]  # really went through a (language-only) EPD path
    counts = auth_counts(secured.url)  # the workers' signed parts all verified
    assert (
        counts["parts_forged"] == before["parts_forged"]
        and counts["parts_replayed"] == before["parts_replayed"]
    )


def test_internal_routes_require_the_cluster_token(secured):
    token = ClusterSecret(SECRET.encode()).token
    encoders = httpx.get(secured.url + "/encoders", headers={HTTP_HEADER: token}, timeout=10).json()
    worker = encoders["encoders"][0]["url"]
    job = {"request_id": "x", "part_index": 0, "num_parts": 1, "reply_endpoint": encoders["embedding_endpoint"],
           "items": [{"item_index": 0, "modality": "image", "url": "data:,"}]}  # fmt: skip
    wrong = ClusterSecret(OTHER.encode()).token
    for headers in ({}, {HTTP_HEADER: wrong}, {HTTP_HEADER: SECRET}):
        r = httpx.post(worker + "/encode", json=job, headers=headers, timeout=10)
        assert r.status_code == 401 and HTTP_HEADER in r.json()["error"]["message"]
        for method, route in CONTROL_PLANE:
            r = httpx.request(
                method, secured.url + route, json={"url": "http://127.0.0.1:9"}, headers=headers, timeout=10
            )
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_cluster_token"
    assert httpx.get(worker + "/health", timeout=30).status_code == 200  # health stays open
    r = httpx.post(secured.url + "/register_encoder", json={"url": "http://127.0.0.1:9"},
                   headers={HTTP_HEADER: token}, timeout=10)  # fmt: skip
    assert r.status_code == 200
    r = httpx.post(secured.url + "/unregister_encoder", json={"url": "http://127.0.0.1:9"},
                   headers={HTTP_HEADER: token}, timeout=10)  # fmt: skip
    assert r.status_code == 200


def test_forged_tampered_and_replayed_parts_are_dropped_and_counted(secured):
    secret = ClusterSecret(SECRET.encode())
    listing = httpx.get(secured.url + "/encoders", headers=secret.headers, timeout=10).json()
    endpoint = listing["embedding_endpoint"]
    before = auth_counts(secured.url)
    signed = secret.sign(part("replayed-request"))
    tampered = list(secret.sign(part("tampered-request")))
    tampered[1] = bytes(32) + tampered[1][32:]
    messages = [part("unsigned-request"), ClusterSecret(OTHER.encode()).sign(part("wrong-key")), tampered,
                signed, signed, signed]  # fmt: skip
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(endpoint)
    for frames in messages:
        sock.send_multipart(frames)
    sock.close()
    ctx.term()
    deadline = time.monotonic() + 20
    while True:
        now = auth_counts(secured.url)
        forged = now["parts_forged"] - before["parts_forged"]
        replayed = now["parts_replayed"] - before["parts_replayed"]
        if (forged, replayed) == (3, 2) or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert (forged, replayed) == (3, 2)
    assert now["status"] == "ok"
    assert chat(secured.url, image_case([42], "Still serving?")).status_code == 200


def test_encoder_with_another_secret_is_not_used(tiny_qwen2_vl, logs):
    """A static encoder with the wrong secret answers 401: the server fails over to local encoding."""
    server, (enc,) = start_with_encoders(
        tiny_qwen2_vl,
        ["--kv-cache-mb", "16"],
        [EncoderSpec(env={ENV_VAR: OTHER})],
        log_dir=logs,
        server_env={ENV_VAR: SECRET},
    )
    try:
        r = chat(server.url, image_case([43], "Who encoded this?"))
        assert r.status_code == 200, r.text
        assert r.json()["mmserve"]["encoded_by"] == "local (failover)"
        assert "cluster token" in server.log()
    finally:
        assert stop_all([server, enc]) == [0, 0]
