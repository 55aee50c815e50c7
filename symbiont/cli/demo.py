"""`symbiont demo`: the point of the platform in one command.

One base executor (`symbiont serve-base`) and, at the same time, three fine-tuning
clients with different PEFT methods plus one generating client, each its own process,
all sharing the executor's single copy of the default model's frozen weights. It ends
with a table per client and the memory of the whole against separate full-model jobs.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HELP = "one executor, three fine-tuning clients (LoRA, IA3, prefix) and a generating client at once"

DESCRIPTION = """\
Starts `symbiont serve-base` on the embedded default model, then at the same time three
`symbiont finetune` clients (LoRA, IA3, prefix tuning) and one `symbiont generate`
client, each a separate process reaching the one executor over loopback TCP. Prints
live progress, then per client: method, steps, final loss, tokens/s and peak memory,
and the memory of the whole against separate full-model jobs. Takes a few minutes on
2 CPU cores (the first run also builds the default model, about a minute).
"""

# (client name, finetune flags). Learning rates suit each method on the default model.
CLIENTS = (
    ("lora", ["--method", "lora", "--r", "8", "--target", "all-linear", "--lr", "3e-3"]),
    ("ia3", ["--method", "ia3", "--lr", "3e-2"]),
    ("prefix", ["--method", "prefix", "--virtual-tokens", "8", "--lr", "3e-2"]),
)
GENERATE_PROMPT = "The history of"


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo",
        help=HELP,
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--steps", type=int, default=30, help="optimizer steps per fine-tuning client (default 30)"
    )
    parser.add_argument(
        "--batch-size", type=int, default=4, help="examples per step per client (default 4)"
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=48,
        help="tokens the generating client produces (default 48)",
    )
    parser.add_argument(
        "--model",
        metavar="DIR",
        help="checkpoint folder to use instead of the embedded default model",
    )
    parser.add_argument(
        "--out",
        metavar="DIR",
        help="folder for adapters and logs (default: a new temporary folder)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for every client")
    parser.set_defaults(func=run)


@dataclass(frozen=True)
class ClientRow:
    name: str
    method: str
    steps: int
    final_loss: float | None
    tokens_per_s: float
    peak_rss: int


def run(args) -> int:
    import symbiont
    from symbiont.train import jobs

    model_dir = Path(args.model) if args.model else symbiont.default_model()
    workdir = Path(args.out or tempfile.mkdtemp(prefix="symbiont-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"model {model_dir}\nwork folder {workdir} (adapters, metrics, logs)")
    started: list = []
    try:
        base, url = jobs.start_base(model_dir, workdir)
        started.append(base)
        base_weights = _weight_bytes(url)
        print(f"serve-base: {base_weights / 2**20:.1f} MiB of frozen weights, once, on {url}")
        clients = [
            jobs.spawn(name, _finetune_argv(args, model_dir, url, workdir / name, flags), workdir)
            for name, flags in CLIENTS
        ]
        generator = jobs.spawn(
            "generate", _generate_argv(args, model_dir, url), workdir, split_stdout=True
        )
        started += [*clients, generator]
        print("started 3 fine-tuning clients (lora, ia3, prefix) and 1 generating client\n")
        _watch([*clients, generator], workdir, args.steps)
        for job in [*clients, generator]:
            jobs.check(jobs.reap(job))
    finally:
        for job in started:
            jobs.stop(job)
    rows = [_client_row(job, workdir / job.name) for job in clients]
    rows.append(_generate_row(generator))
    print(_answer(generator))
    print(_table(rows))
    print(_memory_summary(rows, base, base_weights))
    return 0


def _weight_bytes(url: str) -> int:
    """Bytes of frozen weights the executor serves, from its manifest."""
    import symbiont

    with symbiont.connect(url) as executor:
        manifest = executor.manifest
    size = manifest.dtype.itemsize
    return sum(
        (s.in_features * s.out_features + (s.out_features if s.has_bias else 0)) * size
        for s in manifest.layers
    )


def _finetune_argv(args, model_dir, url, out: Path, flags: list[str]) -> list[str]:
    from symbiont.default_model import default_dataset

    return [
        "finetune", "--model", str(model_dir), "--executor", url,
        "--data", str(default_dataset()), "--out", str(out),
        "--max-steps", str(args.steps), "--batch-size", str(args.batch_size),
        "--max-length", "64", "--seed", str(args.seed), "--threads", "1",
        "--no-progress", *flags,
    ]  # fmt: skip


def _generate_argv(args, model_dir, url) -> list[str]:
    return [
        "generate", "--model", str(model_dir), "--executor", url, "--prompt", GENERATE_PROMPT,
        "--max-new-tokens", str(args.max_new_tokens), "--temperature", "0.8", "--top-p", "0.95",
        "--seed", str(args.seed), "--threads", "1",
    ]  # fmt: skip


def _watch(all_jobs, workdir: Path, steps: int) -> None:
    """One status line per second: each fine-tuning client's step and latest loss."""
    from symbiont.train import jobs

    started, tty, last = time.monotonic(), sys.stdout.isatty(), ""
    while not all(jobs.finished(job) for job in all_jobs):
        line = " | ".join(_progress(job, workdir, steps) for job in all_jobs)
        if tty:  # rewrite one line in place
            print(f"\r[{time.monotonic() - started:4.0f}s] {line}\033[K", end="", flush=True)
        elif line != last:  # logs: a line per change, at most every 5 s
            print(f"[{time.monotonic() - started:4.0f}s] {line}", flush=True)
            last = line
            time.sleep(4.0)
        time.sleep(1.0)
    print()


