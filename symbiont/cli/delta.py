"""`symbiont delta`: fully fine-tuned models as compressed deltas over their base."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from symbiont.cli.flags import add_flags, from_args

HELP = "compress a fully fine-tuned model into a small delta over its base, merge, inspect"

DESCRIPTION = """\
A fully fine-tuned model (every weight trained, not an adapter) stored as its difference
from the base, Δ = W_ft - W_base, compressed the DeltaZip way: each linear layer's delta
made 2:4 sparse and 2- or 4-bit by an optimal-brain-surgeon solver (SparseGPT/GPTQ) that
uses calibration text to keep the layer's outputs, layer by layer through the already
compressed layers. Norms, biases and changed embedding rows are kept as fp16 deltas.

  symbiont delta compress --base BASE --model FINETUNED --out DIR
  symbiont delta merge --base BASE --delta DIR --out MODEL   (a plain transformers model)
  symbiont delta info DIR                                    (size, ratio, layers)

The folder holds manifest.json (base name and hashes, format, layers, file hashes) and
delta.safetensors (or .zst). A delta is refused for any other base than its own.
See docs/deltas.md.
"""

COMPRESS_DESCRIPTION = """\
Compress FINETUNED (--model) against BASE into DIR. Both must be local checkpoint folders
of one architecture (or 'default' for the embedded default model); memory holds one
decoder layer of each plus the calibration activations. One line per solved layer shows
its relative output error on the calibration data, ‖(Δ - Δ̃)X‖² / ‖ΔX‖².

Calibration: --calib FILE (plain text, or JSONL with "text", "prompt"+"completion" or
chat "messages"; ideally the fine-tuning data); without it, the bundled corpus and
fine-tuning set. Windows of --calib-seq-len tokens, at most --calib-samples of them.
"""


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "delta",
        help=HELP,
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = parser.add_subparsers(dest="delta_command", metavar="ACTION", required=True)
    _register_compress(actions)
    _register_merge(actions)
    _register_info(actions)


def _register_compress(actions) -> None:
    from symbiont.cli.flags import MODEL_HELP
    from symbiont.delta.config import CompressConfig

    parser = actions.add_parser(
        "compress",
        help="compress a fine-tuned model into a delta folder",
        description=COMPRESS_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--base", required=True, metavar="BASE", help=MODEL_HELP)
    parser.add_argument(
        "--model",
        required=True,
        metavar="FINETUNED",
        help="checkpoint folder of the fully fine-tuned model (same architecture as --base)",
    )
    parser.add_argument("--out", required=True, type=Path, metavar="DIR", help="new folder")
    parser.add_argument(
        "--calib", metavar="FILE", help="calibration text (default: the bundled data)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="torch intra-op threads (default: torch's choice); small models run fastest on 1",
    )
    add_flags(parser, CompressConfig)
    parser.set_defaults(func=run_compress)


def _register_merge(actions) -> None:
    from symbiont.cli.flags import MODEL_HELP

    parser = actions.add_parser(
        "merge",
        help="write base + delta as a plain transformers checkpoint",
        description="Write W_base + Δ̃ (and the parameter deltas) to --out as an ordinary "
        "Hugging Face checkpoint folder, with the base's tokenizer files. Refused for any "
        "other base than the one the delta was made from (every weight is hashed).",
    )
    parser.add_argument("--base", required=True, metavar="BASE", help=MODEL_HELP)
    parser.add_argument("--delta", required=True, type=Path, metavar="DIR", help="delta folder")
    parser.add_argument("--out", required=True, type=Path, metavar="MODEL", help="new folder")
    parser.set_defaults(func=run_merge)


def _register_info(actions) -> None:
    parser = actions.add_parser(
        "info",
        help="print a delta's size, ratio and layers",
        description="Verify a delta folder and print its base, format, size on disk, ratio "
        "against the fp16 delta of the whole model, and each layer.",
    )
    parser.add_argument("delta", type=Path, metavar="DIR", help="delta folder")
    parser.add_argument("--json", action="store_true", help="print the manifest as JSON")
    parser.set_defaults(func=run_info)


def run_compress(args) -> int:
    from symbiont.cli.flags import resolve_model
    from symbiont.delta.config import CompressConfig

    config = from_args(CompressConfig, args)
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    base, finetuned = resolve_model(args.base), resolve_model(args.model)
    import torch

    from symbiont.delta.calibration import tokenize_calibration
    from symbiont.delta.compress import compress

    if args.threads is not None:
        torch.set_num_threads(args.threads)

    # what would fail after minutes of calibration, refused first
    from symbiont.delta.format import check_output_folder
    from symbiont.model.checkpoint import Checkpoint

    Checkpoint.open(base), Checkpoint.open(finetuned)
    check_output_folder(Path(args.out))
    _check_positions(base, config.calib_seq_len)
    tokenizer = _tokenizer(finetuned, base)
    calibration = tokenize_calibration(
        tokenizer, args.calib, config.calib_samples, config.calib_seq_len
    )
    print(
        f"calibrating on {calibration.shape[0]} sequences of {calibration.shape[1]} tokens; "
        f"{config.method} {config.bits}-bit, sparsity {config.sparsity}, "
        f"group size {config.group_size or 'per row'}",
        file=sys.stderr,
    )
    manifest = compress(
        base,
        finetuned,
        args.out,
        calibration,
        config,
        base_name=args.base,
        progress=_print_progress,
    )
    print(render_info(args.out, manifest, layers=False))
    return 0


def _print_progress(report) -> None:
    print(
        f"[{report.index + 1}/{report.total}] {report.name}: "
        f"relative output error {report.relative_error:.4f}",
        file=sys.stderr,
        flush=True,
    )


def _tokenizer(*folders: str):
    from transformers import AutoTokenizer

    for folder in folders:
        if any(
            (Path(folder) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")
        ):
            return AutoTokenizer.from_pretrained(folder)
    raise ValueError(
        f"no tokenizer in {' or '.join(folders)}; calibration text needs one: save the "
        "tokenizer next to the fine-tuned model (tokenizer.save_pretrained(dir))"
    )


def run_merge(args) -> int:
    from symbiont.cli.flags import resolve_model
    from symbiont.delta.apply import merge_checkpoint

    out = merge_checkpoint(resolve_model(args.base), args.delta, args.out)
    print(f"merged model written to {out}")
    return 0


def run_info(args) -> int:
    from symbiont.delta.format import read_delta

    delta = read_delta(args.delta)  # verifies hashes and every layer
    print(
        json.dumps(delta.manifest, indent=2)
        if args.json
        else render_info(args.delta, delta.manifest)
    )
    return 0


def _check_positions(base, seq_len: int) -> None:
    """Calibration windows must fit the model's positions (else its embedding fails)."""
    from symbiont.model.checkpoint import Checkpoint

    config = Checkpoint.open(base).config
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if limit is not None and seq_len > limit:
        raise ValueError(
            f"--calib-seq-len {seq_len} is longer than the model's {limit} positions; "
            f"give --calib-seq-len {limit} or less"
        )


