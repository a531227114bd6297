"""`mmserve bench engine` end to end on the tiny model: both tables printed, every figure in `--json`."""

from __future__ import annotations

import json

from tests.test_bench_cli import run_cli


def test_bench_engine_reports_the_decode_step_against_its_gemm_floor(tiny_qwen2_vl, tmp_path):
    out = tmp_path / "engine.json"
    args = ["--concurrency", "1,3", "--num-requests", "2", "--hf-requests", "2", "--output-tokens", "8"]
    args += [
        "--rounds",
        "1",
        "--image-size",
        "32x32",
        "--kv-cache-mb",
        "8",
        "--json",
        str(out),
        "--hf-layers",
        "--eager-ops",
        "--fp32-gemm",
        "onednn",
        "--mkl-gemm",
    ]
    done = run_cli("bench", "engine", "--model", tiny_qwen2_vl, *args)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| engine c=3 |" in done.stdout and "step / floor" in done.stdout
    result = json.loads(out.read_text())
    assert result["parameters"]["concurrency"] == [1, 3] and result["parameters"]["dtype"] == "float32"
    # --hf-layers: each engine beside the same engine on transformers' layer code (--disable-layer-fusion);
    # --eager-ops: beside the same engine on PyTorch ops instead of the CPU kernels (--disable-cpu-kernels);
    # --mkl-gemm: beside the same engine with MKL's fp32 GEMMs (--fp32-gemm mkl; the others: oneDNN's)
    variants = ("", " hf-layers", " eager-ops", " mkl-gemm")
    assert set(result["summary"]) == {"hf"} | {f"engine c={c}{v}" for c in (1, 3) for v in variants}
    assert "| engine c=3 hf-layers |" in done.stdout and "| engine c=3 mkl-gemm |" in done.stdout
    assert result["parameters"]["fp32_gemm"] == "onednn" and result["parameters"]["mkl_gemm"]
    assert result["summary"]["hf"]["output_vs_hf"] == 1.0
    (run,) = result["rounds"]["engine c=3"]
    assert run["output_tokens"] == 3 * 8  # at least `concurrency` requests, whatever --num-requests says
    step = run["decode_step"]
    assert step["rows"] == 3 and step["step_ms"] > 0 and step["gemm_floor_ms"] > 0
    assert set(step["breakdown_ms"]) == {"gemm", "attention", "sampler", "scheduler", "other"}
    assert abs(sum(step["breakdown_ms"].values()) - step["step_ms"]) < 1e-6 * step["step_ms"] + 1e-9
    assert step["breakdown_ms"]["attention"] > 0 and step["breakdown_ms"]["sampler"] > 0
    assert [run["decode_step"] for run in result["rounds"]["hf"]] == [None, None]
    # HF's two requests bracket the engine's runs (the machine drifts): one before, one after
    order = [line.split()[2] for line in done.stdout.splitlines() if line.startswith("round 1 ")]
    assert order == ["hf", *["engine"] * 8, "hf"], done.stdout


def test_bench_engine_without_the_profile_times_the_step_and_its_floor_only(tiny_qwen2_vl, tmp_path):
    out = tmp_path / "engine.json"
    args = ["--concurrency", "2", "--num-requests", "2", "--hf-requests", "1", "--output-tokens", "8"]
    args += ["--rounds", "1", "--image-size", "32x32", "--kv-cache-mb", "8", "--json", str(out), "--no-profile"]
    done = run_cli("bench", "engine", "--model", tiny_qwen2_vl, *args)
    assert done.returncode == 0, done.stderr[-3000:]
    (run,) = json.loads(out.read_text())["rounds"]["engine c=2"]
    step = run["decode_step"]
    assert step["rows"] == 2 and step["step_ms"] > 0 and step["gemm_floor_ms"] > 0
    assert step["breakdown_ms"] == {}  # the profiler never ran
    *_, row = (line for line in done.stdout.splitlines() if line.startswith("| engine c=2 |"))  # the step table's
    assert row.endswith("| - | - | - | - | - |"), row


def test_bench_engine_runs_quantized_engines_and_fp8_caches_beside_the_plain_one(tiny_qwen2_vl, tmp_path):
    out = tmp_path / "engine.json"
    args = ["--concurrency", "2", "--num-requests", "2", "--hf-requests", "1", "--output-tokens", "8"]
    args += ["--rounds", "1", "--image-size", "32x32", "--kv-cache-mb", "8", "--json", str(out)]
    more = ["--quantization", "int8,int4", "--kv-cache-dtype", "fp8"]
    done = run_cli("bench", "engine", "--model", tiny_qwen2_vl, *args, *more)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    names = {"", " int8", " int4", " kv-fp8", " int8 kv-fp8", " int4 kv-fp8"}
    assert set(result["summary"]) == {"hf"} | {f"engine c=2{n}" for n in names}
    assert result["parameters"]["quantization"] == ["int8", "int4"]
    assert result["parameters"]["kv_cache_dtype"] == ["fp8"]
    streamed = {
        line.split(":")[0]: float(line.split(": ")[1].split()[0])
        for line in done.stdout.splitlines()
        if "MB of linear weights per decode step" in line
    }
    # fp32 here: int8 about a quarter of its bytes (plus a scale per row), int4 about an eighth (plus scales)
    assert streamed["engine c=2 int4"] < streamed["engine c=2 int8"] < streamed["engine c=2"] / 3
    step = result["rounds"]["engine c=2 int4"][0]["decode_step"]
    assert step["gemm_floor_ms"] > 0 and step["breakdown_ms"]["gemm"] > 0


def test_bench_engine_counts_the_rows_a_full_cache_holds(tiny_qwen2_vl, tmp_path):
    """A KV budget that holds fewer requests than the concurrency: the rest wait, and the decode rate counts the
    rows that ran at once; an int8 cache (a third of fp32's bytes a row here) holds all four in the same
    budget."""
    out = tmp_path / "engine.json"
    args = ["--concurrency", "4", "--num-requests", "4", "--hf-requests", "1", "--output-tokens", "8"]
    args += ["--rounds", "1", "--image-size", "32x32", "--kv-cache-mb", "0.06", "--json", str(out), "--no-profile"]
    done = run_cli("bench", "engine", "--model", tiny_qwen2_vl, *args, "--kv-cache-dtype", "int8")
    assert done.returncode == 0, done.stderr[-3000:]
    rounds = json.loads(out.read_text())["rounds"]
    (plain,), (int8,) = rounds["engine c=4"], rounds["engine c=4 kv-int8"]
    assert 1 <= plain["decode_step"]["rows"] < 4 and int8["decode_step"]["rows"] == 4
    assert plain["output_tokens"] == int8["output_tokens"] == 4 * 8  # the waiting requests ran too
    assert "| engine c=4 kv-int8 | 4 |" in done.stdout
