"""What the engine reports: each step's outputs per request, its counters, and a step that failed."""

from __future__ import annotations

from dataclasses import dataclass

from mmserve.engine.request import Request
from mmserve.logprobs import TokenLogprobs


class BatchFailed(RuntimeError):
    """A step's forward or sampling raised; the batch's requests were ended with finish reason "error"."""

    def __init__(self, request_ids: list[str], cause: Exception) -> None:
        super().__init__(f"step failed for {len(request_ids)} request(s): {type(cause).__name__}: {cause}")
        self.request_ids = request_ids


# vLLM's buckets of `iteration_tokens_total` (tokens computed per engine step).
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class TokenHistogram:
    """Tokens per engine step, counted in the engine process: per-bucket counts (not cumulative; the last
    one is +Inf), their sum; the API server exposes them as a Prometheus histogram."""

    def __init__(self) -> None:
        self.counts = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
        self.sum = 0

    def observe(self, tokens: int) -> None:
        self.counts[next((i for i, b in enumerate(ITERATION_TOKEN_BUCKETS) if tokens <= b), -1)] += 1
        self.sum += tokens


@dataclass(frozen=True)
class EngineStats:
    """The engine's counters and pool use, as its owner reports them (the engine process's StatsMsg)."""

    num_running: int
    num_waiting: int
    kv_slots: int
    kv_slots_used: int
    # KV slots requests hold (running, handed off, reserved for an incoming handoff), cached-prefix slots they
    # share included: what vLLM and SGLang report as KV usage. Slots only the prefix cache holds can be evicted at
    # will and read as free, so an idle engine reads 0; those are exactly the evictable ones, since a running or
    # handed-off request locks the radix path it uses (mmserve.engine.scheduler).
    kv_slots_held: int
    prefix_cache_tokens: int
    prefix_queries_tokens: int
    prefix_hit_tokens: int
    retractions: int
    overlap_stages: int
    overlap_tokens: int
    state_slots: int = 0  # hybrid models: the state pool
    state_slots_used: int = 0
    state_checkpoints: int = 0  # held by the prefix cache
    window_rows: int = 0  # models with sliding-window layers: the window pool
    window_rows_used: int = 0
    iteration_token_counts: tuple[int, ...] = ()  # TokenHistogram.counts
    iteration_tokens_sum: int = 0


@dataclass
class StepOutput:
    request_id: str
    token_id: int | None  # None when the request ended without a new token (abort)
    finish_reason: str | None  # "stop" / "length" / "abort" once finished
    request: Request  # its `group_id` / `index` name the API request and choice (n > 1)
    handoff: bool = False  # prefill server: the request is detached, its KV to be sent (mmserve.disagg)
    logprobs: TokenLogprobs | None = None  # the token's, when the params ask for logprobs
    # prompt_logprobs: one entry per prompt token (None for the first and for media rows), with the first token
    prompt_logprobs: list[TokenLogprobs | None] | None = None