def _progress(job, workdir: Path, steps: int) -> str:
    from symbiont.train import jobs

    if job.name == "generate":
        return "generate: " + ("done" if jobs.finished(job) else "running")
    last = _last_metrics(workdir / job.name)
    if last is None:
        return f"{job.name}: starting"
    return f"{job.name}: step {last['step']}/{steps} loss {last['loss']:.3f}"


def _last_metrics(out: Path) -> dict | None:
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
        return json.loads(lines[-1]) if lines else None
    except (OSError, ValueError):
        return None


def _client_row(job, out: Path) -> ClientRow:
    summary = json.loads((out / "train_summary.json").read_text())
    method = json.loads((out / "adapter_config.json").read_text())["peft_type"]
    return ClientRow(
        job.name, method, summary["steps"], summary["final_loss"], summary["tokens_per_s"],
        job.peak_rss,
    )  # fmt: skip


_GENERATE_SUMMARY = re.compile(r"\[(\d+) tokens, ([\d.]+) tokens/s")


def _generate_row(job) -> ClientRow:
    found = _GENERATE_SUMMARY.search(job.log.read_text(errors="replace"))
    tokens, rate = (int(found[1]), float(found[2])) if found else (0, 0.0)
    return ClientRow("generate", "none (base)", tokens, None, rate, job.peak_rss)


def _answer(job) -> str:
    text = job.log.with_suffix(".out").read_text(errors="replace").strip()
    return f"generating client: {GENERATE_PROMPT!r} -> {text[:300]!r}\n"


def _table(rows: list[ClientRow]) -> str:
    header = f"{'client':<10}{'method':<16}{'steps':>6}{'final loss':>12}{'tokens/s':>10}{'peak RSS':>11}"
    lines = [header, "-" * len(header)]
    for r in rows:
        loss = f"{r.final_loss:.4f}" if r.final_loss is not None else "-"
        lines.append(
            f"{r.name:<10}{r.method:<16}{r.steps:>6}{loss:>12}{r.tokens_per_s:>10.1f}"
            f"{_mib(r.peak_rss):>11}"
        )
    return "\n".join(lines)


def _memory_summary(rows: list[ClientRow], base, base_weights: int) -> str:
    clients = sum(r.peak_rss for r in rows)
    together = clients + base.peak_rss
    separate = clients + len(rows) * base_weights  # each job would hold its own base weights
    return (
        f"\nexecutor (serve-base) peak RSS {_mib(base.peak_rss)}, holding "
        f"{_mib(base_weights)} of frozen weights once\n"
        f"all {len(rows)} clients + executor: {_mib(together)}\n"
        f"separate full-model jobs (each client plus its own copy of the weights, "
        f"estimated): {_mib(separate)}\n"
        "On this tiny default model the weights are small next to each Python+torch "
        "process; on a real model they dominate, which is what benchmarks/multi_finetune.py "
        "measures."
    )


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.0f} MiB"
