"""`symbiont demo`: the point of the platform in one command.

One base executor (`symbiont serve-base`) and, at the same time, three fine-tuning
clients with different PEFT methods plus one generating client, each its own process,
all sharing the executor's single copy of the default model's frozen weights. Then the
same four clients run again as separate jobs, each loading its own copy of the weights
in-process, so that the memory of both ways is measured, not estimated. It ends with a
table per client and one line saying what sharing saved (or cost) and why.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from symbiont.cli.flags import DEFAULT_MODEL, MODEL_HELP, add_flags, from_args, resolve_model

HELP = "one executor, three fine-tuning clients (LoRA, IA3, prefix) and a generating client at once"

DESCRIPTION = """\
Starts `symbiont serve-base` on the embedded default model, then at the same time three
`symbiont finetune` clients (LoRA, IA3, prefix tuning) and one `symbiont generate`
client, each a separate process reaching the one executor over loopback TCP (shared
memory on one host). The generating client continues the start of a passage of the
default model's training corpus greedily. Then, unless --no-baseline, the same four
clients run again as separate jobs, each with its own in-process copy of the weights.
Prints live progress, then per client: method, steps, final loss, tokens/s and peak
memory (PSS, sampled from /proc) in both setups, and one line on what sharing saved.
About 2 minutes on 2 CPU cores; the first run also builds the default model (83 s
measured on a busy 2-core VM, progress on stderr; BENCHMARKS.md).
"""

# (client name, finetune flags). Learning rates suit each method on the default model.
# Learning rates tuned on the default model for 30 steps of 4 examples (final loss from
# about 8.8: LoRA 5.0, IA3 5.3, prefix 5.5); IA3 and prefix train few parameters and
# need larger steps than LoRA.
CLIENTS = (
    ("lora", ["--method", "lora", "--r", "8", "--target", "all-linear", "--lr", "3e-3"]),
    ("ia3", ["--method", "ia3", "--lr", "3e-1"]),
    ("prefix", ["--method", "prefix", "--virtual-tokens", "8", "--lr", "1e-1"]),
)
# The start of a training paragraph of symbiont/assets/corpus.txt: the pretrained default
# model continues it with the corpus's own words when decoding greedily.
# Each process's peak PSS is read this often: its load and first steps are a few seconds
# long, and each read walks the process's page tables (symbiont/processes.py).
PSS_EVERY_S = 0.2
GENERATE_PROMPT = "The central processing unit, usually called the CPU,"


@dataclass(frozen=True)
class DemoConfig:
    """The knobs of `symbiont demo` (each field is a flag)."""

    steps: int = field(default=30, metadata={"help": "optimizer steps per fine-tuning client"})
    batch_size: int = field(default=4, metadata={"help": "examples per step per client"})
    max_new_tokens: int = field(
        default=48, metadata={"help": "tokens the generating client produces"}
    )
    model: str = field(
        default=DEFAULT_MODEL, metadata={"help": "checkpoint folder to use", "metavar": "DIR"}
    )
    out: str | None = field(
        default=None,
        metadata={
            "help": "folder for adapters and logs (default: a new temporary folder)",
            "metavar": "DIR",
        },
    )
    seed: int = field(default=0, metadata={"help": "seed for every client"})
    baseline: bool = field(
        default=True,
        metadata={
            "flag": "--no-baseline",
            "help": "skip the second run of the same clients as separate jobs (each with its "
            "own copy of the weights) that measures the memory sharing saves",
        },
    )

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo",
        help=HELP,
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_flags(parser, DemoConfig, meta={"model": {"help": MODEL_HELP, "metavar": "DIR"}})
    parser.set_defaults(func=run)


@dataclass(frozen=True)
class ClientRow:
    name: str
    method: str
    steps: int
    final_loss: float | None
    tokens_per_s: float
    shared_pss: int | None  # peak PSS in bytes while sharing the executor
    alone_pss: int | None = None  # peak PSS as a separate job with its own weights
    alone_tokens_per_s: float | None = None  # as a separate job


@dataclass(frozen=True)
class Memory:
    """Measured peaks (bytes, each process's sampled peak PSS) of both setups."""

    base_pss: int | None  # the executor process
    weights: int  # frozen weight bytes the executor serves (one copy)
    rows: tuple[ClientRow, ...]

    @property
    def shared_total(self) -> int | None:
        peaks = [self.base_pss, *(r.shared_pss for r in self.rows)]
        return None if None in peaks else sum(peaks)

    @property
    def separate_total(self) -> int | None:
        peaks = [r.alone_pss for r in self.rows]
        return None if None in peaks else sum(peaks)


def run(args) -> int:
    config = from_args(DemoConfig, args)
    model_dir = Path(resolve_model(config.model))
    workdir = Path(config.out or tempfile.mkdtemp(prefix="symbiont-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"model {model_dir}\nwork folder {workdir} (adapters, metrics, logs)", flush=True)
    base_pss, weights, jobs = _run_shared(config, model_dir, workdir)
    rows = [_client_row(job, workdir / job.name) for job in jobs[:-1]]
    rows.append(_generate_row(jobs[-1]))
    if config.baseline:
        print("\nthe same 4 clients again as separate jobs, each with its own copy of the weights")
        alone = _run_clients(config, model_dir, None, workdir / "separate")
        alone_rows = [_client_row(job, workdir / "separate" / job.name) for job in alone[:-1]]
        alone_rows.append(_generate_row(alone[-1]))
        rows = [_with_alone(row, job) for row, job in zip(rows, alone_rows, strict=True)]
    print(_answer(jobs[-1]))
    print(_table(rows, base_pss))
    print(_memory_summary(Memory(base_pss, weights, tuple(rows))))
    return 0


def _run_shared(config: DemoConfig, model_dir: Path, workdir: Path):
    """serve-base and the 4 clients on it; returns its peak PSS, weight bytes, client jobs."""
    from symbiont import processes

    server = processes.ServerProcess(
        model_dir,
        bind=("tcp://127.0.0.1:*",),
        workdir=workdir,
        threads=1,
        pss_interval_s=PSS_EVERY_S,
    )
    with server:
        url = server.url("tcp")
        weights = _weight_bytes(url)
        print(f"serve-base: {_mib(weights)} of frozen weights, once, on {url}")
        jobs = _run_clients(config, model_dir, url, workdir)
    return server.job.peak_pss, weights, jobs


def _run_clients(config: DemoConfig, model_dir: Path, url: str | None, workdir: Path):
    """The 3 fine-tuning clients and the generating client at once, on the executor at
    `url` (None: each loads its own in-process); waits for all, raises if one failed."""
    from symbiont import processes

    workdir.mkdir(parents=True, exist_ok=True)
    jobs: list = []
    try:
        for name, flags in CLIENTS:
            argv = _finetune_argv(config, model_dir, url, workdir / name, flags)
            jobs.append(processes.spawn(name, argv, workdir, pss_interval_s=PSS_EVERY_S))
        argv = _generate_argv(config, model_dir, url)
        jobs.append(
            processes.spawn(
                "generate", argv, workdir, split_stdout=True, pss_interval_s=PSS_EVERY_S
            )
        )
        print("started 3 fine-tuning clients (lora, ia3, prefix) and 1 generating client\n")
        _watch(jobs, workdir, config.steps)
        for job in jobs:
            processes.check(processes.reap(job))
    finally:
        for job in jobs:
            processes.stop(job)
    return jobs


def _weight_bytes(url: str) -> int:
    """Bytes of frozen weights the executor serves, from its manifest."""
    from symbiont.client.remote import connect

    with connect(url) as executor:
        manifest = executor.manifest
    size = manifest.dtype.itemsize
    return sum(
        (s.in_features * s.out_features + (s.out_features if s.has_bias else 0)) * size
        for s in manifest.layers
    )


def _executor_flags(url: str | None) -> list[str]:
    return [] if url is None else ["--executor", url]


def _finetune_argv(args: DemoConfig, model_dir, url, out: Path, flags: list[str]) -> list[str]:
    from symbiont.model.default import default_dataset

    return [
        "finetune", "--model", str(model_dir), *_executor_flags(url),
        "--data", str(default_dataset()), "--out", str(out),
        "--max-steps", str(args.steps), "--batch-size", str(args.batch_size),
        "--max-length", "64", "--seed", str(args.seed), "--threads", "1",
        "--no-progress", *flags,
    ]  # fmt: skip


def _generate_argv(args: DemoConfig, model_dir, url) -> list[str]:
    return [
        "generate", "--model", str(model_dir), *_executor_flags(url),
        "--prompt", GENERATE_PROMPT, "--max-new-tokens", str(args.max_new_tokens),
        "--temperature", "0", "--seed", str(args.seed), "--threads", "1",
    ]  # fmt: skip


def _watch(all_jobs, workdir: Path, steps: int) -> None:
    """One status line per second: each fine-tuning client's step and latest loss."""
    from symbiont.processes import finished

    started, tty, last = time.monotonic(), sys.stdout.isatty(), ""
    while not all(finished(job) for job in all_jobs):
        line = " | ".join(_progress(job, workdir, steps) for job in all_jobs)
        if tty:  # rewrite one line in place
            print(f"\r[{time.monotonic() - started:4.0f}s] {line}\033[K", end="", flush=True)
        elif line != last:  # logs: a line per change, at most every 5 s
            print(f"[{time.monotonic() - started:4.0f}s] {line}", flush=True)
            last = line
            time.sleep(4.0)
        time.sleep(1.0)
    print(f"[{time.monotonic() - started:4.0f}s] all clients done", flush=True)


def _progress(job, workdir: Path, steps: int) -> str:
    from symbiont.processes import finished

    if job.name == "generate":
        return "generate: " + ("done" if finished(job) else "running")
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
    from symbiont.adapters import read_adapter

    method = read_adapter(out, require_weights=False).peft_type
    return ClientRow(
        job.name, method, summary["steps"], summary["final_loss"], summary["tokens_per_s"],
        job.peak_pss,
    )  # fmt: skip


_GENERATE_SUMMARY = re.compile(r"\[(\d+) tokens, ([\d.]+) tokens/s")


def _generate_row(job) -> ClientRow:
    found = _GENERATE_SUMMARY.search(job.log.read_text(errors="replace"))
    tokens, rate = (int(found[1]), float(found[2])) if found else (0, 0.0)
    return ClientRow("generate", "none (base)", tokens, None, rate, job.peak_pss)


def _with_alone(row: ClientRow, alone: ClientRow) -> ClientRow:
    assert row.name == alone.name, (row.name, alone.name)
    return replace(row, alone_pss=alone.shared_pss, alone_tokens_per_s=alone.tokens_per_s)


def _answer(job) -> str:
    """The generated text next to the corpus's own continuation of the prompt."""
    text = job.log.with_suffix(".out").read_text(errors="replace").strip()
    corpus = _corpus_continuation(GENERATE_PROMPT)
    said, truth = text.split(), corpus.split()
    same = 0
    while same < min(len(said), len(truth)) and said[same] == truth[same]:
        same += 1
    if same == len(said) - 1 and same < len(truth) and truth[same].startswith(said[same]):
        same += 1  # the last word was cut off by --max-new-tokens
    return (
        "\ngenerating client (base model, greedy), prompt from the training corpus:\n"
        f"  prompt  {GENERATE_PROMPT!r}\n"
        f"  model   {_clip(text)!r}\n"
        f"  corpus  {_clip(' '.join(truth[: max(len(said), 1)]))!r}\n"
        f"  the first {same} of {len(said)} generated words are the corpus's own\n"
    )


def _corpus_continuation(prompt: str) -> str:
    """What follows `prompt` in the bundled training corpus (its paragraph's rest)."""
    from symbiont.model.default import default_corpus

    for paragraph in default_corpus().read_text(encoding="utf-8").split("\n\n"):
        if paragraph.strip().startswith(prompt):
            return paragraph.strip()[len(prompt) :]
    raise ValueError(f"the corpus has no paragraph starting with {prompt!r}")


def _clip(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _table(rows: list[ClientRow], base_pss: int | None) -> str:
    header = (
        f"{'client':<10}{'method':<16}{'steps':>6}{'final loss':>12}{'tokens/s shared':>17}"
        f"{'alone':>8}{'peak PSS shared':>17}{'alone':>9}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        loss = f"{r.final_loss:.4f}" if r.final_loss is not None else "-"
        alone = f"{r.alone_tokens_per_s:.1f}" if r.alone_tokens_per_s is not None else "-"
        lines.append(
            f"{r.name:<10}{r.method:<16}{r.steps:>6}{loss:>12}{r.tokens_per_s:>17.1f}"
            f"{alone:>8}{_mib(r.shared_pss):>17}{_mib(r.alone_pss):>9}"
        )
    lines.append(f"{'executor':<10}{'serve-base':<16}{'':>43}{_mib(base_pss):>17}{'-':>9}")
    return "\n".join(lines)


def _memory_summary(memory: Memory) -> str:
    """Both setups' measured memory, then in one line what sharing saved or cost, and why."""
    shared, separate = memory.shared_total, memory.separate_total
    if shared is None:
        return "\nmemory: not measured (/proc/PID/smaps_rollup is unreadable here)"
    n, weights = len(memory.rows), memory.weights
    lines = [
        "\nmemory: each process's peak PSS (shared pages split among the processes that "
        "map them), sampled from /proc while it ran, summed",
        f"  executor (serve-base) {_mib(memory.base_pss)}, holding the {_mib(weights)} of "
        "frozen weights once",
        f"  shared:   {n} clients + executor {_mib(shared)}",
    ]
    if separate is None:
        lines.append(
            f"sharing holds the {_mib(weights)} of frozen weights once instead of {n} times; "
            "run without --no-baseline to measure what separate full-model jobs use"
        )
        return "\n".join(lines)
    lines.append(
        f"  separate full-model jobs (measured: the same {n} clients, each loading its own "
        f"copy of the weights) {_mib(separate)}"
    )
    lines.append(_verdict(separate - shared, separate, n, weights, memory.base_pss))
    return "\n".join(lines)


def _verdict(saved: int, separate: int, n: int, weights: int, base_pss: int) -> str:
    copies = f"the {_mib(weights)} of frozen weights held once instead of {n} times"
    if saved > 0:
        return f"sharing saved {_mib(saved)} ({saved / separate:.0%}): {copies}"
    runtime = max(base_pss - weights, 0)
    return (
        f"sharing cost {_mib(-saved)} more than separate jobs: {copies} saves "
        f"{_mib((n - 1) * weights)}, but the executor's own process (Python + torch) takes "
        f"{_mib(runtime)}; sharing pays once the weights exceed ~{_mib(runtime // max(n - 1, 1))} "
        "(BENCHMARKS.md, issue 4: a 222M-parameter model)"
    )


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.0f} MiB"
