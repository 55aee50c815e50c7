"""N concurrent LoRA fine-tuning jobs: N vanilla transformers+peft processes against one
`symbiont serve-base` and N symbiont client processes (shared-memory transport).

Three ways of running the same N jobs on the same cores, each measured in this run:

- `vanilla` (mmap-shared): plain `from_pretrained(dtype=float32)` of an fp32 checkpoint.
  transformers leaves same-dtype safetensors weights memory-mapped, so N such processes
  already share one copy of the weights through the page cache.
- `private` (dtype-converting): the same model from a bf16 copy of the checkpoint,
  computed in fp32 (`from_pretrained(bf16_dir, dtype=float32)`): every process converts,
  so every process holds a private fp32 copy (as it would after a dtype change, a move
  to a device, or quantisation).
- `symbiont`: one `serve-base` holding the fp32 weights once, N clients without them.
- `inprocess` / `inprocess-unfused`: each job hosts its own `BaseExecutor` in-process
  (`symbiont finetune` without `--executor`), with q/k/v and gate/up forward calls fused
  into one call and one matmul (the default), or one call per layer: throughput of the
  placement, not memory (each such job holds its own weights).

Memory is PSS (proportional set size: shared pages divided among the processes that map
them) of every process of an arm, read from /proc/PID/smaps_rollup at the same instant
every 0.2 s until the timed steps start (loading, optimizer state and a whole warm-up step
of the same shapes come first) and every 2 s during them, since each read stalls the
process it reads; the peak of their sum is reported. Throughput is all tokens / (last end -
first start) over a window that all N jobs measure together (they load, take a warm-up
step, then wait at a barrier).

    python benchmarks/multi_finetune.py --model 100m --jobs 1,2,4 --steps 3

`--fusion-ab ROUNDS` instead trains three models in one process, a few steps each in
turn for ROUNDS rounds (so a changing load hits all alike): vanilla, the split over an
in-process executor with fused q/k/v and gate/up calls, and the same split unfused.

    python benchmarks/multi_finetune.py --model 4m --fusion-ab 8 --steps 5 --batch 4

For the split it also prints where a client's step goes: time inside executor calls
(the client's clock) split into the executor's matmuls, waiting in its queue for batch
partners, and the rest (transport and Python on both sides), against the client's own
compute. The models are Llamas built from config with random weights (no download).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODELS = {
    "4m": dict(  # ~4M parameters (benchmarks/peers' small Llama): Python per call shows
        vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2,
    ),
    "100m": dict(  # ~98M parameters, 0.39 GB in fp32: for iterating on a shared machine
        vocab_size=8192, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
        num_attention_heads=12, num_key_value_heads=12,
    ),
    "222m": dict(  # ~222M parameters, 0.89 GB in fp32 (issue 4's model)
        vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
        num_attention_heads=16, num_key_value_heads=16,
    ),
    "443m": dict(  # ~443M parameters, 1.8 GB in fp32 (issue 17's size)
        vocab_size=8192, hidden_size=1536, intermediate_size=4096, num_hidden_layers=15,
        num_attention_heads=16, num_key_value_heads=16,
    ),
}  # fmt: skip
ARMS = ("vanilla", "private", "symbiont", "inprocess", "inprocess-unfused")
IN_PROCESS = ("inprocess", "inprocess-unfused")


# --------------------------------------------------------------------------- worker


def worker(args) -> None:
    """One fine-tuning job; writes {tokens, t_start, t_end, call_s, calls} for the
    measured steps (call_s, calls: time in and number of executor calls, split only)."""
    import peft
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model, timer = _load(args)
    targets = args.targets if args.targets == "all-linear" else args.targets.split(",")
    config = peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=targets)
    model = peft.get_peft_model(model, config)
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
    timer.reset()
    start = time.time()
    tokens = sum(step() for _ in range(args.steps))
    record = {"tokens": tokens, "t_start": start, "t_end": time.time(), **timer.totals()}
    Path(args.result).write_text(json.dumps(record))


class CallTimer:
    """Wraps an executor's `call` to add up the time the client spends inside it."""

    def __init__(self, executor=None):
        self.seconds, self.calls = 0.0, 0
        if executor is not None:
            inner = executor.call

            def timed(op, layer, x):
                start = time.perf_counter()
                try:
                    return inner(op, layer, x)
                finally:
                    self.seconds += time.perf_counter() - start
                    self.calls += 1

            executor.call = timed

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0

    def totals(self) -> dict:
        return {"call_s": self.seconds, "calls": self.calls}


