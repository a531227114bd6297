"""`mmserve bench` core: synthetic workloads, the async load generator (against a fake loopback server), and
metrics from traces with hand-computed answers. Nothing here is timed."""

from __future__ import annotations

import base64
import io
import json
import socket
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import av
import numpy as np
import pytest
from PIL import Image

from mmserve.bench.client import LoadConfig, RequestTrace, run
from mmserve.bench.stats import SLO, parse_slo, percentile, summarize
from mmserve.bench.workload import (
    BenchRequest,
    WorkloadConfig,
    build_workload,
    parse_range,
    parse_size,
    parse_sizes,
)

SMALL = ((32, 24),)


# --- workload ---------------------------------------------------------------------------------------


def _media(req: BenchRequest, kind: str = "image_url") -> list[str]:
    return [p[kind]["url"] for p in req.messages[0]["content"] if p["type"] == kind]


def _text(req: BenchRequest) -> str:
    return next(p["text"] for p in req.messages[0]["content"] if p["type"] == "text")


def _decode(uri: str) -> bytes:
    return base64.b64decode(uri.split(",", 1)[1])


def test_same_seed_same_bytes_different_seed_differs():
    cfg = WorkloadConfig(
        num_requests=6, images_per_request=(1, 3), image_sizes=SMALL, image_reuse=0.5, seed=7
    )
    a, b = build_workload(cfg), build_workload(cfg)
    assert [r.messages for r in a] == [r.messages for r in b]
    c = build_workload(WorkloadConfig(num_requests=6, images_per_request=(1, 3), image_sizes=SMALL, seed=8))
    assert [r.messages for r in a] != [r.messages for r in c]
    assert len({_text(r) for r in a}) == len(a)  # prompts differ per request
    assert all(r.max_tokens == cfg.output_tokens for r in a)


def test_reuse_fraction_pool_identical_unique_distinct():
    cfg = WorkloadConfig(
        num_requests=100, images_per_request=(4, 4), image_sizes=SMALL, image_reuse=0.8, seed=3
    )
    reqs = build_workload(cfg)
    by_key: dict[str, set[str]] = {}
    for r in reqs:
        for key, uri in zip(r.image_keys, _media(r), strict=True):
            by_key.setdefault(key, set()).add(uri)
    keys = [k for r in reqs for k in r.image_keys]
    assert len(keys) == 400
    pooled = sum(k.startswith("pool-") for k in keys)
    assert 0.72 <= pooled / len(keys) <= 0.88
    assert all(len(uris) == 1 for uris in by_key.values())  # one key, one byte string
    pool_keys = {k for k in keys if k.startswith("pool-")}
    assert len(pool_keys) <= cfg.reuse_pool_size
    unique_uris = [next(iter(by_key[k])) for k in keys if k.startswith("unique-")]
    assert len(unique_uris) == len(set(unique_uris)) > 0
    # no unique image collides with a pool image either
    assert not set(unique_uris) & {next(iter(by_key[k])) for k in pool_keys}


def test_no_reuse_means_all_unique():
    reqs = build_workload(WorkloadConfig(num_requests=5, images_per_request=(2, 2), image_sizes=SMALL))
    uris = [u for r in reqs for u in _media(r)]
    assert len(uris) == len(set(uris)) == 10
    assert all(k.startswith("unique-") for r in reqs for k in r.image_keys)


def test_system_prompt_comes_first_and_differs_per_request():
    reqs = build_workload(WorkloadConfig(num_requests=3, system_prompt_tokens=50, image_sizes=((16, 16),)))
    systems = [r.messages[0] for r in reqs]
    assert all(
        m["role"] == "system" and len(m["content"].split()) == 52 for m in systems
    )  # "Session N." + 50
    assert len({m["content"] for m in systems}) == 3  # no cache can hold it for the next request
    assert all(r.messages[1]["content"][0]["type"] == "image_url" for r in reqs)  # the media come after it
    assert "system" not in [m["role"] for m in build_workload(WorkloadConfig(num_requests=1))[0].messages]


