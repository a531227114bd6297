"""Serving metrics from client-side request traces: pure functions, no I/O.

Latency distributions cover successful requests only (`RequestTrace.ok`): TTFT (first content chunk),
ITL (gaps between consecutive content chunks, pooled over requests), TPOT (per request, decode time over
decoded tokens after the first), E2E (send to end of stream). Throughputs divide by the wall time of the
measured run.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from mmserve.bench.client import RequestTrace

__all__ = ["SLO", "Distribution", "Summary", "parse_slo", "percentile", "summarize"]


@dataclass(frozen=True)
class SLO:
    """Per-request latency targets for goodput; None means no target."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None


def parse_slo(text: str) -> SLO:
    """Parses "ttft_ms=500,tpot_ms=50" (either key optional; "" gives no targets); ValueError otherwise."""
    values: dict[str, float] = {}
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        key, sep, value = (p.strip() for p in item.partition("="))
        if not sep or key not in ("ttft_ms", "tpot_ms"):
            raise ValueError(f"expected ttft_ms=N and/or tpot_ms=N, got {item!r}")
        if key in values:
            raise ValueError(f"{key} given twice in {text!r}")
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"{key} must be a number, got {value!r}") from None
        if not number > 0 or math.isinf(number):
            raise ValueError(f"{key} must be a positive finite number, got {value!r}")
        values[key] = number
    return SLO(**values)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (q in [0, 100]) by linear interpolation, as `numpy.percentile` by default.

    An empty list has no percentile: the answer is NaN.
    """
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q must be in [0, 100], got {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True)
class Distribution:
    """Mean and tail of one latency, in seconds, over `count` samples."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: list[float]) -> Distribution | None:
        """None when there are no samples."""
        if not values:
            return None
        return cls(
            len(values),
            math.fsum(values) / len(values),
            percentile(values, 50),
            percentile(values, 90),
            percentile(values, 99),
        )


@dataclass
class Summary:
    """Counts, latency distributions (None when no successful request has the metric), throughputs."""

    total: int
    ok: int
    errors_by_status: dict[str, int]  # "0" for connection errors / timeouts
    wall_s: float
    ttft_s: Distribution | None
    itl_s: Distribution | None
    tpot_s: Distribution | None
    e2e_s: Distribution | None
    request_throughput: float  # ok requests / s
    output_throughput: float  # output tokens of ok requests / s
    goodput: float  # ok requests meeting every SLO target / s
    total_prompt_tokens: int  # over ok requests, as the other token totals
    total_output_tokens: int
    total_cached_tokens: int
    slo: SLO = field(default_factory=SLO)

    def to_json(self) -> dict[str, Any]:
        """A JSON-serializable dict (distributions as nested dicts or null)."""
        return asdict(self)

    def table(self) -> str:
        """A readable, aligned plain-text report; latencies in milliseconds."""
        errors = ", ".join(f"{k}: {v}" for k, v in sorted(self.errors_by_status.items())) or "none"
        rows: list[tuple[str, str]] = [
            ("requests", f"{self.ok} ok / {self.total}"),
            ("errors by status", errors),
            ("wall time (s)", f"{self.wall_s:.2f}"),
            ("request throughput (req/s)", f"{self.request_throughput:.2f}"),
            ("output throughput (tok/s)", f"{self.output_throughput:.1f}"),
            (f"goodput (req/s){_slo_label(self.slo)}", f"{self.goodput:.2f}"),
            ("prompt tokens", str(self.total_prompt_tokens)),
            ("cached prompt tokens", str(self.total_cached_tokens)),
            ("output tokens", str(self.total_output_tokens)),
        ]
        width = max(len(name) for name, _ in rows)
        lines = [f"{name:<{width}}  {value}" for name, value in rows]
        lines += ["", _latency_table(self)]
        return "\n".join(lines)


def _slo_label(slo: SLO) -> str:
    targets = [
        f"{k}<={v:g}" for k, v in (("ttft_ms", slo.ttft_ms), ("tpot_ms", slo.tpot_ms)) if v is not None
    ]
    return f" [{', '.join(targets)}]" if targets else ""


def _latency_table(s: Summary) -> str:
    header = ("latency (ms)", "mean", "p50", "p90", "p99", "n")
    rows = [header]
    for name, dist in (("TTFT", s.ttft_s), ("ITL", s.itl_s), ("TPOT", s.tpot_s), ("E2E", s.e2e_s)):
        if dist is None:
            rows.append((name, "-", "-", "-", "-", "0"))
        else:
            ms = [f"{1000 * v:.2f}" for v in (dist.mean, dist.p50, dist.p90, dist.p99)]
            rows.append((name, *ms, str(dist.count)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join(_aligned(r, widths) for r in rows)


def _aligned(row: tuple[str, ...], widths: list[int]) -> str:
    """The name column left-aligned, numbers right-aligned."""
    cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
    return "  ".join(cells)


def _tpot(t: RequestTrace) -> float | None:
    if t.first_token is None or t.output_tokens <= 1:
        return None
    return (t.end - t.first_token) / (t.output_tokens - 1)


def _meets(t: RequestTrace, slo: SLO) -> bool:
    """Whether an ok request meets every target; a request without decode steps meets any TPOT target."""
    if slo.ttft_ms is not None and (t.first_token is None or (t.first_token - t.start) * 1000 > slo.ttft_ms):
        return False
    tpot = _tpot(t)
    return slo.tpot_ms is None or tpot is None or tpot * 1000 <= slo.tpot_ms


def summarize(traces: list[RequestTrace], wall_s: float, slo: SLO | None = None) -> Summary:
    """Metrics of one measured run; never raises on empty input or a zero wall time (rates are then 0)."""
    slo = slo or SLO()
    ok = [t for t in traces if t.ok]
    errors: dict[str, int] = {}
    for t in traces:
        if not t.ok:
            errors[str(t.status)] = errors.get(str(t.status), 0) + 1
    itl = [b - a for t in ok for a, b in zip(t.token_times, t.token_times[1:], strict=False)]
    tpots = [v for v in map(_tpot, ok) if v is not None]
    output_tokens = sum(t.output_tokens for t in ok)

    def rate(count: float) -> float:
        return count / wall_s if wall_s > 0 else 0.0

    return Summary(
        total=len(traces),
        ok=len(ok),
        errors_by_status=errors,
        wall_s=wall_s,
        ttft_s=Distribution.of([t.first_token - t.start for t in ok if t.first_token is not None]),
        itl_s=Distribution.of(itl),
        tpot_s=Distribution.of(tpots),
        e2e_s=Distribution.of([t.end - t.start for t in ok]),
        request_throughput=rate(len(ok)),
        output_throughput=rate(output_tokens),
        goodput=rate(sum(_meets(t, slo) for t in ok)),
        total_prompt_tokens=sum(t.prompt_tokens for t in ok),
        total_output_tokens=output_tokens,
        total_cached_tokens=sum(t.cached_tokens for t in ok),
        slo=slo,
    )
