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
- `symbiont`: one `serve-base` holding the fp32 weights once, N clients without them
  (`--executor-matmul onednn`: serve-base computes its products on oneDNN, which the
  vanilla jobs, using torch's default, do not).
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

`--device cuda` puts every arm's weights on the GPU: vanilla and private jobs move their
model there (each process its own copy), serve-base runs with `--device cuda` (one copy)
and each symbiont client holds its own few tensors (embeddings, norms, LoRA) there. Each
arm's GPU memory is then sampled too, every 0.5 s, from `nvidia-smi --query-compute-apps`:
the peak of the sum of its processes' used memory, which includes each process's CUDA
context (a few hundred MiB per process: a real cost of every process on the GPU). Where
nvidia-smi is missing or does not list these pids (another pid namespace, in some
containers) the report falls back to the jobs' `torch.cuda.max_memory_reserved()`
(without the CUDA context; serve-base's own figure is then unknown) and says so. Each
job always records torch's max allocated and reserved bytes, printed as a second figure,
and the GPUs' total memory.used (over its reading before the arm starts) is a third.

    python benchmarks/multi_finetune.py --device cuda --model 100m --jobs 1,4 --steps 3 \
        --arms vanilla,symbiont
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import subprocess
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
    """One fine-tuning job; writes {tokens, t_start, t_end, cpu_s, call_s, calls} for the
    measured steps (cpu_s: this process's CPU time, all threads; call_s, calls: time in and
    number of executor calls, split only)."""
    import peft
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    model, timer = _load(args, device)
    targets = args.targets if args.targets == "all-linear" else args.targets.split(",")
    config = peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=targets)
    model = peft.get_peft_model(model, config)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4)
    model.train()
    vocab = model.config.vocab_size

    def step() -> int:
        ids = torch.randint(0, vocab, (args.batch, args.seq), device=device)  # [batch, seq]
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return ids.numel()

    step()  # warm-up: allocator, optimizer state
    _sync(device)
    Path(args.ready).write_text("ready")
    while not Path(args.go).exists():
        time.sleep(0.01)
    timer.reset()
    start, cpu = time.time(), time.process_time()
    tokens = sum(step() for _ in range(args.steps))
    _sync(device)  # CUDA queues kernels: the steps are done once the GPU has run them
    record = {"tokens": tokens, "t_start": start, "t_end": time.time(), **timer.totals()}
    record["cpu_s"] = time.process_time() - cpu
    record.update(_torch_gpu_memory(device))
    Path(args.result).write_text(json.dumps(record))
    if args.hold:  # stay until the supervisor has taken a last GPU memory sample
        deadline = time.monotonic() + HOLD_TIMEOUT_S
        while not Path(args.hold).exists() and time.monotonic() < deadline:
            time.sleep(0.01)


HOLD_TIMEOUT_S = 120.0  # a held worker exits by itself after this


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _torch_gpu_memory(device) -> dict:
    """torch's peak allocated and reserved bytes on `device` (None on the CPU). Reserved
    is what the caching allocator holds; neither counts the CUDA context."""
    import torch

    if device.type != "cuda":
        return {"gpu_allocated": None, "gpu_reserved": None}
    return {
        "gpu_allocated": torch.cuda.max_memory_allocated(device),
        "gpu_reserved": torch.cuda.max_memory_reserved(device),
    }


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


def _load(args, device):
    import torch

    if args.mode in ("vanilla", "private"):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        return model.to(device), CallTimer()
    import symbiont

    if args.mode in IN_PROCESS:
        executor = symbiont.BaseExecutor.from_pretrained(args.model, device=device)
        executor.fuses_calls = args.mode == "inprocess"
        model = symbiont.load_client(args.model, executor, device=device)
        return model, CallTimer(executor)
    options = {} if args.spin_us is None else {"spin_us": args.spin_us}
    if not args.host_areas:
        options.update(_connect_device(device))
    executor = symbiont.connect(args.executor, **options)
    timer = CallTimer(executor)
    return symbiont.load_client(args.model, executor, device=device), timer