@pytest.mark.parametrize("sizes", [((40, 30),), ((16, 16), (48, 32), (24, 40))])
def test_image_sizes_match_config(sizes):
    cfg = WorkloadConfig(num_requests=20, images_per_request=(1, 2), image_sizes=sizes, image_reuse=0.3)
    reqs = build_workload(cfg)
    seen = set()
    for r in reqs:
        decoded = [Image.open(io.BytesIO(_decode(u))).size for u in _media(r)]
        assert decoded == r.image_sizes
        assert set(decoded) <= set(sizes)
        seen |= set(decoded)
    assert seen == set(sizes)  # 20-40 draws cover a 3-way mix


def test_images_per_request_range():
    reqs = build_workload(WorkloadConfig(num_requests=40, images_per_request=(1, 4), image_sizes=SMALL))
    counts = [len(_media(r)) for r in reqs]
    assert all(1 <= c <= 4 for c in counts)
    assert {1, 4} <= set(counts)
    assert all(len(r.image_keys) == len(r.image_sizes) == c for r, c in zip(reqs, counts, strict=True))
    zero = build_workload(WorkloadConfig(num_requests=3, images_per_request=(0, 0), image_sizes=SMALL))
    assert all(_media(r) == [] and _text(r) for r in zero)


def test_formats():
    png = build_workload(WorkloadConfig(num_requests=1, image_sizes=SMALL))[0]
    jpeg = build_workload(WorkloadConfig(num_requests=1, image_sizes=SMALL, image_format="jpeg"))[0]
    assert _media(png)[0].startswith("data:image/png;base64,")
    assert _decode(_media(png)[0]).startswith(b"\x89PNG")
    uri = _media(jpeg)[0]
    assert uri.startswith("data:image/jpeg;base64,")
    assert _decode(uri)[:3] == b"\xff\xd8\xff"
    assert Image.open(io.BytesIO(_decode(uri))).format == "JPEG"


def test_video_option_adds_decodable_video():
    cfg = WorkloadConfig(num_requests=2, image_sizes=SMALL, video=True, video_frames=3, video_size=(32, 16))
    reqs = build_workload(cfg)
    for r in reqs:
        (uri,) = _media(r, "video_url")
        assert uri.startswith("data:video/mp4;base64,")
        with av.open(io.BytesIO(_decode(uri))) as container:
            frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
        assert len(frames) == 3 and frames[0].shape == (16, 32, 3)
    assert _media(reqs[0], "video_url") != _media(reqs[1], "video_url")
    without = build_workload(WorkloadConfig(num_requests=1, image_sizes=SMALL))[0]
    assert _media(without, "video_url") == []


def test_config_validation():
    for bad in (
        {"images_per_request": (3, 1)},
        {"image_format": "gif"},
        {"image_reuse": 1.5},
        {"image_sizes": ()},
        {"video": True, "video_size": (31, 16)},
    ):
        with pytest.raises(ValueError):
            WorkloadConfig(**bad)


def test_parse_helpers():
    assert parse_size("448x448") == (448, 448)
    assert parse_size(" 640X480 ") == (640, 480)
    assert parse_sizes("224x224,448x448") == ((224, 224), (448, 448))
    assert parse_sizes("32x16") == ((32, 16),)
    assert parse_range("2") == (2, 2)
    assert parse_range("1-4") == (1, 4)
    for fn, text in [
        (parse_size, "448"),
        (parse_size, "axb"),
        (parse_size, "0x10"),
        (parse_size, "1x2x3"),
        (parse_sizes, ""),
        (parse_sizes, "224x224,oops"),
        (parse_range, "4-1"),
        (parse_range, "x"),
        (parse_range, "1-2-3"),
        (parse_range, "-1"),
    ]:
        with pytest.raises(ValueError):
            fn(text)


# --- stats ------------------------------------------------------------------------------------------


def _trace(index, start, token_times, end, status=200, output_tokens=None, error=None, prompt=10, cached=0):
    return RequestTrace(
        index=index,
        start=start,
        first_token=token_times[0] if token_times else None,
        token_times=list(token_times),
        end=end,
        status=status,
        output_tokens=len(token_times) if output_tokens is None else output_tokens,
        prompt_tokens=prompt,
        cached_tokens=cached,
        error=error,
    )