def _load(args):
    import torch

    if args.mode in ("vanilla", "private"):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        return model, CallTimer()
    import symbiont

    if args.mode in IN_PROCESS:
        executor = symbiont.BaseExecutor.from_pretrained(args.model)
        executor.fuses_calls = args.mode == "inprocess"
        return symbiont.load_client(args.model, executor), CallTimer(executor)
    options = {} if args.spin_us is None else {"spin_us": args.spin_us}
    executor = symbiont.connect(args.executor, **options)
    timer = CallTimer(executor)
    return symbiont.load_client(args.model, executor), timer


# --------------------------------------------------------------------------- memory


MEASURED_PSS_INTERVAL_S = 2.0  # PSS sampling period while the timed steps run


class PssSampler:
    """PSS of a changing set of processes, read together every `interval_s`; keeps the
    peak of their sum and each process's peak (bytes)."""

    def __init__(self, interval_s: float = 0.2):
        from symbiont.processes import pss

        self._pss = pss
        self.interval_s = interval_s
        self.pids: list[int] = []
        self.peak_total = 0
        self.peaks: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def watch(self, pid: int) -> None:
        self.pids = [*self.pids, pid]

    def _run(self) -> None:
        while not self._stop.is_set():
            total = 0
            for pid in self.pids:
                now = self._pss(pid) or 0
                total += now
                self.peaks[pid] = max(self.peaks.get(pid, 0), now)
            self.peak_total = max(self.peak_total, total)
            self._stop.wait(self.interval_s)


# --------------------------------------------------------------------------- orchestration


@dataclass(frozen=True)
class Outcome:
    arm: str
    jobs: int
    tokens_per_s: float  # aggregate over the concurrent window
    peak_pss: int  # peak of the arm's processes' PSS summed at each sample, bytes
    executor_pss: int  # symbiont only: peak PSS of the serve-base process
    per_job_pss: float  # mean peak PSS of one job process
    profile: dict = field(default_factory=dict)  # symbiont only: where a step goes


