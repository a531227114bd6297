"""Async load generator for `mmserve bench`: streamed chat completions against any OpenAI-compatible server.

Two arrival modes: closed-loop (`concurrency` requests in flight, the next one sent as soon as one ends)
and open-loop (Poisson arrivals at `request_rate` per second, optionally capped at `concurrency` in
flight). Every request is timed on the client with `time.perf_counter()`; failures never raise, they
become traces with a status and an error message.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
from tqdm import tqdm

from mmserve.bench.workload import BenchRequest

__all__ = ["LoadConfig", "RequestTrace", "run", "run_load", "send_one"]

_ERROR_SNIPPET = 500  # characters of an error body kept in a trace


@dataclass
class RequestTrace:
    """What the client saw of one request; all times are `time.perf_counter()` seconds."""

    index: int
    start: float  # when sent
    first_token: float | None  # first non-empty content chunk
    token_times: list[float] = field(default_factory=list)  # arrival of every content chunk
    end: float = 0.0
    status: int = 0  # HTTP status (200 ok), 0 for a connection error or timeout
    output_tokens: int = 0  # from the usage chunk if present, else the number of content chunks
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        """HTTP 200 and a complete stream (no in-band error, `[DONE]` seen)."""
        return self.status == 200 and self.error is None


@dataclass(frozen=True)
class LoadConfig:
    """How to send a workload: target, arrival process, limits."""

    url: str  # base URL, e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted)
    model: str | None = None  # None: the first model of GET /v1/models, or no "model" field if that fails
    concurrency: int | None = 8  # max in flight; None with no request_rate sends everything at once
    request_rate: float | None = None  # Poisson arrivals per second; concurrency, if set, caps in-flight
    timeout_s: float = 600.0  # whole-request limit, connect to last byte
    api_key: str | None = None
    warmup: int = 0  # requests sent (and discarded) before the measured run
    progress: bool = True
    seed: int = 0  # for the Poisson arrival process

    def __post_init__(self) -> None:
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1 or None, got {self.concurrency}")
        if self.request_rate is not None and not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 or None, got {self.request_rate}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")


def server_root(url: str) -> str:
    """The server's root URL (where /metrics and /health are) from a base URL given with or without /v1."""
    return url.rstrip("/").removesuffix("/v1")


def _api_base(url: str) -> str:
    return server_root(url) + "/v1"


def _headers(cfg: LoadConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}


def _payload(cfg: LoadConfig, req: BenchRequest) -> dict[str, Any]:
    body: dict[str, Any] = {
        "messages": req.messages,
        "max_tokens": req.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.model is not None:
        body["model"] = cfg.model
    return body


async def send_one(http: httpx.AsyncClient, cfg: LoadConfig, req: BenchRequest) -> RequestTrace:
    """Sends one streamed chat completion and records its timings; never raises.

    A non-200 answer gives a trace with that status and the error message; a connection error or a
    request over `cfg.timeout_s` gives status 0; a 200 stream that carries an in-band error or ends
    without `[DONE]` keeps status 200 but has `error` set.
    """
    trace = RequestTrace(index=req.index, start=time.perf_counter(), first_token=None)
    chunks = 0
    try:
        async with asyncio.timeout(cfg.timeout_s):
            url = _api_base(cfg.url) + "/chat/completions"
            async with http.stream("POST", url, json=_payload(cfg, req), headers=_headers(cfg)) as resp:
                trace.status = resp.status_code
                if resp.status_code != 200:
                    trace.error = _error_message((await resp.aread()).decode("utf-8", "replace"))
                else:
                    chunks = await _read_stream(resp, trace)
    except TimeoutError:
        trace.status, trace.error = 0, f"timed out after {cfg.timeout_s:g} s"
    except Exception as e:  # connection errors, bad URLs, broken streams: a benchmark records, never aborts
        trace.status, trace.error = 0, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    trace.end = time.perf_counter()
    if trace.output_tokens == 0:
        trace.output_tokens = chunks
    return trace


async def _read_stream(resp: httpx.Response, trace: RequestTrace) -> int:
    """Reads SSE events into `trace`; returns the number of non-empty content chunks."""
    chunks = 0
    done = False
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue  # blank separators, comments, other SSE fields
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            done = True
            break
        now = time.perf_counter()
        try:
            event = json.loads(data)
        except json.JSONDecodeError:
            trace.error = f"unparsable stream event: {data[:_ERROR_SNIPPET]}"
            continue
        if not isinstance(event, dict):
            continue
        if "error" in event:
            trace.error = _error_message(json.dumps(event))
            continue
        if _content(event):
            chunks += 1
            trace.token_times.append(now)
            if trace.first_token is None:
                trace.first_token = now
        _read_usage(event, trace)
    if not done and trace.error is None:
        trace.error = "stream ended without [DONE]"
    return chunks


def _content(event: dict) -> str:
    choices = event.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return ""
    delta = choices[0].get("delta") or {}
    return (delta.get("content") or "") if isinstance(delta, dict) else ""


def _read_usage(event: dict, trace: RequestTrace) -> None:
    usage = event.get("usage")
    if not isinstance(usage, dict):
        return
    trace.output_tokens = int(usage.get("completion_tokens") or 0)
    trace.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict):
        trace.cached_tokens = int(details.get("cached_tokens") or 0)