def _synthetic() -> list[RequestTrace]:
    return [
        # TTFT 0.1, gaps 0.1 0.1, TPOT (end - first) / (n - 1) = (0.4 - 0.1) / 2 = 0.15, E2E 0.4
        _trace(0, 0.0, [0.1, 0.2, 0.3], 0.4, cached=4),
        # TTFT 0.2, gaps 0.2, TPOT (1.6-1.2)/1 = 0.4, E2E 0.6
        _trace(1, 1.0, [1.2, 1.4], 1.6),
        # TTFT 0.5, gaps 0.1 0.2 0.3, TPOT (3.2 - 2.5) / 3 = 0.7 / 3, E2E 1.2
        _trace(2, 2.0, [2.5, 2.6, 2.8, 3.1], 3.2),
        # failures: HTTP 503, a timeout, a 200 stream cut short; none counts in latencies or tokens
        _trace(3, 0.0, [], 0.05, status=503, error="overloaded"),
        _trace(4, 0.0, [], 600.0, status=0, error="timed out"),
        _trace(5, 0.0, [0.1], 0.3, status=200, error="stream ended without [DONE]"),
    ]


def test_summarize_known_answers():
    s = summarize(_synthetic(), wall_s=4.0)
    assert (s.total, s.ok) == (6, 3)
    assert s.errors_by_status == {"503": 1, "0": 1, "200": 1}
    ttft = [0.1, 0.2, 0.5]
    assert s.ttft_s.count == 3
    assert s.ttft_s.mean == pytest.approx(0.8 / 3)
    assert s.ttft_s.p50 == pytest.approx(0.2)
    assert s.ttft_s.p90 == pytest.approx(0.2 + 0.8 * 0.3)  # pos 1.8 between 0.2 and 0.5
    assert s.ttft_s.p99 == pytest.approx(0.2 + 0.98 * 0.3)
    assert s.ttft_s.p90 == pytest.approx(np.percentile(ttft, 90))
    itl = [0.1, 0.1, 0.2, 0.1, 0.2, 0.3]
    assert s.itl_s.count == 6
    assert s.itl_s.mean == pytest.approx(1.0 / 6)
    assert s.itl_s.p50 == pytest.approx(np.percentile(itl, 50)) and s.itl_s.p50 == pytest.approx(0.15)
    assert s.itl_s.p99 == pytest.approx(np.percentile(itl, 99))
    tpot = [0.15, 0.4, 0.7 / 3]
    assert s.tpot_s.count == 3
    assert s.tpot_s.mean == pytest.approx(sum(tpot) / 3)
    assert s.tpot_s.p50 == pytest.approx(0.7 / 3)
    e2e = [0.4, 0.6, 1.2]
    assert s.e2e_s.mean == pytest.approx(2.2 / 3)
    assert s.e2e_s.p90 == pytest.approx(np.percentile(e2e, 90))
    assert s.request_throughput == pytest.approx(3 / 4.0)
    assert s.output_throughput == pytest.approx((3 + 2 + 4) / 4.0)
    assert s.goodput == s.request_throughput  # no SLO
    assert (s.total_prompt_tokens, s.total_output_tokens, s.total_cached_tokens) == (30, 9, 4)


def test_goodput_under_slo():
    traces = _synthetic()
    # TTFT <= 300 ms excludes request 2 (500 ms); TPOT <= 450 ms keeps requests 0 and 1.
    assert summarize(traces, 4.0, SLO(ttft_ms=300, tpot_ms=450)).goodput == pytest.approx(2 / 4.0)
    # TPOT <= 200 ms alone keeps only request 0 (150 ms).
    assert summarize(traces, 4.0, SLO(tpot_ms=200)).goodput == pytest.approx(1 / 4.0)
    assert summarize(traces, 4.0, SLO(ttft_ms=1000)).goodput == pytest.approx(3 / 4.0)


def test_output_tokens_from_usage_drive_tpot():
    # The server batched 8 tokens into 3 chunks: TPOT uses the usage count, ITL the chunk gaps.
    s = summarize([_trace(0, 0.0, [0.1, 0.3, 0.8], 0.8, output_tokens=8)], wall_s=1.0)
    assert s.tpot_s.mean == pytest.approx(0.7 / 7)
    assert s.itl_s.count == 2
    assert s.output_throughput == pytest.approx(8.0)


