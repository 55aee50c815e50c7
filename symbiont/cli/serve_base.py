"""`symbiont serve-base`: load a base once and serve it to clients in other processes/hosts."""

from __future__ import annotations

HELP = "serve a base model's frozen layers to clients in other processes or on other hosts"


def register(subparsers) -> None:
    parser = subparsers.add_parser("serve-base", help=HELP, description=HELP)
    add_arguments(parser)
    parser.set_defaults(func=run)


def add_arguments(parser) -> None:
    """The flags of `serve-base`, generated from its config dataclasses."""
    from symbiont.base.config import BaseProcessConfig, BatchingPolicy, ServiceConfig
    from symbiont.cli.flags import MODEL_HELP, add_flags

    add_flags(parser, BaseProcessConfig, meta={"model": {"help": MODEL_HELP, "metavar": "DIR"}})
    add_flags(parser.add_argument_group("service"), ServiceConfig)
    add_flags(parser.add_argument_group("batching"), BatchingPolicy)


def configs(args):
    """The process and service configs the flags describe."""
    from symbiont.base.config import BaseProcessConfig, BatchingPolicy, ServiceConfig
    from symbiont.cli.flags import from_args
    from symbiont.protocol.shm import cores

    process = from_args(BaseProcessConfig, args)
    policy = from_args(BatchingPolicy, args)
    return process, from_args(ServiceConfig, args, policy=policy, host_cores=cores())


def run(args) -> int:
    from symbiont.base.main import serve
    from symbiont.cli.flags import resolve_model

    process, config = configs(args)
    return serve(process, config, resolve_model(process.model))
