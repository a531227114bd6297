"""lm-eval, unmodified (PyPI's `lm_eval` CLI), as a client of `mmserve serve` (issue 37): a multiple-choice
(loglikelihood) task and a generate_until task from the repository's local JSONL files (examples/lm_eval, no hub
access), through `local-completions` (batched token-id prompts, echo, logprobs) and `local-chat-completions`.
The loglikelihoods equal those of HF's own forward pass on the same token ids (fp32, within 1e-4 summed over a
continuation), on a plain server and on an EPD server with 2 encoder workers."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mmserve.testing.reference import HFReference

ROOT = Path(__file__).resolve().parents[1]
LM_EVAL = str(Path(sys.executable).with_name("lm_eval"))


@pytest.fixture(scope="module")
def ref(tiny_qwen2_vl):
    return HFReference(tiny_qwen2_vl)


def run_lm_eval(model: str, base_url: str, tokenizer: str, tasks: str, out: Path, *extra: str) -> dict:
    """Runs the lm_eval CLI; returns {task: [sample, ...]} from its --log_samples output."""
    args = f"model=tiny,base_url={base_url},tokenizer={tokenizer},tokenizer_backend=huggingface"
    cmd = [
        LM_EVAL,
        "--model",
        model,
        "--model_args",
        args,
        "--include_path",
        "examples/lm_eval",
        "--tasks",
        tasks,
        "--output_path",
        str(out),
        "--log_samples",
        *extra,
    ]
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(out / "ds"),
    }
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    samples = {}
    for task in tasks.split(","):
        (path,) = glob.glob(str(out / "**" / f"samples_{task}_*.jsonl"), recursive=True)
        samples[task] = [json.loads(line) for line in Path(path).read_text().splitlines()]
    return samples


def hf_loglikelihood(ref, context: str, continuation: str) -> float:
    """lm-eval's own split of (context, continuation) into tokens, scored by HF's forward pass."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = ref.tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    n_ctx = len(ref.tokenizer(context, add_special_tokens=False)["input_ids"])
    with torch.no_grad():
        logits = ref.model(input_ids=torch.tensor([whole])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return sum(logp[p - 1, whole[p]].item() for p in range(n_ctx, len(whole)))


def check_scores(ref, samples: list[dict]) -> list[float]:
    scores = []
    for sample in samples:
        for k, (resp,) in enumerate(sample["resps"]):
            args = sample["arguments"][f"gen_args_{k}"]
            got = float(resp[0])
            assert abs(got - hf_loglikelihood(ref, args["arg_0"], args["arg_1"])) < 1e-4, (sample["doc"], k)
            scores.append(got)
    assert len(scores) == 19  # every choice of the 6 questions
    return scores


def test_lm_eval_loglikelihood_and_generation_equal_hf_plain_and_epd(
    shared_server, shared_secured_epd_process, tiny_qwen2_vl, ref, tmp_path
):
    plain = run_lm_eval(
        "local-completions",
        shared_server.url + "/v1/completions",
        tiny_qwen2_vl,
        "mmserve_mc,mmserve_gen",
        tmp_path / "plain",
        "--batch_size",
        "4",
    )
    scores = check_scores(ref, plain["mmserve_mc"])
    generated = [s["resps"][0][0] for s in plain["mmserve_gen"]]
    assert len(generated) == 4 and all(isinstance(g, str) for g in generated)
    epd = shared_secured_epd_process.get()
    on_epd = run_lm_eval(
        "local-completions",
        epd.url + "/v1/completions",
        tiny_qwen2_vl,
        "mmserve_mc",
        tmp_path / "epd",
        "--batch_size",
        "3",
    )
    assert all(
        abs(a - b) < 1e-4 for a, b in zip(check_scores(ref, on_epd["mmserve_mc"]), scores, strict=True)
    )
    chat = run_lm_eval(
        "local-chat-completions",
        shared_server.url + "/v1/chat/completions",
        tiny_qwen2_vl,
        "mmserve_gen",
        tmp_path / "chat",
        "--apply_chat_template",
    )
    assert len(chat["mmserve_gen"]) == 4 and all(
        isinstance(s["resps"][0][0], str) for s in chat["mmserve_gen"]
    )
