"""Command line: `mmserve serve MODEL | encoder MODEL | router | bench ... | make-tiny-model | demo`.

Parsing is cheap and imports nothing heavy: a port that is already taken is reported (exit 1) before torch or
transformers load, let alone a model.
"""

from __future__ import annotations

import argparse
import copy
import os
import socket
import sys

from mmserve.cli_args import (
    _cluster_secret,
    _json_arg,
    add_cluster_args,
    add_embedding_store_args,
    add_engine_args,
    add_fp32_gemm_arg,
    add_media_args,
    add_model_arg,
    embedding_store_config_from_args,
    engine_config_from_args,
    media_config_from_args,
)
from mmserve.disagg.cli import add_disagg_serve_args, add_router_args, run_router, serve_pipeline
from mmserve.glibc_heap import share_main_arena

# Re-exported: mmserve.disagg.cli and the tests build configs through this module.
__all__ = [
    "_cluster_secret",
    "add_cluster_args",
    "build_parser",
    "embedding_store_config_from_args",
    "engine_config_from_args",
    "main",
    "media_config_from_args",
    "server_config_from_args",
]
LOG_LEVELS = ["debug", "info", "warning", "error"]


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every option's help ends with its default, as in `vllm serve --help`; an unset option (None, an off
    switch, an empty list) says nothing. Descriptions and epilogs keep their line breaks."""

    def _format_action(self, action: argparse.Action) -> str:
        default = action.default
        unset = default is None or default is False or default == argparse.SUPPRESS or default in ([], ())
        if action.option_strings and not unset and "default" not in (action.help or ""):
            action = copy.copy(action)
            action.help = _with_default(action.help)
        return super()._format_action(action)


def _with_default(help_text: str | None) -> str:
    return f"{help_text} (default: %(default)s)" if help_text else "default: %(default)s"


class ArgumentParser(argparse.ArgumentParser):
    """argparse with `HelpFormatter` for every (sub)command, and MODEL given positionally or as `--model`
    (`add_model_arg`) turned into `args.model`, refused when missing or given twice differently."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        required = getattr(self, "model_required", None)  # set by add_model_arg on that subcommand's parser
        if required is not None:
            positional, flag = namespace.model_arg, namespace.model_flag
            if positional and flag and positional != flag:
                self.error(f"MODEL {positional!r} and --model {flag!r} differ: give the model once")
            namespace.model = positional or flag
            if namespace.model is None and required:
                self.error(f"the model is required: {self.prog} MODEL (or --model MODEL)")
        return namespace, extras


def _make_tiny_model(args: argparse.Namespace) -> int:
    import time

    from mmserve.testing.tiny_models import build_tiny_model

    start = time.perf_counter()
    if args.quantization is None:
        build_tiny_model(args.out, arch=args.arch, size=args.size, seed=args.seed, thinking=args.thinking)
    else:  # the plain checkpoint beside it, then its quantized form (with the dense oracle in reference/)
        import tempfile

        from mmserve.testing.kit_quant import quantize_checkpoint

        with tempfile.TemporaryDirectory() as plain:
            build_tiny_model(plain, arch=args.arch, size=args.size, seed=args.seed, thinking=args.thinking)
            quantize_checkpoint(plain, args.out, args.quantization, seed=args.seed)
    what = f"{args.size} {args.arch}" + (f" ({args.quantization})" if args.quantization else "")
    print(f"wrote {what} model to {args.out} in {time.perf_counter() - start:.1f}s")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from mmserve.demo import run_demo, run_ui_demo

    if args.ui:
        return 0 if run_ui_demo(args.model_dir, args.port) else 1
    return 0 if run_demo(args.model_dir) else 1


def server_config_from_args(args: argparse.Namespace):
    """The `serve` flags as a ServerConfig. `--served-model-name A B C`: A is the name responses report, B
    and C are accepted too; without it, MODEL as typed."""
    from mmserve.config import ServerConfig

    names = args.served_model_name or [args.model]
    limits = dict(ServerConfig.limit_mm_per_prompt)
    limits.update(_json_arg(args.limit_mm_per_prompt, "--limit-mm-per-prompt"))
    return ServerConfig(
        host=args.host,
        port=args.port,
        served_model_name=names[0],
        served_model_aliases=tuple(name for name in dict.fromkeys(names) if name != names[0]),
        api_key=args.api_key,
        limit_mm_per_prompt=tuple((k, int(v)) for k, v in limits.items()),
        max_waiting_requests=args.max_waiting_requests,
        max_request_body_bytes=int(args.max_request_body_mb * 2**20),
        cache_salt_required=args.cache_salt_required,
        enable_mm_embeds=args.enable_mm_embeds,
        max_mm_embeds_bytes=int(args.max_media_mb * 2**20),
        log_level=args.log_level,
        encoder_urls=tuple(args.encoder_urls or ()),
        encoder_workers=args.encoder_workers,
        encoder_routing=args.encoder_routing,
        encoder_probe_interval_s=args.encoder_probe_interval_s,
        encoder_probe_timeout_s=args.encoder_probe_timeout_s,
        cluster_secret=_cluster_secret(args),
        encoder_transport=args.encoder_transport,
        encoder_dispatch_min_items=args.encoder_dispatch_min_items,
        enable_anonymous_registration=args.enable_anonymous_registration,
        disaggregation_mode=args.disaggregation_mode,
        kv_adopt_timeout_s=args.kv_adopt_timeout_s,
        log_stats_interval_s=args.log_stats_interval,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        disable_ui=args.disable_ui,
    )


