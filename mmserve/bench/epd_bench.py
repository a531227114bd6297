"""`mmserve bench epd`: TTFT of EPD vs monolithic on one light request, side by side in one run.

Launches the configurations as real servers (`mmserve serve ...` subprocesses on loopback), then sends
the same workload to each in alternation: one request at a time, `images` freshly generated images per
request (so no cache hit; with `same_images` each round's images go to every configuration in turn: servers
sharing a global embedding store then show a miss on the first and store hits on the others), a short prompt and one output token; TTFT is measured by the client as the time to the
first streamed content chunk. Reports the median per configuration and the ratio to the first.
"""

from __future__ import annotations

import base64
import io
import statistics
import tempfile
import time

import httpx

from mmserve.bench.engine_bench import make_image
from mmserve.testing.server_process import start_server


def _uri(seed: int, size: tuple[int, int]) -> str:
    buf = io.BytesIO()
    make_image(seed, size).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def ttft(url: str, image_uris: list[str], timeout_s: float = 300.0) -> float:
    images = [{"type": "image_url", "image_url": {"url": uri}} for uri in image_uris]
    content = [*images, {"type": "text", "text": "What is this?"}]
    body = {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 2,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    start = time.perf_counter()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=timeout_s) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content": ""' not in line and "[DONE]" not in line:
                return time.perf_counter() - start
    raise RuntimeError("stream ended without content")


def run(
    model_dir: str,
    configs: dict[str, list[str]],
    rounds: int,
    image_size: tuple[int, int],
    warmup: int = 2,
    images: int = 1,
    same_images: bool = False,
) -> dict[str, list[float]]:
    results: dict[str, list[float]] = {name: [] for name in configs}
    with tempfile.TemporaryDirectory() as logs:
        servers = {
            name: start_server(model_dir, *flags, log_dir=logs, timeout_s=600)
            for name, flags in configs.items()
        }
        try:
            seed = 10_000
            for r in range(warmup + rounds):
                for i, (name, server) in enumerate(servers.items()):
                    if i == 0 or not same_images:  # same_images: every configuration gets the round's images
                        seed += images
                    t = ttft(server.url, [_uri(seed + i, image_size) for i in range(images)])
                    if r >= warmup:
                        results[name].append(t)
                        print(f"round {r - warmup + 1} {name:<14} TTFT {1000 * t:8.1f} ms", flush=True)
        finally:
            for server in servers.values():
                server.stop()
    return results


def report(results: dict[str, list[float]]) -> str:
    names = list(results)
    base = statistics.median(results[names[0]])
    lines = ["| configuration | TTFT median (ms) | p90 (ms) | vs first |", "|---|---|---|---|"]
    for name in names:
        values = sorted(results[name])
        median = statistics.median(values)
        p90 = values[min(len(values) - 1, int(0.9 * len(values)))]
        lines.append(f"| {name} | {1000 * median:.1f} | {1000 * p90:.1f} | {median / base:.2f}x |")
    return "\n".join(lines)
