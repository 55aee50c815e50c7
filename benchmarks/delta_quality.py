"""Quality and size of compressed deltas of a really fully fine-tuned model (issue 16).

Fine-tunes every weight of the embedded default model (or any local Llama-style
checkpoint with a tokenizer, --model DIR) on the bundled fine-tuning set's training split,
then compresses the delta several ways and measures each variant on the held-out split:

- perplexity of the held-out records (prompt + completion, every token after the first);
- exact match: greedy completion of each held-out prompt equals its completion.

Variants: the fine-tuned model itself; the base; our OBS delta at 4-bit 2:4 and 2-bit 2:4;
round to nearest (RTN) of the same two formats; the same OBS solver applied to W_ft itself
(SparseGPT on the fine-tuned model: "base" with zero linear weights, so the other
parameters are treated identically); and a LoRA on every linear layer trained on the same
data with its rank chosen so its fp16 bytes match the 4-bit 2:4 delta's.

Sizes: bytes on disk (with and without the zstd stage) against the fp16 delta of the
whole model (2 bytes per parameter) and of the linear layers alone.

    python benchmarks/delta_quality.py --model default --steps 300
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from symbiont.cli.flags import resolve_model  # noqa: E402
from symbiont.delta import CompressConfig, load_delta, merge_into  # noqa: E402
from symbiont.delta.calibration import tokenize_calibration  # noqa: E402
from symbiont.delta.compress import compress  # noqa: E402
from symbiont.model.default import default_dataset  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="base: 'default' or a folder")
    parser.add_argument("--steps", type=int, default=300, help="full fine-tuning steps")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--held-out", type=int, default=60, help="records held out")
    parser.add_argument("--calib-samples", type=int, default=256)
    parser.add_argument("--calib-seq-len", type=int, default=64)
    parser.add_argument("--lora-steps", type=int, default=None, help="default: 2x --steps")
    parser.add_argument("--lora-lr", type=float, default=3e-3)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (tiny ops: 1 is fastest)"
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    return parser.parse_args()


# --------------------------------------------------------------------------- data


def split_records(held_out: int) -> tuple[list[dict], list[dict]]:
    records = [json.loads(line) for line in default_dataset().read_text().splitlines()]
    random.Random(0).shuffle(records)
    return records[held_out:], records[:held_out]


def encode(tokenizer, records: list[dict]) -> list[torch.Tensor]:
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return [
        torch.tensor(bos + tokenizer(r["prompt"] + r["completion"])["input_ids"] + eos)
        for r in records
    ]


def batches(sequences: list[torch.Tensor], batch: int, steps: int, pad: int, seed: int):
    """`steps` random batches, right-padded; labels -100 on padding."""
    rng = random.Random(seed)
    for _ in range(steps):
        chosen = rng.sample(sequences, batch)
        width = max(len(s) for s in chosen)
        ids = torch.full((batch, width), pad)
        labels = torch.full((batch, width), -100)
        mask = torch.zeros(batch, width, dtype=torch.long)
        for i, seq in enumerate(chosen):
            ids[i, : len(seq)], labels[i, : len(seq)], mask[i, : len(seq)] = seq, seq, 1
        yield ids, mask, labels


# --------------------------------------------------------------------------- training


def train(model, params, sequences, steps, lr, batch, pad, seed) -> float:
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / steps)),
    )
    torch.manual_seed(seed)
    model.train()
    loss = torch.tensor(0.0)
    for step, (ids, mask, labels) in enumerate(batches(sequences, batch, steps, pad, seed)):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        if step % 50 == 0:
            print(f"  step {step}/{steps} loss {loss.item():.3f}", file=sys.stderr, flush=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
    model.eval()
    return loss.item()


def full_fine_tune(base_dir: Path, out: Path, train_seqs, args, pad) -> float:
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    loss = train(model, model.parameters(), train_seqs, args.steps, args.lr, args.batch, pad, 0)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(base_dir).save_pretrained(out)
    return loss


def lora_of_bytes(base_dir: Path, budget: int, train_seqs, args, pad):
    """A LoRA on every linear layer (lm_head included), rank fitted to `budget` fp16 bytes."""
    import peft

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    per_rank = 2 * sum(m.in_features + m.out_features for m in linears)
    rank = max(1, round(budget / per_rank))
    names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if m in linears})
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=names, lora_dropout=0.0)
    model = peft.get_peft_model(model, config)
    trainable = [p for p in model.parameters() if p.requires_grad]
    steps = args.lora_steps or 2 * args.steps
    train(model, trainable, train_seqs, steps, args.lora_lr, args.batch, pad, 0)
    return model, rank, rank * per_rank


# --------------------------------------------------------------------------- evaluation


@torch.no_grad()
def perplexity(model, sequences: list[torch.Tensor]) -> float:
    nll, count = 0.0, 0
    for seq in sequences:
        logits = model(input_ids=seq[None]).logits[0, :-1]
        nll += float(torch.nn.functional.cross_entropy(logits, seq[1:], reduction="sum"))
        count += len(seq) - 1
    return math.exp(nll / count)


@torch.no_grad()
def exact_match(model, tokenizer, records: list[dict]) -> float:
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    hits = 0
    for r in records:
        ids = torch.tensor([bos + tokenizer(r["prompt"])["input_ids"]])
        want = r["completion"].strip()
        for _ in range(len(tokenizer(r["completion"])["input_ids"]) + 2):
            next_id = model(input_ids=ids).logits[0, -1].argmax()
            if int(next_id) == tokenizer.eos_token_id:
                break
            ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
        got = tokenizer.decode(ids[0, len(bos) + len(tokenizer(r["prompt"])["input_ids"]) :])
        hits += got.strip().split("\n")[0].strip() == want
    return hits / len(records)


# --------------------------------------------------------------------------- variants


def zero_linear_base(base_dir: Path, out: Path) -> Path:
    """The base with every linear weight zero: its 'delta' to W_ft is W_ft itself."""
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.zero_()
    model.save_pretrained(out)
    return out


def delta_variant(base_dir, delta_dir):
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    merge_into(model, load_delta(delta_dir, base_dir))
    return model.eval()


def entropy_bits_per_weight(folder: Path) -> tuple[float, float]:
    """Empirical entropy of the stored codes and 2:4 mask nibbles, in bits per weight of
    the linear layers: the floor for any lossless stage over these symbols."""
    from symbiont.delta.packing import stored_per_row, unpack_bits

    def bits(symbols: torch.Tensor) -> float:
        counts = torch.unique(symbols, return_counts=True)[1].double()
        p = counts / counts.sum()
        return float(-(p * p.log2()).sum()) * symbols.numel()

    codes = mask = weights = 0.0
    for layer in load_delta(folder).layers.values():
        rows, columns = layer.shape
        codes += bits(unpack_bits(layer.codes, layer.bits, stored_per_row(columns, layer.two_four)))
        if layer.mask is not None:
            mask += bits(unpack_bits(layer.mask, 4, columns // 4))
        weights += rows * columns
    return codes / weights, mask / weights


def on_disk(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.name.startswith("delta."))


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    base_dir = Path(resolve_model(args.model))
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    train_records, held_records = split_records(args.held_out)
    train_seqs, held_seqs = encode(tokenizer, train_records), encode(tokenizer, held_records)
    work = Path(tempfile.mkdtemp(prefix="delta-quality-"))
    try:
        run(
            args, base_dir, tokenizer, pad, train_records, held_records, train_seqs, held_seqs, work
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(args, base_dir, tokenizer, pad, train_records, held_records, train_seqs, held_seqs, work):
    started = time.perf_counter()
    ft_dir = work / "ft"
    loss = full_fine_tune(base_dir, ft_dir, train_seqs, args, pad)
    print(
        f"full fine-tune: {args.steps} steps, final train loss {loss:.3f} "
        f"({time.perf_counter() - started:.0f} s)",
        file=sys.stderr,
    )
    calib_file = work / "calib.jsonl"
    calib_file.write_text("\n".join(json.dumps(r) for r in train_records))
    calibration = tokenize_calibration(
        tokenizer, calib_file, args.calib_samples, args.calib_seq_len
    )
    zero_base = zero_linear_base(base_dir, work / "zero-base")

    rows: list[dict] = []

    def measure(label: str, model, size: int | None, note: str = "") -> None:
        row = {
            "variant": label,
            "perplexity": perplexity(model, held_seqs),
            "exact_match": exact_match(model, tokenizer, held_records),
            "bytes": size,
            "note": note,
        }
        rows.append(row)
        print(
            f"{label}: ppl {row['perplexity']:.3f}, exact match {row['exact_match']:.3f}",
            file=sys.stderr,
        )

    measure("fine-tuned (fp32)", AutoModelForCausalLM.from_pretrained(ft_dir).eval(), None)
    measure("base (no delta)", AutoModelForCausalLM.from_pretrained(base_dir).eval(), None)
    sizes = None
    variants = [
        ("ours: OBS delta 4-bit 2:4", base_dir, CompressConfig(bits=4)),
        ("ours: OBS delta 2-bit 2:4", base_dir, CompressConfig(bits=2)),
        ("RTN delta 4-bit 2:4", base_dir, CompressConfig(bits=4, method="rtn")),
        ("RTN delta 2-bit 2:4", base_dir, CompressConfig(bits=2, method="rtn")),
        ("OBS on W_ft itself 4-bit 2:4", zero_base, CompressConfig(bits=4)),
        ("ours: OBS delta 4-bit 2:4, per-row scales", base_dir, CompressConfig(group_size=0)),
        ("ours: OBS delta 4-bit dense", base_dir, CompressConfig(bits=4, sparsity="none")),
    ]
    ours_bytes = None
    for label, base, config in variants:
        out = work / label.replace(" ", "_").replace(":", "")
        t0 = time.perf_counter()
        manifest = compress(base, ft_dir, out, calibration, config)
        seconds = time.perf_counter() - t0
        zstd_out = out.with_name(out.name + "-zstd")
        compress(base, ft_dir, zstd_out, calibration, replace(config, zstd=True))
        sizes = manifest["sizes"]
        raw, zstd = on_disk(out), on_disk(zstd_out)
        if ours_bytes is None:
            ours_bytes = raw
        codes, mask = entropy_bits_per_weight(out)
        note = f"entropy: codes {codes:.2f} + mask {mask:.2f} bits/weight; compress {seconds:.0f} s"
        measure(label, delta_variant(base, out), raw, note)
        rows[-1]["bytes_zstd"] = zstd
        rows[-1]["linear_bytes"] = manifest["sizes"]["linear_packed_bytes"]
    lora, rank, lora_bytes = lora_of_bytes(base_dir, ours_bytes, train_seqs, args, pad)
    measure(f"LoRA r={rank} (fp16, all linear)", lora, lora_bytes, "same data, equal bytes")
    report(args, rows, sizes, calibration)


def report(args, rows, sizes, calibration) -> None:
    fp16_all, fp16_linear = sizes["fp16_delta_bytes"], sizes["linear_fp16_bytes"]
    ft = rows[0]["perplexity"]
    print(
        f"\nfp16 delta: whole model {fp16_all} B, linear layers {fp16_linear} B; calibration "
        f"{calibration.shape[0]} x {calibration.shape[1]} tokens; {args.steps} fine-tuning steps\n"
    )
    print(
        "| variant | held-out ppl | vs fine-tuned | exact match | bytes | ratio vs fp16 delta "
        "| with zstd | linear-layer ratio | note |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        size = r["bytes"]
        ratio = f"{fp16_all / size:.2f}x" if size else "-"
        zstd = f"{fp16_all / r['bytes_zstd']:.2f}x" if r.get("bytes_zstd") else "-"
        linear = f"{fp16_linear / r['linear_bytes']:.2f}x" if r.get("linear_bytes") else "-"
        print(
            f"| {r['variant']} | {r['perplexity']:.3f} | {100 * (r['perplexity'] / ft - 1):+.2f}% "
            f"| {r['exact_match']:.3f} | {size if size else '-'} | {ratio} | {zstd} | {linear} "
            f"| {r['note']} |"
        )
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "sizes": sizes}, indent=2))


if __name__ == "__main__":
    main()
