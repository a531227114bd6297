"""vLLM-compatible metrics: counters from engine totals, the one-line stats log, KV usage that ignores cached
prefixes, and a real server whose /metrics carries every series of vLLM's Grafana dashboard (`mmserve:`)."""

from __future__ import annotations

import logging
import re
import time
from types import SimpleNamespace

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from mmserve.engine.cache.kv_pool import KVPool
from mmserve.engine.cache.radix_cache import RadixCache
from mmserve.engine.engine import Engine
from mmserve.engine.request import Request
from mmserve.engine.scheduler import Scheduler, SchedulerConfig
from mmserve.engine.step_output import TokenHistogram
from mmserve.runtime.loop import EngineLoop
from mmserve.runtime.receiver import ReceiverStats
from mmserve.sampling_params import SamplingParams
from mmserve.server.metrics import EngineTotal, ServerMetrics, build_1_2_5_buckets
from mmserve.server.serving import Timings
from mmserve.server.stats_log import StatsLogger, start_stats_log
from mmserve.transport.messages import StatsMsg

# Every series vLLM's Grafana dashboard (examples/observability/prometheus_grafana/grafana.json) queries, and
# the vLLM series around it that dashboards commonly use, as samples with `vllm:` swapped for `mmserve:`.
DASHBOARD_SAMPLES = [
    "e2e_request_latency_seconds_bucket",
    "e2e_request_latency_seconds_sum",
    "e2e_request_latency_seconds_count",
    "prompt_tokens_total",
    "generation_tokens_total",
    "inter_token_latency_seconds_bucket",
    "num_requests_running",
    "num_requests_waiting",
    "time_to_first_token_seconds_bucket",
    "kv_cache_usage_perc",
    "request_prompt_tokens_bucket",
    "request_generation_tokens_bucket",
    "request_success_total",
    "request_queue_time_seconds_sum",
    "request_prefill_time_seconds_sum",
    "request_decode_time_seconds_sum",
    "request_max_num_generation_tokens_sum",
    "time_per_output_token_seconds_bucket",
    "request_time_per_output_token_seconds_bucket",
    "request_inference_time_seconds_sum",
    "request_params_n_sum",
    "request_params_max_tokens_sum",
    "prompt_tokens_cached_total",
    "prefix_cache_queries_total",
    "prefix_cache_hits_total",
    "mm_cache_queries_total",
    "num_preemptions_total",
]


def stats(**fields) -> StatsMsg:
    base = dict(
        num_running=0,
        num_waiting=0,
        kv_cache_usage=0.0,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        mm_cache_queries=0,
        mm_cache_hits=0,
        encode_seconds_total=0.0,
    )
    return StatsMsg(**{**base, **fields})


# -- counters from engine totals ------------------------------------------------------------------------------
def test_token_buckets_are_vllms_1_2_5():
    assert build_1_2_5_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert build_1_2_5_buckets(4096)[-1] == 2000


def test_engine_total_counts_increases_and_never_decreases():
    metrics = ServerMetrics("m")
    total = EngineTotal(metrics.prompt_tokens)  # any counter of the registry
    seen = []
    for engine_total in (5, 5, 8, 3, 4):  # 3: a new engine process counting from 0 again
        total.advance(engine_total)
        seen.append(metrics.values("prompt_tokens_total")["prompt_tokens_total"])
    assert seen == [5, 5, 8, 11, 12]


def test_engine_stats_become_counters_and_gauges():
    metrics = ServerMetrics("m")
    metrics.update_engine(stats(prefix_cache_queries=100, prefix_cache_hits=40, num_preemptions=1))
    metrics.update_engine(
        stats(
            prefix_cache_queries=150,
            prefix_cache_hits=60,
            num_preemptions=1,
            kv_cache_usage=0.25,
            prefix_cache_tokens=64,
            embedding_store={"hits": 3.0, "connected": 1.0},
        )
    )
    text = metrics.render().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["mmserve:prefix_cache_queries"].type == "counter"
    assert families["mmserve:kv_cache_usage_perc"].type == "gauge"
    assert metrics.values(
        "prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total"
    ) == {
        "prefix_cache_queries_total": 150,
        "prefix_cache_hits_total": 60,
        "num_preemptions_total": 1,
    }
    assert metrics.values("kv_cache_usage_perc", "prefix_cache_tokens") == {
        "kv_cache_usage_perc": 0.25,
        "prefix_cache_tokens": 64,
    }
    assert metrics.values("embedding_store_hits_total", "embedding_store_connected") == {
        "embedding_store_hits_total": 3,
        "embedding_store_connected": 1,
    }


