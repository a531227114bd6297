"""`mmserve bench` end to end on the tiny model, and the server-side breakdown on known metrics."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import httpx
import pytest

from mmserve.bench.client import LoadConfig
from mmserve.bench.commands import _choose_seed
from mmserve.bench.compare import format_breakdown, run_one
from mmserve.bench.server_metrics import MetricsUnavailable, breakdown, listed_encoders, scrape, scrape_text
from mmserve.bench.workload import WorkloadConfig, build_workload
from mmserve.transport.cluster_auth import ENV_VAR
from tests.conftest import CLUSTER_SECRET

BEFORE = """
mmserve:request_queue_time_seconds_sum{model_name="m"} 1.0
mmserve:request_queue_time_seconds_count{model_name="m"} 2.0
mmserve:prefix_cache_queries_total{model_name="m"} 100.0
mmserve:prefix_cache_hits_total{model_name="m"} 10.0
"""
AFTER = """
mmserve:request_queue_time_seconds_sum{model_name="m"} 4.0
mmserve:request_queue_time_seconds_count{model_name="m"} 8.0
mmserve:prefix_cache_queries_total{model_name="m"} 300.0
mmserve:prefix_cache_hits_total{model_name="m"} 110.0
"""


def test_breakdown_uses_deltas():
    enc_before = {"mmserve:encoder_cache_hits": 1.0, "mmserve:encoder_cache_queries": 4.0}
    enc_after = {"mmserve:encoder_cache_hits": 4.0, "mmserve:encoder_cache_queries": 8.0}
    out = breakdown(
        {"server": scrape_text(BEFORE), "encoders": enc_before},
        {"server": scrape_text(AFTER), "encoders": enc_after},
    )
    assert out["queue_s_mean"] == 0.5  # 3 s over 6 requests
    assert out["prefix_cache_hit_rate"] == 0.5  # 100 of 200 tokens
    assert out["mm_cache_hit_rate"] == 0.75  # 3 of 4 lookups, from the encoders
    assert out["encode_s_mean"] is None  # nothing measured


def run_cli(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd, env = [sys.executable, "-m", "mmserve.cli", *args], {**os.environ, **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def test_bench_compare_with_hf_baseline(tiny_qwen2_vl, tmp_path):
    out = tmp_path / "compare.json"
    workload = "--rounds 1 --num-requests 4 --image-size 64x64 --output-tokens 4 --concurrency 2 --seed 3"
    proc = run_cli(
        "bench",
        "compare",
        tiny_qwen2_vl,
        "--config",
        "hf=",
        "--config",
        "mmserve=--kv-cache-mb 16",
        *workload.split(),
        "--json",
        str(out),
    )  # MODEL positionally, as `mmserve serve MODEL`
    assert proc.returncode == 0, proc.stderr[-3000:]
    output = json.loads(out.read_text())
    results = output["results"]
    assert set(results) == {"hf", "mmserve"} and output["workload"]["seed"] == 3
    assert all(
        run["ok"] == 4 and run["total_output_tokens"] == 16 for runs in results.values() for run in runs
    )
    assert "| hf |" in proc.stdout and "| mmserve |" in proc.stdout


SECRET = CLUSTER_SECRET


@pytest.fixture(scope="module")
def server(shared_secured_epd_process):
    """One real EPD server for the `bench run` tests (shared with test_cluster_auth, tests/conftest.py); it
    has the cluster secret, so does the bench."""
    return shared_secured_epd_process.get()


def test_bench_run_against_a_server(server, tmp_path):
    out = tmp_path / "bench.json"
    flags = "--num-requests 8 --image-size 64x64,96x64 --image-reuse 0.5 --output-tokens 6 --concurrency 4"
    argv = [
        "bench",
        "--url",
        server.url + "/v1",
        *flags.split(),
        "--slo",
        "ttft_ms=60000",
        "--json",
        str(out),
    ]
    proc = run_cli(*argv, env={ENV_VAR: SECRET})
    # The secret reaches the bench's /encoders call (the control plane needs its token): the encoders' side of
    # the breakdown (transfer time) is measured. A base URL with /v1 is fine: /metrics is read at the root.
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "encoders not scraped" not in proc.stderr
    assert "\r" not in proc.stderr  # no progress redraws when stderr is not a terminal
    result = json.loads(out.read_text())
    assert result["ok"] == result["total"] == 8 and result["errors_by_status"] == {}
    for key in ("ttft_s", "itl_s", "tpot_s", "e2e_s"):
        assert set(result[key]) >= {"mean", "p50", "p90", "p99"}
    assert result["request_throughput"] > 0 and result["output_throughput"] > 0 and result["goodput"] > 0
    assert result["total_output_tokens"] == 8 * 6
    server_side = result["server"]
    stages = "queue encode prefill decode transfer".split()
    for key in [f"{stage}_s_mean" for stage in stages] + ["prefix_cache_hit_rate", "mm_cache_hit_rate"]:
        assert server_side[key] is not None, key
    assert "TTFT" in proc.stdout
    # Every workload parameter is in the output, with the fresh seed drawn for this run (no --seed given).
    workload = result["workload"]
    assert set(workload) == set(WorkloadConfig.__dataclass_fields__)
    assert f"workload seed {workload['seed']}" in proc.stdout
    assert (workload["num_requests"], workload["image_reuse"], result["load"]["concurrency"]) == (8, 0.5, 4)
    assert result["slo"] == "ttft_ms=60000" and "api_key" not in result["load"]


def test_unseeded_runs_draw_fresh_workloads_and_seeded_ones_repeat():
    seeds = set()
    for _ in range(3):
        args = argparse.Namespace(seed=None)
        _choose_seed(args)
        seeds.add(args.seed)
    assert len(seeds) == 3
    args = argparse.Namespace(seed=7)
    _choose_seed(args)
    assert args.seed == 7
    cfg = WorkloadConfig(num_requests=3, image_sizes=((16, 16),), seed=args.seed)
    assert [r.messages for r in build_workload(cfg)] == [r.messages for r in build_workload(cfg)]


def test_bench_without_server_metrics(server):
    """Against a server without mmserve metrics the bench measures the client side and says what it skipped:
    asked to (--no-server-metrics), or because GET /metrics is missing (here: /v1/metrics, a real 404)."""
    with pytest.raises(MetricsUnavailable, match="answered 404"):
        scrape(server.url + "/v1")
    requests = build_workload(
        WorkloadConfig(num_requests=2, image_sizes=((32, 32),), output_tokens=3, seed=1)
    )
    cfg = LoadConfig(url=server.url, concurrency=2, timeout_s=60, progress=False)
    summary, server_side = run_one(cfg, requests, scrape=False)
    assert summary.ok == 2 and server_side == {"skipped": "--no-server-metrics"}
    assert "skipped (--no-server-metrics)" in format_breakdown(server_side)


def test_encoders_note_only_for_a_server_that_uses_encoders(shared_server, capsys):
    # The shared plain server is monolithic and has no anonymous registration: /encoders answers 403.
    with httpx.Client(timeout=10) as http:
        assert listed_encoders(http, shared_server.url, uses_encoders=False) == []
        assert capsys.readouterr().err == ""  # nothing there to miss: no note
        assert listed_encoders(http, shared_server.url, uses_encoders=True) == []
    assert "encoders not scraped: /encoders said 403" in capsys.readouterr().err


def test_bench_kv_memory_frees_window_rows_behind_the_window(tiny_model, tmp_path):
    """`mmserve bench kv-memory` on the tiny Gemma 3 (window 6): a 300-token prompt in chunks of 32 holds at most
    its window, the kept rows and a chunk of sliding rows, while every layer keeping every row would hold 300+."""
    out = tmp_path / "kv.json"
    done = run_cli(
        "bench", "kv-memory", "--model", tiny_model("gemma3"), "--prompt-tokens", "300", "--output-tokens", "8",
        "--max-num-batched-tokens", "32", "--dtype", "float32", "--json", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["window"] == 6 and result["window_peak_rows"] <= 5 + 5 + 32 + 1
    assert result["decode_rows"] <= 5 + 5 + 16 and result["ratio"] > 1.5
    assert "every layer keeps every token's rows" in done.stdout
