"""`symbiont serve`: an OpenAI-compatible server of many adapters over one base model."""

from __future__ import annotations

import argparse

from symbiont.serve.config import EngineConfig


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve a base model and many adapters behind an OpenAI-compatible API",
        description=(
            "Continuous batching of many LoRA/IA3 adapters over one frozen base model. The "
            "`model` field of each request picks the adapter; the base model's name uses none."
        ),
    )
    p.add_argument("--model", required=True, help="local Hugging Face checkpoint folder")
    p.add_argument(
        "--adapter",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="PEFT adapter folder to load under NAME (repeatable)",
    )
    p.add_argument("--executor", help="URL of a base executor served elsewhere (tcp://host:port)")
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", help="require `Authorization: Bearer KEY` on /v1/ routes")
    p.add_argument(
        "--served-model-name", help="name of the base model in the API (default: folder name)"
    )
    p.add_argument("--dtype", help="float32, bfloat16, float16 (default: the checkpoint's)")
    p.add_argument("--device", default="cpu")
    defaults = EngineConfig()
    for flag, help_text in [
        ("max_running", "sequences generated at once"),
        ("max_batched_tokens", "tokens per iteration (decode + prefill chunks)"),
        ("max_queue", "waiting requests before HTTP 429"),
        ("num_blocks", "KV-cache blocks"),
        ("block_size", "tokens per KV-cache block"),
        ("max_adapters", "adapters resident at once"),
        ("max_lora_rank", "largest LoRA rank served"),
    ]:
        p.add_argument(
            "--" + flag.replace("_", "-"),
            type=int,
            default=getattr(defaults, flag),
            help=f"{help_text} (default: %(default)s)",
        )
    p.add_argument("--max-model-len", type=int, help="context limit (default: the model's)")
    p.set_defaults(func=run)


def _adapter_pairs(values: list[str]) -> tuple[tuple[str, str], ...]:
    pairs = []
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--adapter {value!r}: expected NAME=PATH, e.g. sql=runs/sql-lora")
        pairs.append((name, path))
    return tuple(pairs)


def run(args: argparse.Namespace) -> int:
    from symbiont.serve.server import ServerConfig
    from symbiont.serve.server import run as serve

    engine = EngineConfig(
        max_running=args.max_running,
        max_batched_tokens=args.max_batched_tokens,
        max_queue=args.max_queue,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        max_adapters=args.max_adapters,
        max_lora_rank=args.max_lora_rank,
        max_model_len=args.max_model_len,
    )
    config = ServerConfig(
        model=args.model,
        adapters=_adapter_pairs(args.adapter),
        executor=args.executor,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        served_model_name=args.served_model_name,
        dtype=args.dtype,
        device=args.device,
        engine=engine,
    )
    return serve(config)