def _connect_device(device) -> dict:
    """{"device": ...} for `symbiont.connect` where it takes that option (a named
    parameter or a ClientConfig field), off the CPU; else nothing."""
    import dataclasses
    import inspect

    from symbiont.client import remote

    if str(device) == "cpu":
        return {}
    parameter = inspect.signature(remote.connect).parameters.get("device")
    named = parameter is not None and parameter.kind is not inspect.Parameter.VAR_KEYWORD
    fields = {f.name for f in dataclasses.fields(remote.ClientConfig)}
    return {"device": str(device)} if named or "device" in fields else {}


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


GPU_INTERVAL_S = 0.5  # nvidia-smi sampling period (it reads the driver, stalls no process)
APPS_QUERY = ("--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits")
TOTAL_QUERY = ("--query-gpu=memory.used", "--format=csv,noheader,nounits")


def parse_compute_apps(text: str) -> dict[int, int]:
    """MiB per pid from `nvidia-smi --query-compute-apps=pid,used_memory --format=csv,
    noheader,nounits` ("PID, MiB" lines; a pid on several GPUs is summed). Anything else
    is skipped: a header, '[N/A]' or '[Not Supported]' values, blank or other lines."""
    usage: dict[int, int] = {}
    for line in text.splitlines():
        fields = line.split(",")
        if len(fields) != 2:
            continue
        pid, mib = _whole(fields[0]), _mib(fields[1])
        if pid is not None and pid > 0 and mib is not None:
            usage[pid] = usage.get(pid, 0) + mib
    return usage


def parse_total_used(text: str) -> int | None:
    """MiB used over all GPUs from `nvidia-smi --query-gpu=memory.used --format=csv,
    noheader,nounits` (one line per GPU); None when no line is a number."""
    values = [v for v in (_mib(line) for line in text.splitlines()) if v is not None]
    return sum(values) if values else None


def _mib(text: str) -> int | None:
    text = text.strip()
    text = text.removesuffix("MiB").strip()  # in case the units were left on
    try:
        value = round(float(text))
    except (ValueError, OverflowError):  # '[N/A]', '[Not Supported]', a header, 'inf'
        return None
    return value if value >= 0 else None


def _whole(text: str) -> int | None:
    try:
        return int(text.strip())
    except ValueError:
        return None


class GpuSampler:
    """GPU memory of a changing set of processes, from nvidia-smi every `interval_s`:
    the peak of their per-process used memory summed (MiB; None while nvidia-smi has
    listed none of them), each process's peak, and the peak of the GPUs' total
    memory.used over its reading when sampling began (None: no reading)."""

    def __init__(self, command: str = "nvidia-smi", interval_s: float = GPU_INTERVAL_S):
        self.command = shlex.split(command)
        self.interval_s = interval_s
        self.pids: list[int] = []
        self.peak_total: int | None = None
        self.peaks: dict[int, int] = {}
        self.baseline: int | None = None
        self.peak_device: int | None = None
        self.error: str | None = None  # why nvidia-smi gave nothing, the last time
        self._missing = False  # no nvidia-smi: stop trying
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> GpuSampler:
        self.baseline = parse_total_used(self._query(TOTAL_QUERY))
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def watch(self, pid: int) -> None:
        self.pids = [*self.pids, pid]

    def sample(self) -> None:
        """One reading now (the sampling thread calls this too)."""
        with self._lock:
            apps = parse_compute_apps(self._query(APPS_QUERY))
            total = parse_total_used(self._query(TOTAL_QUERY))
            pids = self.pids
            listed = [pid for pid in pids if pid in apps]
            if listed:
                self.peak_total = max(self.peak_total or 0, sum(apps[pid] for pid in listed))
                for pid in listed:
                    self.peaks[pid] = max(self.peaks.get(pid, 0), apps[pid])
            if total is not None and self.baseline is not None:
                self.peak_device = max(self.peak_device or 0, total - self.baseline)

    def _query(self, query: tuple[str, ...]) -> str:
        if self._missing or not self.command:
            return ""
        try:
            done = subprocess.run(
                [*self.command, *query], capture_output=True, text=True, timeout=10
            )
        except FileNotFoundError:
            self._missing, self.error = True, f"{self.command[0]} not found"
            return ""
        except (OSError, subprocess.SubprocessError) as err:
            self.error = f"{self.command[0]}: {err}"
            return ""
        if done.returncode:
            why = (done.stderr or done.stdout).strip().splitlines()
            self.error = f"{self.command[0]} exit {done.returncode}: {why[0] if why else ''}"
            return ""
        return done.stdout

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)