def build_models(folder: Path, config: dict) -> tuple[Path, Path]:
    """The fp32 checkpoint and a bf16 copy of it (same weights, rounded)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    fp32, bf16 = folder / "fp32", folder / "bf16"
    if not (fp32 / "config.json").is_file():
        torch.manual_seed(0)
        model = LlamaForCausalLM(
            LlamaConfig(**config, max_position_embeddings=512, tie_word_embeddings=False)
        )
        model.save_pretrained(fp32)
        model.to(torch.bfloat16).save_pretrained(bf16)
    return fp32, bf16


def run_one(arm: str, n: int, models: tuple[Path, Path], work: Path, args) -> Outcome:
    from symbiont import processes as jobs

    run_dir = Path(tempfile.mkdtemp(prefix=f"{arm}-{n}-", dir=work))
    model_dir = models[1] if arm == "private" else models[0]
    started, base, url = [], None, None
    with PssSampler() as sampler:
        try:
            if arm == "symbiont":
                server = jobs.ServerProcess(
                    model_dir, bind=("tcp://127.0.0.1:*",), workdir=run_dir,
                    threads=args.executor_threads, args=_policy_flags(args),
                ).start()  # fmt: skip
                base, url = server.job, server.url("tcp")
                started.append(base)
                sampler.watch(base.pid)
            workers = []
            for i in range(n):
                workers.append(_spawn_worker(arm, i, model_dir, url, run_dir, args))
                sampler.watch(workers[-1].pid)
            started += workers
            _barrier(workers, run_dir, n)
            before = _executor_stats(url) if url else None
            # Reading smaps_rollup walks a process's page tables (~20 ms for the 450M
            # executor) under its mmap lock, stalling its mmap/munmap meanwhile; every
            # 0.2 s that took ~10% of a core the split needs at N=1 (vanilla's N=1 leaves
            # one idle). The peak is reached by then (load, optimizer state, a whole warm-up
            # step of the same shapes), so the measured steps are sampled sparsely.
            sampler.interval_s = MEASURED_PSS_INTERVAL_S
            (run_dir / "go").write_text("go")
            for job in workers:
                jobs.check(jobs.reap(job))
            after = _executor_stats(url) if url else None
        finally:
            for job in started:
                jobs.stop(job)
    results = [json.loads((run_dir / f"result-{i}.json").read_text()) for i in range(n)]
    window = max(r["t_end"] for r in results) - min(r["t_start"] for r in results)
    job_pss = [sampler.peaks.get(w.pid, 0) for w in workers]
    return Outcome(
        arm,
        n,
        sum(r["tokens"] for r in results) / window,
        sampler.peak_total,
        sampler.peaks.get(base.pid, 0) if base else 0,
        sum(job_pss) / n,
        _profile(results, before, after, window, args) if url else {},
    )


def _policy_flags(args) -> list[str]:
    flags = ["--workers", str(args.executor_workers)]
    if args.spin_us is not None:
        flags += ["--spin-us", str(args.spin_us)]
    if args.max_wait_ms is not None:
        flags += ["--max-wait-ms", str(args.max_wait_ms)]
    if args.policy is not None:
        flags += ["--policy", args.policy]
    return flags


def _executor_stats(url: str) -> dict:
    import symbiont

    executor = symbiont.connect(url, mode="zmq", label="benchmark")
    try:
        return executor.stats()["total"]
    finally:
        executor.close()


def _profile(results: list[dict], before: dict, after: dict, window: float, args) -> dict:
    """Where the split's time went over the measured window (executor counters are
    differences of its totals before and after)."""
    batches = after["batches"] - before["batches"]
    calls = after["calls"] - before["calls"]

    def total_s(key: str, count: str) -> float:
        return (after[key] * after[count] - before[key] * before[count]) / 1e3

    compute_s = total_s("mean_compute_ms", "batches")
    queue_s = total_s("mean_queue_wait_ms", "calls")
    steps = len(results) * args.steps
    return {
        "step_s": sum(r["t_end"] - r["t_start"] for r in results) / steps,
        # per step of one job: the client's own clock inside executor calls, and this
        # job's share of the executor's compute and queueing (all jobs' totals / steps)
        "in_calls_s": sum(r["call_s"] for r in results) / steps,
        "compute_s": compute_s / steps,
        "queue_s": queue_s / steps,
        "layer_calls_per_step": sum(r["calls"] for r in results) / steps,
        "round_trips_per_step": calls / steps,  # q/k/v and gate/up travel as one call
        "calls_per_batch": calls / max(batches, 1),
        "executor_busy": compute_s / window,
    }


def _step_s(outcome: Outcome, args) -> float:
    """Mean seconds per step of one job, from the arm's aggregate throughput."""
    return outcome.jobs * args.batch * args.seq / outcome.tokens_per_s


def _spawn_worker(arm, i, model_dir, url, run_dir, args):
    from symbiont import processes

    argv = [
        __file__, "worker", "--mode", arm, "--model", str(model_dir),
        "--threads", str(args.worker_threads), "--steps", str(args.steps),
        "--batch", str(args.batch), "--seq", str(args.seq), "--seed", str(i),
        "--rank", str(args.rank), "--targets", args.targets,
        "--ready", str(run_dir / f"ready-{i}"), "--go", str(run_dir / "go"),
        "--result", str(run_dir / f"result-{i}.json"),
    ]  # fmt: skip
    if url:
        argv += ["--executor", url]
    if args.spin_us is not None:
        argv += ["--spin-us", str(args.spin_us)]
    name, env = f"{arm}-worker-{i}", {"PYTHONPATH": str(REPO)}
    threads = args.worker_threads
    return processes.spawn(name, [], run_dir, threads=threads, python=argv, env=env)


def _barrier(workers, run_dir: Path, n: int, timeout_s: float = 900) -> None:
    from symbiont import processes as jobs

    deadline = time.monotonic() + timeout_s
    while sum((run_dir / f"ready-{i}").exists() for i in range(n)) < n:
        for job in workers:
            if jobs.finished(job):
                jobs.check(job)
        if time.monotonic() > deadline:
            raise RuntimeError(f"workers not ready after {timeout_s}s; see {run_dir}")
        time.sleep(0.05)


