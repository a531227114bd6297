"""`mmserve bench engine`: the in-process engine vs plain HF `generate`, side by side in one run.

Workload: requests of a text prompt plus one generated image (fresh pixels for every run, so nothing hits
the encoder cache across runs), greedy, a fixed number of output tokens (EOS ignored). The `hf` baseline
runs requests one at a time through `model.generate` (what a user without a serving engine does); the
engine runs them concurrently, at most `concurrency` at once. Configurations alternate within each round;
the report gives medians over rounds and ratios against `hf`.
"""

from __future__ import annotations

import base64
import io
import statistics
import time
from dataclasses import dataclass, field

import numpy as np
from PIL import Image

from mmserve.bench.step_profile import GemmFloor, StepCost, breakdown, steps_beside_floor, streamed_bytes
from mmserve.models.loader import load_model_config
from mmserve.multimodal.items import Modality
from mmserve.sampling_params import SamplingParams
from mmserve.testing.reference import HFReference

CATEGORIES = ("gemm", "attention", "sampler", "scheduler", "other")
PROMPT = "Describe the image in detail, then list every object you can see."


@dataclass
class RunResult:
    name: str
    seconds: float
    output_tokens: int
    ttft_s: list[float] = field(default_factory=list)
    decode_tokens_per_s: float = 0.0  # steady-state decode only (prefill and encode excluded)
    step: StepCost | None = None  # engine: one decode step of `concurrency` rows against its GEMM floor

    def to_json(self) -> dict:
        return {
            "seconds": self.seconds,
            "output_tokens": self.output_tokens,
            "output_tokens_per_s": self.tokens_per_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "ttft_s": self.ttft_s,
            "decode_step": self.step.to_json() if self.step else None,
        }

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def make_image(seed: int, size: tuple[int, int]) -> Image.Image:
    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(size[1], size[0], 3) * 255).astype("uint8"))


def chat_messages(image: Image.Image) -> list[dict]:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    uri = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    return [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": uri}}, {"type": "text", "text": PROMPT}],
        }
    ]


def run_hf(ref: HFReference, images: list[Image.Image], output_tokens: int) -> RunResult:
    """One request at a time; TTFT is a separate 1-token generate per request (not counted in throughput)."""
    template = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}]
    result = RunResult("hf", 0.0, output_tokens * len(images))
    decode_s: list[float] = []
    for image in images:
        t0 = time.perf_counter()
        ref.generate(template, [(Modality.IMAGE, image)], max_new_tokens=1)
        t1 = time.perf_counter()
        ref.generate(template, [(Modality.IMAGE, image)], max_new_tokens=output_tokens)
        t2 = time.perf_counter()
        result.ttft_s.append(t1 - t0)
        result.seconds += t2 - t1
        # decode-only time per token: the full generation minus the 1-token one (preprocessing cancels out)
        decode_s.append(max(1e-9, (t2 - t1) - (t1 - t0)) / (output_tokens - 1))
    result.decode_tokens_per_s = 1.0 / statistics.median(decode_s)
    return result


