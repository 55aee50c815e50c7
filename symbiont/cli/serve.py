"""`symbiont serve`: an OpenAI-compatible server of many adapters over one base model."""

from __future__ import annotations

import argparse

HELP = "serve a base model and many adapters behind an OpenAI-compatible API"
DESCRIPTION = (
    "Continuous batching of many adapters (LoRA, IA3, AdaLoRA, VeRA, LoHa, LoKr, DoRA, "
    "prompt, P- and prefix tuning, mixed) over one frozen base model. The `model` "
    "field of each request picks the adapter; the base model's name uses none. With "
    "--adapter-dir, every adapter folder of DIR is served by its name, loaded on first use "
    "and cached in host memory and --max-loras slots (GET /v1/adapters shows the cache)."
)


def register(subparsers) -> None:
    from symbiont.cli.flags import MODEL_HELP, add_flags
    from symbiont.serve.config import EngineConfig, ServerConfig

    parser = subparsers.add_parser("serve", help=HELP, description=DESCRIPTION)
    add_flags(parser, ServerConfig, meta={"model": {"help": MODEL_HELP, "metavar": "DIR"}})
    add_flags(parser.add_argument_group("engine capacity"), EngineConfig)
    parser.set_defaults(func=run)


def configs(args: argparse.Namespace):
    """The server config (with its engine config) that the flags describe."""
    from symbiont.cli.flags import from_args
    from symbiont.serve.config import EngineConfig, ServerConfig

    return from_args(ServerConfig, args, engine=from_args(EngineConfig, args))


def run(args: argparse.Namespace) -> int:
    import dataclasses

    from symbiont.cli.flags import resolve_model
    from symbiont.serve.http.server import run as serve

    config = configs(args)
    return serve(dataclasses.replace(config, model=resolve_model(config.model)))