def _serve(args: argparse.Namespace) -> int:
    if args.prefill_workers or args.decode_workers:
        # The router in front expects every server to report the first name; the servers get all of them
        # (the pipeline forwards argv).
        first = args.served_model_name[0] if args.served_model_name else None
        return serve_pipeline(argparse.Namespace(**{**vars(args), "served_model_name": first}))
    try:
        server_cfg = server_config_from_args(args)
    except ValueError as e:  # settings that cannot work together: one line, before any model loads
        print(f"mmserve serve: error: {e}", file=sys.stderr)
        return 1
    from mmserve.server.launch import serve

    return serve(server_cfg, engine_config_from_args(args))


def _encoder(args: argparse.Namespace) -> int:
    from mmserve.config import EncoderConfig
    from mmserve.encoder.launch import serve_encoder
    from mmserve.models.resolve import resolve_dtype, resolve_model_path

    model = resolve_model_path(args.model)
    cfg = EncoderConfig(
        model=model,
        host=args.host,
        port=args.port,
        dtype=resolve_dtype(model, args.dtype, args.device),
        device=args.device,
        max_batch_items=args.max_batch_items,
        max_batch_wait_ms=args.max_batch_wait_ms,
        max_pending=args.max_pending,
        embedding_cache_mb=args.embedding_cache_mb,
        pack_weights=not args.disable_weight_packing,
        cpu_kernels=not args.disable_cpu_kernels,
        fp32_gemm=args.fp32_gemm,
        quantization=args.quantization,
        register_urls=tuple(args.register_url or ()),
        register_interval_s=args.register_interval_s,
        shm_pool_mb=args.shm_pool_mb,
        mooncake_pool_mb=args.mooncake_pool_mb,
        advertise_url=args.advertise_url,
        media=media_config_from_args(args),
        mm_processor_kwargs=tuple(_json_arg(args.mm_processor_kwargs, "--mm-processor-kwargs").items()),
        cluster_secret=_cluster_secret(args),
        embedding_store=embedding_store_config_from_args(args),
    )
    return serve_encoder(cfg, args.log_level)


def _serve_ports(args: argparse.Namespace) -> list[tuple[str, str, int]]:
    """(flag, host, port) that `serve` will listen on and the user chose (0 and unset ports are free)."""
    ports = [("--port", args.host, args.port)]
    if args.kv_bootstrap_port:
        ports.append(("--kv-bootstrap-port", args.embedding_host, args.kv_bootstrap_port))
    return ports


def cannot_listen(flag: str, host: str, port: int) -> str | None:
    """Why `host:port` cannot be listened on (one line naming `flag`), or None. Binds and closes at once,
    with SO_REUSEADDR as uvicorn does, so a port in TIME_WAIT counts as free and a listening one as taken."""
    if port == 0:
        return None
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
    except OSError as e:  # socket.gaierror included: a host name that does not resolve
        return f"{flag} {port}: cannot listen on {host}:{port}: {e.strerror or e}"
    return None


