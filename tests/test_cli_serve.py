"""`mmserve serve` as a user starts and stops it: MODEL positionally or as --model, defaults in every --help,
--served-model-name aliases, --dtype auto, a taken port refused before anything loads, and Ctrl-C during a
stream (clean end for the client, no traceback, no process left)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from mmserve.cli import build_parser, engine_config_from_args, main, server_config_from_args
from mmserve.cli_args import embedding_store_config_from_args
from mmserve.models import loader, resolve
from mmserve.server.encoder_workers import as_args, encoder_command, free_port
from mmserve.testing.probes import child_pids
from mmserve.testing.server_process import still_running
from mmserve.transport.cluster_auth import ENV_VAR


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


# -- arguments -----------------------------------------------------------------------------------------
def test_model_is_positional_or_a_flag(capsys):
    for command in ("serve", "encoder"):
        assert parse(command, "m").model == "m"
        assert parse(command, "--model", "m").model == "m"
        assert parse(command, "m", "--model", "m").model == "m"
        for argv, error in (
            ((command,), "the model is required"),
            ((command, "a", "--model", "b"), "differ"),
        ):
            with pytest.raises(SystemExit) as exit_info:
                parse(*argv)
            assert exit_info.value.code == 2 and error in capsys.readouterr().err
    assert parse("bench", "kv", "m").model == parse("bench", "kv", "--model", "m").model == "m"


def test_served_model_names_fill_the_config():
    cfg = server_config_from_args(parse("serve", "org/model", "--served-model-name", "a", "b", "a", "c"))
    assert (cfg.served_model_name, cfg.served_model_aliases) == ("a", ("b", "c"))
    assert cfg.served_model_names == ("a", "b", "c")
    cfg = server_config_from_args(parse("serve", "org/model"))
    assert (cfg.served_model_name, cfg.served_model_aliases) == ("org/model", ())


def test_encoder_workers_run_with_the_servers_gemm_packing_and_kernels(tiny_qwen2_vl):
    flags = (
        "--fp32-gemm",
        "onednn",
        "--disable-weight-packing",
        "--disable-cpu-kernels",
        "--embedding-cache-mb",
        "64",
    )
    cmd = encoder_command(engine_config_from_args(parse("serve", tiny_qwen2_vl, *flags)), 9123, "warning")
    assert cmd[:3] == [sys.executable, "-m", "mmserve.cli"]
    args = parse(*cmd[3:])  # what `serve --encoder-workers N` starts, as `mmserve encoder` reads it
    assert args.command == "encoder" and (args.port, args.embedding_cache_mb) == (9123, 64)
    assert args.fp32_gemm == "onednn" and args.disable_weight_packing and args.disable_cpu_kernels
    default = parse(
        *encoder_command(engine_config_from_args(parse("serve", tiny_qwen2_vl)), 9123, "info")[3:]
    )
    assert (
        default.fp32_gemm == "auto" and not default.disable_weight_packing and not default.disable_cpu_kernels
    )


def test_encoder_workers_share_the_servers_embedding_store(tiny_qwen2_vl):
    store = {
        "--embedding-store": "mooncake://127.0.0.1:50051",
        "--embedding-store-segment-mb": "32",
        "--embedding-store-buffer-mb": "16",
        "--embedding-store-timeout-s": "7",
        "--embedding-store-retry-s": "2",
    }
    engine_cfg = engine_config_from_args(parse("serve", tiny_qwen2_vl, *as_args(store)))
    assert engine_cfg.embedding_store is not None
    args = parse(*encoder_command(engine_cfg, 9123, "warning")[3:])
    assert embedding_store_config_from_args(args) == engine_cfg.embedding_store


def _parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):  # aliases map to the same parser
                yield from _parsers(sub)


def test_every_option_help_shows_its_default():
    checked, helps = 0, {}
    for parser in _parsers(build_parser()):
        text = helps[parser.prog] = " ".join(parser.format_help().split())
        for action in parser._actions:
            default = action.default
            if (
                not action.option_strings
                or default is None
                or default is False
                or default in ([], argparse.SUPPRESS)
            ):
                continue  # unset: nothing to show
            assert f"default: {default}" in text, (parser.prog, action.option_strings)
            checked += 1
    assert checked > 100  # every subcommand, bench included
    assert (
        "--port PORT default: 8000" in helps["mmserve serve"] and "(default: auto)" in helps["mmserve serve"]
    )
    assert (
        "--max-batch-items MAX_BATCH_ITEMS items fused into one tower forward (default: 8)"
        in helps["mmserve encoder"]
    )


def test_bench_help_lists_the_run_flags(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = capsys.readouterr().out
    for flag in ("--url", "--num-requests", "--concurrency", "--seed", "--json", "--no-server-metrics"):
        assert flag in text
    assert "compare" in text and "kv" in text


# -- dtype ---------------------------------------------------------------------------------------------
def checkpoint(tmp_path, name: str, config: dict) -> str:
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_dtype_auto_follows_the_checkpoint_and_the_cpu(tmp_path, monkeypatch, caplog):
    bf16 = checkpoint(tmp_path, "bf16", {"torch_dtype": "bfloat16"})
    fp16_text = checkpoint(tmp_path, "fp16", {"text_config": {"dtype": "float16"}})
    fp32 = checkpoint(tmp_path, "fp32", {"dtype": "float32"})
    unsaid = checkpoint(tmp_path, "unsaid", {})
    monkeypatch.setattr(resolve, "cpu_has_bf16", lambda: True)
    assert [resolve.resolve_dtype(p, "auto") for p in (bf16, fp16_text, fp32, unsaid)] == [
        "bfloat16",
        "bfloat16",  # float16 has no fast CPU kernels
        "float32",
        "float32",
    ]
    assert engine_config_from_args(parse("serve", bf16)).dtype == "bfloat16"  # resolved once, in the config
    assert engine_config_from_args(parse("serve", bf16, "--dtype", "fp32")).dtype == "float32"
    monkeypatch.setattr(resolve, "cpu_has_bf16", lambda: False)
    assert resolve.resolve_dtype(bf16, "auto") == "float32"
    with caplog.at_level(logging.WARNING, logger="mmserve.models.resolve"):
        assert resolve.resolve_dtype(bf16, "bf16") == "bfloat16"  # an explicit choice is kept, with a warning
    assert "bfloat16 on a CPU without native bf16" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mmserve.models.resolve"):
        resolve.resolve_dtype(bf16, "bf16", "cuda")  # a GPU's own affair
        monkeypatch.setattr(resolve, "cpu_has_bf16", lambda: True)
        resolve.resolve_dtype(bf16, "bf16")
    assert not caplog.text
    with pytest.raises(ValueError, match="resolve"):
        loader.parse_dtype("auto")  # nothing downstream may guess
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve.resolve_dtype(bf16, "int8")


def test_tiny_models_stay_float32_and_the_llm_resolves_auto(tiny_qwen2_vl, tmp_path, monkeypatch):
    from mmserve.llm import LLM

    assert resolve.resolve_dtype(tiny_qwen2_vl, "auto") == "float32"
    copy = tmp_path / "bf16"
    shutil.copytree(tiny_qwen2_vl, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    monkeypatch.setattr(resolve, "cpu_has_bf16", lambda: True)
    assert LLM(str(copy), kv_cache_mb=4).engine.cfg.dtype == "bfloat16"


# -- start-up and shutdown -----------------------------------------------------------------------------
def test_a_taken_port_fails_at_once(tmp_path):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    model = checkpoint(tmp_path, "never-loaded", {})  # refused before the model is even looked at
    try:
        for command in ("serve", "encoder"):
            start = time.monotonic()
            proc = subprocess.run(
                [sys.executable, "-m", "mmserve.cli", command, model, "--port", str(port)],
                capture_output=True,
                text=True,
                timeout=60,
            )
            elapsed = time.monotonic() - start
            assert proc.returncode == 1, proc.stderr
            lines = proc.stderr.strip().splitlines()
            assert len(lines) == 1 and f"--port {port}" in lines[0], proc.stderr
            assert "address already in use" in lines[0].lower()
            # Python and the parser only; slower means parsing imported torch (python -X importtime -m mmserve.cli)
            assert elapsed < 3, f"{command}: {elapsed:.1f} s"
    finally:
        holder.close()


def test_a_prefill_or_decode_server_without_a_cluster_secret_is_refused_before_loading(tmp_path, monkeypatch):
    """Without a secret, the router's every handoff would get 403: refused at start, naming how to set one."""
    model = checkpoint(tmp_path, "never-loaded", {})
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    for mode in ("prefill", "decode"):
        start = time.monotonic()
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "mmserve.cli",
                "serve",
                model,
                "--port",
                str(free_port()),
                "--disaggregation-mode",
                mode,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert proc.returncode == 1, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and f"--disaggregation-mode {mode}" in lines[0], proc.stderr
        assert "--cluster-secret" in lines[0] and "$MMSERVE_CLUSTER_SECRET" in lines[0]
        assert "--enable-anonymous-registration" in lines[0]
        assert time.monotonic() - start < 3  # the parser only: no torch, no model
    monkeypatch.delenv(ENV_VAR, raising=False)
    argv = ("serve", model, "--disaggregation-mode", "decode")
    assert server_config_from_args(parse(*argv, "--enable-anonymous-registration")).anonymous_control_plane
    assert server_config_from_args(parse(*argv, "--cluster-secret", "s" * 16)).cluster_secret == "s" * 16
    monkeypatch.setenv(ENV_VAR, "e" * 16)
    assert server_config_from_args(parse(*argv)).cluster_secret == "e" * 16
    assert server_config_from_args(parse("serve", model)).disaggregation_mode == "null"


