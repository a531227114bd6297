"""The transfer seam through real servers: Mooncake's transfer engine and shared memory carry images, video
and audio with HF's greedy tokens, and nothing leaks when either side is SIGKILLed mid-transfer.

(The shared-memory path is also what every `--encoder-workers` test in test_epd_e2e.py and
test_family_epd.py now runs on: it is the default for local workers.)
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time

import httpx
import pytest

from mmserve.testing.probes import metric, settled_integrity
from mmserve.testing.process_group import EncoderSpec, start_with_encoders
from mmserve.testing.server_process import ServerHandle, start_server
from mmserve.transport.cluster_auth import ENV_VAR, ClusterSecret
from tests.engine_helpers import audio_case, image_case, reference_text, video_case

MAX_NEW = 8
MM_KWARGS = '{"video_min_pixels": 3136, "video_max_pixels": 12544}'
SECRET = "transfer-e2e-cluster-secret-0123"
ENV = {ENV_VAR: SECRET}
TOKEN = ClusterSecret(SECRET.encode()).headers


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return str(tmp_path_factory.mktemp("transfer-logs"))


def chat(url: str, case, max_tokens: int = MAX_NEW, timeout: float = 90) -> httpx.Response:
    body = {"messages": case.messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=timeout)


def content(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def transport(url: str, stat: str) -> float:
    """An encoder's transport gauge (absent until its first part: 0)."""
    try:
        return metric(url, "encoder_transport", stat=stat)
    except AssertionError:
        return 0.0


def shm_server(model_dir: str, logs: str, *extra: str) -> tuple[ServerHandle, ServerHandle]:
    """(server, encoder): a server sending every item to one standalone encoder over shared memory, started
    side by side."""
    args = ["--kv-cache-mb", "16", "--encoder-transport", "shm", *extra]
    server, (encoder,) = start_with_encoders(
        model_dir, args, [EncoderSpec(("--shm-pool-mb", "8"))], log_dir=logs
    )
    return server, encoder


def wait_for(check, what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_audio"])
def test_mooncake_transfer_matches_hf(arch, tiny_model, logs):
    """Encoder workers push over Mooncake's transfer engine (TCP on loopback), parts signed."""
    model_dir = tiny_model(arch)
    mm_kwargs = json.loads(MM_KWARGS) if arch == "qwen2_vl" else {}
    extra = ["--mm-processor-kwargs", MM_KWARGS] if mm_kwargs else []
    server = start_server(
        model_dir,
        "--kv-cache-mb",
        "16",
        "--language-only",
        "--encoder-workers",
        "1",
        "--encoder-transport",
        "mooncake",
        "--mooncake-pool-mb",
        "16",
        *extra,
        log_dir=logs,
        env=ENV,
    )
    try:
        listing = httpx.get(server.url + "/encoders", headers=TOKEN, timeout=10).json()
        assert listing["embedding_endpoints"]["mooncake"].startswith("mooncake://127.0.0.1:")
        expected = reference_text(model_dir, MAX_NEW, mm_kwargs)
        if arch == "qwen2_vl":
            cases = [image_case([1, 2], "Two over Mooncake."), video_case(3, "A clip over Mooncake.")]
        else:
            cases = [audio_case([4], "What is this sound?")]
        for case in cases:
            r = chat(server.url, case)
            assert content(r) == expected(case)
            assert r.json()["mmserve"]["encoded_by"] not in ("none", "engine (in-process)")
        assert settled_integrity(server.url)["transfer_held_bytes"] == 0
        worker = listing["encoders"][0]["url"]
        assert metric(worker, "encoder_transport", stat="mooncake_send_timeouts") == 0
        assert metric(worker, "encoder_transport", stat="mooncake_pool_used_bytes") == 0
    finally:
        assert server.stop() == 0


def test_sigkilled_encoder_leaks_nothing_and_requests_fail_over(tiny_qwen2_vl, logs):
    before = set(os.listdir("/dev/shm"))
    server, encoder = shm_server(tiny_qwen2_vl, logs, "--encoder-dispatch-min-items", "2")
    try:
        expected = reference_text(tiny_qwen2_vl, 48)
        # Adaptive dispatch: one item is encoded by the server's own tower, two go to the encoder.
        single = chat(server.url, image_case([9], "Just one."), 48)
        assert content(single) == expected(image_case([9], "Just one."))
        assert single.json()["mmserve"]["encoded_by"] == "engine (in-process)"
        assert transport(encoder.url, "shm_links") == 0
        cases = [image_case([10 + i, 13 + i], f"Killed sender {i}.") for i in range(3)]
        with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
            futures = [pool.submit(chat, server.url, case, 48) for case in cases]
            # Killed once the first part has reached the engine over shared memory (the link exists): its region
            # is held until its request's other item arrives, while the other requests' items still encode.
            # (Polling the pool's used bytes raced the engine releasing regions once decodes got faster.)
            wait_for(lambda: transport(encoder.url, "shm_links") > 0, "a part sent over shared memory")
            encoder.proc.send_signal(signal.SIGKILL)
            results = [f.result(timeout=120) for f in futures]
        for case, r in zip(cases, results, strict=True):  # held regions stay valid; the rest fail over
            assert content(r) == expected(case)
        after = chat(server.url, image_case([20], "After the kill."), 48)  # encoded locally now
        assert content(after) == expected(image_case([20], "After the kill."))
        assert settled_integrity(server.url)["transfer_held_bytes"] == 0
        assert set(os.listdir("/dev/shm")) == before
    finally:
        assert server.stop() == 0
        encoder.stop()


def test_sigkilled_engine_frees_the_encoders_pool(tiny_qwen2_vl, logs):
    before = set(os.listdir("/dev/shm"))
    server, encoder = shm_server(tiny_qwen2_vl, logs, "--language-only")
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            futures = [
                pool.submit(chat, server.url, image_case([30 + i], "Engine dies."), 200, 60) for i in range(2)
            ]
            wait_for(lambda: transport(encoder.url, "shm_pool_used_bytes") > 0, "parts held by the engine")
            (engine_pid,) = server.child_pids()
            os.kill(engine_pid, signal.SIGKILL)
            for f in futures:  # an explicit error (or a cut stream), never a hang
                try:
                    r = f.result(timeout=60)
                    assert r.status_code >= 500 or "error" in r.text
                except httpx.HTTPError:
                    pass
        assert server.proc.wait(timeout=30) == 1  # the server exits with the engine, for its supervisor
        wait_for(lambda: transport(encoder.url, "shm_links") == 0, "link dropped")
        assert transport(encoder.url, "shm_pool_used_bytes") == 0
        assert httpx.get(encoder.url + "/health", timeout=30).status_code == 200
        assert set(os.listdir("/dev/shm")) == before
    finally:
        server.stop()
        encoder.stop()