@dataclass(frozen=True)
class GpuMemory:
    """One arm's GPU memory (MiB from nvidia-smi, bytes from torch; None: not known)."""

    total_mib: int | None  # peak of the per-process used memory summed over the arm
    executor_mib: int | None  # serve-base's peak
    per_job_mib: float | None  # mean peak of one job process
    device_mib: int | None  # peak of the GPUs' memory.used over its reading before the arm
    allocated: int | None  # jobs' torch max_memory_allocated, summed
    reserved: int | None  # jobs' torch max_memory_reserved, summed
    error: str | None = None  # why nvidia-smi gave nothing


def _gpu_memory(gpu: GpuSampler, workers, base, results: list[dict]) -> GpuMemory:
    """The arm's figures; its nvidia-smi sum only if nvidia-smi listed every one of its
    processes at some point (a process is not listed before it starts using CUDA)."""
    pids = [w.pid for w in workers] + ([base.pid] if base else [])
    seen = [pid for pid in pids if pid in gpu.peaks]
    jobs_seen = [gpu.peaks[w.pid] for w in workers if w.pid in gpu.peaks]
    error = gpu.error
    if len(seen) < len(pids):
        why = f"it listed {len(seen)} of the arm's {len(pids)} processes"
        error = f"{why} ({error})" if error else why

    def summed(key: str) -> int | None:
        values = [r.get(key) for r in results]
        return None if None in values else sum(values)

    return GpuMemory(
        gpu.peak_total if len(seen) == len(pids) else None,
        gpu.peaks.get(base.pid) if base else None,
        sum(jobs_seen) / len(jobs_seen) if jobs_seen else None,
        gpu.peak_device,
        summed("gpu_allocated"),
        summed("gpu_reserved"),
        error,
    )


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
    cpu: dict = field(default_factory=dict)  # CPU seconds over the measured steps (_cpu)
    gpu: GpuMemory | None = None  # when GPU memory is measured (--device cuda)


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
    gpu = GpuSampler(args.nvidia_smi) if _measures_gpu(args) else None
    with PssSampler() as sampler, gpu or contextlib.nullcontext():
        samplers = [s for s in (sampler, gpu) if s is not None]
        try:
            if arm == "symbiont":
                server = jobs.ServerProcess(
                    model_dir, bind=("tcp://127.0.0.1:*",), workdir=run_dir,
                    threads=args.executor_threads,
                    args=[*_policy_flags(args), "--device", args.device],
                ).start()  # fmt: skip
                base, url = server.job, server.url("tcp")
                started.append(base)
                for s in samplers:
                    s.watch(base.pid)
            workers = []
            for i in range(n):
                threads = _job_threads(arm, n, args)
                workers.append(_spawn_worker(arm, i, model_dir, url, run_dir, args, threads))
                for s in samplers:
                    s.watch(workers[-1].pid)
            started += workers
            _barrier(workers, run_dir, n)
            before = _executor_stats(url) if url else None
            # Reading smaps_rollup walks a process's page tables (~20 ms for the 450M
            # executor) under its mmap lock, stalling its mmap/munmap meanwhile; every
            # 0.2 s that took ~10% of a core the split needs at N=1 (vanilla's N=1 leaves
            # one idle). The peak is reached by then (load, optimizer state, a whole warm-up
            # step of the same shapes), so the measured steps are sampled sparsely.
            sampler.interval_s = MEASURED_PSS_INTERVAL_S
            executor_cpu = (_cpu_seconds(base.pid), time.time()) if base else None
            (run_dir / "go").write_text("go")
            _await_results(workers, run_dir, n)
            if base is not None:  # the steps' CPU, not the clients' goodbyes
                executor_cpu = _cpu_rate(base.pid, *executor_cpu)
            if gpu is not None:  # held workers wait for a last sample before they exit
                gpu.sample()
                (run_dir / "exit").write_text("exit")
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
        gpu=_gpu_memory(gpu, workers, base, results) if gpu is not None else None,
        cpu=_cpu(results, executor_cpu, window),
    )


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` so far, all its threads (/proc/PID/stat:
    cheap, unlike smaps_rollup)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu_rate(pid: int, cpu_s: float, since: float) -> float:
    """CPU seconds per second of process `pid` since it had used `cpu_s` at time `since`."""
    return (_cpu_seconds(pid) - cpu_s) / max(time.time() - since, 1e-9)


def _cpu(results: list[dict], executor_rate: float | None, window: float) -> dict:
    """CPU seconds the arm's processes used over the measured window: where a step's
    time goes when processes share the cores (each job reports its own; serve-base's
    rate is read from the go signal to the last result, a little wider than the steps).
    Over the window's core-seconds: how busy the cores were."""
    if any("cpu_s" not in r for r in results):
        return {}
    return {
        "jobs_s": sum(r["cpu_s"] for r in results),
        "executor_s": (executor_rate or 0.0) * window,
        "window_s": window,
    }


def _measures_gpu(args) -> bool:
    """GPU memory is sampled off the CPU (and with the hidden --gpu-memory, for tests)."""
    return args.device != "cpu" or args.gpu_memory


def _policy_flags(args) -> list[str]:
    flags = ["--workers", str(args.executor_workers), "--matmul", args.executor_matmul]
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


def _job_threads(arm: str, n: int, args) -> int:
    """Torch threads of each of the n jobs of `arm`."""
    if arm not in ("vanilla", "private") or args.vanilla_threads is None:
        return args.worker_threads
    if args.vanilla_threads == "share":  # the cores among the jobs: none left idle at N=1
        return max(1, len(os.sched_getaffinity(0)) // n)
    return int(args.vanilla_threads)


def _threads_note(args) -> str:
    jobs = f"{args.worker_threads} torch thread(s) per job"
    if args.vanilla_threads == "share":
        return jobs + " (vanilla and private: the cores divided among the jobs)"
    if args.vanilla_threads is not None:
        return jobs + f" (vanilla and private: {args.vanilla_threads})"
    return jobs


def _threads_choice(text: str) -> str:
    if text != "share" and not (text.isdigit() and int(text) >= 1):
        raise argparse.ArgumentTypeError(
            f"a number of threads (1 or more) or 'share', not {text!r}"
        )
    return text


def _spawn_worker(arm, i, model_dir, url, run_dir, args, threads: int):
    from symbiont import processes

    argv = [
        __file__, "worker", "--mode", arm, "--model", str(model_dir),
        "--threads", str(threads), "--steps", str(args.steps),
        "--batch", str(args.batch), "--seq", str(args.seq), "--seed", str(i),
        "--rank", str(args.rank), "--targets", args.targets,
        "--ready", str(run_dir / f"ready-{i}"), "--go", str(run_dir / "go"),
        "--result", str(run_dir / f"result-{i}.json"),
    ]  # fmt: skip
    if url:
        argv += ["--executor", url]
    if args.spin_us is not None:
        argv += ["--spin-us", str(args.spin_us)]
    argv += ["--device", args.device]
    if args.host_areas:
        argv += ["--host-areas"]
    if _measures_gpu(args):
        argv += ["--hold", str(run_dir / "exit")]
    # The repository first, then whatever the caller put on the path (wheels installed
    # elsewhere, say).
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    name, env = f"{arm}-worker-{i}", {"PYTHONPATH": path}
    return processes.spawn(name, [], run_dir, threads=threads, python=argv, env=env)


def _barrier(workers, run_dir: Path, n: int, timeout_s: float = 900) -> None:
    _await_files(workers, run_dir, [f"ready-{i}" for i in range(n)], "ready", timeout_s)


def _await_results(workers, run_dir: Path, n: int, timeout_s: float = 900) -> None:
    names = [f"result-{i}.json" for i in range(n)]
    _await_files(workers, run_dir, names, "done", timeout_s)


def _await_files(workers, run_dir: Path, names: list[str], what: str, timeout_s: float) -> None:
    """Wait until every file in `names` exists in run_dir; raise if a worker fails first."""
    from symbiont import processes as jobs

    deadline = time.monotonic() + timeout_s
    while sum((run_dir / name).exists() for name in names) < len(names):
        for job in workers:
            if jobs.finished(job):
                jobs.check(job)
        if all(jobs.finished(job) for job in workers) and not all(
            (run_dir / name).exists() for name in names
        ):
            raise RuntimeError(f"workers exited before all were {what}; see {run_dir}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"workers not {what} after {timeout_s}s; see {run_dir}")
        time.sleep(0.05)


def report(rows: list[dict[str, Outcome]], args, base_bytes: int | None = None) -> str:
    """The tables; GPU memory too when it was measured (base_bytes: the size of the
    base's linear weights, named where serve-base's GPU memory is unknown)."""
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
    if all(row[a].cpu for row in rows for a in arms):
        lines += ["", *cpu_report(rows, arms, args)]
    if rows[0][arms[0]].gpu is not None:
        lines += ["", *gpu_report(rows, arms, base_bytes)]
    return "\n".join(lines)


def cpu_report(rows: list[dict[str, Outcome]], arms: list[str], args) -> list[str]:
    """CPU time per step of one job (its process, and its share of serve-base's) and how
    busy the machine's cores were over the measured window."""
    cores = len(os.sched_getaffinity(0))  # the cores these processes may run on
    steps = args.steps
    lines = [
        "CPU ms per step of one job (process CPU over the measured steps; executor: "
        f"serve-base's / jobs, spinning included), and the {cores} cores' use over the window",
        f"{'N':>3} " + " ".join(f"{a + ' job':>14} {'executor':>9} {'cores':>6}" for a in arms),
    ]
    for row in rows:
        line = f"{row[arms[0]].jobs:>3}"
        for a in arms:
            c, n = row[a].cpu, row[a].jobs
            busy = (c["jobs_s"] + c["executor_s"]) / (c["window_s"] * cores)
            line += f" {1e3 * c['jobs_s'] / (n * steps):>14.1f}"
            line += f" {1e3 * c['executor_s'] / (n * steps):>9.1f} {busy:>5.0%}"
        lines.append(line)
    return lines


def gpu_report(rows: list[dict[str, Outcome]], arms: list[str], base_bytes: int | None) -> list:
    """GPU memory per arm and N, from nvidia-smi where it listed every process, else
    from torch (the report says which), with the other figures as cross-checks."""
    mib, gib = 2**20, 2**30
    outcomes = [row[a] for row in rows for a in arms]
    from_smi = all(o.gpu.total_mib is not None for o in outcomes)
    baselines = [a for a in arms if a in ("vanilla", "private")]
    ratios = baselines if "symbiont" in arms else []

    def figure(o: Outcome) -> tuple[str, float | None]:
        """(cell, GiB or None when not wholly known)."""
        if from_smi:
            return f"{o.gpu.total_mib * mib / gib:.2f}", o.gpu.total_mib * mib / gib
        if o.gpu.reserved is None:
            return "?", None
        value = o.gpu.reserved / gib
        if o.arm == "symbiont":  # serve-base's share is unknown
            return f"{value:.2f}+?", None
        return f"{value:.2f}", value

    if from_smi:
        lines = [
            "GPU memory, GiB (source: nvidia-smi --query-compute-apps used_memory): peak over "
            "the run of the sum over each arm's processes (serve-base and jobs); it includes "
            "each process's CUDA context, a real cost of every process on the GPU"
        ]
    else:
        why = next((o.gpu.error for o in outcomes if o.gpu.error), "no figures")
        weights = f" (its base weights alone: {base_bytes / gib:.2f} GiB)" if base_bytes else ""
        lines = [
            f"GPU memory, GiB (source: torch.cuda.max_memory_reserved of each job, summed; "
            f"no nvidia-smi figures: {why}): this excludes each process's CUDA context, and "
            f"serve-base's GPU memory is unknown{weights}, so symbiont's figure is its jobs' "
            "only (+?)"
        ]
    head = f"{'N':>3} " + " ".join(f"{a + ' GPU':>13}" for a in arms)
    head += "".join(f" {'gpu/' + b:>12}" for b in ratios)
    lines.append(head)
    for row in rows:
        line = f"{row[arms[0]].jobs:>3} " + " ".join(f"{figure(row[a])[0]:>13}" for a in arms)
        for b in ratios:
            s, base = figure(row["symbiont"])[1], figure(row[b])[1]
            line += f" {s / base:>11.2f}x" if s is not None and base else f" {'n/a':>12}"
        lines.append(line)
    last = rows[-1]
    if from_smi:
        parts = []
        for a in arms:
            g = last[a].gpu
            part = f"{a} {_gib(g.per_job_mib, mib)} GiB per job"
            if a == "symbiont":
                part += f", serve-base {_gib(g.executor_mib, mib)} GiB"
            parts.append(part)
        lines.append(f"per process at N={last[arms[0]].jobs} (GPU): " + "; ".join(parts))
    if all(o.gpu.device_mib is not None for o in outcomes):
        lines.append(
            "GPUs' memory.used over its reading before each arm, GiB (all processes on the GPUs;"
            " a cross-check): "
            + "; ".join(
                f"N={row[arms[0]].jobs}: "
                + ", ".join(f"{a} {_gib(row[a].gpu.device_mib, mib)}" for a in arms)
                + "".join(
                    f", symbiont/{b} {row['symbiont'].gpu.device_mib / row[b].gpu.device_mib:.2f}x"
                    for b in ratios
                    if row[b].gpu.device_mib
                )
                for row in rows
            )
        )
    if any(o.gpu.reserved is not None for o in outcomes):
        lines.append(
            "torch per job, max allocated / max reserved GiB (no CUDA context; serve-base not "
            "included): "
            + "; ".join(
                f"N={row[arms[0]].jobs}: "
                + ", ".join(
                    f"{a} {_gib(_per_job(row[a].gpu.allocated, row[a].jobs), 1)}/"
                    f"{_gib(_per_job(row[a].gpu.reserved, row[a].jobs), 1)}"
                    for a in arms
                )
                for row in rows
            )
        )
    return lines


def _per_job(total: int | None, jobs: int) -> float | None:
    return None if total is None else total / jobs


def _gib(value: float | None, unit: int) -> str:
    """`value` units as GiB, or '?'."""
    return "?" if value is None else f"{value * unit / 2**30:.2f}"


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
    w.add_argument("--device", default="cpu")
    w.add_argument("--hold", default=None, help="after the result, wait for this file")
    w.add_argument("--host-areas", action="store_true")
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
        "--vanilla-threads",
        type=_threads_choice,
        default=None,
        help="torch threads per vanilla and private job: a number, or 'share' for the cores "
        "divided among the N jobs (2 per job at N=1 on 2 cores: a baseline that leaves no "
        "core idle, where a lone symbiont client's products use every serve-base worker); "
        "default: --worker-threads",
    )
    parser.add_argument(
        "--executor-threads",
        type=int,
        default=1,
        help="torch threads per serve-base worker (default 1, like each job)",
    )
    parser.add_argument(
        "--executor-matmul",
        choices=("torch", "onednn"),
        default="torch",
        help="serve-base --matmul, for the symbiont arm (the in-process arms compute on "
        "torch): torch (default; MKL on a CPU, what the vanilla jobs use) or onednn "
        "(symbiont/base/onednn.py; CPU only)",
    )
    parser.add_argument(
        "--executor-workers",
        type=int,
        default=None,
        help="serve-base --workers: batches computed at once, each on a thread of its own "
        "(default: one per core; with --device cuda 1, serve-base's default, as batches "
        "queue on one GPU anyway)",
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
        "--device",
        default="cpu",
        help="where every arm's weights and each job's model live: cpu (default) or cuda; "
        "cuda also measures each arm's GPU memory (nvidia-smi per process)",
    )
    parser.add_argument(
        "--host-areas",
        action="store_true",
        help="with --device cuda: do not pass device= to symbiont.connect (where it takes "
        "it), so calls' tensors cross through host shared memory, not areas on the GPU",
    )
    # For testing the GPU memory path without a GPU: sample and report it on any device,
    # with this nvidia-smi command (a script printing sample output).
    parser.add_argument("--gpu-memory", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--nvidia-smi", default="nvidia-smi", help=argparse.SUPPRESS)
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
    problem = _device_problem(args)
    if problem:
        print(f"{Path(__file__).name}: error: {problem}", file=sys.stderr)
        return 2
    if args.executor_workers is None:
        args.executor_workers = len(os.sched_getaffinity(0)) if args.device == "cpu" else 1
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
          f"measured steps per job; {os.cpu_count()} cores{_device_note(args)}; "
          f"{_threads_note(args)}; serve-base "
          f"--matmul {args.executor_matmul}", flush=True)  # fmt: skip
    rows = []
    for n in (int(x) for x in args.jobs.split(",")):
        row = {arm: run_one(arm, n, models, work, args) for arm in ARMS if arm in arms}
        rows.append(row)
        print(f"N={n}: " + " | ".join(
            f"{a} {o.tokens_per_s:.1f} tok/s {o.peak_pss / 2**30:.2f} GiB{_gpu_note(o)}"
            for a, o in row.items()
        ), flush=True)  # fmt: skip
    print()
    base_bytes = _linear_bytes(models[0]) if _measures_gpu(args) else None
    print(report(rows, args, base_bytes))
    return 0


def _device_problem(args) -> str | None:
    """Why --device cannot be used here (one line), or None."""
    import torch

    try:
        device = torch.device(args.device)
    except (RuntimeError, TypeError):
        return f"--device {args.device!r} is not a device name (cpu, cuda, cuda:0)"
    if device.type not in ("cpu", "cuda"):
        return f"--device {args.device}: this benchmark runs on cpu or cuda"
    if device.type == "cpu":
        return None
    if args.executor_matmul == "onednn":
        return "--executor-matmul onednn computes on the CPU only; leave it out with --device"
    if args.fusion_ab:
        return "--fusion-ab runs on the CPU only; leave out --device"
    if not torch.cuda.is_available():
        why = (
            f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no GPU or driver"
            if torch.version.cuda
            else f"torch {torch.__version__} is a CPU-only build"
        )
        return f"--device {args.device}: CUDA is unavailable ({why}); leave out --device"
    from symbiont.util.device import check_device

    try:
        check_device(args.device)  # e.g. cuda:3 on a machine with fewer GPUs
    except ValueError as err:
        return str(err)
    return None


def _device_note(args) -> str:
    if args.device == "cpu":
        return ""
    import torch

    return f"; device {args.device} ({torch.cuda.get_device_name(torch.device(args.device))})"


def _gpu_note(o: Outcome) -> str:
    """The progress line's GPU figure: nvidia-smi's sum, else the jobs' torch reserved."""
    if o.gpu is None:
        return ""
    if o.gpu.total_mib is not None:
        return f" GPU {o.gpu.total_mib / 1024:.2f} GiB"
    if o.gpu.reserved is not None:
        extra = "+serve-base" if o.arm == "symbiont" else ""
        return f" GPU {o.gpu.reserved / 2**30:.2f} GiB{extra} (torch reserved)"
    return " GPU ?"


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


def _linear_bytes(model_dir: Path) -> int:
    """Bytes of the checkpoint's matrices other than embeddings: roughly what serve-base
    holds (the linear layers' weights, lm_head included)."""
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return sum(
            4 * _numel(f, k)  # fp32
            for k in f.keys()  # noqa: SIM118 - not a dict
            if len(f.get_slice(k).get_shape()) == 2 and "embed" not in k
        )


def _numel(f, key) -> int:
    n = 1
    for d in f.get_slice(key).get_shape():
        n *= d
    return n


if __name__ == "__main__":
    sys.exit(main())