def add_serve_args(p: argparse.ArgumentParser) -> None:
    from mmserve.config import ServerConfig
    from mmserve.server.reasoning import REASONING_PARSERS
    from mmserve.server.tool_parsers import PARSERS

    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="names clients may pass as `model`; responses report the first (default: MODEL as typed)",
    )
    p.add_argument("--limit-mm-per-prompt", default=None, help='JSON, e.g. \'{"image": 4, "video": 1}\'')
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument(
        "--disable-ui", action="store_true", help="serve no playground (/) and no dashboard (/dashboard)"
    )
    p.add_argument("--max-waiting-requests", type=int, default=256)
    p.add_argument("--max-request-body-mb", type=float, default=64)
    p.add_argument(
        "--cache-salt-required",
        action="store_true",
        help="refuse (400) requests without a cache_salt, so every cache hit stays in its tenant's scope",
    )
    p.add_argument(
        "--enable-mm-embeds",
        action="store_true",
        help="accept precomputed embeddings as content parts (image_embeds, video_embeds, audio_embeds)",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model decide to call tools (tool_choice "auto", the default when tools are given)',
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(PARSERS),
        help="how the model writes tool calls (vLLM's names; default: the model family's own when its chat "
        "template renders tools: qwen3_coder for Qwen3.5 / MiniCPM-V 4.6, mistral for Mistral 3, glm45 for "
        "GLM-4.1V / 4.5V; hermes for the rest and for templates without tools)",
    )
    p.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_PARSERS),
        help="split a thinking model's output into `reasoning` and `content` (vLLM's names: qwen3 for Qwen3 / "
        "Qwen3.5 / Qwen3-VL-Thinking, glm45 for GLM-4.5V / GLM-4.1V-Thinking, deepseek_r1); "
        "output constraints and tool calls then apply to the content only",
    )
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    p.add_argument(
        "--log-stats-interval",
        type=float,
        default=ServerConfig.log_stats_interval_s,
        metavar="SECONDS",
        help="log a one-line throughput / queue / KV / cache summary this often while busy (0: off)",
    )
    p.add_argument(
        "--encoder-urls", nargs="*", default=None, help="encoder services to dispatch media to (EPD)"
    )
    p.add_argument("--encoder-workers", type=int, default=0, help="spawn N local encoder processes (EPD)")
    p.add_argument(
        "--language-only", action="store_true", help="load no tower weights; media via encoders only"
    )
    p.add_argument(
        "--encoder-routing",
        default="cache_affinity",
        choices=["cache_affinity", "round_robin", "least_loaded"],
    )
    p.add_argument(
        "--encode-timeout-s", type=float, default=60.0, help="a request's embeddings must arrive by then"
    )
    p.add_argument("--encoder-probe-interval-s", type=float, default=5.0)
    p.add_argument("--encoder-probe-timeout-s", type=float, default=2.0)
    p.add_argument(
        "--encoder-transport",
        default="auto",
        choices=["auto", "tcp", "shm", "mooncake"],
        help="how encoders send embeddings here: auto = shared memory for --encoder-workers, tcp for others",
    )
    p.add_argument(
        "--encoder-dispatch-min-items",
        type=int,
        default=ServerConfig.encoder_dispatch_min_items,
        help="requests with fewer media items are encoded by this server's own tower (when it has one); "
        "0 sends every request to the encoders",
    )
    p.add_argument(
        "--embedding-host",
        default="127.0.0.1",
        help="address the embedding receivers bind (for remote encoders)",
    )
    p.add_argument("--mooncake-pool-mb", type=float, default=256.0, help="Mooncake transfer landing pool")
    add_disagg_serve_args(p)
    add_embedding_store_args(p)
    add_cluster_args(p)
    p.add_argument(
        "--enable-anonymous-registration",
        action="store_true",
        help="without a cluster secret, open /register_encoder, /unregister_encoder and /encoders to anyone "
        "who can reach the port (they could redirect users' media); ignored when a secret is set",
    )