def test_summarize_empty_and_all_failed_never_raise():
    for traces, wall in [([], 0.0), ([], 1.0), (_synthetic()[3:5], 2.0), (_synthetic(), 0.0)]:
        s = summarize(traces, wall, SLO(ttft_ms=1))
        json.dumps(s.to_json())
        assert isinstance(s.table(), str)
    empty = summarize([], 0.0)
    assert (empty.total, empty.ok, empty.errors_by_status) == (0, 0, {})
    assert empty.ttft_s is empty.itl_s is empty.tpot_s is empty.e2e_s is None
    assert empty.request_throughput == empty.output_throughput == empty.goodput == 0.0


def test_summary_json_and_table():
    s = summarize(_synthetic(), 4.0, SLO(ttft_ms=300))
    data = json.loads(json.dumps(s.to_json()))
    assert data["ok"] == 3 and data["errors_by_status"]["503"] == 1
    assert set(data["ttft_s"]) == {"count", "mean", "p50", "p90", "p99"}
    assert data["slo"] == {"ttft_ms": 300, "tpot_ms": None}
    table = s.table()
    for word in ("TTFT", "ITL", "TPOT", "E2E", "goodput", "503"):
        assert word in table
    latency_lines = table.splitlines()[-5:]
    assert len({len(line) for line in latency_lines}) == 1  # aligned columns


