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
# tests/test_modelgen.py checks these against text_models and modelgen/llava.py.
TEXT_ARCH_NAMES = ("llama", "mistral", "qwen2", "qwen3")
MULTIMODAL_ARCH_NAMES = ("llava",)
ARCH_NAMES = TEXT_ARCH_NAMES + MULTIMODAL_ARCH_NAMES
LLAVA_LAYOUT_NAMES = ("hf5", "hub")
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
    parser.add_argument("--preset", default="tiny", choices=PRESET_NAMES, help="text models only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shards", type=int, default=1, help="safetensors shards (text models only)")
    parser.add_argument("--dtype", default="float32", choices=DTYPE_NAMES)
    parser.add_argument(
        "--rope-scaling",
        type=parse_rope_scaling,
        default=None,
        metavar="JSON",
        help='e.g. \'{"rope_type": "linear", "factor": 2.0}\' (text models only)',
    )
    parser.add_argument(
        "--vision-layout",
        default="hf5",
        choices=LLAVA_LAYOUT_NAMES,
        help="llava only: tensor names as transformers 5 names parameters (hf5) or as llava-hf repos (hub)",
    )
    parser.add_argument("out", type=Path, help="output directory")
    return parser


def text_only_options_given(args: argparse.Namespace) -> list[str]:
    given = []
    if args.preset != "tiny":
        given.append("--preset")
    if args.shards != 1:
        given.append("--shards")
    if args.rope_scaling is not None:
        given.append("--rope-scaling")
    return given


def make_llava(args: argparse.Namespace) -> Path:
    # Imported here: the generators need torch, the parser must not.
    from .llava import make_llava_model

    unsupported = text_only_options_given(args)
    if unsupported:
        raise ValueError(f"{', '.join(unsupported)} do not apply to --arch llava (it has one fixed shape)")
    return make_llava_model(args.out, seed=args.seed, dtype=args.dtype, vision_layout=args.vision_layout)


def make_text(args: argparse.Namespace) -> Path:
    from .text_models import make_text_model

    return make_text_model(
        args.arch,
        args.out,
        preset=args.preset,
        seed=args.seed,
        num_shards=args.shards,
        dtype=args.dtype,
        rope_scaling=args.rope_scaling,
    )


def run_make_model(args: argparse.Namespace) -> int:
    try:
        out_dir = make_llava(args) if args.arch == "llava" else make_text(args)
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
