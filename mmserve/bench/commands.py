"""`mmserve bench ...` command line: run (alias serve), compare, engine, stages, epd, transfer, kv, kv-memory."""

from __future__ import annotations

import argparse
import json
import secrets
import shlex
import sys

RUN_ALIASES = {"run", "serve", "compare", "engine", "stages", "epd", "transfer", "kv", "kv-memory"}


def _workload(args: argparse.Namespace):
    from mmserve.bench.workload import WorkloadConfig, parse_range, parse_sizes

    return WorkloadConfig(
        num_requests=args.num_requests,
        images_per_request=parse_range(args.images_per_request),
        image_sizes=parse_sizes(args.image_size),
        image_format=args.image_format,
        image_reuse=args.image_reuse,
        reuse_pool_size=args.reuse_pool_size,
        video=args.video,
        video_frames=args.video_frames,
        prompt_tokens=args.prompt_tokens,
        system_prompt_tokens=args.system_prompt_tokens,
        output_tokens=args.output_tokens,
        seed=args.seed,
    )


def _load(args: argparse.Namespace, url: str):
    from mmserve.bench.client import LoadConfig

    return LoadConfig(
        url=url,
        model=args.served_model,
        concurrency=args.concurrency,
        request_rate=args.request_rate,
        timeout_s=args.timeout_s,
        api_key=args.api_key,
        warmup=args.warmup,
        seed=args.seed,
    )


def _choose_seed(args: argparse.Namespace) -> None:
    """Without --seed, a fresh one: a long-lived server would otherwise serve a repeated run's images (and
    prompts) from its caches. The seed is printed and written to --json, so the run can be repeated."""
    if args.seed is None:
        args.seed = secrets.randbelow(2**31)
        print(f"workload seed {args.seed} (pass --seed {args.seed} to repeat this workload)", flush=True)


def _parameters(args: argparse.Namespace, workload, load) -> dict:
    """Everything that defines the run, for the --json output (never the API key)."""
    import dataclasses

    fields = {k: v for k, v in dataclasses.asdict(load).items() if k not in ("api_key", "progress")}
    return {"workload": dataclasses.asdict(workload), "load": fields, "slo": args.slo}


def _write_json(path: str | None, payload) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(payload, f, indent=2)
        print(f"wrote {path}")


def _run(args: argparse.Namespace) -> int:
    import tempfile

    from mmserve.bench import compare, stats
    from mmserve.bench.workload import build_workload
    from mmserve.testing.server_process import start_server

    if bool(args.url) == bool(args.launch is not None):
        raise SystemExit("give exactly one of --url or --launch")
    if args.launch is not None and not args.model:
        raise SystemExit("--launch needs --model")
    _choose_seed(args)
    slo = stats.parse_slo(args.slo) if args.slo else None
    workload = _workload(args)
    requests = build_workload(workload)
    with tempfile.TemporaryDirectory() as logs:
        server = None
        if args.launch is not None:
            server = start_server(
                args.model, *shlex.split(args.launch), log_dir=logs, timeout_s=900, served_model_name="bench"
            )
        load = _load(args, args.url or server.url)
        try:
            summary, server_side = compare.run_one(load, requests, slo, not args.no_server_metrics)
        finally:
            if server is not None:
                server.stop()
    print(summary.table())
    print(compare.format_breakdown(server_side))
    _write_json(args.json, {**compare.result_json(summary, server_side), **_parameters(args, workload, load)})
    return 0