def test_finished_request_observes_tpot_per_request():
    metrics = ServerMetrics("m", max_model_len=64)
    timings = Timings(queue_s=0.01, prefill_s=0.04, ttft_s=0.1, decode_s=0.8, e2e_s=0.9)
    params = SamplingParams(max_tokens=9, n=2)
    metrics.record_finished("length", timings, 10, 14, 9, params)  # two choices: 9 + 5 tokens
    metrics.record_finished("stop", timings, 10, 1, 1, SamplingParams(max_tokens=9))  # one token: no TPOT
    v = metrics.values(
        "request_time_per_output_token_seconds_sum",
        "request_time_per_output_token_seconds_count",
        "request_max_num_generation_tokens_sum",
        "request_generation_tokens_sum",
        "request_inference_time_seconds_sum",
        "request_params_n_sum",
        "request_success_total",
    )
    assert v["request_time_per_output_token_seconds_count"] == 1
    assert v["request_time_per_output_token_seconds_sum"] == pytest.approx(0.8 / 8)
    assert v["request_max_num_generation_tokens_sum"] == 10 and v["request_generation_tokens_sum"] == 15
    assert v["request_inference_time_seconds_sum"] == pytest.approx(2 * 0.84)
    assert v["request_params_n_sum"] == 3 and v["request_success_total"] == 2


# -- the stats log --------------------------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_stats_line_like_vllms_and_quiet_when_idle():
    metrics, clock = ServerMetrics("m"), Clock()
    log = StatsLogger(metrics, 10.0, clock)
    clock.now += 10
    assert log.line(None).startswith("Avg prompt throughput: 0.0 tokens/s")  # one line says we are up
    clock.now += 10
    assert log.line(stats()) is None  # idle: quiet
    metrics.prompt_tokens.inc(500)
    metrics.generation_tokens.inc(120)
    clock.now += 10
    busy = stats(
        num_running=3, num_waiting=1, kv_cache_usage=0.125, prefix_cache_queries=400, prefix_cache_hits=100
    )
    assert log.line(busy) == (
        "Avg prompt throughput: 50.0 tokens/s, Avg generation throughput: 12.0 tokens/s, Running: 3 reqs, "
        "Waiting: 1 reqs, KV cache usage: 12.5%, Prefix cache hit rate: 25.0%"
    )
    clock.now += 10
    prefill_only = stats(num_running=1, kv_cache_usage=0.5, prefix_cache_queries=400, prefix_cache_hits=100)
    line = log.line(prefill_only)  # no tokens out, but a request runs: logged; the hit rate stays
    assert "Running: 1 reqs" in line and "Prefix cache hit rate: 25.0%" in line
    clock.now += 10
    idle = stats(prefix_cache_queries=400, prefix_cache_hits=100)
    assert "Avg generation throughput: 0.0 tokens/s, Running: 0 reqs" in log.line(idle)  # one idle line
    for _ in range(3):
        clock.now += 10
        assert log.line(idle) is None


def test_stats_line_adds_the_embedding_cache_once_used(caplog):
    metrics, clock = ServerMetrics("m"), Clock()
    log = StatsLogger(metrics, 5.0, clock)
    clock.now += 5
    assert "Embedding cache" not in log.line(stats())
    metrics.generation_tokens.inc(10)
    clock.now += 5
    with caplog.at_level(logging.INFO, logger="mmserve.stats"):
        line = log.log(stats(mm_cache_queries=4, mm_cache_hits=3))
    assert line.endswith("Embedding cache hit rate: 75.0%")
    assert [r.getMessage() for r in caplog.records if r.name == "mmserve.stats"] == [line]


def test_stats_log_off_at_zero_interval():
    assert start_stats_log(ServerMetrics("m"), 0, lambda: None) is None


# -- KV usage counts requests, not cached prefixes ------------------------------------------------------------
def engine_stats(sched: Scheduler) -> StatsMsg:
    """EngineLoop.stats over a real scheduler, with an intake and handoffs that saw nothing."""
    intake = SimpleNamespace(
        encoder=None,
        assembler=SimpleNamespace(stats=ReceiverStats()),
        parts_malformed=0,
        parts_rejected={"forged": 0, "replayed": 0},
        num_waiting=0,
        encode_seconds_total=0.0,
        held_bytes=0,
    )
    engine = SimpleNamespace(
        scheduler=sched,
        pool=sched.pool,
        states=None,
        window_pool=None,
        overlap=SimpleNamespace(stages=0, tokens=0),
        iteration_tokens=TokenHistogram(),
    )
    engine.stats = lambda: Engine.stats(engine)
    loop = SimpleNamespace(
        engine=engine,
        intake=intake,
        handoffs=SimpleNamespace(stats=dict),
    )
    return EngineLoop.stats(loop)


