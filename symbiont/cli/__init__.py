"""The `symbiont` command. Each subcommand lives in its own module of this package and
exposes `HELP` (its line in `symbiont --help`) and `register(subparsers)`, which adds its
parser and sets `func` to run it.

`--help` must answer at once: modules import torch and the like inside functions only, and
`main` builds only the parser of the command it runs (the others get their help line).
Flags come from the config dataclasses (`symbiont.cli.flags`)."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import warnings

from symbiont.cli.flags import FlagError

# Subcommand modules, in the order `--help` lists them.
SUBCOMMANDS = ["delta", "demo", "finetune", "generate", "serve", "serve-base", "stats"]


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser with every subcommand's flags, or only `command`'s (others: help line)."""
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
        module = importlib.import_module(f"symbiont.cli.{name.replace('-', '_')}")
        if command is None or command == name:
            module.register(subparsers)
        else:
            subparsers.add_parser(name, help=module.HELP)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), "")
    parser = build_parser(command if command in SUBCOMMANDS else "")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    _hide_warnings_users_cannot_act_on()
    try:
        return args.func(args) or 0
    except FlagError as err:  # flags that parse but make an invalid config
        _subparser(parser, args.command).error(str(err))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `symbiont generate ... | head`: the reader left, no error
        # Python's advice: point stdout at devnull so the flush at exit does not raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (ValueError, RuntimeError, OSError) as err:
        # User-facing errors (bad paths, bad configs, lost executor) already say what to fix.
        if args.verbose:
            raise
        print(f"symbiont {args.command}: error: {err}", file=sys.stderr)
        return 1


def _hide_warnings_users_cannot_act_on() -> None:
    # peft 0.21 asks transformers 5 for a renamed attribute each time it wraps a model;
    # nothing a user of `symbiont` does can change it.
    warnings.filterwarnings(
        "ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning
    )


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[command]


if __name__ == "__main__":
    sys.exit(main())
