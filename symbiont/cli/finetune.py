"""`symbiont finetune`: train a PEFT adapter on a client whose base layers run on an executor."""

from __future__ import annotations

import argparse
import logging
import shutil
from pathlib import Path

from symbiont.cli.flags import FlagError

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
    from symbiont.cli.flags import MODEL_HELP

    group = parser.add_argument_group("model and executor")
    group.add_argument(
        "--model",
        required=True,
        metavar="DIR",
        help=MODEL_HELP + "; the client reads its embeddings and norms from it, never its "
        "linear weights",
    )
    group.add_argument(
        "--executor",
        metavar="URL",
        action="append",
        help="address of a running `symbiont serve-base` (e.g. tcp://127.0.0.1:7100); "
        "twice with --mask-activations shares; "
        "default: load the base executor in this process",
    )
    group.add_argument(
        "--executor-token",
        metavar="TOKEN",
        action="append",
        help="the --token of that serve-base, once per --executor in the same order (two "
        "parties of --mask-activations shares hold different ones); default: $SYMBIONT_TOKEN",
    )

    group.add_argument(
        "--mask-activations",
        choices=("pool", "shares"),
        default=None,
        help="hide activations and gradients from the executor: 'pool' masks every call "
        "with a fresh combination of pooled noises (one executor); 'shares' splits every "
        "call between two executors of parties that do not collude (give --executor "
        "twice); see docs/privacy.md (default: no masking)",
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
        metavar="N",
        help="torch intra-op threads for this process (default: torch's choice, one per "
        "core, less one with an --executor on this host, which spins on a core while it waits "
        "for calls); use 1 when several clients share a few cores",
    )
    group.add_argument(
        "--matmul",
        choices=("torch", "onednn"),
        default=None,
        help="without --executor: what computes the base's products in this process, torch "
        "(default; bitwise a vanilla job) or onednn (float32 on a CPU, within fp32 rounding; "
        "1.7-2.5x faster products on an AMD EPYC, see docs/service.md); a serve-base's are "
        "set where it runs (serve-base --matmul)",
    )
    group.add_argument(
        "--device",
        default=None,
        help="where this client computes (default: cpu; cuda, cuda:1): the model, adapter, optimizer "
        "and batches; without --executor the base weights go there too; with a serve-base "
        "on the same GPU, calls' tensors stay on it (CUDA IPC)",
    )


# Help for the fields of `AdapterFlags` (symbiont.adapters); their defaults come from it.
ADAPTER_HELP = {
    "method": {"help": "PEFT method; ignored with --peft-config"},
    "r": {"help": "adapter rank"},
    "alpha": {"help": "LoRA/LoHa/LoKr alpha (default: 2 * r)"},
    "dropout": {"help": "LoRA dropout probability"},
    "target": {
        "help": "modules to adapt: 'all-linear' or comma-separated names such as "
        "q_proj,v_proj (default: PEFT's choice for the architecture)",
        "metavar": "MODULES",
    },
    "virtual_tokens": {"help": "virtual tokens for prefix and prompt tuning"},
}


def _add_adapter_flags(parser) -> None:
    from symbiont.adapters import METHODS, AdapterFlags
    from symbiont.cli.flags import add_flags

    group = parser.add_argument_group("adapter")
    meta = {**ADAPTER_HELP, "method": {**ADAPTER_HELP["method"], "choices": METHODS}}
    add_flags(group, AdapterFlags, meta=meta)
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


def _add_training_flags(parser) -> None:
    from symbiont.cli.flags import add_flags
    from symbiont.train.config import TrainConfig

    group = parser.add_argument_group("training")
    group.add_argument(
        "--out", required=True, metavar="DIR", help="output folder (adapter, checkpoints, metrics)"
    )
    add_flags(group, TrainConfig)
    again = group.add_mutually_exclusive_group()
    again.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in --out (same settings required)",
    )
    again.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the run already in --out (its adapter, checkpoints and metrics)",
    )
    group.add_argument(
        "--no-progress", action="store_true", help="no progress bar (metrics are still written)"
    )


def train_config(args):
    from symbiont.cli.flags import from_args
    from symbiont.train.config import TrainConfig

    if args.eval_every and not args.eval_data:
        raise FlagError(
            "--eval-every evaluates on --eval-data FILE; give it, or leave out --eval-every"
        )
    return from_args(TrainConfig, args)


ADAPTER_FIELDS = ("r", "alpha", "dropout", "target", "virtual_tokens")


