"""Command line: `mmserve make-tiny-model | demo`."""

from __future__ import annotations

import argparse
import os
import sys

from mmserve.disagg.cli import add_disagg_serve_args, add_router_args, run_router, serve_pipeline


def _make_tiny_model(args: argparse.Namespace) -> int:
    import time

    from mmserve.testing.tiny_models import build_tiny_model

    start = time.perf_counter()
    build_tiny_model(args.out, arch=args.arch, size=args.size, seed=args.seed)
    print(f"wrote {args.size} {args.arch} model to {args.out} in {time.perf_counter() - start:.1f}s")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from mmserve.demo import run_demo

    return 0 if run_demo(args.model_dir) else 1


def _json_arg(text: str | None, flag: str) -> dict:
    import json

    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise SystemExit(f"{flag}: not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise SystemExit(f"{flag}: expected a JSON object")
    return value


def media_config_from_args(args: argparse.Namespace):
    from mmserve.config import MediaConfig

    return MediaConfig(
        max_media_bytes=int(args.max_media_mb * 2**20), fetch_timeout_s=args.media_fetch_timeout_s,
        allowed_local_media_path=args.allowed_local_media_path,
        allowed_media_domains=tuple(args.allowed_media_domains or ()), allow_private_urls=args.allow_private_media_urls,
        allowed_media_networks=tuple(args.allowed_media_networks or ()),
        media_host_overrides=tuple(args.media_resolve or ()),
    )  # fmt: skip


def _host_override(text: str) -> tuple[str, str]:
    """argparse type of --media-resolve: "HOST=IP" -> (normalised host, IP)."""
    import ipaddress

    host, _, ip = text.partition("=")
    try:
        ipaddress.ip_address(ip)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HOST=IP, got {text!r}") from None
    if not host:
        raise argparse.ArgumentTypeError(f"expected HOST=IP, got {text!r}")
    return host.rstrip(".").lower(), ip


def _network(text: str) -> str:
    import ipaddress

    try:
        return str(ipaddress.ip_network(text, strict=False))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not an IP network: {text!r}") from e


def engine_config_from_args(args: argparse.Namespace):
    from mmserve.config import EngineConfig
    from mmserve.models.loader import resolve_model_path

    media = media_config_from_args(args)
    return EngineConfig(
        model=resolve_model_path(args.model), dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        kv_cache_mb=args.kv_cache_mb, disable_prefix_cache=args.disable_prefix_cache,
        embedding_cache_mb=args.embedding_cache_mb,
        mm_processor_kwargs=tuple(_json_arg(args.mm_processor_kwargs, "--mm-processor-kwargs").items()), media=media,
        language_only=getattr(args, "language_only", False), encode_timeout_s=getattr(args, "encode_timeout_s", 60.0),
        max_prompt_tokens=args.max_prompt_tokens, max_mm_pixels_per_prompt=args.max_mm_pixels_per_prompt,
        embedding_host=getattr(args, "embedding_host", "127.0.0.1"),
        mooncake_pool_mb=getattr(args, "mooncake_pool_mb", 256.0),
        embedding_store=embedding_store_config_from_args(args),
        disaggregation_mode=getattr(args, "disaggregation_mode", "null"),
        kv_transfer_timeout_s=getattr(args, "kv_transfer_timeout_s", 30.0),
        kv_bootstrap_port=getattr(args, "kv_bootstrap_port", 0),
    )  # fmt: skip


def embedding_store_config_from_args(args: argparse.Namespace):
    """The --embedding-store* flags as an EmbeddingStoreConfig, or None without --embedding-store."""
    from mmserve.config import EmbeddingStoreConfig
    from mmserve.encoder.store_backends import BACKENDS

    if not getattr(args, "embedding_store", None):
        return None
    try:
        cfg = EmbeddingStoreConfig(
            args.embedding_store,
            local_host=args.embedding_store_local_host,
            segment_mb=args.embedding_store_segment_mb,
            buffer_mb=args.embedding_store_buffer_mb,
            timeout_s=args.embedding_store_timeout_s,
            retry_s=args.embedding_store_retry_s,
        )
    except ValueError as e:
        raise SystemExit(f"--embedding-store: {e}") from None
    if cfg.scheme not in BACKENDS:
        raise SystemExit(f"--embedding-store: unknown scheme {cfg.scheme!r}; known: {sorted(BACKENDS)}")
    return cfg


def _serve(args: argparse.Namespace) -> int:
    if args.prefill_workers or args.decode_workers:
        return serve_pipeline(args)
    from mmserve.config import ServerConfig
    from mmserve.server.launch import serve

    limits = dict(ServerConfig.limit_mm_per_prompt)
    limits.update(_json_arg(args.limit_mm_per_prompt, "--limit-mm-per-prompt"))
    server_cfg = ServerConfig(
        host=args.host, port=args.port, served_model_name=args.served_model_name or args.model,
        api_key=args.api_key, limit_mm_per_prompt=tuple((k, int(v)) for k, v in limits.items()),
        max_waiting_requests=args.max_waiting_requests, max_request_body_bytes=int(args.max_request_body_mb * 2**20),
        cache_salt_required=args.cache_salt_required,
        enable_mm_embeds=args.enable_mm_embeds, max_mm_embeds_bytes=int(args.max_media_mb * 2**20),
        log_level=args.log_level, encoder_urls=tuple(args.encoder_urls or ()), encoder_workers=args.encoder_workers,
        encoder_routing=args.encoder_routing, encoder_probe_interval_s=args.encoder_probe_interval_s,
        encoder_probe_timeout_s=args.encoder_probe_timeout_s, cluster_secret=_cluster_secret(args),
        encoder_transport=args.encoder_transport, encoder_dispatch_min_items=args.encoder_dispatch_min_items,
        enable_anonymous_registration=args.enable_anonymous_registration,
        disaggregation_mode=args.disaggregation_mode, kv_adopt_timeout_s=args.kv_adopt_timeout_s,
    )  # fmt: skip
    return serve(server_cfg, engine_config_from_args(args))


def _encoder(args: argparse.Namespace) -> int:
    from mmserve.config import EncoderConfig
    from mmserve.encoder.launch import serve_encoder
    from mmserve.models.loader import resolve_model_path

    cfg = EncoderConfig(
        model=resolve_model_path(args.model), host=args.host, port=args.port, dtype=args.dtype, device=args.device,
        max_batch_items=args.max_batch_items, max_batch_wait_ms=args.max_batch_wait_ms, max_pending=args.max_pending,
        embedding_cache_mb=args.embedding_cache_mb, register_urls=tuple(args.register_url or ()),
        register_interval_s=args.register_interval_s, shm_pool_mb=args.shm_pool_mb,
        mooncake_pool_mb=args.mooncake_pool_mb, advertise_url=args.advertise_url, media=media_config_from_args(args),
        mm_processor_kwargs=tuple(_json_arg(args.mm_processor_kwargs, "--mm-processor-kwargs").items()),
        cluster_secret=_cluster_secret(args), embedding_store=embedding_store_config_from_args(args),
    )  # fmt: skip
    return serve_encoder(cfg, args.log_level)


def _cluster_secret(args: argparse.Namespace) -> str | None:
    from mmserve.transport.cluster_auth import resolve_secret

    try:
        secret = resolve_secret(args.cluster_secret)
    except ValueError as e:
        raise SystemExit(f"--cluster-secret / $MMSERVE_CLUSTER_SECRET: {e}") from None
    return secret.secret.decode() if secret else None


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster-secret", default=None,
                   help="shared secret of encoders and language servers (>= 16 bytes; prefer the "
                        "MMSERVE_CLUSTER_SECRET environment variable: argv is visible to other users)")  # fmt: skip


