"""N fully fine-tuned variants served as compressed deltas over one base vs swapping whole
models, under the same memory budget and trace (issue 16, DeltaZip's serving claim).

Variants: N "full fine-tunes" of the base (--model, default the embedded default model):
every weight moved a little (a seeded perturbation of the size a real fine-tune leaves,
plus changed embedding rows), each compressed at 4-bit 2:4 with `symbiont.delta.compress`
and merged back with `delta merge` for the swapping baseline. Perplexity is not measured
here (docs/deltas.md and the issue-16 quality table are); only serving cost is.

Memory budget: the base plus the N compressed deltas, B = M + N·δ (M: the model's bytes
as served, δ: one delta's bytes in memory). Swapping keeps floor(B / M) whole models
resident (at least one).

Systems, each over the same trace (seeded; Poisson arrivals at --rate req/s, Zipf(--zipf)
popularity over the N variants, prompts of 8-32 tokens, --out-tokens generated with EOS
ignored, so every system makes the same tokens):

  swap          one serving engine per resident variant (its merged checkpoint, loaded on
                demand with `Engine.from_pretrained`); requests dispatched in arrival
                order: each goes to its variant's engine if resident, and the first one
                whose variant is not stops the line until an idle engine is swapped out
                and its variant swapped in (vLLM serving one model per instance, FCFS)
  deltas        one engine on the base; the N deltas in `--adapter-dir`, loaded on first
                use by the adapter cache, all resident (--max-deltas N), exact apply
                (packed 2:4 4-bit, decompressed per call); every variant shares each batch
  deltas+hot1   the same, but the most popular variant applied merged (its Δ̃ kept dense,
                `--delta NAME=DIR:merged`): the budget grows by that dense delta (D), and
                it is compared with swapping under that larger budget (swap@B+D)
  deltas-hot    every delta merged: fastest per call, but each delta then holds the
                base's linear bytes, so it does NOT fit any of these budgets (its memory is
                printed); shown for the exact-vs-merged trade-off

Prints throughput (generated tokens/s over the makespan) and P50/P99 end-to-end latency
per system and N, the ratios deltas/swap, and the per-call cost of the three ways to add
a delta to a shared batch for one layer (exact, dense Δ̃, merged weight W+Δ̃ on the
delta's rows); writes a plot (matplotlib) next to this file.

    python benchmarks/deltas.py                          # N = 4, 8, 16, ~5 minutes
    python benchmarks/deltas.py --variants 8 --requests 48
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


@dataclass(frozen=True)
class TraceItem:
    arrival: float  # seconds after the start
    variant: int
    prompt: list[int]


@dataclass
class Run:
    system: str
    n: int
    tokens: int
    seconds: float
    latency: list[float]  # finish - arrival, per request
    swaps: int = 0  # whole-model loads (swap) or delta loads (deltas)
    memory: int = 0  # bytes held for the variants (see the module docstring)

    @property
    def throughput(self) -> float:
        return self.tokens / self.seconds

    def pct(self, q: float) -> float:
        return float(np.percentile(self.latency, q))


# -- the variants -----------------------------------------------------------------------


def make_variants(base: Path, n: int, root: Path, seed: int) -> list[tuple[Path, Path]]:
    """n (delta folder, merged checkpoint) pairs, made once under `root` and reused."""
    from transformers import AutoModelForCausalLM

    from symbiont.delta import CompressConfig, merge_checkpoint
    from symbiont.delta.compress import compress

    pairs = []
    vocab = AutoModelForCausalLM.from_pretrained(base).config.vocab_size
    for i in range(n):
        delta, merged = root / "deltas" / f"v{i:02d}", root / "merged" / f"v{i:02d}"
        if not merged.exists():
            start = time.perf_counter()
            finetuned = _perturbed(base, root / "ft-tmp", seed + i)
            g = torch.Generator().manual_seed(seed + 100 + i)
            calibration = torch.randint(3, vocab, (16, 32), generator=g)
            shutil.rmtree(delta, ignore_errors=True)
            compress(base, finetuned, delta, calibration, CompressConfig(bits=4))
            merge_checkpoint(base, delta, merged)
            shutil.rmtree(finetuned)
            print(f"  variant v{i:02d} compressed and merged in {time.perf_counter() - start:.1f}s")
        pairs.append((delta, merged))
    return pairs


def _perturbed(base: Path, out: Path, seed: int) -> Path:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "embed_tokens" in name:
                param[:16] += 0.02 * torch.randn(param[:16].shape, generator=g)
            else:
                param += 0.02 * param.std() * torch.randn(param.shape, generator=g)
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out)
    for file in base.iterdir():  # the tokenizer travels with the fine-tune
        if file.is_file() and file.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy2(file, out / file.name)
    return out


def make_trace(args, n: int, vocab: int) -> list[TraceItem]:
    rng = np.random.default_rng(args.seed)
    popularity = 1.0 / np.arange(1, n + 1) ** args.zipf
    order = rng.permutation(n)
    picks = order[rng.choice(n, args.requests, p=popularity / popularity.sum())]
    gaps = rng.exponential(1.0 / args.rate, args.requests)
    arrivals = np.cumsum(gaps) - gaps[0]
    return [
        TraceItem(float(t), int(v), rng.integers(3, vocab, int(rng.integers(8, 33))).tolist())
        for t, v in zip(arrivals, picks, strict=True)
    ]


# -- memory -------------------------------------------------------------------------------


def model_bytes(path: Path) -> int:
    """Bytes of a checkpoint's tensors (what one served copy of the model holds)."""
    from symbiont.model.checkpoint import Checkpoint

    checkpoint = Checkpoint.open(path)
    return sum(f.stat().st_size for f in {Path(p) for p in checkpoint.tensor_files.values()})


