"""Quantized models through real processes, against HF `generate` (fp32):

- EPD: `mmserve serve --quantization int4 --quantize-tower --keep-lm-head-unquantized --language-only
  --encoder-workers 1`: the spawned encoder worker quantizes its tower too (the flag travels), and the answers
  equal HF's on a checkpoint whose language-model and tower weights are the dequantized ones (the head is not);
- P/D: an AWQ checkpoint with `--kv-cache-dtype fp8` through `--prefill-workers 1 --decode-workers 1`: both
  engines load its codes and keep fp8 rows (the flags travel to the children), and the rows cross between them;
- a checkpoint that is already quantized refuses `--quantization` at start, naming the checkpoint.
"""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from mmserve.testing.kit_quant import dequantized_reference, quantize_checkpoint
from mmserve.testing.reference import HFReference
from mmserve.testing.server_process import start_server
from tests.engine_helpers import reference, reference_text
from tests.families import FAMILIES

SPEC = FAMILIES["qwen2_vl"]
MAX_NEW = 8
ARGS = ["--kv-cache-mb", "16", "--mm-processor-kwargs", '{"video_min_pixels": 3136, "video_max_pixels": 12544}']


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return str(tmp_path_factory.mktemp("quantized-serving"))


def chat(url: str, case) -> str:
    body = {"messages": case.messages, "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_epd_with_a_quantized_tower_and_language_model(tiny_qwen2_vl, tmp_path, logs):
    ref_dir = dequantized_reference(tiny_qwen2_vl, str(tmp_path / "ref"), "int4", head=False, tower=True)
    expected = reference_text(ref_dir, MAX_NEW, SPEC.mm_kwargs)
    lm_only = reference_text(
        dequantized_reference(tiny_qwen2_vl, str(tmp_path / "lm"), "int4", head=False), MAX_NEW, SPEC.mm_kwargs
    )
    cases = {**SPEC.cases(), "again": SPEC.two([1, 2])}
    # The tower's quantization shows in the answers: a worker that left its tower alone would fail here.
    assert any(expected(c) != lm_only(c) for name, c in cases.items() if name != "text")
    server = start_server(
        tiny_qwen2_vl,
        *ARGS,
        "--quantization",
        "int4",
        "--quantize-tower",
        "--keep-lm-head-unquantized",
        "--language-only",
        "--encoder-workers",
        "1",
        log_dir=logs,
    )
    try:
        for name, case in cases.items():
            assert chat(server.url, case) == expected(case), name
    finally:
        assert server.stop() == 0


def test_pd_pipeline_serves_an_awq_checkpoint_with_an_fp8_cache(tiny_qwen2_vl, tmp_path, logs):
    checkpoint = quantize_checkpoint(tiny_qwen2_vl, str(tmp_path / "awq"), "awq")
    ref = HFReference(os.path.join(checkpoint, "reference"), mm_processor_kwargs=SPEC.mm_kwargs, kv_cache_dtype="fp8")
    expected = lambda case: ref.tokenizer.decode(  # noqa: E731
        reference(ref, case, MAX_NEW).token_ids, skip_special_tokens=True
    )
    server = start_server(
        checkpoint,
        *ARGS,
        "--kv-cache-dtype",
        "fp8",
        "--prefill-workers",
        "1",
        "--decode-workers",
        "1",
        "--max-num-batched-tokens",
        "16",
        log_dir=logs,
    )
    try:
        for name, case in SPEC.cases().items():
            r = httpx.post(
                server.url + "/v1/chat/completions",
                timeout=120,
                json={"messages": case.messages, "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True},
            )
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == expected(case), name
            route = dict(p.strip().split("=", 1) for p in r.headers["x-mmserve-route"].split(";"))
            assert route["prefill"] != route["decode"] and int(route["kv_bytes"]) > 0
    finally:
        assert server.stop() == 0


def test_quantizing_a_quantized_checkpoint_is_refused_at_start(tiny_qwen2_vl, tmp_path):
    checkpoint = quantize_checkpoint(tiny_qwen2_vl, str(tmp_path / "gptq"), "gptq")
    argv = [sys.executable, "-m", "mmserve.cli", "serve", checkpoint, "--port", "0", "--quantization", "int8"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=180)
    assert done.returncode != 0
    assert "already quantized" in done.stderr and checkpoint in done.stderr
