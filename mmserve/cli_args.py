"""Flag groups that several subcommands share (model, engine, media, embedding store, cluster secret), and
the configs built from them. Imports stay light: `mmserve --help` and the port check run before torch."""

from __future__ import annotations

import argparse


def add_model_arg(p: argparse.ArgumentParser, required: bool = True) -> None:
    """MODEL positionally (`mmserve serve MODEL`, as `vllm serve MODEL`) or as `--model MODEL`; the parser
    (mmserve.cli.ArgumentParser) turns either into `args.model` and refuses two different ones."""
    p.add_argument(
        "model_arg", nargs="?", default=None, metavar="MODEL", help="local checkpoint directory or hub id"
    )
    p.add_argument("--model", dest="model_flag", default=None, metavar="MODEL", help="the same as MODEL")
    p.set_defaults(model=None)
    p.usage = "%(prog)s " + ("MODEL" if required else "[MODEL]") + " [options]"
    p.model_required = required  # type: ignore[attr-defined]


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
        max_media_bytes=int(args.max_media_mb * 2**20),
        fetch_timeout_s=args.media_fetch_timeout_s,
        allowed_local_media_path=args.allowed_local_media_path,
        allowed_media_domains=tuple(args.allowed_media_domains or ()),
        allow_private_urls=args.allow_private_media_urls,
        allowed_media_networks=tuple(args.allowed_media_networks or ()),
        media_host_overrides=tuple(args.media_resolve or ()),
    )


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
    """The engine flags as an EngineConfig; `--dtype auto` is resolved here, once (mmserve.models.loader)."""
    from mmserve.config import EngineConfig
    from mmserve.models.resolve import resolve_dtype, resolve_model_path

    model = resolve_model_path(args.model)
    return EngineConfig(
        model=model,
        dtype=resolve_dtype(model, args.dtype, args.device),
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        kv_cache_mb=args.kv_cache_mb,
        state_cache_mb=args.state_cache_mb,
        disable_prefix_cache=args.disable_prefix_cache,
        encode_prefill_overlap=not args.disable_encode_prefill_overlap,
        pack_weights=not args.disable_weight_packing,
        fp32_gemm=args.fp32_gemm,
        fuse_layers=not args.disable_layer_fusion,
        cpu_kernels=not args.disable_cpu_kernels,
        quantization=args.quantization,
        quantize_lm_head=not args.keep_lm_head_unquantized,
        quantize_tower=args.quantize_tower,
        kv_cache_dtype=args.kv_cache_dtype,
        embedding_cache_mb=args.embedding_cache_mb,
        mm_processor_kwargs=tuple(_json_arg(args.mm_processor_kwargs, "--mm-processor-kwargs").items()),
        media=media_config_from_args(args),
        language_only=getattr(args, "language_only", False),
        encode_timeout_s=getattr(args, "encode_timeout_s", 60.0),
        max_prompt_tokens=args.max_prompt_tokens,
        max_mm_pixels_per_prompt=args.max_mm_pixels_per_prompt,
        embedding_host=getattr(args, "embedding_host", "127.0.0.1"),
        mooncake_pool_mb=getattr(args, "mooncake_pool_mb", 256.0),
        embedding_store=embedding_store_config_from_args(args),
        disaggregation_mode=getattr(args, "disaggregation_mode", "null"),
        kv_transfer_timeout_s=getattr(args, "kv_transfer_timeout_s", 30.0),
        kv_bootstrap_port=getattr(args, "kv_bootstrap_port", 0),
    )


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