def delta_memory(engine, model_bytes: int) -> int:
    """The base plus every delta held in memory (cache tiers and pinned ones)."""
    pinned = engine.deltas.loaded.values() if engine.deltas is not None else ()
    held = [engine.deltas.by_slot[slot] for slot in pinned]
    held += [e.weights for e in engine.cache._entries.values() if e.weights is not None]
    return model_bytes + sum(w.nbytes for w in held)


# -- systems ------------------------------------------------------------------------------


def _params(args):
    from symbiont.serve import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=args.out_tokens, ignore_eos=True)


def run_deltas(
    args, n: int, trace: list[TraceItem], folder: Path, mode: str, hot: str | None = None
) -> Run:
    """One engine, the deltas of `folder` applied `mode`; `hot`: that one pinned merged."""
    from symbiont.serve import Engine, Request

    config = dataclasses.replace(args.engine, max_deltas=n, delta_mode=mode)
    engine = Engine.from_pretrained(args.model_path, config=config)
    engine.attach_adapter_dir(folder)
    if hot is not None:  # pinned under the same name: it shadows the folder's copy
        engine.load_delta(hot, folder / hot, mode="merged")
    names = sorted(p.name for p in folder.iterdir())
    pending, requests, latency = deque(trace), {}, []
    start = time.monotonic()
    while pending or engine.has_work():
        now = time.monotonic() - start
        while pending and pending[0].arrival <= now:
            item = pending.popleft()
            request = Request(f"r{len(requests)}", item.prompt, names[item.variant], _params(args))
            request.arrival = start + item.arrival
            engine.add_request(request)
            requests[request.request_id] = request
        if not engine.has_work():
            time.sleep(max(0.0, min(0.002, pending[0].arrival - now)))
            continue
        for output in engine.step():
            if output.finished:
                latency.append(time.monotonic() - requests[output.request_id].arrival)
        if engine.stalled:
            time.sleep(0.0005)
    seconds = time.monotonic() - start
    memory = delta_memory(engine, args.model_bytes)
    engine.close()
    failed = [r.error for r in requests.values() if r.error]
    assert not failed, failed[0]
    tokens = sum(len(r.sequences[0].output_ids) for r in requests.values())
    loads = sum(card["load_seconds"] is not None for card in engine.cache.cards()) + bool(hot)
    system = "deltas-hot" if mode == "merged" else "deltas+hot1" if hot else "deltas"
    return Run(system, n, tokens, seconds, latency, loads, memory)