def _error_message(body: str) -> str:
    """The `error.message` of an OpenAI error body if there is one, else the start of the body."""
    try:
        error = json.loads(body).get("error")
        message = error.get("message") if isinstance(error, dict) else error
        if message:
            return str(message)[:_ERROR_SNIPPET]
    except (json.JSONDecodeError, AttributeError):
        pass
    return body[:_ERROR_SNIPPET] or "(empty body)"


class _Progress:
    """A tqdm bar of requests done (and failed) on stderr; silent when stderr is not a terminal (logs, CI,
    pipes get no carriage-return redraws) or when `enabled` is False."""

    def __init__(self, total: int, label: str, enabled: bool) -> None:
        # file looked up now: callers may redirect stderr
        self.bar = tqdm(
            total=total, desc=label, unit="req", file=sys.stderr, disable=None if enabled else True
        )
        self.errors = 0

    def update(self, trace: RequestTrace) -> None:
        if not trace.ok:
            self.errors += 1
            self.bar.set_postfix(failed=self.errors, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def _arrival_offsets(cfg: LoadConfig, n: int) -> list[float]:
    """Send times relative to the start of the run: all zero, or a Poisson process from `cfg.seed`."""
    if cfg.request_rate is None or n == 0:
        return [0.0] * n
    rng = random.Random(cfg.seed)
    gaps = [0.0] + [rng.expovariate(cfg.request_rate) for _ in range(n - 1)]
    return list(itertools.accumulate(gaps))


async def _send_all(
    send: Callable[[BenchRequest], Awaitable[RequestTrace]],
    cfg: LoadConfig,
    requests: list[BenchRequest],
    progress: _Progress,
) -> list[RequestTrace]:
    limit = asyncio.Semaphore(cfg.concurrency) if cfg.concurrency is not None else None

    async def one(req: BenchRequest) -> RequestTrace:
        if limit is None:
            trace = await send(req)
        else:
            async with limit:
                trace = await send(req)
        progress.update(trace)
        return trace

    t0 = time.perf_counter()
    tasks = []
    for req, offset in zip(requests, _arrival_offsets(cfg, len(requests)), strict=True):
        delay = t0 + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(req)))
    traces = await asyncio.gather(*tasks)
    progress.close()
    return list(traces)


async def _discover_model(http: httpx.AsyncClient, cfg: LoadConfig) -> str | None:
    """The first model id of GET /v1/models, or None if the server does not say."""
    try:
        url = _api_base(cfg.url) + "/models"
        resp = await http.get(url, headers=_headers(cfg), timeout=min(cfg.timeout_s, 30.0))
        data = resp.json().get("data") if resp.status_code == 200 else None
        return str(data[0]["id"]) if data else None
    except Exception:  # no usable answer: send requests without a "model" field
        return None


async def run_load(cfg: LoadConfig, requests: list[BenchRequest]) -> tuple[list[RequestTrace], float]:
    """Sends the workload; returns (traces in request order, wall seconds of the measured run).

    With `cfg.model` None the model is asked of GET /v1/models first. `cfg.warmup` requests (cycling
    through `requests`, same concurrency, no arrival delays) go next and are discarded; they repeat the
    first requests' media, so a caching server sees those items again. The measured run ends when every
    request has ended, successfully or not.
    """
    async with _client(cfg) as http:
        if cfg.model is None and requests:
            model = await _discover_model(http, cfg)
            cfg = replace(cfg, model=model) if model is not None else cfg

        async def send(req: BenchRequest) -> RequestTrace:
            return await send_one(http, cfg, req)

        if cfg.warmup and requests:
            warm = [requests[i % len(requests)] for i in range(cfg.warmup)]
            await _send_all(
                send, replace(cfg, request_rate=None), warm, _Progress(len(warm), "warmup", cfg.progress)
            )
        t0 = time.perf_counter()
        traces = await _send_all(send, cfg, requests, _Progress(len(requests), "bench", cfg.progress))
        wall = time.perf_counter() - t0
    return traces, wall


def _client(cfg: LoadConfig) -> httpx.AsyncClient:
    # No connection cap of our own (the semaphore is the limit), and no proxies from the environment:
    # a benchmark should measure the server, not an intermediary.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=cfg.concurrency or 64)
    return httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout_s), limits=limits, trust_env=False)


def run(cfg: LoadConfig, requests: list[BenchRequest]) -> tuple[list[RequestTrace], float]:
    """Synchronous wrapper of `run_load`."""
    return asyncio.run(run_load(cfg, requests))
