"""EPD end to end: real encoder processes, real servers, parity with HF, caching, faults and failover."""

from __future__ import annotations

import concurrent.futures
import http.server
import json
import threading
import time
from dataclasses import dataclass

import httpx
import pytest
import zmq

from mmserve.testing.probes import metric, open_fds, settled_integrity
from mmserve.testing.process_group import EncoderSpec, start_together, start_with_encoders, stop_all
from mmserve.testing.server_process import ServerHandle, free_port, start_encoder, start_server
from mmserve.transport.cluster_auth import ENV_VAR, ClusterSecret
from tests.engine_helpers import image_case, reference_text, video_case

MAX_NEW = 8
MM_KWARGS = '{"video_min_pixels": 3136, "video_max_pixels": 12544}'


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return str(tmp_path_factory.mktemp("epd-logs"))


@pytest.fixture(scope="module")
def expected(tiny_qwen2_vl):
    return reference_text(tiny_qwen2_vl, MAX_NEW, json.loads(MM_KWARGS))


def chat(url: str, case, timeout: float = 60, **extra) -> httpx.Response:
    body = {"messages": case.messages, "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True, **extra}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=timeout)


def content(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


# -- two local encoder workers (spawned by the server) ----------------------------------------------------
@pytest.fixture(scope="module")
def epd2(tiny_qwen2_vl, logs):
    # Anonymous control plane (loopback only): the tests read /encoders for encoder URLs and counters.
    handle = start_server(
        tiny_qwen2_vl,
        *("--kv-cache-mb", "16", "--encoder-workers", "2", "--mm-processor-kwargs", MM_KWARGS),
        "--enable-anonymous-registration",
        log_dir=logs,
    )
    yield handle
    settled_integrity(handle.url)  # pools and caches consistent after every test that shared it
    assert handle.stop() == 0


def test_epd_matches_hf_for_images_and_video(epd2, expected):
    for case in (
        image_case([1], "Describe."),
        image_case([2, 3], "Compare."),
        video_case(4, "What happens?"),
    ):
        r = chat(epd2.url, case)
        assert content(r) == expected(case)
        assert "127.0.0.1" in r.json()["mmserve"]["encoded_by"]  # computed by an encoder service


def test_items_of_one_request_spread_over_encoders(epd2, expected):
    case = image_case([10, 11, 12, 13], "Four pictures.")
    r = chat(epd2.url, case)
    assert content(r) == expected(case)
    assert len(r.json()["mmserve"]["encoded_by"].split(", ")) == 2


def test_cache_affinity_computes_a_repeated_image_once(epd2):
    encoders = [e["url"] for e in httpx.get(epd2.url + "/encoders", timeout=10).json()["encoders"]]
    before = sum(metric(u, "encoder_cache_hits") for u in encoders)
    first, second = chat(epd2.url, image_case([20], "Once.")), chat(epd2.url, image_case([20], "Twice."))
    assert content(first) and content(second)
    assert sum(metric(u, "encoder_cache_hits") for u in encoders) == before + 1
    # The response reports the encoder's hit too (from the dispatcher's answer, never waited for).
    assert [r.json()["mmserve"]["mm_cache_hits"] for r in (first, second)] == [0, 1]


def test_64_concurrent_requests_across_two_encoders(epd2):
    cases = [image_case([100 + i % 16], f"Question {i % 16}.") for i in range(64)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=64) as pool:
        outs = list(pool.map(lambda c: chat(epd2.url, c, timeout=240), cases, timeout=300))
    assert all(o.status_code == 200 for o in outs), [o.text for o in outs if o.status_code != 200][:3]
    bodies = [o.json() for o in outs]
    assert len({b["id"] for b in bodies}) == 64  # none duplicated
    for i in range(16, 64):  # identical requests, identical greedy answers: none mixed up
        assert (
            bodies[i]["choices"][0]["message"]["content"]
            == bodies[i % 16]["choices"][0]["message"]["content"]
        )
    assert httpx.get(epd2.url + "/health", timeout=10).status_code == 200


def test_malformed_and_unknown_parts_are_dropped_and_counted(epd2):
    endpoint = httpx.get(epd2.url + "/encoders", timeout=10).json()["embedding_endpoint"]
    from mmserve.multimodal.items import MAIN, ItemEmbedding, Modality
    from mmserve.transport.embedding_wire import EmbeddingItem, encode_part

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(endpoint)
    import torch

    item = EmbeddingItem(0, ItemEmbedding(Modality.IMAGE, bytes(16), {MAIN: torch.zeros(1, 64)}))
    sock.send_multipart([b"not msgpack", b""])
    sock.send_multipart(encode_part("no-such-request", 0, 1, "forger", [item]))
    sock.close()
    ctx.term()

    def dropped():
        for line in httpx.get(epd2.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("mmserve:embedding_parts_dropped_total{"):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    deadline = time.monotonic() + 20  # an unknown request's part waits out the early-arrival TTL (5 s)
    while dropped() < 2:
        assert time.monotonic() < deadline, "bad parts were not counted"
        time.sleep(0.5)
    assert content(chat(epd2.url, image_case([30], "Still fine?")))


def cache_counts(encoders: list[ServerHandle]) -> tuple[float, float]:
    """(hits, queries) of the encoders' caches, summed."""
    hits = sum(metric(e.url, "encoder_cache_hits") for e in encoders)
    return hits, sum(metric(e.url, "encoder_cache_queries") for e in encoders)


# -- a server with vision weights, round robin over two standalone encoders ---------------------------------
@pytest.fixture(scope="module")
def round_robin(tiny_qwen2_vl, logs):
    """(server, its two encoders): test_round_robin_computes_a_repeated_image_twice, then
    test_killed_encoders_fall_back_to_local_encoding kills both encoders."""
    server, encoders = start_with_encoders(
        tiny_qwen2_vl,
        ["--kv-cache-mb", "16", "--encoder-routing", "round_robin"],
        [EncoderSpec(), EncoderSpec()],
        log_dir=logs,
    )
    yield server, encoders
    assert stop_all([server, *encoders])[0] == 0


def test_round_robin_computes_a_repeated_image_twice(round_robin):
    server, encoders = round_robin
    hits, queries = cache_counts(encoders)
    for text in ("One.", "Two."):
        assert content(chat(server.url, image_case([40], text)))
    assert cache_counts(encoders) == (hits, queries + 2)  # computed twice, never a hit


# -- language-only: no vision weights, encoder faults ----------------------------------------------------
class FakeEncoder:
    """A loopback HTTP encoder that is healthy but hangs (or answers 503 / 422) on /encode, as `mode` says."""

    def __init__(self) -> None:
        self.mode = "503"
        self.calls = 0
        self.released = threading.Event()  # ends the hangs (tests never wait for them to run out)
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def arm(self, mode: str) -> None:
        self.mode, self.calls = mode, 0
        self.released.clear()

    def _handler(self):
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(b'{"status": "ok", "cache": {}}')

            def do_POST(self):
                fake.calls += 1
                mode = fake.mode
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if mode == "hang":
                    fake.released.wait(8)  # past the dispatcher's attempt timeout; bounded so the thread ends
                # 422: an encoder of another version rejecting the job's schema; it pushes no error part.
                self.send_response(422 if mode == "422" else 503)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(b'{"detail": "validation error"}')

        return Handler

    def close(self) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()


@dataclass
class FailoverStack:
    server: ServerHandle
    fake: FakeEncoder
    real: ServerHandle


@pytest.fixture(scope="module")
def failover_stack(tiny_qwen2_vl, logs):
    """A language-only server over a fake encoder and a real one (round robin), shared by the fault modes."""
    fake = FakeEncoder()
    try:
        server, (real,) = start_with_encoders(
            tiny_qwen2_vl,
            [
                *("--kv-cache-mb", "16", "--language-only", "--encode-timeout-s", "9"),
                *("--encoder-routing", "round_robin", "--disable-prefix-cache"),
                *("--mm-processor-kwargs", MM_KWARGS, "--enable-anonymous-registration"),
            ],
            [fake.url, EncoderSpec(("--mm-processor-kwargs", MM_KWARGS))],
            log_dir=logs,
        )
    except BaseException:
        fake.close()
        raise
    yield FailoverStack(server, fake, real)
    assert stop_all([server, real])[0] == 0
    fake.close()


def wait_until_healthy(server_url: str, encoder_urls: list[str], timeout_s: float = 20) -> None:
    """Until the server's prober holds each of these encoders healthy (a fault of the last test is behind it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        listing = httpx.get(server_url + "/encoders", timeout=10).json()["encoders"]
        if all(e["healthy"] for e in listing if e["url"] in encoder_urls):
            return
        assert time.monotonic() < deadline, listing
        time.sleep(0.2)


FAULT_MODES = ["hang", "503", "422"]


@pytest.mark.parametrize("mode", FAULT_MODES)
def test_faulty_encoder_fails_over_to_a_healthy_one(failover_stack, expected, mode):
    server, fake = failover_stack.server, failover_stack.fake
    wait_until_healthy(server.url, [fake.url, failover_stack.real.url])
    fake.arm(mode)
    # Images new to this server (its engine caches embeddings), so every request goes to an encoder.
    seeds = range(50 + 6 * FAULT_MODES.index(mode), 56 + 6 * FAULT_MODES.index(mode))
    failovers = httpx.get(server.url + "/encoders", timeout=10).json()["failovers"]
    try:
        start = time.monotonic()
        for seed in seeds[:2]:  # round robin: one of the two goes to the faulty encoder first
            case = image_case([seed], "Fail over.")
            assert content(chat(server.url, case)) == expected(case)
        assert fake.calls >= 1 and time.monotonic() - start < 20
        assert httpx.get(server.url + "/encoders", timeout=10).json()["failovers"] >= failovers + 1
        # Nothing leaks across further failovers: KV slots all free again, socket/file counts flat.
        fds = [open_fds(pid) for pid in [server.proc.pid, *server.child_pids()]]
        for seed in seeds[2:]:
            assert chat(server.url, image_case([seed], "Again.")).status_code == 200
        assert metric(server.url, "kv_cache_usage_perc") == 0
        assert metric(server.url, "num_requests_running") == 0
        after = [open_fds(pid) for pid in [server.proc.pid, *server.child_pids()]]
        assert all(a <= b + 2 for a, b in zip(after, fds, strict=True)), (fds, after)
    finally:
        fake.released.set()
    settled_integrity(server.url)


def test_language_only_with_killed_encoder_gets_a_clear_error(tiny_qwen2_vl, expected, logs):
    server, (enc,) = start_with_encoders(
        tiny_qwen2_vl,
        ["--kv-cache-mb", "16", "--language-only", "--encode-timeout-s", "6"],
        [EncoderSpec()],
        log_dir=logs,
    )
    try:
        case = image_case([60], "Hello.")
        assert content(chat(server.url, case)) == expected(case)
        enc.proc.kill()  # SIGKILL
        enc.proc.wait(10)
        start = time.monotonic()
        r = chat(server.url, image_case([61], "Anyone?"))
        assert r.status_code in (502, 503, 504), r.text
        assert "encoder" in r.json()["error"]["message"]
        assert time.monotonic() - start < 10
        # text-only requests still work, and the server stays healthy
        text_only = {"prompt": "hi", "max_tokens": 2}
        assert httpx.post(server.url + "/v1/completions", json=text_only, timeout=30).status_code == 200
    finally:
        assert server.stop() == 0
        enc.stop()


@pytest.fixture(scope="module")
def loners(tiny_qwen2_vl, logs, shared_language_only_process):
    """Processes that one test each uses, started side by side when the first of them is needed:
    "no_encoder", a language-only server without encoders (the one shared with test_control_plane,
    tests/conftest.py, which registers none for good); "max_pending_0", an encoder that takes no job."""
    no_encoder, max_pending_0 = shared_language_only_process.get_beside(
        lambda: start_encoder(tiny_qwen2_vl, "--max-pending", "0", log_dir=logs)
    )
    yield {"no_encoder": no_encoder, "max_pending_0": max_pending_0}
    assert max_pending_0.stop() == 0


def test_no_encoder_and_no_vision_weights_is_503(loners):
    r = chat(loners["no_encoder"].url, image_case([70], "Hello."))
    assert r.status_code == 503 and "encoder" in r.json()["error"]["message"]


def test_killed_encoders_fall_back_to_local_encoding(round_robin, expected):
    server, encoders = round_robin
    for enc in encoders:
        enc.proc.kill()
        enc.proc.wait(10)
    case = image_case([80], "Local please.")
    r = chat(server.url, case)
    assert content(r) == expected(case)
    assert "local" in r.json()["mmserve"]["encoded_by"]


def test_registration_unregistration_and_server_restart(tiny_qwen2_vl, expected, logs):
    """Runtime registration as deployed: server and encoder share a cluster secret, and every control-plane
    call carries its token (the anonymous mode is covered in tests/test_control_plane.py)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    secret = {ENV_VAR: "registration test secret, 16+ bytes"}
    auth = ClusterSecret(secret[ENV_VAR].encode()).headers
    register = ("--register-url", url, "--register-interval-s", "0.5")

    def registered(server) -> list[str]:
        listing = httpx.get(server.url + "/encoders", headers=auth, timeout=10).json()
        return [e["url"] for e in listing["encoders"]]

    def wait_for(predicate, what: str, timeout_s: float = 20) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            assert time.monotonic() < deadline, what
            time.sleep(0.2)

    # The encoder heartbeats to the server's URL from its start: the two start side by side.
    started = start_together(
        {
            "encoder": lambda: start_encoder(tiny_qwen2_vl, *register, log_dir=logs, env=secret),
            "server": lambda: start_server(
                tiny_qwen2_vl, "--kv-cache-mb", "16", "--language-only", port=port, log_dir=logs, env=secret
            ),
        }
    )
    enc, server = started["encoder"], started["server"]
    try:
        wait_for(lambda: registered(server) == [enc.url], "encoder did not register")
        case = image_case([90], "Registered?")
        assert content(chat(server.url, case)) == expected(case)
        r = httpx.post(url + "/unregister_encoder", json={"url": enc.url}, headers=auth, timeout=10)
        assert r.status_code == 200
        time.sleep(1.5)  # several heartbeats: an explicit unregister is never revived by them
        assert registered(server) == []
        assert chat(server.url, image_case([91], "Now?")).status_code == 503
        r = httpx.post(url + "/register_encoder", json={"url": enc.url}, headers=auth, timeout=10)
        assert r.status_code == 200
        assert registered(server) == [enc.url]
        assert server.stop() == 0
        server = start_server(
            tiny_qwen2_vl, "--kv-cache-mb", "16", "--language-only", port=port, log_dir=logs, env=secret
        )
        wait_for(lambda: registered(server) == [enc.url], "encoder did not re-register after the restart")
        assert content(chat(server.url, case)) == expected(case)
    finally:
        assert stop_all([server, enc])[0] == 0


def test_four_encoders_in_bfloat16_match_hf_bfloat16(tiny_qwen2_vl, logs):

    expected = reference_text(tiny_qwen2_vl, MAX_NEW, json.loads(MM_KWARGS), dtype="bfloat16")
    server = start_server(tiny_qwen2_vl, "--kv-cache-mb", "16", "--dtype", "bfloat16", "--encoder-workers", "4",
                          "--encoder-routing", "round_robin", "--mm-processor-kwargs", MM_KWARGS, log_dir=logs)  # fmt: skip
    try:
        for case in (image_case([120, 121, 122, 123], "Four, in bf16."), video_case(124, "A bf16 video.")):
            ref = expected(case)
            r = chat(server.url, case)
            assert content(r) == ref
        assert len(r.json()["mmserve"]["encoded_by"].split(", ")) == 1  # the video: one item, one encoder
        four = chat(server.url, image_case([125, 126, 127, 128], "Spread."))
        assert len(four.json()["mmserve"]["encoded_by"].split(", ")) == 4  # round robin: one item each
    finally:
        assert server.stop() == 0


def test_bad_media_over_epd_is_400_and_not_retried(epd2):
    before = httpx.get(epd2.url + "/encoders", timeout=10).json()["failovers"]
    bad = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAA"}},
        {"type": "text", "text": "Broken."}]}], "max_tokens": 4}  # fmt: skip
    r = httpx.post(epd2.url + "/v1/chat/completions", json=bad, timeout=30)
    assert r.status_code == 400 and "image item 0" in r.json()["error"]["message"]
    assert httpx.get(epd2.url + "/encoders", timeout=10).json()["failovers"] == before