def _cluster_secret(args: argparse.Namespace) -> str | None:
    from mmserve.transport.cluster_auth import resolve_secret

    try:
        secret = resolve_secret(args.cluster_secret)
    except ValueError as e:
        raise SystemExit(f"--cluster-secret / $MMSERVE_CLUSTER_SECRET: {e}") from None
    return secret.secret.decode() if secret else None


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cluster-secret",
        default=None,
        help="shared secret of encoders and language servers (>= 16 bytes; prefer the "
        "MMSERVE_CLUSTER_SECRET environment variable: argv is visible to other users)",
    )


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
    p.add_argument(
        "--allow-private-media-urls",
        action="store_true",
        help="allow media URLs on loopback/private addresses (intranets, tests)",
    )
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
    add_model_arg(p)
    p.add_argument(
        "--dtype",
        default="auto",
        help="auto (the checkpoint's: bfloat16 for Qwen checkpoints, float32 on a CPU without native bf16) "
        "| float32 | bfloat16 | float16",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's context length")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64, help="cap on running requests")
    p.add_argument(
        "--kv-cache-mb",
        type=float,
        default=None,
        help="KV budget (default: room for --max-num-seqs requests of --max-model-len tokens, at most 20%% of "
        "free memory)",
    )
    p.add_argument(
        "--state-cache-mb",
        type=float,
        default=None,
        help="models with linear-attention layers (Qwen3.5): the budget of per-request states and their "
        "prefix-cache checkpoints (default: 2 x --max-num-seqs states, at most 20%% of free memory)",
    )
    p.add_argument("--disable-prefix-cache", action="store_true")
    p.add_argument(
        "--disable-encode-prefill-overlap",
        action="store_true",
        help="wait for a request's media before prefilling any of it (default: its text before the first item "
        "is prefilled while the media encode)",
    )
    p.add_argument(
        "--disable-weight-packing",
        action="store_true",
        help="keep linear weights in PyTorch's layout (default on a CPU in bf16/fp16: packed once into "
        "oneDNN's, which gives the same outputs faster)",
    )
    add_fp32_gemm_arg(p)
    p.add_argument(
        "--disable-layer-fusion",
        action="store_true",
        help="run the language model's decoder layers through transformers' own code (default for Qwen2-shaped "
        "layers: fused q/k/v and gate/up GEMMs, fewer ops; the same outputs, bitwise in fp32)",
    )
    p.add_argument(
        "--disable-cpu-kernels",
        action="store_true",
        help="run the decode step's norms, RoPE and decode attention, and the Qwen-VL towers' vision RoPE, as "
        "PyTorch ops (default on a CPU: "
        "mmserve's kernels, built once per machine with g++; decode attention reads K/V in place in the pool)",
    )
    add_quantization_args(p)
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


def add_quantization_args(p: argparse.ArgumentParser) -> None:
    from mmserve.config import KV_CACHE_DTYPES, QUANTIZATIONS

    p.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default=None,
        help="quantize a bf16/fp32 checkpoint's language model on load, weight-only: int8 (per channel) or int4 "
        "(per group of 128, with zero points); a checkpoint that is already quantized (AWQ, GPTQ, FP8, "
        "compressed-tensors) loads as it is without this flag",
    )
    p.add_argument(
        "--keep-lm-head-unquantized",
        action="store_true",
        help="with --quantization: leave lm_head in the model dtype (default: quantized too)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="the KV cache's element type: auto (the model's dtype); fp8 (= fp8_e4m3) / fp8_e5m2: K and V rows "
        "rounded to fp8 unscaled as they are stored; int8: codes with a scale per token and KV head. About half of "
        "bf16's bytes; prefill and decode servers must agree",
    )
    p.add_argument(
        "--quantize-tower",
        action="store_true",
        help="with --quantization: the vision/audio tower's linear layers too (spawned encoder workers too)",
    )


def add_fp32_gemm_arg(p: argparse.ArgumentParser) -> None:
    from mmserve.config import FP32_GEMMS

    p.add_argument(
        "--fp32-gemm",
        choices=FP32_GEMMS,
        default="auto",
        help="fp32 linear layers on a CPU: mkl (PyTorch's own GEMM, what HF runs), onednn (weights packed once "
        "into oneDNN's layout), auto (default: onednn on x86 CPUs not made by Intel, where MKL is 1.5-3x slower "
        "for a few rows; mkl on Intel's)",
    )