def run_swap(
    args, n: int, trace: list[TraceItem], merged: list[Path], resident: int, system="swap"
) -> Run:
    """Whole models swapped in and out, at most `resident` at once, FCFS dispatch."""
    from symbiont.serve import Engine, Request

    engines: dict[int, Engine] = {}  # variant -> its engine, in least recently used order
    pending, waiting, requests, latency = deque(trace), deque(), {}, []
    swaps = 0
    start = time.monotonic()
    while pending or waiting or any(e.has_work() for e in engines.values()):
        now = time.monotonic() - start
        while pending and pending[0].arrival <= now:
            item = pending.popleft()
            request = Request(f"r{len(requests)}", item.prompt, None, _params(args))
            request.arrival = start + item.arrival
            requests[request.request_id] = request
            waiting.append((item.variant, request))
        while waiting:  # arrival order; the first non-resident variant stops the line
            variant, request = waiting[0]
            if variant not in engines:
                idle = [v for v, e in engines.items() if not e.has_work()]
                if len(engines) >= resident and not idle:
                    break
                if len(engines) >= resident:
                    del engines[idle[0]]  # swapped out (least recently used idle)
                engines[variant] = Engine.from_pretrained(merged[variant], config=args.engine)
                swaps += 1
            engines[variant] = engines.pop(variant)  # most recently used last
            engines[variant].add_request(request)
            waiting.popleft()
        busy = [e for e in engines.values() if e.has_work()]
        if not busy:
            if pending:
                time.sleep(max(0.0, min(0.002, pending[0].arrival - now)))
            continue
        for engine in busy:
            for output in engine.step():
                if output.finished:
                    latency.append(time.monotonic() - requests[output.request_id].arrival)
    seconds = time.monotonic() - start
    failed = [r.error for r in requests.values() if r.error]
    assert not failed, failed[0]
    tokens = sum(len(r.sequences[0].output_ids) for r in requests.values())
    return Run(system, n, tokens, seconds, latency, swaps, resident * args.model_bytes)


