"""A small, bounded HTTP load generator for overload, fault and soak tests.

Load: `run_closed_loop` keeps `concurrency` requests in flight (a fixed count, or until a duration ends);
`run_fixed_rate` starts requests at a fixed rate for a duration. Every request has its own timeout and ends
in exactly one `Outcome` (HTTP status, latency, error code, parsed body); a request that has not returned
when the run's deadline passes is reported as `status=0, error_code="hung"`, so a caller can always assert
that everything returned. Every loop is bounded in count and in time.

Process and server probes (memory, file descriptors, metrics, integrity) are in `mmserve.testing.probes`.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

MAX_REQUESTS = 100_000  # hard cap on any run, whatever its duration
HUNG_GRACE_S = 30.0  # how long past its own timeout a request may take before the run reports it hung


@dataclass(frozen=True)
class Call:
    """One HTTP request of a run: a POST of `body` (JSON, or raw bytes) to `path`."""

    path: str
    body: dict | bytes
    stream: bool = False
    tag: str = ""  # the caller's label ("valid", "bad_base64", ...), copied into the outcome
    close_after_chunks: int | None = None  # streaming: disconnect after this many data chunks


@dataclass
class Outcome:
    index: int
    tag: str
    status: int  # HTTP status; 0 when no response came (timeout, connection error, hung)
    latency_s: float
    error_code: str | None = None  # error.code of an error body (in-band too), or the exception's name
    body: dict | None = None  # the JSON body; for a stream: text, finish_reason, usage, chunks, done
    retry_after: str | None = None
    started_s: float = 0.0  # monotonic start time

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error_code is None


def send(http: httpx.Client, base_url: str, call: Call, index: int, timeout_s: float) -> Outcome:
    """One request, bounded by `timeout_s` in total (streams check the deadline between chunks)."""
    start = time.monotonic()
    outcome = Outcome(index, call.tag, 0, 0.0, started_s=start)
    kwargs = {"json": call.body} if isinstance(call.body, dict) else {
        "content": call.body, "headers": {"content-type": "application/json"}}  # fmt: skip
    try:
        with http.stream("POST", base_url + call.path, timeout=timeout_s, **kwargs) as r:
            outcome.status = r.status_code
            outcome.retry_after = r.headers.get("retry-after")
            if call.stream and r.status_code == 200:
                outcome.body = _read_stream(r, outcome, call.close_after_chunks, start + timeout_s)
            else:
                r.read()
                try:
                    outcome.body = r.json()
                except ValueError:
                    outcome.body = {"raw": r.text[:500]}
                if r.status_code != 200:
                    outcome.error_code = _error_code(outcome.body)
    except httpx.HTTPError as e:
        outcome.status = 0
        outcome.error_code = type(e).__name__
    except Exception as e:  # a reply the client cannot read (e.g. a malformed event): still one outcome
        outcome.error_code = f"client_{type(e).__name__}"
    outcome.latency_s = time.monotonic() - start
    return outcome


def _read_stream(r: httpx.Response, outcome: Outcome, close_after: int | None, deadline: float) -> dict:
    """Server-sent events of a chat / completion stream; closes early after `close_after` data chunks."""
    summary: dict = {"text": "", "finish_reason": None, "usage": None, "chunks": 0, "done": False}
    for line in r.iter_lines():
        if time.monotonic() > deadline:
            outcome.error_code = "stream_timeout"
            break
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            summary["done"] = True
            break
        event = json.loads(data)
        summary["chunks"] += 1
        if "error" in event:  # an in-band error (e.g. the engine died mid-stream)
            outcome.error_code = _error_code(event) or "stream_error"
            continue
        if event.get("usage"):
            summary["usage"] = event["usage"]
        for choice in event.get("choices", []):
            delta = choice.get("delta", {})
            summary["text"] += delta.get("content") or choice.get("text") or ""
            summary["finish_reason"] = choice.get("finish_reason") or summary["finish_reason"]
        if close_after is not None and summary["chunks"] >= close_after:
            outcome.error_code = "client_closed"
            break  # leaving the `with` block closes the connection mid-stream
    return summary


def _error_code(body: dict | None) -> str | None:
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        return str(err.get("code") or err.get("type") or "error")
    return "error"


# -- runs ------------------------------------------------------------------------------------------------
def run_closed_loop(base_url: str, make_call: Callable[[int], Call], *, concurrency: int,
                    num_requests: int | None = None, duration_s: float | None = None, timeout_s: float = 60.0,
                    start_together: bool = False) -> list[Outcome]:  # fmt: skip
    """Keep `concurrency` requests in flight until `num_requests` were sent or `duration_s` has passed.

    `make_call(i)` builds request i (called from worker threads). With `start_together`, the first
    `concurrency` requests are released at once (a burst). Returns the outcomes in request order."""
    if num_requests is None and duration_s is None:
        raise ValueError("give num_requests, duration_s or both")
    limit = min(num_requests if num_requests is not None else MAX_REQUESTS, MAX_REQUESTS)
    end = time.monotonic() + duration_s if duration_s is not None else float("inf")
    counter, lock = iter(range(limit)), threading.Lock()
    outcomes: dict[int, Outcome] = {}
    barrier = threading.Barrier(concurrency) if start_together else None

    def worker(http: httpx.Client) -> None:
        if barrier is not None:
            barrier.wait(timeout=30)
        while time.monotonic() < end:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            call = make_call(i)
            outcomes[i] = Outcome(i, call.tag, 0, 0.0, "hung", started_s=time.monotonic())  # until it returns
            outcomes[i] = send(http, base_url, call, i, timeout_s)

    # Worst case per worker: every one of its requests takes its whole timeout.
    budget_s = (duration_s if duration_s is not None else limit / concurrency * timeout_s) + timeout_s
    _run_workers(worker, concurrency, budget_s + HUNG_GRACE_S)
    return _finalize(outcomes)


def run_fixed_rate(base_url: str, make_call: Callable[[int], Call], *, rate_per_s: float, duration_s: float,
                   timeout_s: float = 60.0, max_in_flight: int = 64) -> list[Outcome]:  # fmt: skip
    """Submit request i at `i / rate_per_s` seconds for `duration_s` (open loop). At most `max_in_flight` run
    at once; the rest wait for a thread, and their latency counts from when they are sent. Returns the
    outcomes in request order."""
    num = min(int(duration_s * rate_per_s), MAX_REQUESTS)
    outcomes: dict[int, Outcome] = {}
    start = time.monotonic()
    with httpx.Client(limits=_limits(max_in_flight)) as http:
        pool = concurrent.futures.ThreadPoolExecutor(max_in_flight, thread_name_prefix="load")
        futures = {}
        for i in range(num):
            delay = start + i / rate_per_s - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            call = make_call(i)
            outcomes[i] = Outcome(i, call.tag, 0, 0.0, "hung", started_s=time.monotonic())
            futures[pool.submit(send, http, base_url, call, i, timeout_s)] = i
        done, _ = concurrent.futures.wait(futures, timeout=timeout_s + HUNG_GRACE_S)
        for future in done:
            outcomes[futures[future]] = future.result()
        pool.shutdown(wait=False, cancel_futures=True)
    return _finalize(outcomes)


def _limits(n: int) -> httpx.Limits:
    return httpx.Limits(max_connections=n, max_keepalive_connections=n)


def _run_workers(worker: Callable[[httpx.Client], None], n: int, timeout_s: float) -> None:
    with httpx.Client(limits=_limits(n)) as http:
        threads = [
            threading.Thread(target=worker, args=(http,), daemon=True, name=f"load-{i}") for i in range(n)
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout_s
        for t in threads:  # a thread still alive at the deadline leaves its request marked "hung"
            t.join(max(0.0, deadline - time.monotonic()))


def _finalize(outcomes: dict[int, Outcome]) -> list[Outcome]:
    result = [outcomes[i] for i in sorted(outcomes)]
    for o in result:
        if o.error_code == "hung":
            o.latency_s = time.monotonic() - o.started_s
    return result


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q / 100 * len(ordered))))
    return ordered[rank - 1]


def summarize(outcomes: list[Outcome]) -> dict:
    """Counts by status and latency percentiles (of the 200s) of a run."""
    by_status: dict[str, int] = {}
    for o in outcomes:
        by_status[str(o.status)] = by_status.get(str(o.status), 0) + 1
    latencies = [o.latency_s for o in outcomes if o.status == 200]
    return {"requests": len(outcomes), "by_status": by_status,
            "p50_s": round(percentile(latencies, 50), 4), "p99_s": round(percentile(latencies, 99), 4),
            "max_s": round(max((o.latency_s for o in outcomes), default=0.0), 4)}  # fmt: skip
