"""The `symbiont` command. Each subcommand lives in its own module of this package and
exposes `register(subparsers)`, which adds its parser and sets `func` to run it."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# Subcommand modules, in the order `--help` lists them.
SUBCOMMANDS = ["demo", "finetune", "generate", "serve", "serve-base", "stats"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="symbiont",
        description=(
            "One frozen base LLM shared by many tenants. A base executor holds the frozen "
            "linear weights once; clients (ordinary Hugging Face models with their own "
            "adapters) call it layer by layer, in-process or from other processes and hosts."
        ),
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(f"symbiont.cli.{name.replace('-', '_')}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (ValueError, RuntimeError, OSError) as err:
        # User-facing errors (bad paths, bad configs, lost executor) already say what to fix.
        if args.verbose:
            raise
        print(f"symbiont {args.command}: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