def adapter_flags(args):
    """The adapter flags (None with --peft-config); refuses flags the method would drop."""
    from symbiont.adapters import AdapterFlags
    from symbiont.adapters.flags import unused_by
    from symbiont.cli.flags import field_default, from_args

    given = {  # a flag left out reads as its default (or None)
        name
        for name in ADAPTER_FIELDS
        if getattr(args, name, None) not in (None, field_default(AdapterFlags, name))
    }
    if args.peft_config:
        if given:
            flags = ", ".join("--" + name.replace("_", "-") for name in sorted(given))
            raise FlagError(f"--peft-config sets the whole adapter; leave out {flags}")
        return None
    flags = from_args(AdapterFlags, args)
    unused = unused_by(flags.method, given)
    if unused:
        names = ", ".join("--" + name.replace("_", "-") for name in unused)
        them = "it" if len(unused) == 1 else "them"
        raise FlagError(f"--method {flags.method} does not use {names}; leave {them} out")
    return flags


def peft_config(args, flags, total_steps: int):
    from symbiont.adapters import build_peft_config, load_peft_config

    if flags is None:
        return load_peft_config(args.peft_config)
    return build_peft_config(flags, total_steps)


def prepare_out(out: Path, *, resume: bool, overwrite: bool) -> None:
    """Refuse to train over an earlier run in `out` unless asked to resume or replace it;
    with --overwrite, remove it (call once the new run's inputs have loaded)."""
    for path in earlier_run(out, resume=resume, overwrite=overwrite):
        shutil.rmtree(path) if path.is_dir() else path.unlink()


def earlier_run(out: Path, *, resume: bool, overwrite: bool) -> list[Path]:
    """The files of an earlier run in `out` that --overwrite replaces; refuses without
    --resume or --overwrite."""
    from symbiont.train.checkpoints import ADAPTER_FILES, CHECKPOINT_PREFIX
    from symbiont.train.loop import METRICS_FILE, SUMMARY_FILE

    if out.exists() and not out.is_dir():  # found only after the model and data loaded
        raise FlagError(f"--out {out} is a file; --out is the run's folder: choose another")
    if resume or not out.is_dir():
        return []
    files = [out / name for name in (*ADAPTER_FILES, METRICS_FILE, SUMMARY_FILE)]
    earlier = [p for p in files if p.exists()]
    earlier += sorted(p for p in out.glob(CHECKPOINT_PREFIX + "*") if p.is_dir())
    if not earlier:
        return []
    if not overwrite:
        raise FlagError(
            f"--out {out} already holds a run ({', '.join(p.name for p in earlier[:3])}"
            f"{', ...' if len(earlier) > 3 else ''}): pass --resume to continue it, "
            "--overwrite to replace it, or choose another --out"
        )
    return earlier


def run(args) -> int:
    import peft
    import torch

    from symbiont.cli.flags import resolve_model
    from symbiont.tenant import open_client, open_executor, set_threads
    from symbiont.train import load_examples, pad_id, train
    from symbiont.util.device import check_device

    config = train_config(args)
    adapter = adapter_flags(args)
    # refused now, removed only once the new run's model, data and adapter have loaded:
    # a typo in --data must not cost the earlier run
    earlier_run(Path(args.out), resume=args.resume, overwrite=args.overwrite)
    set_threads(args.threads, args.executor)
    device = args.device or "cpu"
    check_device(device)
    model_dir = resolve_model(args.model)
    executor = open_executor(
        model_dir,
        args.executor,
        device=device,
        dtype=args.dtype,
        mask_activations=args.mask_activations,
        tokens=args.executor_token,
        matmul=args.matmul or "torch",
    )
    try:
        model, tokenizer = open_client(model_dir, executor, device=device, dtype=args.dtype)
        examples = load_examples(args.data, tokenizer, config.max_length)
        evals = (
            load_examples(args.eval_data, tokenizer, config.max_length) if args.eval_data else []
        )
        torch.manual_seed(config.seed)  # adapter initialisation
        model = peft.get_peft_model(
            model, peft_config(args, adapter, config.total_steps(len(examples)))
        )
        trainable, total = model.get_nb_trainable_parameters()
        log.info(
            "%d training examples, %d eval; %s adapter with %d trainable parameters; %d steps",
            len(examples), len(evals), model.peft_config["default"].peft_type.value,
            trainable, config.total_steps(len(examples)),
        )  # fmt: skip
        if args.overwrite and earlier_run(Path(args.out), resume=args.resume, overwrite=True):
            log.info("--overwrite: removing the earlier run in %s", args.out)
            prepare_out(Path(args.out), resume=args.resume, overwrite=True)
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