def _compare(args: argparse.Namespace) -> int:
    from mmserve.bench import compare, stats
    from mmserve.bench.peer import PeerError, PeerSpec

    configs = {}
    for spec in args.config:
        name, _, flags = spec.partition("=")
        configs[name.strip()] = flags
    try:
        peers = tuple(PeerSpec.parse(spec) for spec in args.peer)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    names = [*configs, *(p.name for p in peers)]
    if not names:
        raise SystemExit("give at least one --config or --peer")
    if len(set(names)) != len(names) or any(p.name == "hf" for p in peers):
        raise SystemExit(f"configuration and peer names must be distinct (and a peer is not 'hf'): {names}")
    _choose_seed(args)
    slo = stats.parse_slo(args.slo) if args.slo else None
    workload, load = _workload(args), _load(args, "")
    try:
        results = compare.compare(
            args.model, configs, workload, load, args.rounds, slo, peers, args.one_at_a_time
        )
    except PeerError as e:
        raise SystemExit(f"bench compare: {e}") from None
    print(compare.report(results))
    _write_json(args.json, {"results": results, **_parameters(args, workload, load)})
    if args.plot:
        compare.plot(results, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _engine(args: argparse.Namespace) -> int:
    from mmserve.bench import engine_bench
    from mmserve.bench.workload import parse_size
    from mmserve.models.resolve import resolve_dtype, resolve_model_path

    model = resolve_model_path(args.model)
    dtype = resolve_dtype(model, args.dtype)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    quantizations = [q for q in (args.quantization or "").split(",") if q]
    kv_dtypes = [d for d in (args.kv_cache_dtype or "").split(",") if d]
    results = engine_bench.run(
        model,
        concurrencies,
        args.num_requests,
        args.hf_requests,
        args.output_tokens,
        args.rounds,
        parse_size(args.image_size),
        dtype,
        args.kv_cache_mb,
        args.hf_layers,
        args.eager_ops,
        args.fp32_gemm,
        args.mkl_gemm,
        not args.no_profile,
        tuple(quantizations),
        tuple(kv_dtypes),
    )
    print(engine_bench.report(results))
    print()
    print(engine_bench.step_report(results))
    parameters = {**vars(args), "model": model, "dtype": dtype, "concurrency": concurrencies}
    parameters.update(quantization=quantizations, kv_cache_dtype=kv_dtypes)
    parameters.pop("func", None)
    _write_json(args.json, engine_bench.to_json(results, parameters))
    return 0


def _stages(args: argparse.Namespace) -> int:
    from mmserve.bench import stages_bench
    from mmserve.bench.workload import parse_sizes
    from mmserve.models.resolve import resolve_dtype, resolve_model_path

    model = resolve_model_path(args.model)
    dtype = resolve_dtype(model, args.dtype)
    counts = [int(n) for n in args.images.split(",") if n]
    tokens = [int(n) for n in args.prefill_tokens.split(",") if n]
    options = {"fp32_gemm": args.fp32_gemm, "cpu_kernels": not args.eager_ops}
    if args.max_num_batched_tokens:
        options["max_num_batched_tokens"] = args.max_num_batched_tokens
    costs = stages_bench.run(
        model, dtype, parse_sizes(args.image_size), counts, tokens, args.rounds, **options
    )
    print(f"\n{model} ({dtype}), medians of {args.rounds} rounds")
    print(stages_bench.summary(costs))
    _write_json(args.json, {"model": model, "dtype": dtype, "stages": [c.to_json() for c in costs]})
    return 0


def _epd(args: argparse.Namespace) -> int:
    from mmserve.bench import epd_bench
    from mmserve.bench.workload import parse_size

    configs = {name: shlex.split(flags) for name, _, flags in (spec.partition("=") for spec in args.config)}
    results = epd_bench.run(
        args.model,
        configs,
        args.rounds,
        parse_size(args.image_size),
        images=args.images,
        same_images=args.same_images,
    )
    print(epd_bench.report(results))
    return 0


def _transfer(args: argparse.Namespace) -> int:
    from mmserve.transport.throughput import PATHS, measure

    print(f"{'MiB':>6} " + " ".join(f"{p:>11}" for p in PATHS) + "   GB/s; shm / memcpy")
    for size in (float(s) for s in args.sizes_mb.split(",")):
        rates = measure(size, args.repeats, args.rounds)
        cells = " ".join(f"{rates[p]:>11.2f}" for p in PATHS)
        print(f"{size:>6g} {cells}   {rates['shm'] / rates['memcpy']:.2f}x", flush=True)
    return 0


def _kv(args: argparse.Namespace) -> int:
    from mmserve.bench import kv_bench
    from mmserve.models.resolve import resolve_dtype, resolve_model_path

    model = resolve_model_path(args.model)
    lens = [int(x) for x in args.prompt_lens.split(",")]
    dtype = resolve_dtype(model, args.dtype)
    rows = kv_bench.run(model, lens, dtype, args.repeats, args.kv_cache_mb, args.kv_cache_dtype)
    print(kv_bench.report(rows))
    _write_json(args.json, rows)
    return 0


def _kv_memory(args: argparse.Namespace) -> int:
    from mmserve.bench import kv_memory
    from mmserve.models.resolve import resolve_dtype, resolve_model_path

    if (args.model is None) == (args.shape is None):
        print("mmserve bench kv-memory: give --model or --shape", file=sys.stderr)
        return 2
    model = resolve_model_path(args.model) if args.model else None
    dtype = (
        resolve_dtype(model, args.dtype) if model else ("bfloat16" if args.dtype == "auto" else args.dtype)
    )
    result = kv_memory.run(
        model, args.shape, dtype, args.prompt_tokens, args.output_tokens, args.max_num_batched_tokens
    )
    print(kv_memory.report(result, dtype))
    _write_json(args.json, kv_memory.as_json(result))
    return 0


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload (synthetic, offline; reproducible under --seed)")
    g.add_argument("--num-requests", type=int, default=64)
    g.add_argument("--images-per-request", default="1", help="N or MIN-MAX")
    g.add_argument("--image-size", default="448x448", help="WxH, or a comma-separated mix")
    g.add_argument("--image-format", default="png", choices=["png", "jpeg"])
    g.add_argument("--image-reuse", type=float, default=0.0, help="fraction of items drawn from a small pool")
    g.add_argument("--reuse-pool-size", type=int, default=8, help="distinct images in that pool")
    g.add_argument("--video", action="store_true", help="add one short generated video per request")
    g.add_argument("--video-frames", type=int, default=8)
    g.add_argument("--prompt-tokens", type=int, default=32)
    g.add_argument(
        "--system-prompt-tokens",
        type=int,
        default=0,
        help="words of a system message before the media, different in every request",
    )
    g.add_argument("--output-tokens", type=int, default=64)
    g.add_argument(
        "--seed",
        type=int,
        default=None,
        help="images, prompts and arrivals from this seed (default: a fresh one per run, printed and in --json)",
    )
    g = p.add_argument_group("load")
    g.add_argument("--concurrency", type=int, default=8, help="requests in flight at most")
    g.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second")
    g.add_argument("--warmup", type=int, default=0, help="requests sent and discarded first")
    g.add_argument("--timeout-s", type=float, default=600)
    g.add_argument("--api-key", default=None)
    g.add_argument("--served-model", default=None, help="model name to send (default: the server's first)")
    g.add_argument("--slo", default=None, help="goodput targets, e.g. ttft_ms=500,tpot_ms=50")
    g.add_argument("--json", default=None, help="write the results, with every parameter and the seed, here")


def _add_run_parser(bench) -> argparse.ArgumentParser:
    p = bench.add_parser(
        "run",
        aliases=["serve"],
        help="drive a synthetic multimodal load against one OpenAI-compatible server",
    )
    p.add_argument(
        "--url",
        "--base-url",
        default=None,
        help="the server, e.g. http://127.0.0.1:8000 (with or without /v1)",
    )
    p.add_argument(
        "--launch",
        default=None,
        help='or launch `mmserve serve` with these flags, e.g. "--encoder-workers 2"',
    )
    p.add_argument("--model", default=None, help="model for --launch")
    p.add_argument(
        "--no-server-metrics",
        action="store_true",
        help="skip the server-side breakdown (skipped anyway when GET /metrics has no mmserve metrics)",
    )
    _add_workload_args(p)
    p.set_defaults(func=_run)
    return p


def add_bench_parser(sub) -> None:
    from mmserve.cli_args import add_fp32_gemm_arg, add_model_arg
    from mmserve.config import KV_CACHE_DTYPES

    bench_parser = sub.add_parser(
        "bench", help="performance, measured side by side (default subcommand: run)"
    )
    bench = bench_parser.add_subparsers(dest="bench_command", required=True)
    run_parser = _add_run_parser(bench)
    # `mmserve bench --url ...` is `mmserve bench run --url ...`: its help lists run's flags too.
    bench_parser.epilog = "`mmserve bench [run] ...`:\n\n" + run_parser.format_help()

    p = bench.add_parser("compare", help="the same workload against several configurations, alternating")
    add_model_arg(p)
    p.add_argument(
        "--config",
        action="append",
        default=[],
        help='NAME="serve flags" (repeatable; NAME hf = plain transformers one at a time)',
    )
    p.add_argument(
        "--peer",
        action="append",
        default=[],
        help='NAME="shell command" starting another OpenAI-compatible server on {port} ({model}: --model), '
        'e.g. llamacpp="llama-server -m m.gguf --mmproj p.gguf --port {port}" (repeatable; docs/llamacpp.md)',
    )
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--one-at-a-time",
        action="store_true",
        help="start each server for its own turn and stop it after (every round): none idles beside the one "
        "measured, and models too large to be loaded twice can be compared",
    )
    p.add_argument("--plot", default=None, help="write latency/throughput bars to this PNG")
    _add_workload_args(p)
    p.set_defaults(func=_compare)

    p = bench.add_parser("engine", help="in-process engine vs HF generate one request at a time")
    add_model_arg(p)
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated engine concurrencies")
    p.add_argument(
        "--num-requests", type=int, default=16, help="requests per engine run (at least its concurrency)"
    )
    p.add_argument(
        "--hf-requests",
        type=int,
        default=4,
        help="requests of the hf baseline per round, half before the engine runs and half after",
    )
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--image-size", default="224x224", help="WxH")
    p.add_argument("--dtype", default="auto", help="as `serve --dtype`; both sides use it")
    p.add_argument("--kv-cache-mb", type=float, default=1024)
    p.add_argument(
        "--hf-layers",
        action="store_true",
        help="also run each engine with transformers' layer code (--disable-layer-fusion), side by side "
        "(every engine is held at once: twice the memory)",
    )
    p.add_argument(
        "--eager-ops",
        action="store_true",
        help="also run each engine with PyTorch ops instead of mmserve's CPU kernels (--disable-cpu-kernels), "
        "side by side (every engine is held at once)",
    )
    add_fp32_gemm_arg(p)
    p.add_argument(
        "--mkl-gemm",
        action="store_true",
        help="also run each engine with its fp32 GEMMs in MKL (--fp32-gemm mkl), side by side",
    )
    p.add_argument(
        "--no-profile",
        action="store_true",
        help="no profiled breakdown of the decode step (step and floor only): the profiler holds every op's event",
    )
    p.add_argument(
        "--quantization",
        default=None,
        help="comma-separated: also run each engine with its weights quantized on load (e.g. int8,int4), side by "
        "side (every engine is held at once)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default=None,
        help="comma-separated: also run each engine with its KV cache in that type (e.g. fp8), and beside each "
        "--quantization engine too",
    )
    p.add_argument("--json", default=None, help="write every figure (both tables, per round) here")
    p.set_defaults(func=_engine)

    p = bench.add_parser(
        "stages", help="the tower and a prefill chunk part by part against their GEMM/attention floors"
    )
    add_model_arg(p)
    p.add_argument("--dtype", default="auto", help="as `serve --dtype`")
    p.add_argument("--image-size", default="448x448", help="WxH, or a comma-separated list (one table each)")
    p.add_argument("--images", default="1", help="comma-separated images per request (one tower batch each)")
    p.add_argument("--prefill-tokens", default="283,2048", help="comma-separated prefill chunk lengths")
    p.add_argument("--rounds", type=int, default=5, help="runs of each stage, each beside its floor")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="the engine's chunk budget (default: the longest)",
    )
    p.add_argument("--eager-ops", action="store_true", help="PyTorch ops instead of mmserve's CPU kernels")
    add_fp32_gemm_arg(p)
    p.add_argument("--json", default=None, help="write every part of every stage here")
    p.set_defaults(func=_stages)

    p = bench.add_parser(
        "epd", help="TTFT of server configurations side by side, one light request at a time"
    )
    add_model_arg(p)
    p.add_argument("--config", action="append", required=True, help='NAME="serve flags"; ratios vs the first')
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--image-size", default="448x448", help="WxH")
    p.add_argument(
        "--images", type=int, default=1, help="images per request (the adaptive-dispatch crossover)"
    )
    p.add_argument(
        "--same-images",
        action="store_true",
        help="send each round's images to every configuration in turn (store hits after the first)",
    )
    p.set_defaults(func=_epd)

    p = bench.add_parser("transfer", help="embedding transports (tcp, ipc, shm, Mooncake) vs memcpy, one run")
    p.add_argument("--sizes-mb", default="1,16,64", help="comma-separated part sizes")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.set_defaults(func=_transfer)

    p = bench.add_parser("kv", help="prefill -> decode KV handoff per backend (zmq, Mooncake) vs raw ZMQ")
    add_model_arg(p)
    p.add_argument("--prompt-lens", default="256,1024,4096", help="comma-separated prompt lengths (tokens)")
    p.add_argument("--dtype", default="auto", help="as `serve --dtype`")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--kv-cache-mb", type=float, default=1024)
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="both engines' KV cache type (as `serve`)",
    )
    p.add_argument("--json", default=None, help="write the results as JSON here")
    p.set_defaults(func=_kv)

    p = bench.add_parser("kv-memory", help="KV bytes one long request holds, windows freed vs every row kept")
    p.add_argument(
        "--model", default=None, help="a checkpoint with sliding-window layers (local dir or hub id)"
    )
    p.add_argument(
        "--shape", default=None, choices=["gemma3-4b"], help="or build this attention geometry offline"
    )
    p.add_argument("--prompt-tokens", type=int, default=8192)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--dtype", default="auto", help="as `serve --dtype` (with --shape: bfloat16)")
    p.add_argument("--json", default=None, help="write the result as JSON here")
    p.set_defaults(func=_kv_memory)


def default_subcommand(argv: list[str]) -> list[str]:
    """`mmserve bench --url ...` means `mmserve bench run --url ...`."""
    if (
        len(argv) >= 1
        and argv[0] == "bench"
        and (len(argv) == 1 or argv[1] not in RUN_ALIASES | {"-h", "--help"})
    ):
        return ["bench", "run", *argv[1:]]
    return argv
