"""`symbiont finetune`: train a PEFT adapter on a client whose base layers run on an executor."""

from __future__ import annotations

import argparse
import logging

HELP = "fine-tune a PEFT adapter (LoRA, IA3, prefix tuning, ...) through a base executor"

DESCRIPTION = """\
Fine-tune an adapter on a client model whose frozen linear layers run on a base executor:
a remote one started with `symbiont serve-base` (--executor URL), or one loaded in this
process from --model when --executor is left out.

--out receives the final adapter at its root (a standard PEFT folder that vanilla peft
loads on the full model), checkpoints in checkpoint-NNNNNN/ subfolders, and metrics.jsonl.
Checkpoints are written atomically; --resume continues from the newest one and gives
the same adapter as an uninterrupted run.

Data: JSONL records with "text", "prompt"+"completion" (loss on the completion only),
or chat "messages" (rendered with the tokenizer's chat template, loss on assistant
turns), or a folder written by `datasets` save_to_disk.
"""

log = logging.getLogger(__name__)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "finetune",
        help=HELP,
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_model_flags(parser)
    _add_adapter_flags(parser)
    _add_data_flags(parser)
    _add_training_flags(parser)
    parser.set_defaults(func=run)


def _add_model_flags(parser) -> None:
    group = parser.add_argument_group("model and executor")
    group.add_argument(
        "--model",
        required=True,
        metavar="DIR",
        help="local Hugging Face checkpoint folder of the base model (with tokenizer); the "
        "client reads its embeddings and norms from it, never its linear weights",
    )
    group.add_argument(
        "--executor",
        metavar="URL",
        help="address of a running `symbiont serve-base` (e.g. tcp://127.0.0.1:7100); "
        "default: load the base executor in this process",
    )
    group.add_argument(
        "--dtype",
        default=None,
        help="dtype the client computes in (float32, bfloat16, ...); default: the executor's",
    )
    group.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads for this process (default: torch's choice); use 1 when "
        "several clients share a few cores",
    )


def _add_adapter_flags(parser) -> None:
    from symbiont.train.adapters import METHODS

    group = parser.add_argument_group("adapter")
    group.add_argument(
        "--method",
        default="lora",
        choices=METHODS,
        help="PEFT method (default lora); ignored with --peft-config",
    )
    group.add_argument("--r", type=int, default=16, help="adapter rank (default 16)")
    group.add_argument(
        "--alpha", type=float, default=None, help="LoRA/LoHa/LoKr alpha (default 2 * r)"
    )
    group.add_argument(
        "--dropout", type=float, default=0.0, help="LoRA dropout probability (default 0)"
    )
    group.add_argument(
        "--target",
        default=None,
        metavar="MODULES",
        help="modules to adapt: 'all-linear' or comma-separated names such as q_proj,v_proj "
        "(default: PEFT's choice for the architecture)",
    )
    group.add_argument(
        "--virtual-tokens",
        type=int,
        default=16,
        help="virtual tokens for prefix and prompt tuning (default 16)",
    )
    group.add_argument(
        "--peft-config",
        metavar="JSON",
        help="any PEFT config as JSON (as PeftConfig.save_pretrained writes it, or an adapter "
        "folder); overrides --method, --r, --alpha, --dropout, --target",
    )


def _add_data_flags(parser) -> None:
    group = parser.add_argument_group("data")
    group.add_argument(
        "--data", required=True, metavar="PATH", help="training data (JSONL or saved dataset)"
    )
    group.add_argument(
        "--eval-data", metavar="PATH", help="held-out data for the periodic eval loss"
    )
    group.add_argument(
        "--max-length",
        type=int,
        default=512,
        help="truncate examples to this many tokens (default 512)",
    )