def best_of(args, system, *system_args) -> Run:
    """--repeats runs; the median throughput stands for them (the machine is shared)."""
    runs = sorted((system(*system_args) for _ in range(args.repeats)), key=lambda r: r.throughput)
    return runs[len(runs) // 2]


# -- per-call cost of one layer's delta -------------------------------------------------------


def layer_costs(delta_dir: Path, base: Path, rows: int = 8, reps: int = 200) -> dict[str, float]:
    """Seconds per call to add one delta's term to `rows` rows of a shared batch, summed
    over every linear layer of the delta: exact (decompress per call), dense Δ̃ (merged
    apply as served), merged weight (x (W + Δ̃)ᵀ on the delta's rows, replacing them)."""
    from symbiont.delta import delta_product, load_delta
    from symbiont.model.checkpoint import Checkpoint

    delta, checkpoint = load_delta(delta_dir), Checkpoint.open(base)
    costs = {"exact": 0.0, "dense": 0.0, "merged-weight": 0.0}
    for name, layer in delta.layers.items():
        weight = checkpoint.read(f"{name}.weight").float()
        dense, layer = layer.dense(), layer.serving()  # as exact serving holds it
        merged = weight + dense
        x = torch.randn(rows, layer.shape[1])  # the delta's rows of a batch of 4x as many
        y = torch.zeros(4 * rows, layer.shape[0])
        index = torch.arange(rows) * 4
        for kind in costs:
            for rep in range(reps + 1):
                if rep == 1:  # the first call warms up
                    start = time.perf_counter()
                if kind == "exact":
                    y.index_put_((index,), delta_product(x, layer), accumulate=True)
                elif kind == "dense":
                    y.index_put_((index,), x @ dense.T, accumulate=True)
                else:  # replace the rows: x (W + Δ̃)ᵀ
                    y.index_put_((index,), x @ merged.T)
            costs[kind] += (time.perf_counter() - start) / reps
    return costs


# -- output -------------------------------------------------------------------------------


def _layers(delta_dir: Path):
    from symbiont.delta import load_delta

    return load_delta(delta_dir).layers.values()


def plot(runs: list[Run], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_l) = plt.subplots(1, 2, figsize=(10, 4))
    for system in dict.fromkeys(r.system for r in runs):
        mine = [r for r in runs if r.system == system]
        ns = [r.n for r in mine]
        ax_t.plot(ns, [r.throughput for r in mine], marker="o", label=system)
        ax_l.plot(ns, [r.pct(99) for r in mine], marker="o", label=system)
    ax_t.set(xlabel="variants N", ylabel="generated tokens / s", title="throughput")
    ax_l.set(xlabel="variants N", ylabel="seconds", title="P99 end-to-end latency")
    for ax in (ax_t, ax_l):
        ax.set_xscale("log", base=2)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def parse_args(argv):
    from symbiont.serve.config import EngineConfig

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--variants", default="4,8,16", help="values of N")
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--rate", type=float, default=40.0, help="Poisson arrivals per second")
    parser.add_argument("--zipf", type=float, default=1.0)
    parser.add_argument("--out-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-hot", action="store_true", help="skip the deltas-hot system")
    parser.add_argument("--workdir", default=None, help="keep the variants here (reused)")
    parser.add_argument("--plot", default=str(Path(__file__).with_suffix(".png")))
    args = parser.parse_args(argv)
    args.engine = EngineConfig(
        max_running=32, max_batched_tokens=512, block_size=16, num_blocks=512, max_adapters=16
    )
    return args


def main(argv=None) -> int:
    from symbiont.cli.flags import resolve_model
    from symbiont.model.checkpoint import Checkpoint

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    args.model_path = Path(resolve_model(args.model))
    ns = [int(n) for n in args.variants.split(",")]
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="symbiont-deltas-bench-"))
    print(f"model {args.model_path}; variants in {workdir}; load {os.getloadavg()[0]:.2f}")
    pairs = make_variants(args.model_path, max(ns), workdir, args.seed)
    vocab = Checkpoint.open(args.model_path).config.vocab_size
    args.model_bytes = model_bytes(args.model_path)
    packed = sum(f.stat().st_size for f in pairs[0][0].iterdir() if f.suffix != ".json")
    costs = layer_costs(pairs[0][0], args.model_path)
    print(
        "per-call cost of one delta on 8 rows, all layers: "
        + ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in costs.items())
    )
    dense = sum(t.numel() * 4 for t in (layer.dense() for layer in _layers(pairs[0][0])))
    runs = []
    for n in ns:
        folder = workdir / f"dir-{n}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        for delta, _ in pairs[:n]:  # copies: --adapter-dir follows no link out of itself
            shutil.copytree(delta, folder / delta.name)
        budget = args.model_bytes + n * packed
        resident = max(1, budget // args.model_bytes)
        resident_hot = max(1, (budget + dense) // args.model_bytes)
        trace = make_trace(args, n, vocab)
        hottest = f"v{max(set(t.variant for t in trace), key=[t.variant for t in trace].count):02d}"
        print(f"N={n}: budget B {budget / 2**20:.1f} MiB (model {args.model_bytes / 2**20:.1f} "
              f"MiB + {n} x delta {packed / 2**20:.2f} MiB): swap keeps {resident}; B+D "
              f"{(budget + dense) / 2**20:.1f} MiB (one dense delta {dense / 2**20:.1f} MiB): "
              f"swap keeps {resident_hot}; hottest {hottest}")  # fmt: skip
        merged = [m for _, m in pairs[:n]]
        mine = [
            best_of(args, run_swap, args, n, trace, merged, resident),
            best_of(args, run_deltas, args, n, trace, folder, "exact"),
        ]
        if resident_hot != resident:
            mine.append(best_of(args, run_swap, args, n, trace, merged, resident_hot, "swap@B+D"))
        mine.append(best_of(args, run_deltas, args, n, trace, folder, "exact", hottest))
        if not args.no_hot:
            mine.append(best_of(args, run_deltas, args, n, trace, folder, "merged"))
        for run in mine:
            print(f"  {run.system:11s} {run.throughput:7.1f} tok/s  P50 {run.pct(50):6.2f}s "
                  f"P99 {run.pct(99):6.2f}s  loads {run.swaps:3d}  memory "
                  f"{run.memory / 2**20:6.1f} MiB")  # fmt: skip
        runs += mine
    print(f"\nload average {os.getloadavg()[0]:.2f}; threads {args.threads}")
    print("| N | budget | swap tok/s | deltas tok/s | ratio | swap P99 s | deltas P99 s |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for n in ns:
        by = {r.system: r for r in runs if r.n == n}
        rows = [("B", by["swap"], by["deltas"])]
        rows.append(("B+D (hot1)", by.get("swap@B+D", by["swap"]), by["deltas+hot1"]))
        for label, swap, ours in rows:
            print(f"| {n} | {label} | {swap.throughput:.1f} | {ours.throughput:.1f} | "
                  f"{ours.throughput / swap.throughput:.2f}x | {swap.pct(99):.2f} | "
                  f"{ours.pct(99):.2f} |")  # fmt: skip
        if "deltas-hot" in by:
            hot = by["deltas-hot"]
            print(f"| {n} | all merged ({hot.memory / 2**20:.0f} MiB of deltas) | "
                  f"{by['swap'].throughput:.1f} | {hot.throughput:.1f} | "
                  f"{hot.throughput / by['swap'].throughput:.2f}x | {by['swap'].pct(99):.2f} | "
                  f"{hot.pct(99):.2f} |")  # fmt: skip
    plot(runs, Path(args.plot))
    print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
