"""Soak: EPD (a server and two encoder workers) under steady mixed load. Every valid request gets its full
answer, every invalid one its 4xx, never a 5xx; memory and file descriptors of every process stay flat and
the engine's pools and caches are consistent at the end.

The CI variant runs ~17 s of load (7 s warm-up, 10 s measured: ~500 requests, the same assertions);
`pytest -m slow tests/test_soak.py` runs the same code for 10 minutes.
Set MMSERVE_SOAK_REPORT=path.json to keep the summary.
"""

from __future__ import annotations

import json
import os
import random
import time

import httpx
import pytest

from mmserve.testing.load import Call, Outcome, run_closed_loop, summarize
from mmserve.testing.probes import ProcSample, process_tree, sample
from mmserve.testing.server_process import start_server
from tests.conftest import random_image
from tests.engine_helpers import png_uri

CONCURRENCY = 4
WARMUP_S = 7.0  # ~400 requests: allocators warm, the 4096-slot prefix cache ~3/4 full
CI_DURATION_S = 10.0
SETTLE_S = 3.0  # pause after a phase so in-flight work, caches and freed memory settle before sampling
REPEATED = [
    png_uri(random_image(seed)) for seed in range(500, 506)
]  # a small pool: encoder/engine cache hits
TEXTS = ["Describe it.", "What is this?", "Colors?", "One word.", "Count the objects."]
# RSS may grow at most max(10 %, RSS_FLOOR_BYTES): over the short CI window allocator noise (arena growth,
# pages first touched by a rarely-taken path) is a few MB on processes of a few hundred MB; a leak of even
# a few KB per request (~500 requests) shows in the 10-minute variant, which runs ~50x as many.
RSS_GROWTH = 0.10
RSS_FLOOR_BYTES = 16 * 2**20
FD_SLACK = 5

INVALID = {
    "bad_base64": lambda: {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@not-base64@@"}},
        {"type": "text", "text": "Broken."}]}], "max_tokens": 4},
    "unknown_part": lambda: {"messages": [{"role": "user", "content": [{"type": "hologram"}]}], "max_tokens": 4},
    "huge_max_tokens": lambda: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**9},
}  # fmt: skip


def make_call(i: int) -> Call:
    """Request i of the mix: ~10 % invalid (400), else an image (half from the repeated pool, half fresh)
    or text-only request of 4-8 tokens, a quarter of them streamed. Deterministic in i."""
    rng = random.Random(i)
    if rng.random() < 0.10:
        kind = sorted(INVALID)[i % len(INVALID)]
        return Call("/v1/chat/completions", INVALID[kind](), tag=kind)
    text = rng.choice(TEXTS)
    roll = rng.random()
    if roll < 0.45:
        content = [
            {"type": "image_url", "image_url": {"url": rng.choice(REPEATED)}},
            {"type": "text", "text": text},
        ]
    elif roll < 0.9:
        fresh = png_uri(random_image(100_000 + i))
        content = [{"type": "image_url", "image_url": {"url": fresh}}, {"type": "text", "text": text}]
    else:
        content = text
    stream = rng.random() < 0.25
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": rng.randint(4, 8), "temperature": 0,
            "ignore_eos": True, "stream": stream}  # fmt: skip
    if stream:
        body["stream_options"] = {"include_usage": True}
    return Call("/v1/chat/completions", body, stream=stream, tag="valid")


def check(o: Outcome, call: Call) -> str | None:
    """Why this outcome is wrong for its request, or None."""
    if call.tag != "valid":
        if o.status != 400 or o.body["error"]["type"] != "invalid_request_error":
            return f"{call.tag}: expected 400, got {o.status} {o.body}"
        return None
    if not o.ok:
        return f"valid request: {o.status} {o.error_code} {o.body}"
    if call.stream:
        done, usage = o.body["done"], o.body["usage"] or {}
        finish = o.body["finish_reason"]
    else:
        done, usage, finish = True, o.body["usage"], o.body["choices"][0]["finish_reason"]
    if not done or finish != "length" or usage.get("completion_tokens") != call.body["max_tokens"]:
        return f"valid request incomplete: done={done} finish={finish} usage={usage}"
    return None


def health(url: str) -> dict:
    r = httpx.get(url + "/health", params={"check_integrity": "true"}, timeout=10)
    return {"http": r.status_code, **r.json()}


