"""`pdserve` command line: serve, gateway, register, make-model."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from pdserve.membership.sidecar import add_register_parser
    from pdserve.modelgen.cli import add_make_model_parser
    from pdserve.server.launch import add_serve_parser

    from pdserve.startup import OneLineParser

    parser = OneLineParser(prog="pdserve", description="Disaggregated LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)
    add_make_model_parser(sub)
    add_register_parser(sub)
    try:
        from pdserve.gateway.cli import add_gateway_parser
    except ImportError:  # the gateway is optional while it is being built
        pass
    else:
        add_gateway_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        from pdserve.server.launch import run_serve

        return run_serve(args)
    if args.command == "make-model":
        from pdserve.modelgen.cli import run_make_model

        return run_make_model(args)
    if args.command == "register":
        from pdserve.membership.sidecar import run_register

        return run_register(args)
    if args.command == "gateway":
        from pdserve.gateway.cli import run_gateway

        return run_gateway(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