def render_info(folder: Path, manifest: dict, *, layers: bool = True) -> str:
    """Human-readable summary: base, format, sizes and ratios, then one line per layer."""
    try:
        return _render_info(folder, manifest, layers)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as err:
        from symbiont.delta.format import MANIFEST, DeltaFormatError

        why = f"lacks {err}" if isinstance(err, KeyError) else f"has a malformed field ({err})"
        raise DeltaFormatError(
            f"{Path(folder) / MANIFEST} {why}; it was not written by `symbiont delta "
            "compress` as is, re-compress the delta"
        ) from err


def _render_info(folder: Path, manifest: dict, layers: bool) -> str:
    sizes = manifest["sizes"]
    on_disk = sum(f["bytes"] for f in manifest["files"].values())
    packed = sizes["linear_packed_bytes"] + sizes["params_bytes"]
    c = manifest["compression"]
    lines = [
        f"delta {folder}",
        f"  base: {manifest['base']['name']} (fingerprint {manifest['base']['fingerprint']})",
        f"  format: {c['method']} {c['bits']}-bit, sparsity {c['sparsity']}, group size "
        f"{c['group_size'] or 'per row'}, zstd {'on' if c['zstd'] else 'off'}; "
        f"calibrated on {c['calibration_sequences']} sequences ({c['calibration_tokens']} tokens)",
        f"  size on disk: {_bytes(on_disk)} ({', '.join(manifest['files'])}); ratio "
        f"{sizes['fp16_delta_bytes'] / on_disk:.2f}x against the fp16 delta of the whole "
        f"model ({_bytes(sizes['fp16_delta_bytes'])})",
        f"  before zstd: {_bytes(packed)} = linear layers {_bytes(sizes['linear_packed_bytes'])} "
        f"({sizes['linear_fp16_bytes'] / max(sizes['linear_packed_bytes'], 1):.2f}x against "
        f"their fp16 {_bytes(sizes['linear_fp16_bytes'])}) + {len(manifest['params'])} "
        f"other parameters as fp16 deltas {_bytes(sizes['params_bytes'])}",
        f"  {len(manifest['layers'])} linear layers",
    ]
    if layers:
        for layer in manifest["layers"]:
            out_features, in_features = layer["shape"]
            lines.append(
                f"    {layer['name']:<44} [{out_features} x {in_features}] "
                f"{layer['bits']}-bit {layer['sparsity']}"
            )
        for param in manifest["params"]:
            lines.append(f"    {param['name']:<44} {param['shape']} {param['kind']}")
    return "\n".join(lines)


def _bytes(count: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")