def add_encoder_args(p: argparse.ArgumentParser) -> None:
    from mmserve.config import QUANTIZATIONS

    add_model_arg(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--dtype", default="auto", help="auto (the checkpoint's) | float32 | bfloat16 | float16")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-batch-items", type=int, default=8, help="items fused into one tower forward")
    p.add_argument("--max-batch-wait-ms", type=float, default=5.0)
    p.add_argument("--max-pending", type=int, default=64, help="jobs queued or running; more get 503")
    p.add_argument("--embedding-cache-mb", type=float, default=1024)
    p.add_argument(
        "--disable-weight-packing",
        action="store_true",
        help="keep the tower's linear weights in PyTorch's layout (default on a CPU in bf16/fp16: packed once "
        "into oneDNN's, same outputs, faster)",
    )
    add_fp32_gemm_arg(p)
    p.add_argument(
        "--disable-cpu-kernels",
        action="store_true",
        help="run the Qwen-VL towers' vision RoPE as PyTorch ops (default on a CPU: mmserve's kernel, the same bits)",
    )
    p.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default=None,
        help="quantize the tower's linear layers on load, weight-only (int8 per channel, int4 per group of 128); "
        "a tower is compute-bound, so this saves memory, not time",
    )
    p.add_argument("--register-url", nargs="*", default=None, help="language servers to register with")
    p.add_argument("--register-interval-s", type=float, default=5.0, help="registration heartbeat period")
    p.add_argument("--advertise-url", default=None, help="URL servers use to reach this encoder")
    p.add_argument("--shm-pool-mb", type=float, default=256.0, help="shared-memory pool per engine (shm://)")
    p.add_argument("--mooncake-pool-mb", type=float, default=256.0, help="Mooncake transfer staging pool")
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    add_media_args(p)
    add_embedding_store_args(p)
    add_cluster_args(p)


def build_parser() -> argparse.ArgumentParser:
    from mmserve.models.family import FAMILIES
    from mmserve.testing.kit_base import SIZES
    from mmserve.testing.kit_quant import FORMATS as KIT_FORMATS

    parser = ArgumentParser(prog="mmserve", description="Multimodal LLM serving with EPD disaggregation")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-tiny-model", help="build a random-weight checkpoint offline")
    p.add_argument("--arch", choices=sorted(FAMILIES), default="qwen2_vl", help="HF model_type of the family")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument(
        "--size",
        choices=SIZES,
        default="tiny",
        help="tiny (tests), small (Qwen2-0.5B-like, bench), 2b (qwen2_vl only: Qwen2-VL-2B's shapes, 4.4 GB), "
        "7b (qwen2_5_vl only: Qwen2.5-VL-7B's shapes, 16 GB)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--thinking",
        action="store_true",
        help="a thinking model (qwen3_5, qwen3_5_moe): Qwen3.6's real chat template and <think> tokens",
    )
    p.add_argument(
        "--quantization",
        choices=KIT_FORMATS,
        default=None,
        help="write the checkpoint quantized in a published format (the language model's linear layers; "
        "compressed-tensors ones by that library), with its dense oracle in OUT/reference",
    )
    p.set_defaults(func=_make_tiny_model)

    p = sub.add_parser("serve", help="OpenAI-compatible server (API process + engine process)")
    add_serve_args(p)
    p.set_defaults(func=_serve, listen_ports=_serve_ports)

    p = sub.add_parser("router", help="OpenAI front of prefill and decode servers (P/D disaggregation)")
    add_router_args(p)
    p.set_defaults(func=run_router, listen_ports=lambda args: [("--port", args.host, args.port)])

    p = sub.add_parser("encoder", help="standalone encoder service (tower weights only: vision or audio)")
    add_encoder_args(p)
    p.set_defaults(func=_encoder, listen_ports=lambda args: [("--port", args.host, args.port)])

    from mmserve.bench.commands import add_bench_parser

    add_bench_parser(sub)

    p = sub.add_parser("demo", help="run the stack on the embedded tiny model")
    p.add_argument("--model-dir", default="models/tiny-qwen2-vl")
    p.add_argument("--ui", action="store_true", help="serve the playground and dashboard until Ctrl-C")
    p.add_argument("--port", type=int, default=8000, help="with --ui: the server's port")
    p.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    from mmserve.bench.commands import default_subcommand

    argv = default_subcommand(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # as typed: the P/D pipeline forwards it to its servers (mmserve.disagg.pipeline)
    for flag, host, port in getattr(args, "listen_ports", lambda _: [])(args):
        if problem := cannot_listen(flag, host, port):
            print(f"mmserve {args.command}: error: {problem}", file=sys.stderr)
            return 1
    # Several threads of one process run torch (engine loop and encode thread; encoder job threads and
    # batcher), and the engine and encoder processes share the cores. With libgomp's default spin-wait, each
    # thread's OpenMP team spins ~0.1-0.2 s after every parallel region and starves everyone else on a small
    # machine (measured: POST /encode of a 64x64 image 150 ms -> 11 ms; EPD p90 TTFT under image load 1.4x ->
    # 0.9x of monolithic). A short spin keeps decode throughput (passive waiting cost 15% at 16 requests).
    # Must be set before torch initialises OpenMP; child processes inherit it; an explicit user setting wins.
    os.environ.setdefault("GOMP_SPINCOUNT", "20000")
    if args.command == "encoder":
        # An encoder serves short, bursty jobs next to an engine that needs the cores: never spin.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # Weight-loading bars drown the output. transformers reads huggingface_hub's switch when it is imported;
    # setting it here, not through transformers' logging, keeps transformers (1.5 s) off the path to the
    # engine's spawn, and the child processes inherit it. An explicit user setting wins.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # Before any thread of torch's allocates: they all share glibc's main arena then (mmserve.glibc_heap).
    share_main_arena()
    return args.func(args)


def run() -> None:
    """The `mmserve` command: `main`, then leave without the interpreter's teardown (mmserve.fast_exit)."""
    from mmserve.fast_exit import exit_now

    exit_now(main())


if __name__ == "__main__":
    run()
