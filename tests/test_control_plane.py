"""The control plane of a language server (`/register_encoder`, `/unregister_encoder`, `/encoders`) is locked.

Three real servers, started side by side once for the module (the anonymous one is shared with
test_epd_e2e), and one real encoder:
- secured: a cluster secret and an API key. Only the cluster token opens the control plane (401 otherwise,
  the API key included).
- locked: no secret, an API key, a static encoder (`--encoder-urls`). The control plane is off (403 naming the
  flag), while the static encoder keeps serving media.
- anonymous: no secret, `--enable-anonymous-registration`: the control plane is open and the start-up log
  says so loudly.
The encoder heartbeats with `--register-url` to the secured and the locked server and logs each refusal once,
with its reason.
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass

import httpx
import pytest

from mmserve.testing.probes import metric
from mmserve.testing.process_group import stop_all
from mmserve.testing.server_process import ServerHandle, free_port, start_encoder, start_server
from mmserve.transport.cluster_auth import ENV_VAR, HTTP_HEADER, ClusterSecret
from tests.engine_helpers import image_case

SECRET = "control-plane test secret, 16+ bytes"
API_KEY = "sk-control-plane"
FAKE_ENCODER = "http://127.0.0.1:9"  # discard port: registering it sends nothing anywhere that matters
WARNING = "anonymous encoder registration is ON"
ROUTES = [("POST", "/register_encoder"), ("POST", "/unregister_encoder"), ("GET", "/encoders")]


@dataclass
class Stack:
    secured: ServerHandle
    locked: ServerHandle
    anonymous: ServerHandle
    encoder: ServerHandle


@pytest.fixture(scope="module")
def stack(tiny_qwen2_vl, tmp_path_factory, shared_language_only_process):
    logs = str(tmp_path_factory.mktemp("control-plane-logs"))
    secured_port, locked_port, encoder_port = free_port(), free_port(), free_port()
    encoder_url = f"http://127.0.0.1:{encoder_port}"
    common = ("--kv-cache-mb", "16", "--language-only")  # no tower: media can only go through an encoder
    starts = {
        # The encoder first: the locked server's prober must find its static encoder up (a static encoder that
        # fails its first probes is out of rotation until a later probe, seconds away).
        "encoder": lambda: start_encoder(
            tiny_qwen2_vl,
            "--register-url",
            f"http://127.0.0.1:{secured_port}",
            f"http://127.0.0.1:{locked_port}",
            "--register-interval-s",
            "0.3",
            port=encoder_port,
            log_dir=logs,
        ),
        "secured": lambda: start_server(
            tiny_qwen2_vl,
            *common,
            "--api-key",
            API_KEY,
            port=secured_port,
            env={ENV_VAR: SECRET},
            log_dir=logs,
        ),
        "locked": lambda: start_server(
            tiny_qwen2_vl,
            *common,
            "--api-key",
            API_KEY,
            "--encoder-urls",
            encoder_url,
            port=locked_port,
            log_dir=logs,
        ),
        # --language-only --enable-anonymous-registration: the one shared with test_epd_e2e (tests/conftest.py).
        "anonymous": shared_language_only_process.get,
    }
    # Two at a time: start-up is mostly imports, CPU-bound; more at once than cores only thrashes.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = {name: pool.submit(start) for name, start in starts.items()}
        concurrent.futures.wait(futures.values(), timeout=300)
    started = {name: f.result() for name, f in futures.items() if f.done() and f.exception() is None}
    try:
        if len(started) < len(starts):
            failed = [f.exception() for f in futures.values() if not f.done() or f.exception() is not None]
            raise AssertionError(f"start-up failed: {failed}")
        yield Stack(**started)
    finally:
        own = [handle for name, handle in started.items() if name != "anonymous"]  # the shared one stays up
        codes = stop_all(own)
    assert codes == [0] * len(codes)


def call(server: ServerHandle, method: str, route: str, headers: dict[str, str] | None = None):
    return httpx.request(method, server.url + route, json={"url": FAKE_ENCODER}, headers=headers, timeout=10)


def error_of(r: httpx.Response, status: int) -> dict:
    """The OpenAI-style error body of a refused call, checked for shape and status."""
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"] and error["code"], error
    return error


def test_secured_server_takes_only_the_cluster_token(stack):
    token = ClusterSecret(SECRET.encode()).token
    wrong = ClusterSecret(b"some other secret, 16+ bytes").token
    bearer = {"Authorization": f"Bearer {API_KEY}"}
    refused = [{}, {HTTP_HEADER: wrong}, {HTTP_HEADER: SECRET}, bearer, {**bearer, HTTP_HEADER: wrong}]
    for method, route in ROUTES:
        for headers in refused:
            error = error_of(call(stack.secured, method, route, headers), 401)
            assert error["code"] == "invalid_cluster_token", (route, headers)
            assert HTTP_HEADER in error["message"]
    # The token is checked before the body is read: a caller without it learns nothing about the schema.
    r = httpx.post(stack.secured.url + "/register_encoder", content=b"not json", timeout=10)
    assert error_of(r, 401)["code"] == "invalid_cluster_token"

    good = {HTTP_HEADER: token}
    registered = call(stack.secured, "POST", "/register_encoder", good)
    assert registered.json() == {"url": FAKE_ENCODER, "registered": True}
    listing = call(stack.secured, "GET", "/encoders", good)
    assert listing.status_code == 200 and FAKE_ENCODER in [e["url"] for e in listing.json()["encoders"]]
    assert call(stack.secured, "POST", "/unregister_encoder", good).status_code == 200
    listing = call(stack.secured, "GET", "/encoders", good).json()
    assert FAKE_ENCODER not in [e["url"] for e in listing["encoders"]]


def test_without_a_secret_the_control_plane_is_off_even_with_the_api_key(stack):
    for method, route in ROUTES:
        for headers in ({}, {"Authorization": f"Bearer {API_KEY}"}, {HTTP_HEADER: "anything"}):
            error = error_of(call(stack.locked, method, route, headers), 403)
            assert error["code"] == "control_plane_disabled", (route, headers)
            message = error["message"]  # names both ways to open it
            assert "--enable-anonymous-registration" in message and "--cluster-secret" in message


def test_static_encoder_still_serves_while_registration_is_locked(stack):
    body = {"messages": image_case([7], "What is it?").messages, "max_tokens": 4, "temperature": 0}
    r = httpx.post(
        stack.locked.url + "/v1/chat/completions",
        json=body,
        timeout=60,
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    assert r.status_code == 200, r.text
    assert r.json()["mmserve"]["encoded_by"] == stack.encoder.url  # --language-only: only the encoder can


def test_refused_registration_is_logged_once_with_its_reason(stack):
    def logged() -> tuple[int, int]:
        log = stack.encoder.log()
        return log.count("refused our registration (403)"), log.count("refused our registration (401)")

    deadline = time.monotonic() + 20
    while logged() != (1, 1):
        assert time.monotonic() < deadline, stack.encoder.log()
        time.sleep(0.2)
    log = stack.encoder.log()
    assert "anonymous registration is off" in log and "--enable-anonymous-registration" in log
    assert "requires a cluster secret and this encoder has none" in log
    # Heartbeats go on (each one refused again) without repeating the error.
    refusals = metric(stack.locked.url, "request_errors_total", status="403")
    while metric(stack.locked.url, "request_errors_total", status="403") < refusals + 3:
        assert time.monotonic() < deadline + 10, "the encoder stopped heartbeating"
        time.sleep(0.2)
    assert logged() == (1, 1)


def test_anonymous_registration_works_and_is_announced_loudly(stack):
    log = stack.anonymous.log()
    assert f"mmserve: WARNING: {WARNING}" in log  # the plain stderr line
    assert f"WARNING mmserve.server: {WARNING}" in log  # the logger's
    assert "anyone" in log and "other users' media" in log
    for quiet in (stack.secured, stack.locked):
        assert WARNING not in quiet.log()

    assert call(stack.anonymous, "POST", "/register_encoder").status_code == 200
    listing = call(stack.anonymous, "GET", "/encoders")
    assert listing.status_code == 200 and [e["url"] for e in listing.json()["encoders"]] == [FAKE_ENCODER]
    assert "embedding_endpoint" in listing.json()  # the full view: the operator opted in
    assert call(stack.anonymous, "POST", "/unregister_encoder").status_code == 200
    assert error_of(call(stack.anonymous, "POST", "/unregister_encoder"), 404)["code"] == "encoder_not_found"
    assert call(stack.anonymous, "GET", "/encoders").json()["encoders"] == []