def report(rows: list[dict[str, Outcome]], args) -> str:
    gib = 2**30
    arms = [a for a in ARMS if a in rows[0]]
    head = f"{'N':>3} " + " ".join(f"{a + ' tok/s':>15}" for a in arms)
    head += " " + " ".join(f"{a + ' GiB':>13}" for a in arms)
    baselines = [a for a in arms if a in ("vanilla", "private")]
    if "symbiont" in arms:
        head += " " + " ".join(f"{'tput/' + b:>13} {'mem/' + b:>12}" for b in baselines)
    lines = [head]
    for row in rows:
        line = f"{row[arms[0]].jobs:>3} "
        line += " ".join(f"{row[a].tokens_per_s:>15.1f}" for a in arms)
        line += " " + " ".join(f"{row[a].peak_pss / gib:>13.2f}" for a in arms)
        if "symbiont" in arms:
            s = row["symbiont"]
            for b in baselines:
                line += f" {s.tokens_per_s / row[b].tokens_per_s:>12.2f}x"
                line += f" {s.peak_pss / row[b].peak_pss:>11.2f}x"
        lines.append(line)
    for a in (a for a in IN_PROCESS if a in arms and "vanilla" in arms):
        ratios = ", ".join(
            f"N={row[a].jobs}: {row[a].tokens_per_s / row['vanilla'].tokens_per_s:.2f}x"
            for row in rows
        )
        lines.append(f"{a} throughput / vanilla: {ratios}")
    last = rows[-1]
    lines += ["", f"per process at N={last[arms[0]].jobs} (peak PSS):"]
    for a in arms:
        o = last[a]
        extra = f", executor {o.executor_pss / gib:.2f} GiB" if a == "symbiont" else ""
        lines.append(f"  {a}: {o.per_job_pss / gib:.2f} GiB per job{extra}")
    if "symbiont" in arms:
        lines += [
            "",
            "split: where one job's step goes, ms per step (executor figures: all jobs' / steps)",
        ]
        lines.append(
            f"{'N':>3} {'step':>8} {'own work':>9} {'in calls':>9} {'compute':>8} "
            f"{'queue':>8} {'rest':>8} {'trips':>6} {'calls/batch':>12} {'exec busy':>10}"
        )
        for row in rows:
            p = row["symbiont"].profile
            rest = p["in_calls_s"] - p["queue_s"] - p["compute_s"]
            ms = [1e3 * v for v in (p["step_s"], p["step_s"] - p["in_calls_s"], p["in_calls_s"])]
            ms += [1e3 * v for v in (p["compute_s"], p["queue_s"], rest)]
            lines.append(
                f"{row['symbiont'].jobs:>3} {ms[0]:>8.1f} {ms[1]:>9.1f} {ms[2]:>9.1f} "
                f"{ms[3]:>8.1f} {ms[4]:>8.1f} {ms[5]:>8.1f} {p['round_trips_per_step']:>6.0f} "
                f"{p['calls_per_batch']:>12.2f} {p['executor_busy']:>9.0%}"
            )
        lines.append(
            "(own work: the client outside executor calls (attention, norms, LoRA, optimizer); "
            "in calls: waiting on the executor = compute (this job's share of the executor's "
            "matmuls) + queue (waiting for batch partners) + rest (transport, Python on both "
            "sides, waiting while other jobs' batches compute); trips: round trips per step"
        )
        if "vanilla" in arms:
            lines.append(
                "vanilla step ms, for comparison: "
                + ", ".join(
                    f"N={row['vanilla'].jobs}: {1e3 * _step_s(row['vanilla'], args):.1f}"
                    for row in rows
                )
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    sub = parser.add_subparsers(dest="command")
    w = sub.add_parser("worker")
    for flag in ("--mode", "--model", "--executor", "--ready", "--go", "--result"):
        w.add_argument(flag)
    for flag, default in (("--threads", 1), ("--steps", 4), ("--batch", 1), ("--seq", 64)):
        w.add_argument(flag, type=int, default=default)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--spin-us", type=float, default=None)
    w.add_argument("--rank", type=int, default=8)
    w.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj")
    parser.add_argument("--model", choices=sorted(MODELS), default="100m")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"some of {','.join(ARMS)}")
    parser.add_argument("--jobs", default="1,2,4", help="comma-separated N values")
    parser.add_argument("--steps", type=int, default=3, help="measured steps per job")
    parser.add_argument("--batch", type=int, default=1, help="sequences per step")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument(
        "--targets",
        default="q_proj,k_proj,v_proj,o_proj",
        help="LoRA target modules (comma-separated, or all-linear)",
    )
    parser.add_argument(
        "--worker-threads", type=int, default=1, help="torch threads per job process (default 1)"
    )
    parser.add_argument(
        "--executor-threads",
        type=int,
        default=1,
        help="torch threads per serve-base worker (default 1, like each job)",
    )
    parser.add_argument(
        "--executor-workers",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="serve-base --workers: batches computed at once, each on a thread of its own "
        "(default: one per core; 1 is serve-base's default)",
    )
    parser.add_argument(
        "--spin-us",
        type=float,
        default=None,
        help="shared-memory spin window of serve-base and of each client (0: always sleep)",
    )
    parser.add_argument(
        "--max-wait-ms", type=float, default=None, help="serve-base --max-wait-ms (batching wait)"
    )
    parser.add_argument(
        "--policy",
        choices=("opportunistic", "lockstep", "no-lockstep"),
        default=None,
        help="serve-base --policy (batching policy; default: serve-base's)",
    )
    parser.add_argument("--work", default=None, help="folder for the models and logs")
    parser.add_argument(
        "--fusion-ab",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="instead: vanilla vs in-process split with and without fused calls, one process",
    )
    args = parser.parse_args(argv)
    if args.command == "worker":
        worker(args)
        return 0
    arms = args.arms.split(",")
    if not arms or not set(arms) <= set(ARMS):
        parser.error(f"--arms takes some of {','.join(ARMS)}, got {args.arms!r}")
    work = Path(args.work or tempfile.mkdtemp(prefix="multi-finetune-"))
    work.mkdir(parents=True, exist_ok=True)
    models = build_models(work / f"model-{args.model}", MODELS[args.model])
    if args.fusion_ab:
        print(f"model {args.model}, LoRA r={args.rank} on {args.targets}, batch {args.batch} x "
              f"seq {args.seq}, {args.worker_threads} thread(s), {args.fusion_ab} rounds of "
              f"{args.steps} steps per model\n")  # fmt: skip
        print(fusion_ab(args, models[0]))
        return 0
    print(f"model {args.model} ({_params(models[0]) / 1e6:.0f}M parameters, fp32); LoRA r="
          f"{args.rank} on {args.targets}; batch {args.batch} x seq {args.seq}, {args.steps} "
          f"measured steps per job; {os.cpu_count()} cores", flush=True)  # fmt: skip
    rows = []
    for n in (int(x) for x in args.jobs.split(",")):
        row = {arm: run_one(arm, n, models, work, args) for arm in ARMS if arm in arms}
        rows.append(row)
        print(f"N={n}: " + " | ".join(
            f"{a} {o.tokens_per_s:.1f} tok/s {o.peak_pss / 2**30:.2f} GiB" for a, o in row.items()
        ), flush=True)  # fmt: skip
    print()
    print(report(rows, args))
    return 0


