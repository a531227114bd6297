"""Overload: bursts far beyond the server's (and an encoder's) capacity end in 200 or a clean 503, never
a hang, and the server is healthy and consistent afterwards."""

from __future__ import annotations

import httpx
import pytest

from mmserve.testing.load import Call, Outcome, run_closed_loop, summarize
from mmserve.testing.probes import metric, settled_integrity
from mmserve.testing.process_group import EncoderSpec, start_with_encoders, stop_all
from mmserve.testing.server_process import start_server
from tests.engine_helpers import image_case, reference_text

CAPACITY = 4  # --max-num-seqs 2 + --max-waiting-requests 2
BURST = 20
MAX_NEW = 32  # long enough that the burst arrives while the first requests still run


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return str(tmp_path_factory.mktemp("overload-logs"))


def chat_call(seed: int, max_tokens: int, stream: bool = False, text: str = "Describe it.") -> Call:
    body = {"messages": image_case([seed], text).messages, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}  # fmt: skip
    if stream:
        body["stream_options"] = {"include_usage": True}
    return Call("/v1/chat/completions", body, stream=stream, tag="stream" if stream else "plain")


def completed(o: Outcome, max_tokens: int) -> bool:
    """A 200 whose answer has all its tokens, streamed or not."""
    if not o.ok:
        return False
    if o.tag == "stream":
        return (
            o.body["done"]
            and o.body["finish_reason"] == "length"
            and o.body["usage"]["completion_tokens"] == max_tokens
        )
    return (
        o.body["choices"][0]["finish_reason"] == "length"
        and o.body["usage"]["completion_tokens"] == max_tokens
    )


def test_burst_beyond_capacity_gets_200_or_503_and_recovers(tiny_qwen2_vl, logs):
    server = start_server(tiny_qwen2_vl, "--kv-cache-mb", "16", "--max-num-seqs", "2", "--max-waiting-requests",
                          "2", log_dir=logs)  # fmt: skip
    try:
        calls = [chat_call(200 + i, MAX_NEW, stream=i % 2 == 1) for i in range(BURST)]
        outs = run_closed_loop(server.url, calls.__getitem__, concurrency=BURST, num_requests=BURST,
                               timeout_s=60, start_together=True)  # fmt: skip
        assert len(outs) == BURST and all(o.status != 0 for o in outs), [
            (o.status, o.error_code) for o in outs
        ]
        assert {o.status for o in outs} <= {200, 503}, summarize(outs)
        ok, busy = [o for o in outs if o.status == 200], [o for o in outs if o.status == 503]
        assert len(busy) >= 1 and len(ok) >= CAPACITY, summarize(outs)  # the first CAPACITY always get in
        assert all(completed(o, MAX_NEW) for o in ok), [o.body for o in ok if not completed(o, MAX_NEW)][:2]
        for o in busy:  # a clean refusal: OpenAI-style body, a hint when to retry, nothing streamed
            assert o.retry_after == "1" and o.error_code == "queue_full"
            assert (
                o.body["error"]["type"] == "service_unavailable" and "capacity" in o.body["error"]["message"]
            )
        assert metric(server.url, "request_errors_total", status="503") == len(busy)
        # Recovery: nothing left in flight, pools consistent, and a fresh request gets a full answer.
        assert settled_integrity(server.url)["in_flight"] == 0
        (fresh,) = run_closed_loop(
            server.url, lambda _: chat_call(299, MAX_NEW), concurrency=1, num_requests=1
        )
        assert completed(fresh, MAX_NEW), fresh
        assert settled_integrity(server.url)["num_running"] == 0
    finally:
        assert server.stop() == 0


def test_encoder_burst_beyond_max_pending_falls_back_to_local_encoding(tiny_qwen2_vl, logs):
    """An encoder that takes one job at a time (each held 0.3 s in its batch window) behind a server that
    has vision weights: the overflow is refused with 503 by the encoder and encoded by the engine instead,
    and every answer equals the HF reference, whichever side encoded it."""
    expected = reference_text(tiny_qwen2_vl, 6)
    server, (enc,) = start_with_encoders(
        tiny_qwen2_vl,
        ["--kv-cache-mb", "16", "--enable-anonymous-registration"],
        [EncoderSpec(("--max-pending", "1", "--max-batch-wait-ms", "300"))],
        log_dir=logs,
    )
    try:
        n, max_new = 12, 6
        calls = [chat_call(300 + i, max_new, text="Who encoded me?") for i in range(n)]
        outs = run_closed_loop(server.url, calls.__getitem__, concurrency=n, num_requests=n, timeout_s=90,
                               start_together=True)  # fmt: skip
        assert all(o.status == 200 for o in outs), summarize(outs)
        assert metric(enc.url, "encoder_rejected_jobs_total") >= 1  # the encoder was overloaded
        stats = httpx.get(server.url + "/encoders", timeout=10).json()
        assert stats["local_fallbacks"] >= 1
        encoded_by = [o.body["mmserve"]["encoded_by"] for o in outs]
        assert any(enc.url in e for e in encoded_by) and any("local" in e for e in encoded_by), encoded_by
        for i, o in enumerate(outs):
            assert o.body["choices"][0]["message"]["content"] == expected(
                image_case([300 + i], "Who encoded me?")
            )
        assert settled_integrity(server.url)["in_flight"] == 0
    finally:
        assert stop_all([server, enc])[0] == 0