def test_kv_usage_counts_slots_requests_hold_and_not_cached_prefixes():
    pool = KVPool.uniform(64, 1, 1, 2, torch.float32)
    sched = Scheduler(SchedulerConfig(16, 8, max_model_len=1000), pool, RadixCache(pool))
    prompt = list(range(8))
    a = Request("a", prompt, SamplingParams(temperature=0, max_tokens=4))
    sched.add(a)
    sched.schedule()  # the whole prompt: 8 slots
    sched.cache_prompt(a)  # now shared with the prefix cache: still a's
    assert engine_stats(sched).kv_cache_usage == 8 / 64
    a.append_output(7)
    sched.finish(a, "length")
    idle = engine_stats(sched)
    assert idle.kv_cache_usage == 0 and idle.prefix_cache_tokens == 8 and idle.kv_slots_used == 8
    b = Request("b", prompt, SamplingParams(temperature=0, max_tokens=4))
    sched.add(b)
    sched.schedule()  # 7 cached tokens shared with the prefix cache + 1 new slot
    assert engine_stats(sched).kv_cache_usage == 8 / 64 and pool.num_used == 9
    sched.reserve(4)  # a decode server's slots for an incoming handoff count too
    assert engine_stats(sched).kv_cache_usage == 12 / 64


# -- a real server --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(shared_server):
    """The plain server shared with other modules (tests/conftest.py): --log-level info, a stats line every
    0.5 s; counters and the log are read as differences."""
    return shared_server


def scrape(url: str) -> dict[str, list]:
    """/metrics as {sample name: [samples]}, and the families checked for vLLM's conventions."""
    text = httpx.get(url + "/metrics", timeout=10).text
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if family.type == "counter":
                assert s.name.endswith(("_total", "_created")), s.name
            if s.name.startswith("mmserve:"):
                assert s.labels["model_name"] == "tiny" and s.labels["engine"] == "0", s
                samples.setdefault(s.name.removeprefix("mmserve:"), []).append(s)
    return samples


def total(samples: dict[str, list], name: str, **labels: str) -> float:
    return sum(s.value for s in samples[name] if labels.items() <= s.labels.items())


def stats_lines(server, since: int = 0) -> list[str]:
    """The stats log lines written after the first `since` characters of the server's log."""
    return re.findall(r"mmserve\.stats: (.*)", server.log()[since:])


def test_server_exposes_the_vllm_dashboard_series(server):
    logged = len(server.log())
    before = scrape(server.url)
    assert not [name for name in DASHBOARD_SAMPLES if name not in before]
    body = {
        "model": "tiny",
        "prompt": "The quick brown fox",
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
    }
    prompt_tokens = 0
    for _ in range(2):
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
        prompt_tokens += r.json()["usage"]["prompt_tokens"]
    after = scrape(server.url)

    def grew(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    assert grew("request_success_total", finished_reason="length") == 2
    assert grew("prompt_tokens_total") == prompt_tokens and grew("generation_tokens_total") == 10
    assert grew("request_time_per_output_token_seconds_count") == 2  # TPOT: one per request
    assert grew("request_time_per_output_token_seconds_sum") > 0
    assert grew("inter_token_latency_seconds_count") == grew("time_per_output_token_seconds_count") >= 2
    assert grew("e2e_request_latency_seconds_count") == grew("time_to_first_token_seconds_count") == 2
    assert grew("request_prompt_tokens_sum") == prompt_tokens and grew("request_params_max_tokens_sum") == 10
    assert grew("prefix_cache_hits_total") > 0  # the second request reused the first's prompt
    # vLLM's iteration_tokens_total (tokens per engine step) and cache_config_info
    deadline = time.monotonic() + 20
    while grew("iteration_tokens_total_count") < 5:  # 2 prefills + 8 decode steps at least, once stats arrive
        assert time.monotonic() < deadline, "iteration_tokens_total never counted the steps"
        time.sleep(0.2)
        after = scrape(server.url)
    assert grew("iteration_tokens_total_sum") >= 2 + 8  # prompts (cached by earlier users, but >= 1 token) + decodes
    inf = [s for s in after["iteration_tokens_total_bucket"] if s.labels["le"] == "+Inf"]
    assert inf[0].value == total(after, "iteration_tokens_total_count")
    (info,) = after["cache_config_info"]
    assert info.value == 1 and info.labels["block_size"] == "1" and int(info.labels["num_gpu_blocks"]) > 0
    assert info.labels["enable_prefix_caching"] == "True"
    deadline = time.monotonic() + 20
    while True:  # idle: the KV slots are free again, and the prompts stay in the prefix cache
        now = scrape(server.url)
        if total(now, "kv_cache_usage_perc") == 0 and total(now, "num_requests_running") == 0:
            break
        assert time.monotonic() < deadline, "KV cache usage never returned to 0"
        time.sleep(0.2)
    assert total(now, "prefix_cache_tokens") > 0
    # The stats log saw the work, then goes quiet once idle (one idle line).
    deadline = time.monotonic() + 20
    while not any("Avg generation throughput: 0.0" not in line for line in stats_lines(server, logged)):
        assert time.monotonic() < deadline, stats_lines(server, logged)
        time.sleep(0.2)
    time.sleep(1.5)
    quiet = len(stats_lines(server, logged))
    time.sleep(1.5)
    assert len(stats_lines(server, logged)) == quiet, stats_lines(server, logged)[-3:]
    assert stats_lines(server, logged)[-1].startswith("Avg prompt throughput: 0.0 tokens/s")