def settled(url: str, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + max(timeout_s, SETTLE_S)
    time.sleep(SETTLE_S)
    while (h := health(url))["in_flight"] or h["num_running"] or h["num_waiting"]:
        assert time.monotonic() < deadline, h
        time.sleep(0.2)
    return h


def soak(model_dir: str, log_dir: str, duration_s: float) -> dict:
    server = start_server(model_dir, "--kv-cache-mb", "2", "--embedding-cache-mb", "1", "--encoder-workers", "2",
                          "--enable-anonymous-registration", log_dir=log_dir)  # fmt: skip
    try:
        pids = process_tree(server.proc.pid)
        roles = sorted(s.role for s in sample(pids))
        assert roles == ["encoder", "encoder", "engine", "server"], roles
        # Warm-up: fills the KV pool, the prefix and embedding caches, the allocators' pools.
        warm = run_closed_loop(
            server.url, make_call, concurrency=CONCURRENCY, duration_s=WARMUP_S, timeout_s=60
        )
        assert all(check(o, make_call(o.index)) is None for o in warm), summarize(warm)
        settled(server.url)
        before = sample(pids)

        offset = len(warm)  # fresh images stay fresh: the load continues the warm-up's numbering
        outs = run_closed_loop(server.url, lambda i: make_call(offset + i), concurrency=CONCURRENCY,
                               duration_s=duration_s, timeout_s=60)  # fmt: skip
        end = settled(server.url)
        after = sample(pids)
        encoders = httpx.get(server.url + "/encoders", timeout=10).json()
    finally:
        assert server.stop() == 0
    problems = [p for o in outs if (p := check(o, make_call(offset + o.index)))]
    report = build_report(duration_s, outs, before, after, end, encoders)
    print("\n" + report["line"])
    if os.environ.get("MMSERVE_SOAK_REPORT"):
        with open(os.environ["MMSERVE_SOAK_REPORT"], "w") as f:
            json.dump(report, f, indent=2)
    assert not problems, (len(problems), problems[:5])
    assert report["5xx"] == 0 and report["ok"] > 0 and report["4xx"] > 0
    assert end["http"] == 200 and end["status"] == "ok", end
    assert end["transfer_held_bytes"] == 0, end  # every shared-memory region of the load went back
    for b, a in zip(before, after, strict=True):
        allowed = max(RSS_GROWTH * b.rss_bytes, RSS_FLOOR_BYTES)
        assert a.rss_bytes - b.rss_bytes <= allowed, f"{b.role} {b.pid}: RSS {b.rss_bytes} -> {a.rss_bytes}"
        assert a.open_fds <= b.open_fds + FD_SLACK, f"{b.role} {b.pid}: fds {b.open_fds} -> {a.open_fds}"
    return report


def build_report(duration_s: float, outs: list[Outcome], before: list[ProcSample], after: list[ProcSample],
                 end: dict, encoders: dict) -> dict:  # fmt: skip
    s = summarize(outs)
    statuses = {int(k): v for k, v in s["by_status"].items()}
    procs = [{"role": b.role, "pid": b.pid, "rss_mb_before": round(b.rss_bytes / 2**20, 1),
              "rss_mb_after": round(a.rss_bytes / 2**20, 1), "fds_before": b.open_fds, "fds_after": a.open_fds}
             for b, a in zip(before, after, strict=True)]  # fmt: skip
    report = {"duration_s": duration_s, "concurrency": CONCURRENCY, "requests": s["requests"],
              "ok": statuses.get(200, 0), "4xx": sum(v for k, v in statuses.items() if 400 <= k < 500),
              "5xx": sum(v for k, v in statuses.items() if k >= 500), "no_response": statuses.get(0, 0),
              "p50_s": s["p50_s"], "p99_s": s["p99_s"], "processes": procs, "kv_slots_used": end["kv_slots_used"],
              "failovers": encoders["failovers"], "local_fallbacks": encoders["local_fallbacks"]}  # fmt: skip
    mem = ", ".join(f"{p['role']} {p['rss_mb_before']}->{p['rss_mb_after']} MB fds {p['fds_before']}->{p['fds_after']}"
                    for p in procs)  # fmt: skip
    report["line"] = (f"soak {duration_s:.0f}s c={CONCURRENCY}: {report['requests']} requests, {report['ok']} ok, "
                      f"{report['4xx']} 4xx, {report['5xx']} 5xx, p50 {report['p50_s'] * 1000:.0f} ms, "
                      f"p99 {report['p99_s'] * 1000:.0f} ms; {mem}")  # fmt: skip
    return report


def test_soak_ci(tiny_qwen2_vl, tmp_path):
    soak(tiny_qwen2_vl, str(tmp_path), duration_s=CI_DURATION_S)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_soak_10_minutes(tiny_qwen2_vl, tmp_path):
    soak(tiny_qwen2_vl, str(tmp_path), duration_s=600)
