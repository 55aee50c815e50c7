"""N concurrent LoRA fine-tuning jobs: N vanilla transformers+peft processes (each with its
own copy of the model) against one `symbiont serve-base` and N symbiont client processes.

For each N it prints aggregate training tokens/s and total peak memory (PSS sampled from
/proc/PID/smaps_rollup) of both ways and their ratios, then the largest N each fits in a
memory budget.

    python benchmarks/multi_finetune.py --jobs 1,2,4,8 --steps 4

The model is a Llama built from config with random weights (no download), sized so the
frozen weights dominate a job's memory. Every worker loads, trains one warm-up step,
then waits at a barrier so all N measure the same concurrent window.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODEL = dict(  # ~222M parameters, ~0.9 GB in fp32: the weights dominate a LoRA job's memory
    vocab_size=8192,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=16,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


# --------------------------------------------------------------------------- worker


def worker(args) -> None:
    """One fine-tuning job; writes {tokens, t_start, t_end} for the measured steps."""
    import peft
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = _load(args)
    model = peft.get_peft_model(
        model, peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")
    )
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4)
    model.train()
    vocab = model.config.vocab_size

    def step() -> int:
        ids = torch.randint(0, vocab, (args.batch, args.seq))  # [batch, seq]
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return ids.numel()

    step()  # warm-up: allocator, optimizer state
    Path(args.ready).write_text("ready")
    while not Path(args.go).exists():
        time.sleep(0.01)
    start = time.time()
    tokens = sum(step() for _ in range(args.steps))
    record = {"tokens": tokens, "t_start": start, "t_end": time.time()}
    Path(args.result).write_text(json.dumps(record))


def _load(args):
    import torch

    if args.mode == "vanilla":
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    import symbiont

    return symbiont.load_client(args.model, symbiont.connect(args.executor))


# --------------------------------------------------------------------------- orchestration


@dataclass(frozen=True)
class Outcome:
    jobs: int
    tokens_per_s: float  # aggregate over the concurrent window
    peak_rss: int  # sum of every process's peak PSS (sampled, shared pages split), bytes
    executor_rss: int  # symbiont only: the serve-base process
    per_job_rss: float  # mean peak of one job process


def build_model(folder: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (folder / "config.json").is_file():
        return folder
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**MODEL)).save_pretrained(folder)
    return folder


def run_one(mode: str, n: int, model_dir: Path, work: Path, args) -> Outcome:
    from symbiont import processes as jobs

    run_dir = Path(tempfile.mkdtemp(prefix=f"{mode}-{n}-", dir=work))
    started, base, url = [], None, None
    try:
        if mode == "symbiont":
            server = jobs.ServerProcess(
                model_dir, bind=("tcp://127.0.0.1:*",), workdir=run_dir,
                threads=args.executor_threads,
            ).start()  # fmt: skip
            base, url = server.job, server.url("tcp")
            started.append(base)
        threads = args.worker_threads
        workers = [_spawn_worker(mode, i, model_dir, url, run_dir, threads, args) for i in range(n)]
        started += workers
        _barrier(workers, run_dir, n)
        for job in workers:
            jobs.check(jobs.reap(job))
    finally:
        for job in started:
            jobs.stop(job)
    results = [json.loads((run_dir / f"result-{i}.json").read_text()) for i in range(n)]
    window = max(r["t_end"] for r in results) - min(r["t_start"] for r in results)
    job_rss = [w.peak_pss or 0 for w in workers]
    executor_rss = (base.peak_pss or 0) if base else 0
    return Outcome(
        n,
        sum(r["tokens"] for r in results) / window,
        sum(job_rss) + executor_rss,
        executor_rss,
        sum(job_rss) / n,
    )


def _spawn_worker(mode, i, model_dir, url, run_dir, threads, args):
    from symbiont import processes

    argv = [
        __file__, "worker", "--mode", mode, "--model", str(model_dir),
        "--threads", str(threads), "--steps", str(args.steps), "--batch", str(args.batch),
        "--seq", str(args.seq), "--seed", str(i),
        "--ready", str(run_dir / f"ready-{i}"), "--go", str(run_dir / "go"),
        "--result", str(run_dir / f"result-{i}.json"),
    ]  # fmt: skip
    if url:
        argv += ["--executor", url]
    name, env = f"{mode}-worker-{i}", {"PYTHONPATH": str(REPO)}
    return processes.spawn(name, [], run_dir, threads=threads, python=argv, env=env)


def _barrier(workers, run_dir: Path, n: int, timeout_s: float = 600) -> None:
    from symbiont import processes as jobs

    deadline = time.monotonic() + timeout_s
    while sum((run_dir / f"ready-{i}").exists() for i in range(n)) < n:
        for job in workers:
            if jobs.finished(job):
                jobs.check(job)
        if time.monotonic() > deadline:
            raise RuntimeError(f"workers not ready after {timeout_s}s; see {run_dir}")
        time.sleep(0.05)
    (run_dir / "go").write_text("go")


def report(rows: list[tuple[Outcome, Outcome]], budget: int) -> str:
    gib = 2**30
    lines = [
        f"{'N':>3} {'vanilla tok/s':>14} {'symbiont tok/s':>15} {'tput ratio':>11} "
        f"{'vanilla GiB':>12} {'symbiont GiB':>13} {'mem ratio':>10}",
    ]
    for v, s in rows:
        lines.append(
            f"{v.jobs:>3} {v.tokens_per_s:>14.1f} {s.tokens_per_s:>15.1f} "
            f"{s.tokens_per_s / v.tokens_per_s:>10.2f}x {v.peak_rss / gib:>12.2f} "
            f"{s.peak_rss / gib:>13.2f} {s.peak_rss / v.peak_rss:>10.2f}"
        )
    v, s = rows[-1]
    fit_v = int(budget // v.per_job_rss)
    fit_s = int(max(0, budget - s.executor_rss) // s.per_job_rss)
    lines += [
        "",
        f"per job: vanilla {v.per_job_rss / gib:.2f} GiB; symbiont client "
        f"{s.per_job_rss / gib:.2f} GiB + one executor {s.executor_rss / gib:.2f} GiB",
        f"largest N in a {budget / gib:.0f} GiB budget (from the N={v.jobs} per-process peaks): "
        f"vanilla {fit_v}, symbiont {fit_s}",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    w = sub.add_parser("worker")
    for flag in ("--mode", "--model", "--executor", "--ready", "--go", "--result"):
        w.add_argument(flag)
    for flag, default in (("--threads", 1), ("--steps", 4), ("--batch", 2), ("--seq", 128)):
        w.add_argument(flag, type=int, default=default)
    w.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", default="1,2,4,8", help="comma-separated N values")
    parser.add_argument("--steps", type=int, default=4, help="measured steps per job")
    parser.add_argument("--batch", type=int, default=2, help="sequences per step")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    parser.add_argument(
        "--worker-threads", type=int, default=1, help="torch threads per job process (default 1)"
    )
    parser.add_argument(
        "--executor-threads",
        type=int,
        default=1,
        help="torch threads of the serve-base process (default 1: on a busy 2-core machine "
        "two OpenMP threads ran small matmuls several times slower)",
    )
    parser.add_argument("--budget-gib", type=float, default=16.0, help="memory budget (GiB)")
    parser.add_argument("--work", default=None, help="folder for the model and logs")
    args = parser.parse_args(argv)
    if args.command == "worker":
        worker(args)
        return 0
    work = Path(args.work or tempfile.mkdtemp(prefix="multi-finetune-"))
    work.mkdir(parents=True, exist_ok=True)
    model_dir = build_model(work / "model")
    print(f"model {model_dir}: {_params(model_dir) / 1e6:.0f}M parameters; batch {args.batch} x "
          f"seq {args.seq}, {args.steps} measured steps per job, {os.cpu_count()} cores", flush=True)  # fmt: skip
    rows = []
    for n in (int(x) for x in args.jobs.split(",")):
        vanilla = run_one("vanilla", n, model_dir, work, args)
        symb = run_one("symbiont", n, model_dir, work, args)
        rows.append((vanilla, symb))
        print(f"N={n}: vanilla {vanilla.tokens_per_s:.1f} tok/s {vanilla.peak_rss / 2**30:.2f} GiB"
              f" | symbiont {symb.tokens_per_s:.1f} tok/s {symb.peak_rss / 2**30:.2f} GiB", flush=True)  # fmt: skip
    print()
    print(report(rows, int(args.budget_gib * 2**30)))
    return 0


def _params(model_dir: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return sum(_numel(f, k) for k in f.keys())  # noqa: SIM118 - not a dict


def _numel(f, key) -> int:
    n = 1
    for d in f.get_slice(key).get_shape():
        n *= d
    return n


if __name__ == "__main__":
    sys.exit(main())
