"""Chameleon's ablation (issue 14): adapter cache and multi-level queue scheduler.

Trace (seeded): Poisson arrivals; --adapters LoRA adapters (all linear layers) with ranks
8, 16, 32, 64, 128 in equal numbers and Zipf(--zipf) popularity over a shuffled order,
more of them than the --max-loras slots; prompt lengths log-normal (median ~24 tokens,
4-128); output lengths heavy-tailed: each adapter has a task whose requests are long
(48-96 tokens) with probability 0.1 or 0.6, else short (2-12). Outputs ignore EOS, so every
system makes the same tokens; `max_tokens` is the true length (the MLQ predictor's cap).

Systems, each on a fresh engine over the same trace, all adapters from one --adapter-dir:
  fifo-nocache  FIFO; no cache: an adapter leaves its slot and host memory as soon as no
                request holds it, so nearly every request reads it from disk (S-LoRA-like)
  fifo-lru      FIFO + cache, LRU eviction
  fifo-cost     FIFO + cache, Chameleon's cost-aware eviction
  mlq-cost      MLQ + cost-aware cache (Chameleon)
The host tier holds the --max-loras largest adapters (the cache counts the host copies of
resident adapters against its budget) plus --host-fraction of all adapters' bytes (so
eviction matters).

Offered loads are multiples (--loads) of the capacity measured first (fifo-cost with the
whole trace at time 0: requests finished per second up to the 75th percentile finish, so
the drain at the end does not count). The SLO on P99 TTFT is --slo-factor (10) x the
unloaded TTFT, measured first: 30 requests of the trace served one at a time by
fifo-nocache (each reads its adapter from disk), what an idle baseline server gives.
(Chameleon sets it to 5x the mean execution time at low load; with this trace's outputs
that is seconds, and every system would meet it up to saturation.) The same line prints
the mean disk load of an adapter and the iteration time alone: on CPU a load costs about
an iteration, which bounds what any cache can save. --repeats runs each point on traces
of --repeats seeds and pools their TTFTs (P99 over repeats x requests).

Prints per system and load P50/P99 TTFT, throughput and disk loads (with --breakdown,
where TTFT went: queue / adapter load / slot wait / run, over all requests and the
slowest 5%), P99 ratios against fifo-nocache, the sustained load within the SLO (the
largest load up to which every load tried meets it, and where P99 crosses it, log-linear
between loads) with its ratio to fifo-nocache's, and writes a plot (matplotlib).

    python benchmarks/chameleon.py --requests 300 --repeats 2 --loads \
        0.25,0.375,0.5,0.625,0.75,0.875,1.0,1.25 --plot benchmarks/chameleon-sweep.png
                                                        # ~25 min on 2 quiet cores
    python benchmarks/chameleon.py --requests 40 --loads 0.5,1.0     # smoke, ~3 min
    python benchmarks/chameleon.py --step-cost 1000    # step time, 1,000 vs 10 registered
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

RANKS = (8, 16, 32, 64, 128)
SYSTEMS = {
    "fifo-nocache": ("fifo", "lru", False),
    "fifo-lru": ("fifo", "lru", True),
    "fifo-cost": ("fifo", "cost", True),
    "mlq-cost": ("mlq", "cost", True),
}


@dataclass(frozen=True)
class TraceItem:
    arrival: float  # seconds after the start, at load 1.0 (scaled per run)
    adapter: str
    prompt: list[int]
    max_tokens: int


def make_trace(args, names: list[str], vocab: int) -> list[TraceItem]:
    rng = np.random.default_rng(args.seed)
    order = rng.permutation(len(names))
    popularity = 1.0 / np.arange(1, len(names) + 1) ** args.zipf
    picks = order[rng.choice(len(names), args.requests, p=popularity / popularity.sum())]
    p_long = {name: rng.choice([0.1, 0.6]) for name in names}
    gaps = rng.exponential(1.0, args.requests)
    items = []
    for t, pick in zip(np.cumsum(gaps) - gaps[0], picks, strict=True):
        name = names[int(pick)]
        prompt_len = int(np.clip(rng.lognormal(np.log(24), 0.8), 4, 128))
        long = rng.random() < p_long[name]
        out = int(rng.integers(48, 97) if long else rng.integers(2, 13))
        prompt = rng.integers(300, vocab, prompt_len).tolist()
        items.append(TraceItem(float(t), name, prompt, out))
    return items


def make_adapters(model: str, n: int, folder: Path, seed: int) -> list[str]:
    """n LoRA adapters on every linear layer, ranks 8..128 in equal numbers, saved."""
    import peft
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    names, templates = [], {}
    for i in range(n):
        rank = RANKS[i % len(RANKS)]
        if rank not in templates:
            config = peft.LoraConfig(
                r=rank, lora_alpha=2 * rank, target_modules="all-linear", task_type="CAUSAL_LM"
            )
            base = AutoModelForCausalLM.from_pretrained(model)
            templates[rank] = peft.get_peft_model(base, config)
        with torch.no_grad():
            for name, param in templates[rank].named_parameters():
                if "lora_" in name:
                    param.copy_(torch.randn_like(param) * 0.02)
        names.append(f"t{i:03d}-r{rank}")
        templates[rank].save_pretrained(folder / names[-1])
    return names


@dataclass
class Run:
    system: str
    load: float
    ttft: list[float]
    tokens: int
    seconds: float
    service: list[float]  # admission -> finish, per request
    loads: int
    finishes: list[float]  # seconds after the start, in order
    probe: Probe | None = None

    def pct(self, q: float) -> float:
        return float(np.percentile(self.ttft, q))

    @property
    def throughput(self) -> float:
        return self.tokens / self.seconds


class LoadCounter:
    """Counts disk loads and their seconds (the engine's observer hook)."""

    def __init__(self):
        self.loads = 0
        self.load_seconds: list[float] = []

    def on_first_token(self, seconds): ...
    def on_inter_token(self, seconds): ...
    def on_tokens(self, n): ...
    def on_request(self, adapter): ...
    def on_adapter_cache(self, tier, hit): ...
    def on_adapter_evict(self, tier): ...

    def on_adapter_load(self, seconds, ok):
        self.loads += 1
        self.load_seconds.append(seconds)


WAITS = ("queue", "load", "slot")  # why a waiting request was not admitted in a pass


class Probe:
    """Where each request's TTFT goes: arrival -> admission split by what held it back in
    each scheduling pass (`queue`: not reached, or no running room / KV blocks; `load`: its
    adapter was being read from disk; `slot`: its adapter waited for a slot), then
    admission -> first token (`run`: prefill chunks and the iterations they ride in).
    Also the engine thread's iteration times and the seconds it spent placing adapters
    into slots. Wraps the scheduler's methods; measures, changes nothing."""

    def __init__(self, engine):
        self.scheduler = engine.scheduler
        self.waits: dict[object, dict[str, float]] = {}
        self._last: dict[object, float] = {}
        self._why: dict[object, str] = {}
        self.admitted: dict[object, float] = {}
        self.steps: list[float] = []
        self.place_seconds = 0.0
        self.distinct: list[int] = []  # adapters in each iteration's batch
        schedule, try_admit, step = (
            engine.scheduler.schedule,
            engine.scheduler.try_admit,
            engine.step,
        )
        verdicts = {"loading": "load", "wait": "slot", "no_room": "queue"}

        def probed_schedule():
            now = time.monotonic()
            for seq in self.scheduler.waiting:
                waits = self.waits.setdefault(seq, dict.fromkeys(WAITS, 0.0))
                last = self._last.get(seq, self._arrival(seq))
                waits[self._why.get(seq, "queue")] += max(0.0, now - last)
                self._last[seq], self._why[seq] = now, "queue"
            batch = schedule()
            if batch:
                self.distinct.append(len({item.seq.cached_adapter for item in batch}))
            return batch

        def probed_try_admit(seq):
            verdict = try_admit(seq)
            if verdict.value == "ok":
                self.admitted[seq] = time.monotonic()
            else:
                self._why[seq] = verdicts[verdict.value]
            return verdict

        def probed_step():
            start = time.perf_counter()
            outputs = step()
            if not engine.stalled:
                self.steps.append(time.perf_counter() - start)
            return outputs

        engine.scheduler.schedule, engine.scheduler.try_admit = probed_schedule, probed_try_admit
        engine.step = probed_step
        if engine.cache is not None:
            place = engine.cache.place

            def probed_place(name, evict=True):
                start = time.perf_counter()
                try:
                    return place(name, evict)
                finally:
                    self.place_seconds += time.perf_counter() - start

            engine.cache.place = probed_place
        self.arrivals: dict[str, float] = {}

    def _arrival(self, seq) -> float:
        return self.arrivals[seq.request_id]

    def breakdown(self, requests) -> list[dict[str, float]]:
        """Per request (in order): seconds of queue, load, slot waits and run."""
        rows = []
        for request in requests:
            seq = request.sequences[0]
            row = dict(self.waits.get(seq, dict.fromkeys(WAITS, 0.0)))
            row["run"] = request.first_token_time - self.admitted[seq]
            rows.append(row)
        return rows


def forget_when_idle(cache) -> None:
    """The no-cache baseline: an adapter no request holds leaves its slot and host memory."""
    from symbiont.serve.adapter_cache import AdapterState
    from symbiont.serve.adapters import cached_key

    release = cache.release

    def release_and_forget(name: str) -> None:
        release(name)
        entry = cache.lookup(name)
        if entry.refs == 0 and entry.state in (AdapterState.HOST, AdapterState.RESIDENT):
            if entry.state is AdapterState.RESIDENT:
                cache.registry.remove(cached_key(name))
            entry.weights, entry.state = None, AdapterState.DISK

    cache.release = release_and_forget


def run(args, system: str, trace: list[TraceItem], load: float, capacity: float) -> Run:
    """Replay `trace` at `load` x `capacity` requests/s (load 0: all at once)."""
    from symbiont.serve import Engine, Request, SamplingParams
    from symbiont.serve.config import EngineConfig

    scheduler, policy, cached = SYSTEMS[system]
    config = dataclasses.replace(
        args.engine, scheduler=scheduler, cache_policy=policy, host_cache_bytes=args.host_bytes
    )
    counter = LoadCounter()
    engine = Engine.from_pretrained(args.model_path, config=config, observer=counter)
    assert isinstance(engine.config, EngineConfig)
    engine.attach_adapter_dir(args.adapter_dir)
    if not cached:
        forget_when_idle(engine.cache)
    probe = Probe(engine)
    scale = 0.0 if load == 0 else 1.0 / (load * capacity)
    pending = deque(trace)
    requests, service, finishes = [], [], []
    start = time.monotonic()
    while pending or engine.has_work():
        now = time.monotonic() - start
        while pending and pending[0].arrival * scale <= now:
            item = pending.popleft()
            params = SamplingParams(temperature=0.0, max_tokens=item.max_tokens, ignore_eos=True)
            request = Request(f"r{len(requests)}", item.prompt, item.adapter, params)
            request.arrival = start + item.arrival * scale  # late admission counts as waiting
            probe.arrivals[request.request_id] = request.arrival
            engine.add_request(request)
            requests.append(request)
        if not engine.has_work():
            time.sleep(max(0.0, min(0.002, pending[0].arrival * scale - now)))
            continue
        for output in engine.step():
            if output.finished:
                seq = engine_request(requests, output.request_id).sequences[0]
                service.append(time.monotonic() - (seq.admitted_at or start))
                finishes.append(time.monotonic() - start)
        if engine.stalled:
            time.sleep(0.0005)
    seconds = time.monotonic() - start
    engine.close()
    failed = [r.error for r in requests if r.error]
    assert not failed, f"{system}: {failed[0]}"
    ttft = [r.first_token_time - r.arrival for r in requests]
    tokens = sum(len(r.sequences[0].output_ids) for r in requests)
    probe.rows = probe.breakdown(requests)
    probe.load_seconds = counter.load_seconds
    return Run(system, load, ttft, tokens, seconds, service, counter.loads, finishes, probe)


def describe(r: Run, tail: float = 0.05) -> str:
    """Where TTFT went: mean seconds per part over all requests and over the slowest
    `tail` share; iteration time, disk-load time and slot placement time."""
    probe = r.probe
    order = np.argsort(r.ttft)[::-1]
    slow = order[: max(1, int(round(tail * len(order))))]
    parts = (*WAITS, "run")

    def means(idx) -> str:
        return " ".join(f"{p} {np.mean([probe.rows[i][p] for i in idx]) * 1e3:6.1f}" for p in parts)

    loads = probe.load_seconds or [0.0]
    return (
        f"    all  (ms): {means(range(len(r.ttft)))}\n"
        f"    slowest {len(slow)} (ms): {means(slow)}\n"
        f"    iteration {np.mean(probe.steps) * 1e3:.1f} ms (p99 {np.percentile(probe.steps, 99) * 1e3:.1f}), "
        f"{len(probe.steps)} iterations, {np.mean(probe.distinct):.1f} adapters each; disk load {np.mean(loads) * 1e3:.1f} ms mean "
        f"(p99 {np.percentile(loads, 99) * 1e3:.1f}) x {r.loads}; placing in slots "
        f"{probe.place_seconds * 1e3:.0f} ms in all"
    )


def run_repeats(args, system: str, traces, load: float, capacity: float) -> Run:
    """One run per trace (--repeats traces of different seeds), pooled: TTFTs of all runs
    together, so P99 is over repeats x requests (a single run's P99 is its 3rd-worst
    request, and the machine's other jobs hit single runs)."""
    runs = [run(args, system, trace, load, capacity) for trace in traces]
    pooled = Run(
        system,
        load,
        [t for r in runs for t in r.ttft],
        sum(r.tokens for r in runs),
        sum(r.seconds for r in runs),
        [t for r in runs for t in r.service],
        sum(r.loads for r in runs),
        runs[0].finishes,
        runs[0].probe,
    )
    pooled.parts = runs
    return pooled


def unloaded_ttft(args, trace: list[TraceItem], n: int = 30) -> tuple[float, float, float]:
    """Requests served one at a time (nothing else queued or running) by the baseline,
    fifo-nocache, on one engine after a warm-up: (mean TTFT, mean disk load, mean
    iteration) in seconds. Every one reads its adapter from disk (the baseline forgets
    idle adapters). The SLO is a multiple of the mean TTFT: what an idle server gives."""
    from symbiont.serve import Engine, Request, SamplingParams

    config = dataclasses.replace(args.engine, host_cache_bytes=args.host_bytes)
    counter = LoadCounter()
    engine = Engine.from_pretrained(args.model_path, config=config, observer=counter)
    engine.attach_adapter_dir(args.adapter_dir)
    forget_when_idle(engine.cache)
    probe = Probe(engine)
    ttfts = []
    for i, item in enumerate([trace[0], *trace[:n]]):
        params = SamplingParams(temperature=0.0, max_tokens=item.max_tokens, ignore_eos=True)
        request = Request(f"r{i}", item.prompt, item.adapter, params)
        probe.arrivals[request.request_id] = request.arrival
        engine.add_request(request)
        while engine.has_work():
            engine.step()
            if engine.stalled:
                time.sleep(0.0005)
        ttfts.append(request.first_token_time - request.arrival)
    engine.close()
    loads = counter.load_seconds[1:]
    return float(np.mean(ttfts[1:])), float(np.mean(loads)), float(np.mean(probe.steps))


def engine_request(requests, request_id: str):
    return requests[int(request_id[1:])]


def sustained(runs: list[Run], slo: float) -> tuple[float, float]:
    """(the largest offered load up to which every load tried keeps P99 TTFT within the
    SLO, 0 if the lightest already misses it; that load moved towards the first missing
    one where the straight line between their log P99s crosses the SLO)."""
    series = sorted(runs, key=lambda r: r.load)
    held, crossing = 0.0, 0.0
    for i, r in enumerate(series):
        if r.pct(99) > slo:
            if i:
                lo, hi = series[i - 1], r
                a, b = np.log(lo.pct(99)), np.log(hi.pct(99))
                crossing = lo.load + (hi.load - lo.load) * (np.log(slo) - a) / (b - a)
            return held, crossing
        held = crossing = r.load
    return held, crossing


def plot(runs: dict[str, list[Run]], slo: float, capacity: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for system, series in runs.items():
        rate = [r.load * capacity for r in series]
        axes[0].plot(rate, [r.pct(99) for r in series], marker="o", label=system)
        axes[1].plot(rate, [r.pct(50) for r in series], marker="o", label=system)
        axes[2].plot(rate, [r.throughput for r in series], marker="o", label=system)
    axes[0].axhline(slo, color="grey", linestyle="--", linewidth=1, label="SLO")
    for ax, title in zip(axes, ["P99 TTFT (s)", "P50 TTFT (s)", "tokens/s"], strict=True):
        ax.set_xlabel("offered load (requests/s)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def step_cost(args, names: list[str], registered: int, repeats: int = 3) -> None:
    """Mean engine step time with 10 adapters in use, the folder holding 10 adapters vs
    `registered` (copies of one): registering adds no per-step cost."""
    import shutil

    from symbiont.serve import Engine, Request, SamplingParams

    used = names[:10]
    with tempfile.TemporaryDirectory() as small, tempfile.TemporaryDirectory() as big:
        for name in used:
            shutil.copytree(args.adapter_dir / name, Path(small) / name)
            shutil.copytree(args.adapter_dir / name, Path(big) / name)
        for i in range(registered - len(used)):
            shutil.copytree(args.adapter_dir / used[0], Path(big) / f"x{i:05d}")
        config = dataclasses.replace(args.engine, max_adapters=16)
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        best = {}
        for _ in range(repeats):
            for label, folder in (("10", small), (str(registered), big)):
                engine = Engine.from_pretrained(args.model_path, config=config)
                engine.attach_adapter_dir(folder)
                engine.generate([[5, 6, 7, 8]] * 10, used, params)  # loads, warms up
                prompts = [[5 + i % 50, 6, 7, 8, 9, 10] for i in range(40)]
                for i, prompt in enumerate(prompts):
                    engine.add_request(Request(f"s{i}", prompt, used[i % 10], params))
                steps, spent = 0, 0.0
                while engine.has_work():
                    start = time.perf_counter()
                    engine.step()
                    spent, steps = spent + time.perf_counter() - start, steps + 1
                engine.close()
                best[label] = min(best.get(label, float("inf")), spent / steps)
    ratio = best[str(registered)] / best["10"]
    print(
        f"step time, 10 adapters in use: {best['10'] * 1e3:.2f} ms with 10 registered, "
        f"{best[str(registered)] * 1e3:.2f} ms with {registered} registered ({ratio:.3f}x)"
    )


def parse_args(argv):
    from symbiont.serve.config import EngineConfig

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="checkpoint folder or 'default'")
    parser.add_argument("--adapters", type=int, default=40)
    parser.add_argument("--max-loras", type=int, default=8)
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--loads", default="0.25,0.5,0.75,1.0,1.25", help="multiples of capacity")
    parser.add_argument("--zipf", type=float, default=1.0)
    parser.add_argument("--host-fraction", type=float, default=0.25)
    parser.add_argument(
        "--slo-factor",
        type=float,
        default=10.0,
        help="SLO on P99 TTFT: this many times the unloaded TTFT (one request at a time)",
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--repeats", type=int, default=1, help="traces (seeds) per point, TTFTs pooled"
    )
    parser.add_argument(
        "--breakdown", action="store_true", help="print where TTFT went for every run"
    )
    parser.add_argument(
        "--step-cost",
        type=int,
        default=0,
        metavar="N",
        help="only measure the step time with N adapters registered vs 10 (10 in use)",
    )
    parser.add_argument("--plot", default="benchmarks/chameleon.png")
    args = parser.parse_args(argv)
    args.engine = EngineConfig(
        max_running=16,
        max_batched_tokens=256,
        max_queue=4096,
        block_size=16,
        num_blocks=512,
        max_adapters=args.max_loras,
        max_lora_rank=max(RANKS),
        mlq_refresh_s=2.0,
    )
    return args


def main(argv=None) -> int:
    from symbiont.cli.flags import resolve_model

    args = parse_args(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(args.threads)
    args.model_path = resolve_model(args.model)
    loads = [float(x) for x in args.loads.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        args.adapter_dir = Path(tmp)
        names = make_adapters(args.model_path, args.adapters, args.adapter_dir, args.seed)
        total = sum(f.stat().st_size for f in args.adapter_dir.rglob("*.safetensors"))
        # the cache counts the host copies of resident adapters against its host budget:
        # room for the --max-loras largest, plus --host-fraction of all for idle ones
        sizes = sorted(f.stat().st_size for f in args.adapter_dir.rglob("*.safetensors"))
        resident = sum(sizes[-args.max_loras :])
        args.host_bytes = max(1, resident + int(args.host_fraction * total))
        from transformers import AutoConfig

        if args.step_cost:
            step_cost(args, names, args.step_cost)
            return 0
        vocab = AutoConfig.from_pretrained(args.model_path).vocab_size
        traces = [
            make_trace(argparse.Namespace(**{**vars(args), "seed": args.seed + i}), names, vocab)
            for i in range(args.repeats)
        ]
        trace = traces[0]
        run(args, "fifo-cost", trace[:20], 0, 1.0)  # warm-up
        saturated = run(args, "fifo-cost", trace, 0, 1.0)
        k = int(0.75 * len(trace))
        capacity = k / saturated.finishes[k - 1]
        alone, disk_load, iteration = unloaded_ttft(args, trace)
        slo = args.slo_factor * alone
        print(
            f"model {args.model}, {args.adapters} adapters ({total / 2**20:.1f} MiB, host tier "
            f"{args.host_bytes / 2**20:.1f} MiB), {args.max_loras} slots, {len(trace)} requests "
            f"x {args.repeats} traces; capacity {capacity:.1f} req/s; load average "
            f"{os.getloadavg()}"
        )
        print(
            f"unloaded (one request at a time, fifo-nocache): TTFT {alone * 1e3:.1f} ms mean, "
            f"of which its adapter's disk load {disk_load * 1e3:.1f} ms (one iteration alone: "
            f"{iteration * 1e3:.1f} ms); SLO on P99 TTFT = {args.slo_factor:g} x "
            f"{alone * 1e3:.1f} ms = {slo:.3f} s"
        )
        print(describe(saturated).replace("    ", "  saturated run: ", 1))
        print(
            f"{'system':<13} {'load':>5} {'req/s':>6} {'TTFT p50':>9} {'TTFT p99':>9} "
            f"{'tok/s':>7} {'loads':>6}  load avg"
        )
        runs: dict[str, list[Run]] = {s: [] for s in SYSTEMS}
        for load in loads:
            for system in SYSTEMS:
                r = run_repeats(args, system, traces, load, capacity)
                runs[system].append(r)
                print(
                    f"{system:<13} {load:5.2f} {load * capacity:6.1f} {r.pct(50):9.3f} "
                    f"{r.pct(99):9.3f} {r.throughput:7.1f} {r.loads:6d}  "
                    f"{os.getloadavg()[0]:.1f}",
                    flush=True,
                )
                if args.breakdown:
                    print(describe(r.parts[0]), flush=True)
        print(f"load average (1, 5, 15 min) at the end: {os.getloadavg()}")
    base = runs["fifo-nocache"]
    print("\nP99 TTFT vs fifo-nocache at the same load (" + ", ".join(map(str, loads)) + "):")
    for system, series in runs.items():
        ratios = " ".join(
            f"{r.pct(99) / b.pct(99):5.2f}" for r, b in zip(series, base, strict=True)
        )
        print(f"  {system:<13} {ratios}")
    print(
        f"\nsustained load within the SLO ({slo:.3f} s): largest load tried up to which every "
        "load meets it / where P99 crosses it (log-linear between loads), x capacity; "
        "ratio vs fifo-nocache"
    )
    ref_held, ref_cross = sustained(base, slo)
    for system, series in runs.items():
        held, cross = sustained(series, slo)
        vs = (
            f"{held / ref_held:.2f}x / {cross / ref_cross:.2f}x"
            if ref_held
            else "n/a (fifo-nocache meets the SLO at no load tried)"
        )
        print(f"  {system:<13} {held:.2f} / {cross:.2f} ({cross * capacity:.1f} req/s)  {vs}")
    plot(runs, slo, capacity, Path(args.plot))
    print(f"\nplot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