def _add_training_flags(parser) -> None:
    group = parser.add_argument_group("training")
    group.add_argument(
        "--out", required=True, metavar="DIR", help="output folder (adapter, checkpoints, metrics)"
    )
    group.add_argument(
        "--max-steps",
        type=int,
        default=0,
        help="optimizer steps to run; 0 (default) runs --epochs epochs",
    )
    group.add_argument("--epochs", type=int, default=1, help="epochs when --max-steps is 0")
    group.add_argument(
        "--batch-size", type=int, default=2, help="examples per micro-batch (default 2)"
    )
    group.add_argument(
        "--grad-accum",
        type=int,
        default=1,
        help="micro-batches per optimizer step (default 1)",
    )
    group.add_argument("--lr", type=float, default=2e-4, help="AdamW learning rate (default 2e-4)")
    group.add_argument(
        "--weight-decay", type=float, default=0.0, help="AdamW weight decay (default 0)"
    )
    group.add_argument(
        "--schedule",
        default="linear",
        choices=("linear", "cosine", "constant", "constant_with_warmup"),
        help="learning-rate schedule after warm-up (default linear decay to 0)",
    )
    group.add_argument("--warmup-steps", type=int, default=0, help="linear warm-up steps")
    group.add_argument(
        "--max-grad-norm",
        type=float,
        default=1.0,
        help="clip the gradient norm to this (default 1.0; 0 disables)",
    )
    group.add_argument("--seed", type=int, default=0, help="seed for adapter init and data order")
    group.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="optimizer steps between eval losses (default: only at the end)",
    )
    group.add_argument(
        "--save-every",
        type=int,
        default=0,
        help="optimizer steps between checkpoints (default: only at the end)",
    )
    group.add_argument(
        "--save-total-limit",
        type=int,
        default=2,
        help="checkpoints to keep, oldest deleted first (default 2; 0 keeps all)",
    )
    group.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in --out (same settings required)",
    )
    group.add_argument(
        "--no-progress", action="store_true", help="no progress bar (metrics are still written)"
    )


def train_config(args):
    from symbiont.train import TrainConfig

    return TrainConfig(
        max_steps=args.max_steps,
        epochs=args.epochs,
        batch_size=args.batch_size,
        grad_accum=args.grad_accum,
        lr=args.lr,
        weight_decay=args.weight_decay,
        warmup_steps=args.warmup_steps,
        schedule=args.schedule,
        max_grad_norm=args.max_grad_norm,
        max_length=args.max_length,
        seed=args.seed,
        eval_every=args.eval_every,
        save_every=args.save_every,
        save_total_limit=args.save_total_limit,
    )


def peft_config(args, total_steps: int):
    from symbiont.train import AdapterSpec, build_peft_config, load_peft_config

    if args.peft_config:
        return load_peft_config(args.peft_config)
    spec = AdapterSpec(
        method=args.method,
        r=args.r,
        alpha=args.alpha,
        dropout=args.dropout,
        target=args.target,
        virtual_tokens=args.virtual_tokens,
    )
    return build_peft_config(spec, total_steps)


def run(args) -> int:
    import peft
    import torch

    from symbiont.train import load_examples, pad_id, train
    from symbiont.train.session import open_client, set_threads
    from symbiont.transport import open_executor

    set_threads(args.threads)
    config = train_config(args)
    executor = open_executor(args.model, args.executor, dtype=args.dtype)
    try:
        model, tokenizer = open_client(args.model, executor, dtype=args.dtype)
        examples = load_examples(args.data, tokenizer, config.max_length)
        evals = (
            load_examples(args.eval_data, tokenizer, config.max_length) if args.eval_data else []
        )
        torch.manual_seed(config.seed)  # adapter initialisation
        model = peft.get_peft_model(model, peft_config(args, config.total_steps(len(examples))))
        trainable, total = model.get_nb_trainable_parameters()
        log.info(
            "%d training examples, %d eval; %s adapter with %d trainable parameters; %d steps",
            len(examples), len(evals), model.peft_config["default"].peft_type.value,
            trainable, config.total_steps(len(examples)),
        )  # fmt: skip
        result = train(
            model,
            examples,
            config,
            args.out,
            pad_token_id=pad_id(tokenizer),
            eval_examples=evals,
            resume=args.resume,
            progress=not args.no_progress,
        )
    finally:
        executor.close()
    eval_text = f", eval loss {result.eval_loss:.4f}" if result.eval_loss is not None else ""
    print(
        f"trained {result.steps} steps: loss {result.final_loss:.4f}{eval_text}, "
        f"{result.tokens_per_s:.0f} tokens/s; adapter in {args.out}"
    )
    return 0
