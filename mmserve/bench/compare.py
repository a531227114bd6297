"""`mmserve bench` runs: one load against a server, and side-by-side comparisons of configurations.

`run_one`: scrape the server's metrics, drive the workload, scrape again; returns the client-side summary
and the server-side breakdown. `compare`: launch every configuration as a real server (the name `hf` is the
in-process plain-transformers baseline) and every peer (another OpenAI server from a command line,
mmserve.bench.peer), then for each round send that round's workload (fresh images per round, so caches only
see what the workload's own reuse gives them) to every configuration and peer in turn, with the same client,
and report medians over rounds with ratios against the first configuration.
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
from typing import Any

from mmserve.bench import client as load
from mmserve.bench import server_metrics, stats
from mmserve.bench.peer import PeerSpec, start_peer, stop_peer
from mmserve.bench.workload import WorkloadConfig, build_workload
from mmserve.testing.probes import tree_resident_mb
from mmserve.testing.server_process import ServerHandle, start_server

# Summary metrics shown side by side: (label, path into Summary.to_json(), higher is better)
HEADLINE = (
    ("TTFT mean s", ("ttft_s", "mean"), False),
    ("TTFT p90 s", ("ttft_s", "p90"), False),
    ("TPOT mean s", ("tpot_s", "mean"), False),
    ("E2E mean s", ("e2e_s", "mean"), False),
    ("req/s", ("request_throughput",), True),
    ("output tok/s", ("output_throughput",), True),
    # the server's process tree after the round (peers' too; not the in-process hf baseline): what the weights,
    # caches and runtime hold, and the sum of each process's peak (loading included)
    ("resident MB", ("resident_mb",), False),
    ("peak resident MB", ("peak_resident_mb",), False),
)


def run_one(
    load_cfg: load.LoadConfig, requests, slo: stats.SLO | None = None, scrape: bool = True
) -> tuple[stats.Summary, dict]:
    """Client-side summary and server-side breakdown of one load run against `load_cfg.url`. The breakdown is
    `{"skipped": why}` without `scrape`, or when the server has no mmserve metrics (any other OpenAI server)."""
    root = load.server_root(load_cfg.url)
    try:
        before = server_metrics.scrape(root) if scrape else None
    except server_metrics.MetricsUnavailable as e:
        before, skipped = None, str(e)
    else:
        skipped = None if scrape else "--no-server-metrics"
    traces, wall_s = load.run(load_cfg, requests)
    summary = stats.summarize(traces, wall_s, slo)
    if before is None:
        return summary, {"skipped": skipped}
    try:
        return summary, server_metrics.breakdown(before, server_metrics.scrape(root))
    except server_metrics.MetricsUnavailable as e:
        return summary, {"skipped": f"after the run: {e}"}


def result_json(summary: stats.Summary, server: dict | None) -> dict[str, Any]:
    result = summary.to_json()
    result["server"] = server
    return result


def format_breakdown(server: dict) -> str:
    if "skipped" in server:
        return f"server-side breakdown: skipped ({server['skipped']}); the numbers above are the client's"
    lines = ["server-side breakdown (means over the run; None: not measured):"]
    lines += [
        f"  {key:<24} {value:.4f}" if isinstance(value, float) else f"  {key:<24} {value}"
        for key, value in server.items()
    ]
    return "\n".join(lines)


def _value(summary: dict[str, Any], path: tuple[str, ...]) -> float | None:
    value: Any = summary
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value if isinstance(value, int | float) else None


def compare(
    model_dir: str,
    configs: dict[str, str],
    workload: WorkloadConfig,
    load_template: load.LoadConfig,
    rounds: int,
    slo: stats.SLO | None = None,
    peers: tuple[PeerSpec, ...] = (),
    one_at_a_time: bool = False,
) -> dict[str, list[dict[str, Any]]]:
    """`peers` get the same requests and client as the configurations, asking their model of GET /v1/models
    (or sending `load_template.model`); their server-side breakdown is skipped unless they have mmserve
    metrics. Every server and peer is up for the whole run, or, `one_at_a_time`, started for its own turn and
    stopped after it (in every round): none idles beside the one measured, and models that do not fit in memory
    twice can be compared. Every server and peer started here is stopped on the way out, error or not."""
    import shlex

    results: dict[str, list[dict[str, Any]]] = {name: [] for name in [*configs, *(p.name for p in peers)]}
    by_name = {p.name: p for p in peers}
    servers: dict[str, ServerHandle] = {}  # configurations' and peers' servers now up, by name
    baselines: dict[str, Any] = {}  # the in-process `hf` baseline while loaded

    def start(name: str, logs: str) -> None:
        if name in by_name:
            servers[name] = start_peer(by_name[name], model_dir, logs)
        elif name == "hf":
            from mmserve.bench.hf_baseline import HFBaseline
            from mmserve.models.resolve import resolve_dtype, resolve_model_path

            # in the dtype `mmserve serve` picks by default (--dtype auto), so both compute alike
            path = resolve_model_path(model_dir)
            baselines[name] = HFBaseline(path, resolve_dtype(path, "auto"))
        else:
            servers[name] = start_server(
                model_dir, *shlex.split(configs[name]), log_dir=logs, timeout_s=900, served_model_name="bench"
            )

    def stop(name: str) -> None:
        baselines.pop(name, None)
        server = servers.pop(name, None)
        if server is not None and name in by_name:
            stop_peer(server)
        elif server is not None:
            server.stop()

    with tempfile.TemporaryDirectory() as logs:
        try:
            if not one_at_a_time:  # peers first: the slowest to come up
                for name in [*by_name, *configs]:
                    start(name, logs)
            for r in range(rounds):
                requests = build_workload(dataclasses.replace(workload, seed=workload.seed + 1000 * r))
                for name in results:
                    if one_at_a_time:
                        start(name, logs)
                    if name == "hf":
                        traces, wall_s = baselines[name].run(requests)
                        summary = stats.summarize(traces, wall_s, slo).to_json()
                    else:
                        server = servers[name]
                        cfg = dataclasses.replace(load_template, url=server.url, progress=False)
                        if name in configs:
                            cfg = dataclasses.replace(cfg, model="bench")
                        summary = result_json(*run_one(cfg, requests, slo))
                        summary["resident_mb"], summary["peak_resident_mb"] = tree_resident_mb(server.proc.pid)
                    if one_at_a_time:
                        stop(name)
                    results[name].append(summary)
                    print(
                        f"round {r + 1} {name:<16} "
                        + "  ".join(
                            f"{label} {_value(summary, path):.3f}"
                            for label, path, _ in HEADLINE
                            if _value(summary, path) is not None
                        ),
                        flush=True,
                    )
        finally:
            for name in [*by_name, *configs]:  # peers first, as before
                stop(name)
    return results


def medians(runs: list[dict[str, Any]]) -> dict[str, float | None]:
    out = {}
    for label, path, _ in HEADLINE:
        values = [v for v in (_value(run, path) for run in runs) if v is not None]
        out[label] = statistics.median(values) if values else None
    return out


def report(results: dict[str, list[dict[str, Any]]]) -> str:
    names = list(results)
    table = {name: medians(runs) for name, runs in results.items()}
    base = table[names[0]]
    header = "| configuration | " + " | ".join(f"{label} | ratio" for label, _, _ in HEADLINE) + " |"
    lines = [header, "|---" * (1 + 2 * len(HEADLINE)) + "|"]
    for name in names:
        cells = []
        for label, _, _ in HEADLINE:
            value, ref = table[name][label], base[label]
            ratio = f"{value / ref:.2f}x" if value is not None and ref else ""
            cells += [f"{value:.3f}" if value is not None else "", ratio]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    errors = {
        name: sum(sum(run.get("errors_by_status", {}).values()) for run in runs)
        for name, runs in results.items()
    }
    lines.append("\nerrors: " + ", ".join(f"{name} {count}" for name, count in errors.items()))
    return "\n".join(lines)


def plot(results: dict[str, list[dict[str, Any]]], path: str) -> None:
    """Latency percentiles and throughput per configuration (matplotlib, imported only when asked)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, (ax_lat, ax_tp) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        runs = results[name]
        vals = [
            statistics.median(
                [v for v in (_value(run, ("ttft_s", q)) for run in runs) if v is not None] or [0]
            )
            for q in ("p50", "p90", "p99")
        ]
        ax_lat.bar([x + i * width for x in range(3)], vals, width, label=name)
        ax_tp.bar(i, medians(runs)["output tok/s"] or 0, label=name)
    ax_lat.set_xticks(
        [x + width * (len(names) - 1) / 2 for x in range(3)], ["TTFT p50", "TTFT p90", "TTFT p99"]
    )
    ax_lat.set_ylabel("seconds")
    ax_lat.legend()
    ax_tp.set_xticks(range(len(names)), names)
    ax_tp.set_ylabel("output tokens / s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
