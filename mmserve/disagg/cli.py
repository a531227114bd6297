"""The prefill-decode part of the command line: `mmserve router`, `serve`'s P/D flags and its pipeline."""

from __future__ import annotations

import argparse


def router_config_from_args(args: argparse.Namespace, **fields):
    """The `mmserve router` flags (and those `serve` shares with it) as a RouterConfig."""
    from mmserve.cli import _cluster_secret
    from mmserve.config import RouterConfig

    try:
        return RouterConfig(
            host=args.host,
            port=args.port,
            kv_transfer_backend=args.kv_transfer_backend,
            cluster_secret=_cluster_secret(args),
            enable_anonymous_registration=args.enable_anonymous_registration,
            api_key=args.api_key,
            served_model_name=args.served_model_name,
            log_level=args.log_level,
            **fields,
        )
    except ValueError as e:
        raise SystemExit(f"mmserve: {e}") from None


def run_router(args: argparse.Namespace) -> int:
    from mmserve.disagg.router import serve_router

    cfg = router_config_from_args(
        args,
        prefill_urls=tuple(args.prefill),
        decode_urls=tuple(args.decode),
        request_timeout_s=args.request_timeout_s,
        health_interval_s=args.health_interval_s,
    )
    return serve_router(cfg)


def serve_pipeline(args: argparse.Namespace) -> int:
    """`serve --prefill-workers P --decode-workers D`: the whole P/D pipeline on this machine."""
    from mmserve.cli import engine_config_from_args
    from mmserve.disagg.pipeline import PipelineConfig, run_pipeline

    if args.prefill_workers < 1 or args.decode_workers < 1:
        raise SystemExit("mmserve: a pipeline needs --prefill-workers and --decode-workers both >= 1")
    if args.disaggregation_mode != "null":
        raise SystemExit("mmserve: --disaggregation-mode is set per server by the pipeline; leave it out")
    router = router_config_from_args(args, max_request_body_bytes=int(args.max_request_body_mb * 2**20))
    cfg = PipelineConfig(
        serve_argv=tuple(args.argv),
        prefill_workers=args.prefill_workers,
        decode_workers=args.decode_workers,
        router=router,
        encoder_workers=args.encoder_workers,
        encoder_urls=tuple(args.encoder_urls or ()),
        encoder_transport=args.encoder_transport,
        log_level=args.log_level,
    )
    return run_pipeline(cfg, engine_config_from_args(args) if args.encoder_workers else None)


def add_disagg_serve_args(p: argparse.ArgumentParser) -> None:
    """`serve`'s prefill-decode flags: this server's role, and the one-machine pipeline."""
    p.add_argument(
        "--disaggregation-mode",
        default="null",
        choices=["null", "prefill", "decode"],
        help="prefill-decode disaggregation: null = this server does both; prefill / decode servers take "
        "requests from `mmserve router` only (a decode server loads no vision weights)",
    )
    p.add_argument(
        "--kv-transfer-timeout-s",
        type=float,
        default=30.0,
        help="every step of a KV handoff (reserve, transfer, commit) must finish within this",
    )
    p.add_argument(
        "--kv-bootstrap-port",
        type=int,
        default=0,
        help="decode server: port of the KV handoff socket on --embedding-host (0: any free port)",
    )
    p.add_argument(
        "--kv-adopt-timeout-s",
        type=float,
        default=300.0,
        help="decode server: a request whose prefill and KV do not arrive by then fails with 504",
    )
    p.add_argument(
        "--prefill-workers",
        type=int,
        default=0,
        help="with --decode-workers: run a P/D pipeline on this machine (this many prefill servers, "
        "the decode servers, and `mmserve router` on --host/--port in front)",
    )
    p.add_argument("--decode-workers", type=int, default=0, help="decode servers of the P/D pipeline")
    add_kv_backend_arg(p)


def add_kv_backend_arg(p: argparse.ArgumentParser) -> None:
    from mmserve.disagg.kv_messages import BACKENDS

    p.add_argument(
        "--kv-transfer-backend",
        default="zmq",
        choices=BACKENDS,
        help="how prefill servers move the KV to decode servers (chosen by the router, per request)",
    )


def add_router_args(p: argparse.ArgumentParser) -> None:
    from mmserve.cli import add_cluster_args
    from mmserve.config import RouterConfig as C

    for role in ("prefill", "decode"):
        p.add_argument(
            f"--{role}", nargs="*", default=[], metavar="URL", help=f"{role} servers: http://host:port"
        )
    p.add_argument("--host", default=C.host)
    p.add_argument("--port", type=int, default=C.port)
    add_kv_backend_arg(p)
    add_cluster_args(p)
    p.add_argument(
        "--enable-anonymous-registration",
        action="store_true",
        help="without a cluster secret, open /register_server, /unregister_server and /servers to anyone who "
        "can reach the port (they could send users' prompts to a server of theirs); ignored with a secret",
    )
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument("--served-model-name", default=None, help="default: the model the servers report")
    p.add_argument(
        "--request-timeout-s",
        type=float,
        default=C.request_timeout_s,
        help="bound on every wait for a server: a prefill, the decode answer's start, each streamed read",
    )
    p.add_argument(
        "--health-interval-s", type=float, default=C.health_interval_s, help="period of /health probes"
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
