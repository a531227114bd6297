"""Command line: `mmserve make-tiny-model | demo`."""

from __future__ import annotations

import argparse
import sys


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mmserve", description="Multimodal LLM serving with EPD disaggregation"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-tiny-model", help="build a random-weight checkpoint offline")
    p.add_argument("--arch", choices=["qwen2_vl", "qwen2_5_vl"], default="qwen2_vl")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--size", choices=["tiny", "small"], default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_make_tiny_model)

    p = sub.add_parser("demo", help="run the stack on the embedded tiny model")
    p.add_argument("--model-dir", default="models/tiny-qwen2-vl")
    p.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-process CLI setting: weight-loading bars drown the output
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
