"""`mmserve bench` end to end on the tiny model, and the server-side breakdown on known metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from mmserve.bench.server_metrics import breakdown, scrape_text
from mmserve.transport.cluster_auth import ENV_VAR

BEFORE = """
mmserve:request_queue_time_seconds_sum{model_name="m"} 1.0
mmserve:request_queue_time_seconds_count{model_name="m"} 2.0
mmserve:prefix_cache_queries{model_name="m"} 100.0
mmserve:prefix_cache_hits{model_name="m"} 10.0
"""
AFTER = """
mmserve:request_queue_time_seconds_sum{model_name="m"} 4.0
mmserve:request_queue_time_seconds_count{model_name="m"} 8.0
mmserve:prefix_cache_queries{model_name="m"} 300.0
mmserve:prefix_cache_hits{model_name="m"} 110.0
"""


def test_breakdown_uses_deltas():
    enc_before = {"mmserve:encoder_cache_hits": 1.0, "mmserve:encoder_cache_queries": 4.0}
    enc_after = {"mmserve:encoder_cache_hits": 4.0, "mmserve:encoder_cache_queries": 8.0}
    out = breakdown({"server": scrape_text(BEFORE), "encoders": enc_before},
                    {"server": scrape_text(AFTER), "encoders": enc_after})  # fmt: skip
    assert out["queue_s_mean"] == 0.5  # 3 s over 6 requests
    assert out["prefix_cache_hit_rate"] == 0.5  # 100 of 200 tokens
    assert out["mm_cache_hit_rate"] == 0.75  # 3 of 4 lookups, from the encoders
    assert out["encode_s_mean"] is None  # nothing measured


def run_cli(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd, env = [sys.executable, "-m", "mmserve.cli", *args], {**os.environ, **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def test_bench_run_against_a_launched_server(tiny_qwen2_vl, tmp_path):
    out = tmp_path / "bench.json"
    proc = run_cli("bench", "--launch", "--kv-cache-mb 16 --encoder-workers 1", "--model", tiny_qwen2_vl,
                   "--num-requests", "8", "--image-size", "64x64,96x64", "--image-reuse", "0.5",
                   "--output-tokens", "6", "--concurrency", "4", "--slo", "ttft_ms=60000", "--json", str(out),
                   env={ENV_VAR: "bench test secret, 16+ bytes"})  # fmt: skip
    # The secret reaches the launched server and the bench's /encoders call (the control plane needs its
    # token): the encoders' side of the breakdown (transfer time) is measured.
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "encoders not scraped" not in proc.stderr
    result = json.loads(out.read_text())
    assert result["ok"] == result["total"] == 8 and result["errors_by_status"] == {}
    for key in ("ttft_s", "itl_s", "tpot_s", "e2e_s"):
        assert set(result[key]) >= {"mean", "p50", "p90", "p99"}
    assert result["request_throughput"] > 0 and result["output_throughput"] > 0 and result["goodput"] > 0
    assert result["total_output_tokens"] == 8 * 6
    server = result["server"]
    for key in ("queue_s_mean", "encode_s_mean", "prefill_s_mean", "decode_s_mean", "transfer_s_mean",
                "prefix_cache_hit_rate", "mm_cache_hit_rate"):  # fmt: skip
        assert server[key] is not None, key
    assert "TTFT" in proc.stdout


def test_bench_compare_with_hf_baseline(tiny_qwen2_vl, tmp_path):
    out = tmp_path / "compare.json"
    proc = run_cli("bench", "compare", "--model", tiny_qwen2_vl, "--config", "hf=", "--config",
                   "mmserve=--kv-cache-mb 16", "--rounds", "1", "--num-requests", "4", "--image-size", "64x64",
                   "--output-tokens", "4", "--concurrency", "2", "--json", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert set(results) == {"hf", "mmserve"}
    assert all(
        run["ok"] == 4 and run["total_output_tokens"] == 16 for runs in results.values() for run in runs
    )
    assert "| hf |" in proc.stdout and "| mmserve |" in proc.stdout