def fusion_ab(args, model_dir: Path) -> str:
    """tokens/s of vanilla, fused and unfused in-process split training, steps interleaved."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    import symbiont

    torch.set_num_threads(args.worker_threads)
    targets = args.targets if args.targets == "all-linear" else args.targets.split(",")
    config = peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=targets)
    models = {"vanilla": AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)}
    for name, fused in (("split, fused calls", True), ("split, one call per layer", False)):
        executor = symbiont.BaseExecutor.from_pretrained(model_dir)
        executor.fuses_calls = fused
        models[name] = symbiont.load_client(model_dir, executor)
    steps, seconds = {}, dict.fromkeys(models, 0.0)
    for name, model in models.items():
        torch.manual_seed(0)
        model = peft.get_peft_model(model, config).train()
        params = [p for p in model.parameters() if p.requires_grad]
        steps[name] = _train_step(model, torch.optim.AdamW(params, lr=2e-4), args)
        steps[name]()  # warm: allocator, optimizer state, the fused calls' order
    names = list(steps)
    for round_ in range(args.fusion_ab):
        turn = round_ % len(names)  # each model takes each place in a round in turn
        for name in names[turn:] + names[:turn]:
            step = steps[name]
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            seconds[name] += time.perf_counter() - start
    tokens = args.fusion_ab * args.steps * args.batch * args.seq
    lines = ["| training | tokens/s | vs vanilla |", "|---|---:|---:|"]
    for name in models:
        rate = tokens / seconds[name]
        lines.append(f"| {name} | {rate:.0f} | {seconds['vanilla'] / seconds[name]:.2f}x |")
    return "\n".join(lines)


def _train_step(model, optimizer, args):
    import torch

    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)

    def step() -> None:
        ids = torch.randint(0, vocab, (args.batch, args.seq), generator=generator)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


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