def add_embedding_store_args(p: argparse.ArgumentParser) -> None:
    from mmserve.config import EmbeddingStoreConfig as C

    p.add_argument(
        "--embedding-store",
        default=None,
        metavar="mooncake://HOST:PORT",
        help="global embedding store (a Mooncake master) shared by every instance pointed at it, "
        "consulted after the local embedding cache",
    )
    p.add_argument(
        "--embedding-store-local-host",
        default=C.local_host,
        help="address other instances reach this process's store segment at",
    )
    p.add_argument(
        "--embedding-store-segment-mb",
        type=float,
        default=C.segment_mb,
        help="memory this process contributes to the store",
    )
    p.add_argument(
        "--embedding-store-buffer-mb",
        type=float,
        default=C.buffer_mb,
        help="transfer buffer; bounds the size of one entry",
    )
    p.add_argument(
        "--embedding-store-timeout-s",
        type=float,
        default=C.timeout_s,
        help="give up on one store get/put after this (the item is encoded locally)",
    )
    p.add_argument(
        "--embedding-store-retry-s",
        type=float,
        default=C.retry_s,
        help="after a failure, leave the store alone this long",
    )


def add_media_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mm-processor-kwargs", default=None, help="JSON, e.g. '{\"max_pixels\": 802816}'")
    p.add_argument(
        "--allowed-local-media-path", default=None, help="file:// media is read only below this dir"
    )
    p.add_argument(
        "--allowed-media-domains", nargs="*", default=None, help="http(s) media only from these hosts"
    )
    p.add_argument("--allow-private-media-urls", action="store_true",
                   help="allow media URLs on loopback/private addresses (intranets, tests)")  # fmt: skip
    p.add_argument(
        "--allowed-media-networks",
        nargs="*",
        type=_network,
        default=None,
        metavar="CIDR",
        help="allow media from these private networks only (narrower than --allow-private-media-urls)",
    )
    p.add_argument(
        "--media-resolve",
        type=_host_override,
        nargs="*",
        default=None,
        metavar="HOST=IP",
        help="pin media host names to addresses before DNS (like curl --resolve); still checked",
    )
    p.add_argument("--max-media-mb", type=float, default=32)
    p.add_argument("--media-fetch-timeout-s", type=float, default=10)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="local checkpoint directory or hub id")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 | auto")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64, help="cap on running requests")
    p.add_argument("--kv-cache-mb", type=float, default=None, help="KV budget (default: 20%% of free memory)")
    p.add_argument("--disable-prefix-cache", action="store_true")
    p.add_argument("--embedding-cache-mb", type=float, default=512)
    p.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=None,
        help="per-request prompt limit, media tokens included (default: the context length)",
    )
    p.add_argument(
        "--max-mm-pixels-per-prompt",
        type=int,
        default=None,
        help="per-request limit on model-input pixels over all images and video frames",
    )
    add_media_args(p)