def test_encoder_refuses_work_beyond_max_pending(loners):
    enc = loners["max_pending_0"]
    job = {
        **{"request_id": "r", "part_index": 0, "num_parts": 1, "reply_endpoint": "tcp://127.0.0.1:1"},
        "items": [{"item_index": 0, "modality": "image", "url": "data:,"}],
    }
    r = httpx.post(enc.url + "/encode", json=job, timeout=10)
    assert r.status_code == 503 and r.headers.get("retry-after") == "1"
    assert metric(enc.url, "encoder_rejected_jobs_total") == 1


def test_encoder_killed_mid_request_fails_over(tiny_qwen2_vl, expected, logs):
    # The slow encoder holds each job in its batch window for 3 s: long enough to kill it mid-request.
    server, (slow, fast) = start_with_encoders(
        tiny_qwen2_vl,
        [
            *("--kv-cache-mb", "16", "--language-only", "--encode-timeout-s", "30"),
            *("--encoder-routing", "round_robin"),
        ],
        [EncoderSpec(("--max-batch-wait-ms", "3000")), EncoderSpec()],
        log_dir=logs,
    )
    try:
        case = image_case([140], "Killed mid-way.")
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            future = pool.submit(chat, server.url, case)
            deadline = time.monotonic() + 10
            while metric(slow.url, "encoder_pending_jobs") < 1:  # the job is inside the slow encoder
                assert time.monotonic() < deadline
                time.sleep(0.05)
            slow.proc.kill()
            r = future.result(timeout=60)
        assert content(r) == expected(case)
        assert fast.url in r.json()["mmserve"]["encoded_by"]
    finally:
        assert stop_all([server, fast, slow])[:2] == [0, 0]  # the slow one was killed
