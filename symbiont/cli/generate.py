"""`symbiont generate`: generate text with a client model, optionally with a PEFT adapter."""

from __future__ import annotations

import argparse
import sys

HELP = "generate text through a base executor, with or without a PEFT adapter"

DESCRIPTION = """\
Generate a continuation of --prompt with a client model whose frozen linear layers run
on a base executor: a remote one (`symbiont serve-base`, --executor URL) or one loaded
in this process from --model. --adapter loads any standard PEFT adapter folder, whether
`symbiont finetune` wrote it or it was trained elsewhere with vanilla peft.

Decoding is greedy unless --temperature > 0. Text goes to stdout (token by token with
--stream); a summary line goes to stderr.
"""


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "generate",
        help=HELP,
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--model",
        required=True,
        metavar="DIR",
        help="local Hugging Face checkpoint folder of the base model (with tokenizer)",
    )
    parser.add_argument(
        "--executor",
        metavar="URL",
        help="address of a running `symbiont serve-base` (e.g. tcp://127.0.0.1:7100); "
        "default: load the base executor in this process",
    )
    parser.add_argument(
        "--adapter", metavar="DIR", help="PEFT adapter folder (adapter_config.json + weights)"
    )
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the prompt text")
    prompt.add_argument(
        "--prompt-file", metavar="FILE", help="read the prompt from FILE ('-': stdin)"
    )
    parser.add_argument(
        "--chat",
        action="store_true",
        help="wrap the prompt as a user message with the tokenizer's chat template",
    )
    parser.add_argument(
        "--max-new-tokens", type=int, default=128, help="most tokens to generate (default 128)"
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature; 0 (default) decodes greedily",
    )
    parser.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0 = off)"
    )
    parser.add_argument(
        "--top-k", type=int, default=0, help="sample among the k likeliest tokens (0 = off)"
    )
    parser.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    parser.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="stop when TEXT is generated (not printed); repeat for several",
    )
    parser.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    parser.add_argument(
        "--kv-offload",
        default="none",
        choices=("none", "cpu"),
        help="'cpu' keeps the KV cache in host memory, for long contexts (a CPU client "
        "already does)",
    )
    parser.add_argument(
        "--device", default="cpu", help="device of the client side (default cpu; e.g. cuda:0)"
    )
    parser.add_argument("--dtype", default=None, help="client dtype (default: the executor's)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.set_defaults(func=run)


def settings_from(args):
    from symbiont.generation import GenerationSettings

    return GenerationSettings(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
        kv_offload=args.kv_offload,
    )


def load_adapter(model, adapter: str):
    from pathlib import Path

    import peft

    if not (Path(adapter) / "adapter_config.json").is_file():
        raise ValueError(f"{adapter} is not a PEFT adapter folder (no adapter_config.json)")
    return peft.PeftModel.from_pretrained(model, adapter).eval()


def run(args) -> int:
    from symbiont.generation import chat_prompt, generate
    from symbiont.train.session import open_client, set_threads
    from symbiont.transport import open_executor

    set_threads(args.threads)
    settings = settings_from(args)
    text = _read_prompt(args)
    executor = open_executor(args.model, args.executor, dtype=args.dtype)
    try:
        model, tokenizer = open_client(args.model, executor, device=args.device, dtype=args.dtype)
        if args.adapter:
            model = load_adapter(model, args.adapter)
        prompt = chat_prompt(tokenizer, text) if args.chat else text
        on_text = _print_now if args.stream else None
        result = generate(model, tokenizer, prompt, settings, on_text=on_text)
    finally:
        executor.close()
    if not args.stream:
        sys.stdout.write(result.text)
    sys.stdout.write("\n")
    print(
        f"[{len(result.token_ids)} tokens, {result.tokens_per_s:.1f} tokens/s, "
        f"stopped: {result.stop_reason}]",
        file=sys.stderr,
    )
    return 0


def _read_prompt(args) -> str:
    if args.prompt is not None:
        return args.prompt
    if args.prompt_file == "-":
        return sys.stdin.read()
    with open(args.prompt_file, encoding="utf-8") as handle:
        return handle.read()


def _print_now(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
