"""`symbiont generate`: generate text with a client model, optionally with a PEFT adapter."""

from __future__ import annotations

import argparse
import sys

# The command decodes greedily and longer than the API's defaults (OpenAI's 16 tokens at
# temperature 1): a person at a terminal wants a whole, reproducible answer.
GENERATE_DEFAULTS_FIELDS = {"max_tokens": 128, "temperature": 0.0}
SAMPLING_FLAGS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop")

HELP = "generate text through a base executor, with or without a PEFT adapter"

DESCRIPTION = """\
Generate a continuation of --prompt with a client model whose frozen linear layers run
on a base executor: a remote one (`symbiont serve-base`, --executor URL) or one loaded
in this process from --model. --adapter loads any standard PEFT adapter folder, whether
`symbiont finetune` wrote it or it was trained elsewhere with vanilla peft.

Decoding is greedy unless --temperature > 0; sampling follows the same rules as
`symbiont serve` (docs/serving.md). Text goes to stdout (token by token with --stream);
a summary line goes to stderr.
"""


def register(subparsers) -> None:
    from symbiont.cli.flags import MODEL_HELP, add_flags
    from symbiont.decoding import SamplingParams

    parser = subparsers.add_parser(
        "generate",
        help=HELP,
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", required=True, metavar="DIR", help=MODEL_HELP)
    parser.add_argument(
        "--executor",
        metavar="URL",
        action="append",
        help="address of a running `symbiont serve-base` (e.g. tcp://127.0.0.1:7100); "
        "twice with --mask-activations shares; "
        "default: load the base executor in this process",
    )
    parser.add_argument(
        "--executor-token",
        metavar="TOKEN",
        action="append",
        help="the --token of that serve-base, once per --executor in the same order (two "
        "parties of --mask-activations shares hold different ones); default: $SYMBIONT_TOKEN",
    )

    parser.add_argument(
        "--mask-activations",
        choices=("pool", "shares"),
        default=None,
        help="hide activations and gradients from the executor: 'pool' masks every call "
        "with a fresh combination of pooled noises (one executor); 'shares' splits every "
        "call between two executors of parties that do not collude (give --executor "
        "twice); see docs/privacy.md (default: no masking)",
    )
    parser.add_argument(
        "--adapter", metavar="DIR", help="PEFT adapter folder, as save_pretrained writes it"
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
    add_flags(
        parser,
        SamplingParams,
        only=SAMPLING_FLAGS,
        meta={"max_tokens": {"flag": "--max-new-tokens"}},
        defaults=generate_defaults(),
    )
    parser.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    parser.add_argument(
        "--kv-offload",
        choices=("none", "cpu"),
        help="'cpu' keeps the KV cache in host memory, for long contexts (a CPU client "
        "already does; default: none)",
    )
    parser.add_argument("--device", help="device of the client side (default: cpu; e.g. cuda:0)")
    parser.add_argument("--dtype", default=None, help="client dtype (default: the executor's)")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="torch intra-op threads (default: torch's choice, one per core, less one with "
        "an --executor on this host, which spins on a core while it waits for calls)",
    )
    parser.set_defaults(func=run)


def generate_defaults():
    from symbiont.decoding import SamplingParams

    return SamplingParams(**GENERATE_DEFAULTS_FIELDS)


def settings_from(args):
    """The shared `SamplingParams` of the flags (a bad value raises ValueError naming its flag)."""
    from symbiont.decoding import InvalidSamplingParams, SamplingParams

    try:
        values = {name: getattr(args, name) for name in SAMPLING_FLAGS}
        values["stop"] = tuple(values["stop"] or ())
        return SamplingParams(**values)
    except InvalidSamplingParams as err:
        name = "max-new-tokens" if err.field == "max_tokens" else err.field.replace("_", "-")
        raise ValueError(f"--{name}: {str(err).split(': ', 1)[1]}") from None


def load_adapter(model, adapter: str):
    """The model with the PEFT adapter folder `adapter` on it, refused when it was made
    for another base (a target module or shape this model lacks)."""
    import peft

    from symbiont.adapters import read_adapter

    spec = read_adapter(adapter)
    spec.check_base(model)
    return peft.PeftModel.from_pretrained(model, str(spec.path)).eval()


def check_context(model, prompt_tokens: int, max_new_tokens: int) -> None:
    """Refuse a prompt the model cannot attend over, before spending time on it."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit and prompt_tokens + max_new_tokens > limit:
        raise ValueError(
            f"the prompt ({prompt_tokens} tokens) plus --max-new-tokens ({max_new_tokens}) "
            f"exceeds the model's context of {limit} tokens; shorten the prompt or lower "
            "--max-new-tokens"
        )


def run(args) -> int:
    from symbiont.cli.flags import resolve_model
    from symbiont.decoding import chat_prompt, generate
    from symbiont.tenant import open_client, open_executor, set_threads
    from symbiont.util.device import check_device

    set_threads(args.threads, args.executor)
    args.model = resolve_model(args.model)
    settings = settings_from(args)
    text = _read_prompt(args)
    device = args.device or "cpu"
    check_device(device)
    executor = open_executor(  # an in-process base on the client's device, as the client
        args.model,
        args.executor,
        device=device,
        dtype=args.dtype,
        mask_activations=args.mask_activations,
        tokens=args.executor_token,
    )
    try:
        model, tokenizer = open_client(args.model, executor, device=device, dtype=args.dtype)
        if args.adapter:
            model = load_adapter(model, args.adapter)
        prompt = chat_prompt(tokenizer, text) if args.chat else tokenizer(text)["input_ids"]
        check_context(model, len(prompt), settings.max_tokens)
        on_text = _print_now if args.stream else None
        result = generate(
            model,
            tokenizer,
            prompt,
            settings,
            on_text=on_text,
            kv_offload=args.kv_offload or "none",
        )
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