def test_ctrl_c_during_a_stream_ends_cleanly(tiny_qwen2_vl, tmp_path):
    port = free_port()
    log_path = tmp_path / "server.log"
    cmd = [sys.executable, "-m", "mmserve.cli", "serve", tiny_qwen2_vl, "--port", str(port)]
    with open(log_path, "w") as log:  # MODEL positionally; info: the start-up line with the dtype
        server = subprocess.Popen(
            [*cmd, *"--kv-cache-mb 16 --log-level info".split()], stdout=log, stderr=log
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while not _healthy(url):
            assert server.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        children = child_pids(server.pid)
        assert children  # the engine process
        body = {
            "messages": [{"role": "user", "content": "count"}],
            "max_tokens": 3000,
            "ignore_eos": True,
            "stream": True,
        }
        events, interrupted_at = [], None
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=20) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():  # bounded: the read timeout, and 3000 tokens
                if line.startswith("data:"):
                    events.append(line.removeprefix("data:").strip())
                    if interrupted_at is None:
                        interrupted_at = time.monotonic()
                        server.send_signal(signal.SIGINT)
        ended_after = time.monotonic() - interrupted_at
        assert events[-1] == "[DONE]" and "server_shutting_down" in events[-2], events[-3:]
        # Ended by the shutdown, not by running out of tokens (no wall-clock bound: CI machines stall).
        assert len(events) < 3000, (len(events), ended_after)
        assert server.wait(timeout=60) == 0  # the engine stopped in order (ShutdownReq), a clean exit
        assert not still_running(children), "a child outlived the server"  # at most a moment's lag
        text = log_path.read_text()
        assert "Traceback" not in text, text
        assert f"model {tiny_qwen2_vl}: dtype float32, device cpu, max model len 4096" in text
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
