"""Server-side breakdown for a bench run: scrape `/metrics` (and the encoders') before and after, diff.

Histograms give mean seconds per request for each stage (queue, encode, prefill, decode, and, for EPD,
the encoders' transfer time); gauges and counters give prefix-cache and embedding-cache hit rates over the
run. Everything is computed from deltas, so earlier traffic (warm-up, other runs) does not count.
"""

from __future__ import annotations

import sys

import httpx
from prometheus_client.parser import text_string_to_metric_families

from mmserve.transport import cluster_auth

# (label in the report, histogram name without the `mmserve:` prefix)
STAGES = (
    ("queue", "request_queue_time_seconds"),
    ("encode", "request_encode_time_seconds"),
    ("prefill", "request_prefill_time_seconds"),
    ("decode", "request_decode_time_seconds"),
)


def scrape_text(text: str) -> dict[str, float]:
    """Prometheus text -> {sample name: value}, labels summed away (one model per server)."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + float(sample.value)
    return values


def listed_encoders(http: httpx.Client, url: str, uses_encoders: bool = True) -> list[dict]:
    """The server's encoders from `/encoders`, part of its control plane: that needs the cluster token (taken
    from $MMSERVE_CLUSTER_SECRET, which a server launched by the bench inherits too) or a server started with
    --enable-anonymous-registration. Refused: none, and a note on stderr says why when the server
    `uses_encoders` (a monolithic one has nothing there to miss)."""
    secret = cluster_auth.resolve_secret(None)
    try:
        r = http.get(url + "/encoders", headers=secret.headers if secret else None)
        if r.status_code in (401, 403) and uses_encoders:
            hint = f"set {cluster_auth.ENV_VAR} or launch with --enable-anonymous-registration"
            print(f"bench: encoders not scraped: /encoders said {r.status_code} ({hint})", file=sys.stderr)
        return r.json().get("encoders", []) if r.status_code == 200 else []
    except (httpx.HTTPError, ValueError):
        return []


class MetricsUnavailable(Exception):
    """The server has no mmserve metrics to read (another OpenAI server, a router, a proxy): the bench then
    reports client-side numbers only."""


def scrape(url: str, timeout_s: float = 10.0) -> dict[str, dict[str, float]]:
    """{"server": metrics, "encoders": summed metrics of every registered encoder} for a server's root URL.
    Raises MetricsUnavailable (saying why) when GET /metrics fails or holds no `mmserve:` metric."""
    with httpx.Client(timeout=timeout_s, trust_env=False) as http:
        try:
            resp = http.get(url + "/metrics")
        except httpx.HTTPError as e:
            raise MetricsUnavailable(f"GET {url}/metrics failed: {type(e).__name__}: {e}") from None
        if resp.status_code != 200:
            raise MetricsUnavailable(f"GET {url}/metrics answered {resp.status_code}")
        try:
            server = scrape_text(resp.text)
        except ValueError as e:  # not Prometheus text
            raise MetricsUnavailable(f"GET {url}/metrics is not Prometheus text ({e})") from None
        if not any(name.startswith("mmserve:") for name in server):
            raise MetricsUnavailable(f"GET {url}/metrics has no mmserve metrics")
        encoders: dict[str, float] = {}
        uses_encoders = server.get("mmserve:embedding_parts_received_total", 0.0) > 0
        for enc in listed_encoders(http, url, uses_encoders):
            try:
                for name, value in scrape_text(http.get(enc["url"] + "/metrics").text).items():
                    encoders[name] = encoders.get(name, 0.0) + value
            except httpx.HTTPError:
                continue
    return {"server": server, "encoders": encoders}


def _delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def breakdown(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
) -> dict[str, float | None]:
    """Mean stage seconds per request and cache hit rates over the run (None where nothing was measured)."""
    s0, s1 = before["server"], after["server"]
    e0, e1 = before["encoders"], after["encoders"]
    out: dict[str, float | None] = {}
    for label, hist in STAGES:
        name = f"mmserve:{hist}"
        out[f"{label}_s_mean"] = _ratio(_delta(s0, s1, name + "_sum"), _delta(s0, s1, name + "_count"))
    transfer = "mmserve:encoder_transfer_seconds"
    out["transfer_s_mean"] = _ratio(_delta(e0, e1, transfer + "_sum"), _delta(e0, e1, transfer + "_count"))
    out["prefix_cache_hit_rate"] = _ratio(
        _delta(s0, s1, "mmserve:prefix_cache_hits_total"),
        _delta(s0, s1, "mmserve:prefix_cache_queries_total"),
    )
    # Embedding cache: the encoders' when there are any (EPD), else the engine's in-process one.
    if e1:
        out["mm_cache_hit_rate"] = _ratio(
            _delta(e0, e1, "mmserve:encoder_cache_hits"), _delta(e0, e1, "mmserve:encoder_cache_queries")
        )
    else:
        out["mm_cache_hit_rate"] = _ratio(
            _delta(s0, s1, "mmserve:mm_cache_hits_total"), _delta(s0, s1, "mmserve:mm_cache_queries_total")
        )
    return out