def build_parser() -> argparse.ArgumentParser:
    from mmserve.config import ServerConfig

    parser = argparse.ArgumentParser(
        prog="mmserve", description="Multimodal LLM serving with EPD disaggregation"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    from mmserve.models.family import FAMILIES

    p = sub.add_parser("make-tiny-model", help="build a random-weight checkpoint offline")
    p.add_argument("--arch", choices=sorted(FAMILIES), default="qwen2_vl", help="HF model_type of the family")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--size", choices=["tiny", "small"], default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_make_tiny_model)

    p = sub.add_parser("serve", help="OpenAI-compatible server (API process + engine process)")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--limit-mm-per-prompt", default=None, help='JSON, e.g. \'{"image": 4, "video": 1}\'')
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
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
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
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
    p.set_defaults(func=_serve)

    p = sub.add_parser("router", help="OpenAI front of prefill and decode servers (P/D disaggregation)")
    add_router_args(p)
    p.set_defaults(func=run_router)

    p = sub.add_parser("encoder", help="standalone encoder service (tower weights only: vision or audio)")
    p.add_argument("--model", required=True, help="local checkpoint directory or hub id")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-batch-items", type=int, default=8, help="items fused into one tower forward")
    p.add_argument("--max-batch-wait-ms", type=float, default=5.0)
    p.add_argument("--max-pending", type=int, default=64, help="jobs queued or running; more get 503")
    p.add_argument("--embedding-cache-mb", type=float, default=1024)
    p.add_argument("--register-url", nargs="*", default=None, help="language servers to register with")
    p.add_argument("--register-interval-s", type=float, default=5.0, help="registration heartbeat period")
    p.add_argument("--advertise-url", default=None, help="URL servers use to reach this encoder")
    p.add_argument("--shm-pool-mb", type=float, default=256.0, help="shared-memory pool per engine (shm://)")
    p.add_argument("--mooncake-pool-mb", type=float, default=256.0, help="Mooncake transfer staging pool")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_media_args(p)
    add_embedding_store_args(p)
    add_cluster_args(p)
    p.set_defaults(func=_encoder)

    from mmserve.bench.commands import add_bench_parser

    add_bench_parser(sub)

    p = sub.add_parser("demo", help="run the stack on the embedded tiny model")
    p.add_argument("--model-dir", default="models/tiny-qwen2-vl")
    p.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    from mmserve.bench.commands import default_subcommand

    argv = default_subcommand(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # as typed: the P/D pipeline forwards it to its servers (mmserve.disagg.pipeline)
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
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-process CLI setting: weight-loading bars drown the output
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