def test_percentile_matches_numpy():
    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 10, 101):
        values = list(rng.random(n))
        for q in (0, 1, 25, 50, 90, 99, 99.9, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert np.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_parse_slo():
    assert parse_slo("ttft_ms=500,tpot_ms=50") == SLO(500.0, 50.0)
    assert parse_slo(" tpot_ms = 25 ") == SLO(tpot_ms=25.0)
    assert parse_slo("") == SLO()
    for bad in ("ttft=5", "ttft_ms", "ttft_ms=abc", "ttft_ms=-1", "ttft_ms=1,ttft_ms=2", "e2e_ms=3"):
        with pytest.raises(ValueError):
            parse_slo(bad)


# --- client against a fake OpenAI server on loopback ------------------------------------------------

FAIL_INDEX = 5
NO_USAGE_INDEX = 7


class _FakeOpenAI(BaseHTTPRequestHandler):
    """Streams `max_tokens` one-character chunks; "req-5" gets a 503, "req-7" no usage chunk, "<hang>" stalls."""

    server: _Server

    def log_message(self, *args) -> None:  # keep pytest output clean
        pass

    def do_GET(self) -> None:
        if self.path != "/v1/models":
            self._json(404, {"error": {"message": "not found"}})
            return
        self._json(200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.bodies.append(body)
        text = next(p["text"] for p in body["messages"][0]["content"] if p["type"] == "text")
        if f"req-{FAIL_INDEX}." in text:
            self._json(503, {"error": {"message": "server overloaded", "type": "service_unavailable"}})
            return
        if "<hang>" in text:
            self.server.stop.wait(2.0)  # longer than the client's timeout; ends early at teardown
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        n = body["max_tokens"]
        self._event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        for i in range(n):
            time.sleep(0.002)
            self._event({"choices": [{"index": 0, "delta": {"content": chr(97 + i % 26)}}]})
        self._event({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
        if f"req-{NO_USAGE_INDEX}." not in text:
            usage = {
                "prompt_tokens": 11,
                "completion_tokens": n,
                "prompt_tokens_details": {"cached_tokens": 3},
            }
            self._event({"choices": [], "usage": usage})
        self.wfile.write(b"data: [DONE]\n\n")

    def _event(self, data: dict) -> None:
        self.wfile.write(f"data: {json.dumps(data)}\n\n".encode())
        self.wfile.flush()

    def _json(self, status: int, data: dict) -> None:
        raw = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _FakeOpenAI)
        self.lock = threading.Lock()
        self.bodies: list[dict] = []
        self.stop = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def fake_server() -> Iterator[_Server]:
    server = _Server()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.stop.set()
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def _requests(n: int, max_tokens: int = 5, text: str = "req-{i}. hello") -> list[BenchRequest]:
    return [
        BenchRequest(
            i, [{"role": "user", "content": [{"type": "text", "text": text.format(i=i)}]}], max_tokens, [], []
        )
        for i in range(n)
    ]


def _check_ok(trace: RequestTrace, max_tokens: int, usage: bool = True) -> None:
    assert trace.ok, trace.error
    assert trace.output_tokens == max_tokens
    assert len(trace.token_times) == max_tokens  # the empty role chunk is not a token
    assert trace.start <= trace.first_token == trace.token_times[0] <= trace.end
    assert trace.token_times == sorted(trace.token_times) and trace.token_times[-1] <= trace.end
    assert (trace.prompt_tokens, trace.cached_tokens) == ((11, 3) if usage else (0, 0))


def test_run_load_concurrency(fake_server):
    reqs = _requests(12, max_tokens=5)
    cfg = LoadConfig(url=fake_server.url, concurrency=4, timeout_s=10, progress=False)
    traces, wall = run(cfg, reqs)
    assert [t.index for t in traces] == list(range(12))
    assert wall > 0
    bad = traces[FAIL_INDEX]
    assert (bad.status, bad.first_token, bad.output_tokens) == (503, None, 0)
    assert "overloaded" in bad.error
    for t in traces:
        if t.index != FAIL_INDEX:
            _check_ok(t, 5, usage=t.index != NO_USAGE_INDEX)
    s = summarize(traces, wall)
    assert (s.ok, s.errors_by_status) == (11, {"503": 1})
    body = fake_server.bodies[0]
    assert body["model"] == "fake-model"  # discovered from /v1/models
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0 and body["ignore_eos"] is True and body["max_tokens"] == 5


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_run_load_request_rate_and_warmup(fake_server, capsys, monkeypatch):
    reqs = _requests(6, max_tokens=3, text="rate {i}.")
    cfg = LoadConfig(
        url=fake_server.url + "/v1/", model="m", concurrency=2, request_rate=200.0, warmup=2, timeout_s=10
    )
    traces, _ = run(cfg, reqs)
    assert len(fake_server.bodies) == 8  # 2 warm-up requests, discarded
    assert len(traces) == 6 and all(t.ok and t.output_tokens == 3 for t in traces)
    assert all(b["model"] == "m" for b in fake_server.bodies)
    assert capsys.readouterr().err == ""  # stderr is not a terminal here: no progress bar
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    run(cfg, reqs)
    assert "bench: 100%" in terminal.getvalue() and "6/6" in terminal.getvalue()
    unlimited = LoadConfig(
        url=fake_server.url, concurrency=None, request_rate=500.0, timeout_s=10, progress=False
    )
    traces, _ = run(unlimited, reqs)
    assert all(t.ok for t in traces)


def test_workload_through_client(fake_server):
    cfg = WorkloadConfig(
        num_requests=4, images_per_request=(1, 2), image_sizes=SMALL, output_tokens=3, seed=1
    )
    reqs = build_workload(cfg)
    traces, _ = run(LoadConfig(url=fake_server.url, concurrency=2, timeout_s=10, progress=False), reqs)
    assert [t.index for t in traces] == [0, 1, 2, 3]
    for t in traces:
        _check_ok(t, 3)
    sent = sorted(fake_server.bodies, key=lambda b: _text(BenchRequest(0, b["messages"], 0, [], [])))
    assert [b["messages"] for b in sent] == [r.messages for r in reqs]


def test_run_load_timeout_becomes_status_0(fake_server):
    reqs = _requests(2, text="req-{i}. <hang>")
    traces, _ = run(LoadConfig(url=fake_server.url, model="m", timeout_s=0.3, progress=False), reqs)
    assert all(t.status == 0 and "timed out" in t.error for t in traces)


def test_run_load_closed_port_gives_status_0():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    traces, _ = run(LoadConfig(url=f"http://127.0.0.1:{port}", timeout_s=5, progress=False), _requests(3))
    assert [t.status for t in traces] == [0, 0, 0]
    assert all(t.error and not t.ok for t in traces)
    assert summarize(traces, 1.0).errors_by_status == {"0": 3}