def run_engine(
    llm, images: list[Image.Image], output_tokens: int, concurrency: int, name: str, profile: bool = True
) -> RunResult:
    params = SamplingParams(temperature=0, max_tokens=output_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.chat([chat_messages(im) for im in images], params)
    result = RunResult(name, time.perf_counter() - start, output_tokens * len(images))
    assert all(len(o.token_ids) == output_tokens for o in outputs)
    result.decode_tokens_per_s, result.step = decode_rate(llm, images[:concurrency], output_tokens, profile)
    if concurrency == 1:  # queue time is other requests' turn, not this one's latency
        result.ttft_s = [o.metrics["encode_s"] + o.metrics["prefill_s"] for o in outputs]
    return result


def decode_rate(
    llm, images: list[Image.Image], output_tokens: int, profile: bool = True
) -> tuple[float, StepCost]:
    """Steady-state decode tokens/s with len(images) requests running (all prefilled, then timed steps), and
    the cost of one such step: its median time, the GEMM floor of as many rows, and a profiled breakdown.
    Where the KV cache holds fewer requests than that, the rest wait and run after: the timed steps are those
    of the last requests, as many as the cache held at once, and the rate counts those rows (so a cache that
    holds more tokens per byte shows its capacity at the same --kv-cache-mb)."""
    from mmserve.multimodal.messages import parse_messages

    engine = llm.engine
    for i, image in enumerate(images):
        template, media = parse_messages(chat_messages(image))
        text = llm.tokenizer.apply_chat_template(template, add_generation_prompt=True, tokenize=False)
        ids = llm.tokenizer(text, add_special_tokens=False)["input_ids"]
        engine.add_request(
            f"decode-rate-{time.monotonic_ns()}-{i}",
            ids,
            SamplingParams(temperature=0, max_tokens=output_tokens, ignore_eos=True),
            llm.encode(media)[0],
        )
    while engine.is_prefilling:
        engine.step()
    rows = sum(1 for r in engine.scheduler.running if not r.is_prefill)
    # the last steps, every request still decoding; none without `profile` (the profiler's events of an emulated
    # bf16 GEMM, on a CPU without native bf16, took 8 GB for three steps at 16 rows)
    profiled = min(3, max(0, output_tokens - 4)) if profile else 0
    # The first output came with the prefill.
    times, floors = steps_beside_floor(
        engine, output_tokens - 1 - profiled, GemmFloor(engine.runner, rows)
    )
    step_s = statistics.median(times)
    parts = breakdown(engine, profiled, step_s) if profiled else {}
    while engine.has_work:
        engine.step()
    cost = StepCost(rows, step_s * 1e3, statistics.median(floors) * 1e3, parts)
    return rows / step_s, cost


def run(
    model_dir: str,
    concurrencies: list[int],
    num_requests: int,
    hf_requests: int,
    output_tokens: int,
    rounds: int,
    image_size: tuple[int, int],
    dtype: str,
    kv_cache_mb: float,
    hf_layers: bool = False,
    eager_ops: bool = False,
    fp32_gemm: str = "auto",
    mkl_gemm: bool = False,
    profile: bool = True,
    quantizations: tuple[str, ...] = (),
    kv_cache_dtypes: tuple[str, ...] = (),
) -> dict[str, list[RunResult]]:
    """Every engine with `fp32_gemm` (`--fp32-gemm`), and beside each, in the same rounds: with `hf_layers` the
    same engine running transformers' layer code instead of its fused layers (`--disable-layer-fusion`); with
    `eager_ops` the same engine running PyTorch ops instead of mmserve's CPU kernels (`--disable-cpu-kernels`);
    with `mkl_gemm` the same engine with its fp32 GEMMs in MKL (`--fp32-gemm mkl`); for each of `quantizations`
    and `kv_cache_dtypes`, and each pair of them, the same engine with its weights quantized on load
    (`--quantization int8|int4`) and its KV cache in that type (`--kv-cache-dtype fp8`)."""
    from mmserve.llm import LLM

    ref = HFReference(model_dir, dtype=dtype)
    base = {"fp32_gemm": fp32_gemm}
    variants = [("", base)]  # name suffix, LLM options
    variants += [(" hf-layers", {**base, "fuse_layers": False})] if hf_layers else []
    variants += [(" eager-ops", {**base, "cpu_kernels": False})] if eager_ops else []
    variants += [(" mkl-gemm", {"fp32_gemm": "mkl"})] if mkl_gemm else []
    for q in (None, *quantizations):
        for kv in ("auto", *kv_cache_dtypes):
            if q is not None or kv != "auto":
                name = (f" {q}" if q else "") + (f" kv-{kv}" if kv != "auto" else "")
                variants.append((name, {**base, "quantization": q, "kv_cache_dtype": kv}))
    engines = {
        f"engine c={c}{suffix}": (
            c,
            LLM(model_dir, dtype=dtype, kv_cache_mb=kv_cache_mb, max_num_seqs=c, **options),
        )
        for c in concurrencies
        for suffix, options in variants
    }
    cfg = load_model_config(model_dir)
    engine = next(iter(engines.values()))[1].engine
    print(
        f"model {model_dir}: {cfg.num_layers} layers ({sum(s.has_kv for s in engine.family.layer_specs)} with KV), "
        f"{cfg.num_kv_heads} KV heads x {cfg.head_dim} dims; KV cache {engine.kv_bytes_per_token} bytes/token in "
        f"{dtype}" + (f"; {engine.states.slot_bytes / 2**20:.2f} MB of state per request" if engine.states else "")
    )
    for name, (_, llm) in engines.items():
        print(f"{name}: {streamed_bytes(llm.engine.runner) / 2**20:.3f} MB of linear weights per decode step")
    results: dict[str, list[RunResult]] = {}
    seed = 0
    # HF's requests bracket the engine's in each round, half before and half after: this machine's memory
    # bandwidth drifts over minutes, and a baseline measured only before the engine runs could be off by 30%.
    hf_before = (hf_requests + 1) // 2
    hf_runs = [("hf", hf_before)] + ([("hf", hf_requests - hf_before)] if hf_requests > hf_before else [])
    for r in range(rounds):
        engine_runs = [(name, max(num_requests, c)) for name, (c, _) in engines.items()]
        for name, count in [hf_runs[0], *engine_runs, *hf_runs[1:]]:
            images = [make_image(seed + i, image_size) for i in range(count)]
            seed += count
            if name == "hf":
                res = run_hf(ref, images, output_tokens)
            else:
                c, llm = engines[name]
                res = run_engine(llm, images, output_tokens, c, name, profile)
            results.setdefault(name, []).append(res)
            print(
                f"round {r + 1} {name:<12} {res.tokens_per_s:8.1f} output tok/s ({res.seconds:.1f}s)",
                flush=True,
            )
    return results


def report(results: dict[str, list[RunResult]]) -> str:
    base = statistics.median(r.tokens_per_s for r in results["hf"])
    base_ttft = statistics.median(t for r in results["hf"] for t in r.ttft_s)
    base_decode = statistics.median(r.decode_tokens_per_s for r in results["hf"])
    lines = [
        "| configuration | output tok/s, end to end | vs hf | decode tok/s | vs hf | TTFT, 1 at a time (s) | vs hf |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, runs in results.items():
        tps = statistics.median(r.tokens_per_s for r in runs)
        ttfts = [t for r in runs for t in r.ttft_s]
        ttft = statistics.median(ttfts) if ttfts else None
        ttft_cells = f"{ttft:.3f} | {ttft / base_ttft:.2f}x" if ttft else " | "
        decode = statistics.median(r.decode_tokens_per_s for r in runs)
        lines.append(
            f"| {name} | {tps:.1f} | {tps / base:.2f}x | {decode:.1f} | {decode / base_decode:.2f}x | {ttft_cells} |"
        )
    return "\n".join(lines)


def step_report(results: dict[str, list[RunResult]]) -> str:
    """The decode step of each engine configuration against its GEMM floor (medians over rounds)."""
    lines = [
        "| configuration | rows | step ms | GEMM floor ms | step / floor | GEMM | attention | sampler | scheduler "
        "| other |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, runs in results.items():
        costs = [r.step for r in runs if r.step is not None]
        if not costs:
            continue
        step = statistics.median(c.step_ms for c in costs)
        floor = statistics.median(c.gemm_floor_ms for c in costs)
        profiled = [c for c in costs if c.breakdown_ms]  # none with --no-profile: no breakdown, not zeros
        parts = [statistics.median(c.breakdown_ms[k] for c in profiled) for k in CATEGORIES] if profiled else []
        cells = " | ".join(f"{p:.1f}" for p in parts) if parts else " | ".join("-" for _ in CATEGORIES)
        rows = min(c.rows for c in costs)  # requests decoding in a step: fewer than asked where the cache is full
        lines.append(f"| {name} | {rows} | {step:.1f} | {floor:.1f} | {step / floor:.2f}x | {cells} |")
    return "\n".join(lines)


def to_json(results: dict[str, list[RunResult]], parameters: dict) -> dict:
    """Every figure of both tables, per configuration and round, with the ratios against `hf` (medians)."""
    base = statistics.median(r.tokens_per_s for r in results["hf"])
    base_decode = statistics.median(r.decode_tokens_per_s for r in results["hf"])
    summary = {}
    for name, runs in results.items():
        tps = statistics.median(r.tokens_per_s for r in runs)
        decode = statistics.median(r.decode_tokens_per_s for r in runs)
        summary[name] = {
            "output_tokens_per_s": tps,
            "output_vs_hf": tps / base,
            "decode_tokens_per_s": decode,
            "decode_vs_hf": decode / base_decode,
        }
        steps = [r.step.over_floor for r in runs if r.step is not None]
        if steps:
            summary[name]["step_over_gemm_floor"] = statistics.median(steps)
    rounds = {name: [r.to_json() for r in runs] for name, runs in results.items()}
    return {"parameters": parameters, "summary": summary, "rounds": rounds}
