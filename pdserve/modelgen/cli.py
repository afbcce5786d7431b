"""`pdserve make-model`: write a tiny randomly initialised model to disk.

pdserve/cli.py registers this via `add_make_model_parser` and dispatches to `run_make_model`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

# Names only: building the parser must not import torch (the gateway shares this CLI and stays torch-free).
# tests/test_modelgen.py checks these against text_models.
ARCH_NAMES = ("llama", "mistral", "qwen2", "qwen3")
PRESET_NAMES = ("tiny", "h256", "llama120m")
DTYPE_NAMES = ("float32", "bfloat16", "float16")


def parse_rope_scaling(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"--rope-scaling is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("--rope-scaling must be a JSON object")
    return value


def add_make_model_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "make-model",
        help="generate a tiny random model (HF layout + tokenizer) offline",
        description="Generate a deterministic, randomly initialised Hugging Face-layout model and tokenizer.",
    )
    parser.add_argument("--arch", required=True, choices=ARCH_NAMES)
    parser.add_argument("--preset", default="tiny", choices=PRESET_NAMES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shards", type=int, default=1, help="number of safetensors shards")
    parser.add_argument("--dtype", default="float32", choices=DTYPE_NAMES)
    parser.add_argument(
        "--rope-scaling",
        type=parse_rope_scaling,
        default=None,
        metavar="JSON",
        help='e.g. \'{"rope_type": "linear", "factor": 2.0}\'',
    )
    parser.add_argument("out", type=Path, help="output directory")
    return parser


def run_make_model(args: argparse.Namespace) -> int:
    from .text_models import make_text_model

    try:
        out_dir = make_text_model(
            args.arch,
            args.out,
            preset=args.preset,
            seed=args.seed,
            num_shards=args.shards,
            dtype=args.dtype,
            rope_scaling=args.rope_scaling,
        )
    except ValueError as exc:
        print(f"make-model: {exc}", file=sys.stderr)
        return 2
    print(out_dir)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point, for use before pdserve/cli.py wires the subcommand in."""
    parser = argparse.ArgumentParser(prog="python -m pdserve.modelgen.cli")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_make_model_parser(subparsers)
    return run_make_model(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
