"""Prometheus metrics of the API server: vLLM's series under the `mmserve:` prefix, plus mmserve's own.

A vLLM Grafana dashboard works here with `vllm:` replaced by `mmserve:` (docs/metrics.md maps each series).
Names, types, label names (`model_name`, `engine`, `finished_reason`) and units follow vLLM
(vllm/v1/metrics/loggers.py); prometheus_client appends `_total` to every counter.

Two sources, one registry per app (tests run several servers in one process):
- request series are observed here as responses stream and complete (`mmserve.server.serving.Generation`);
- engine series come from the engine's periodic StatsMsg (the engine process owns those numbers): gauges are
  set, and the engine's running totals advance counters by their increase (`EngineTotal`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

from mmserve.encoder.embedding_store import METRIC_DOCS as STORE_METRIC_DOCS
from mmserve.engine.step_output import ITERATION_TOKEN_BUCKETS
from mmserve.transport.messages import StatsMsg

if TYPE_CHECKING:
    from mmserve.sampling_params import SamplingParams
    from mmserve.server.serving import Timings

PREFIX = "mmserve:"
LABELS = ("model_name", "engine")
ENGINE_INDEX = "0"  # one engine per API server; vLLM labels every series with its engine's index


def _buckets(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split())


# vLLM's buckets, with finer ones below for small fast models (dashboards read any bucket layout).
TTFT_BUCKETS = _buckets(
    "0.001 0.005 0.01 0.02 0.04 0.06 0.08 0.1 0.25 0.5 0.75 1 2.5 5 7.5 10 20 40 80 160 640 2560"
)
TOKEN_TIME_BUCKETS = _buckets(
    "0.001 0.0025 0.005 0.0075 0.01 0.025 0.05 0.075 0.1 0.15 0.2 0.3 0.4 0.5 0.75 1 2.5 5 7.5 10 20 40 80"
)
REQUEST_TIME_BUCKETS = _buckets(
    "0.005 0.01 0.025 0.05 0.1 0.3 0.5 0.8 1 1.5 2 2.5 5 10 15 20 30 40 50 60 120 240 480 960 1920 7680"
)
N_BUCKETS = (1, 2, 5, 10, 20)

# StatsMsg field -> (counter name without `_total`, help). Each is a total the engine counts since it started.
ENGINE_TOTALS: dict[str, tuple[str, str]] = {
    "prefix_cache_queries": ("prefix_cache_queries", "Prefix cache queries, in queried tokens."),
    "prefix_cache_hits": ("prefix_cache_hits", "Prefix cache hits, in cached tokens."),
    "mm_cache_queries": ("mm_cache_queries", "Multi-modal cache queries (the engine's encoder), in items."),
    "mm_cache_hits": ("mm_cache_hits", "Multi-modal cache hits (the engine's encoder), in items."),
    "num_preemptions": ("num_preemptions", "Preemptions: running requests retracted to free KV."),
    "encode_seconds_total": ("encode_seconds", "Seconds the engine spent fetching and encoding media."),
    "overlap_stages": (
        "encode_prefill_overlap_stages",
        "Prefill stages run while their request's media were encoded (encode-prefill overlap).",
    ),
    "overlap_tokens": (
        "encode_prefill_overlap_tokens",
        "Prompt tokens prefilled while their request's media were encoded.",
    ),
    "parts_received": ("embedding_parts_received", "Embedding parts received from encoders."),
    "parts_dropped": (
        "embedding_parts_dropped",
        "Parts dropped: stale, unknown, invalid, malformed, forged or replayed.",
    ),
    "parts_forged": ("embedding_parts_forged", "Parts dropped for a missing or wrong HMAC."),
    "parts_replayed": ("embedding_parts_replayed", "Signed parts dropped as replays or stale."),
    # Prefill-decode disaggregation (mmserve.disagg): handoffs sent (prefill) or adopted (decode).
    "kv_handoffs": ("kv_handoffs", "Requests handed to a decode server (prefill) or adopted (decode)."),
    "kv_handoff_failures": ("kv_handoff_failures", "Handoffs that failed, timed out or were refused."),
    "kv_bytes": ("kv_transfer_bytes", "KV bytes sent (prefill) or received (decode)."),
}
STORE_GAUGES = frozenset({"connected"})  # every other embedding store statistic is a running total


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value`: vLLM's buckets for token counts."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


class EngineTotal:
    """A Counter fed with a total the engine has counted since it started (StatsMsg carries absolute numbers).

    The counter advances by the total's increase, rather than a custom collector exporting the engine's number
    as is: it stays an ordinary Counter (`_total`, `_created`, readable from the registry by the stats log),
    and it never decreases: a total that goes backwards (a new engine counting from 0 again) adds its new count
    instead of reading as a counter reset.
    """

    def __init__(self, counter: Counter) -> None:
        self.counter = counter
        self.last = 0.0

    def advance(self, total: float) -> None:
        delta = total - self.last if total >= self.last else total
        self.last = total
        if delta > 0:
            self.counter.inc(delta)


class _IterationTokens(Collector):
    """vLLM's `iteration_tokens_total`: a histogram of the tokens each engine step computed. The engine
    process counts it (StatsMsg carries per-bucket counts and the sum), so it is exposed as collected."""

    def __init__(self, values: tuple[str, str]) -> None:
        self._values = values
        self.counts: list[int] = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
        self.sum = 0

    def collect(self):
        family = HistogramMetricFamily(
            PREFIX + "iteration_tokens_total", "Number of tokens per engine step.", labels=LABELS
        )
        cumulative, buckets = 0, []
        for bound, count in zip((*map(str, ITERATION_TOKEN_BUCKETS), "+Inf"), self.counts, strict=True):
            cumulative += count
            buckets.append((bound, cumulative))
        family.add_metric(list(self._values), buckets, self.sum)
        yield family


class ServerMetrics:
    def __init__(self, model_name: str, max_model_len: int = 32768) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self._values = (model_name, ENGINE_INDEX)
        self.iteration_tokens = _IterationTokens(self._values)
        self.registry.register(self.iteration_tokens)
        tokens = build_1_2_5_buckets(max_model_len)
        hist, counter, gauge = self._hist, self._counter, self._gauge
        # -- requests (vLLM) ---------------------------------------------------------------------------------
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed (media expanded).")
        self.prompt_tokens_cached = counter(
            "prompt_tokens_cached", "Prompt tokens found in the prefix cache."
        )
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        self._success = Counter(
            PREFIX + "request_success",
            "Count of finished requests, by finish reason.",
            [*LABELS, "finished_reason"],
            registry=self.registry,
        )
        for reason in ("stop", "length", "error"):  # present from the start, as in vLLM
            self._success.labels(*self._values, reason)
        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = hist(
            "inter_token_latency_seconds", "Time between consecutive outputs.", TOKEN_TIME_BUCKETS
        )
        self._itl_old_name = hist(
            "time_per_output_token_seconds",
            "Time between consecutive outputs: vLLM's older name of inter_token_latency_seconds.",
            TOKEN_TIME_BUCKETS,
        )
        self.request_tpot = hist(
            "request_time_per_output_token_seconds",
            "Per request: (e2e latency - time to first token) / (generation tokens - 1).",
            TOKEN_TIME_BUCKETS,
        )
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to the last token.", REQUEST_TIME_BUCKETS)
        self.queue_time = hist(
            "request_queue_time_seconds", "Time waiting for the scheduler.", REQUEST_TIME_BUCKETS
        )
        self.prefill_time = hist(
            "request_prefill_time_seconds", "Scheduled to first token.", REQUEST_TIME_BUCKETS
        )
        self.decode_time = hist("request_decode_time_seconds", "First to last token.", REQUEST_TIME_BUCKETS)
        self.inference_time = hist(
            "request_inference_time_seconds",
            "Scheduled to last token (prefill + decode).",
            REQUEST_TIME_BUCKETS,
        )
        self.prompt_tokens_hist = hist("request_prompt_tokens", "Prompt tokens per request.", tokens)
        self.generation_tokens_hist = hist("request_generation_tokens", "Output tokens per request.", tokens)
        self.max_generation_tokens_hist = hist(
            "request_max_num_generation_tokens", "Output tokens of the request's longest choice.", tokens
        )
        self.params_n = hist("request_params_n", "The n request parameter.", N_BUCKETS)
        self.params_max_tokens = hist(
            "request_params_max_tokens", "The max_tokens request parameter.", tokens
        )
        # -- requests (mmserve) ------------------------------------------------------------------------------
        self.encode_time = hist(
            "request_encode_time_seconds", "Media fetch + encode time per request.", REQUEST_TIME_BUCKETS
        )
        self._errors = Counter(
            PREFIX + "request_errors",
            "Requests answered with an error, by HTTP status.",
            [*LABELS, "status"],
            registry=self.registry,
        )
        # -- engine ------------------------------------------------------------------------------------------
        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests queued or encoding.")
        self.kv_usage = gauge(
            "kv_cache_usage_perc",
            "KV-cache usage by requests, 1 means 100 percent (cached prefixes not counted).",
        )
        self.prefix_cache_tokens = gauge("prefix_cache_tokens", "Tokens held by the prefix cache.")
        self.state_usage = gauge(
            "state_cache_usage_perc",
            "Linear-attention state pool usage (running requests and checkpoints), 1 means 100 percent.",
        )
        self.state_checkpoints = gauge("state_checkpoints", "Linear-attention state checkpoints in the prefix cache.")
        self.transfer_held = gauge(
            "transfer_held_bytes", "Shared-memory / Mooncake pool bytes live requests view."
        )
        self.kv_pending = gauge("kv_handoffs_pending", "Handoffs in progress (their KV slots held).")
        self.totals = {field: EngineTotal(counter(name, doc)) for field, (name, doc) in ENGINE_TOTALS.items()}
        # The engine's local encoder's global embedding store (--embedding-store); absent: all 0.
        self.store_totals = {
            name: EngineTotal(counter(f"embedding_store_{name}", doc))
            for name, doc in STORE_METRIC_DOCS.items()
            if name not in STORE_GAUGES
        }
        self.store_gauges = {
            name: gauge(f"embedding_store_{name}", STORE_METRIC_DOCS[name]) for name in STORE_GAUGES
        }

    # -- child processes (mmserve.server.encoder_workers) -----------------------------------------------------
    def watch_children(self, names: list[str]) -> None:
        """`child_process_restarts_total{process=NAME}`, each at 0 from the start (a rate needs the 0)."""
        self._child_restarts = Counter(
            PREFIX + "child_process_restarts",
            "Child processes of this server restarted after they died, by process.",
            [*LABELS, "process"],
            registry=self.registry,
        )
        for name in names:
            self._child_restarts.labels(*self._values, name)

    def record_child_restart(self, name: str) -> None:
        self._child_restarts.labels(*self._values, name).inc()

    def _hist(self, name: str, doc: str, buckets) -> Histogram:
        return Histogram(PREFIX + name, doc, LABELS, registry=self.registry, buckets=buckets).labels(
            *self._values
        )

    def _counter(self, name: str, doc: str) -> Counter:
        return Counter(PREFIX + name, doc, LABELS, registry=self.registry).labels(*self._values)

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(PREFIX + name, doc, LABELS, registry=self.registry).labels(*self._values)

    # -- request events (mmserve.server.serving.Generation) -----------------------------------------------
    def record_first_token(self, timings: Timings, prompt_tokens: int, cached_tokens: int) -> None:
        """The first output of a request: its prompt counts as processed (as in vLLM, not at the end)."""
        self.ttft.observe(timings.ttft_s)
        self.queue_time.observe(timings.queue_s)
        self.prefill_time.observe(timings.prefill_s)
        self.prompt_tokens.inc(prompt_tokens)
        self.prompt_tokens_cached.inc(cached_tokens)

    def record_output_gap(self, seconds: float) -> None:
        """Time between two consecutive outputs of one request."""
        self.itl.observe(seconds)
        self._itl_old_name.observe(seconds)

    def record_handoff(self, timings: Timings, prompt_tokens: int, cached_tokens: int) -> None:
        """Prefill server: the request's prompt is prefilled and its KV reached the decode server."""
        self.queue_time.observe(timings.queue_s)
        self.prefill_time.observe(timings.prefill_s)
        self.prompt_tokens.inc(prompt_tokens)
        self.prompt_tokens_cached.inc(cached_tokens)
        self.count_finished("handoff")

    def record_finished(
        self,
        reason: str,
        timings: Timings,
        prompt_tokens: int,
        generation_tokens: int,
        longest_choice_tokens: int,
        params: SamplingParams,
    ) -> None:
        """A request that finished (stop, length, ...): vLLM's per-request histograms and request_success.
        `timings` holds e2e_s, and ttft_s / prefill_s / decode_s once a first token came; `generation_tokens`
        counts every choice's tokens (n > 1), `longest_choice_tokens` the longest choice's."""
        self.count_finished(reason)
        self.e2e.observe(timings.e2e_s)
        if timings.ttft_s:
            self.decode_time.observe(timings.decode_s)
            self.inference_time.observe(timings.prefill_s + timings.decode_s)
            if longest_choice_tokens > 1:  # the longest choice decoded for the whole decode time
                self.request_tpot.observe(timings.decode_s / (longest_choice_tokens - 1))
        self.prompt_tokens_hist.observe(prompt_tokens)
        self.generation_tokens_hist.observe(generation_tokens)
        self.max_generation_tokens_hist.observe(longest_choice_tokens)
        self.params_n.observe(params.n)
        if params.max_tokens is not None:
            self.params_max_tokens.observe(params.max_tokens)

    def count_finished(self, reason: str) -> None:
        self._success.labels(*self._values, reason).inc()

    def record_error(self, status: int) -> None:
        self._errors.labels(*self._values, str(status)).inc()

    # -- engine ---------------------------------------------------------------------------------------------
    def update_engine(self, stats: StatsMsg | None) -> None:
        """Copy the engine's latest StatsMsg (None: none yet). Call from one thread (the event loop)."""
        if stats is None:
            return
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.prefix_cache_tokens.set(stats.prefix_cache_tokens)
        self.state_usage.set(stats.state_cache_usage)
        self.state_checkpoints.set(stats.state_checkpoints)
        if stats.iteration_token_counts:
            self.iteration_tokens.counts = list(stats.iteration_token_counts)
            self.iteration_tokens.sum = stats.iteration_tokens_sum
        self.transfer_held.set(stats.transfer_held_bytes)
        self.kv_pending.set(stats.kv_pending)
        for field, total in self.totals.items():
            total.advance(getattr(stats, field))
        for name, value in stats.embedding_store.items():
            if name in self.store_totals:
                self.store_totals[name].advance(value)
            elif name in self.store_gauges:
                self.store_gauges[name].set(value)

    def set_cache_config(self, **config: str | int | bool) -> None:
        """vLLM's `cache_config_info`: a gauge of 1 whose labels are the KV cache's configuration."""
        labels = {k: str(v) for k, v in config.items()} | dict(zip(LABELS, self._values, strict=True))
        gauge = Gauge(PREFIX + "cache_config_info", "Information of the KV cache configuration.",
                      list(labels), registry=self.registry)
        gauge.labels(**labels).set(1)

    def values(self, *names: str) -> dict[str, float]:
        """Current values of samples of this registry by name without the prefix (e.g. "prompt_tokens_total"),
        each summed over its label values; 0 for a name with no sample."""
        wanted = {PREFIX + n: n for n in names}
        out = dict.fromkeys(names, 0.0)
        for family in self.registry.collect():
            for sample in family.samples:
                if sample.name in wanted:
                    out[wanted[sample.name]] += sample.value
        return out

    def render(self) -> bytes:
        return generate_latest(self.registry)
