"""Co-serving (issue 15, FlexLLM): inference under Poisson load while a LoRA fine-tuning
job trains on the same base executor, four ways of sharing, on the default model:

  coserve     symbiont/jobs/coserve.py: after each engine iteration the job runs the
              largest token window s* with f(c, s*) <= the TPOT target (cost model
              profiled at the job's start, refitted online)
  static      a fixed time share: after every iteration the job gets `--static-share` of
              the target (windows sized by the cost model), whatever the load
  temporal    alternate: after every iteration the job runs a whole pass of its step (the
              batch's forward, or its backward), unbounded
  gate        today's behaviour without --slo-tpot-ms: the job trains whole steps freely,
              its base calls waiting while inference calls run (jobs/priority.py)

Each phase replays the same Poisson arrivals (seeded) for `--seconds`: requests of
`--prompt` random tokens generating `--tokens` tokens (greedy, EOS ignored), through an
`Engine` driven by one thread as `symbiont serve` drives it. Baselines in the same run: the
job alone (whole steps, no inference; measured again before each rate, as the machine's
load drifts) and inference alone at each rate.

Reported per rate and mode: SLO attainment (requests whose time per output token, from
first to last token, is within the target), P50/P90 TPOT, inference throughput (generated
tokens/s) and its ratio to inference alone, fine-tuning tokens/s (tokens of finished
micro-batches) and its ratio to the job alone. A plot goes to `--plot`.

    python benchmarks/coserve.py
    python benchmarks/coserve.py --rates 2 8 16 --seconds 10 --slo-ms 40 --plot coserve.png
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import peft
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from symbiont import BaseExecutor, load_client  # noqa: E402
from symbiont.decoding import SamplingParams  # noqa: E402
from symbiont.jobs.coserve import (  # noqa: E402
    CoServe,
    CostModel,
    Slot,
    _Need,
    plan_positions,
    profile,
)
from symbiont.jobs.priority import (  # noqa: E402
    PriorityGate,
    TrainingExecutor,
    give_inference_priority,
)
from symbiont.jobs.windows import IGNORE_INDEX, WindowedStep  # noqa: E402
from symbiont.model.default import default_model  # noqa: E402
from symbiont.serve import EngineConfig  # noqa: E402
from symbiont.serve.engine import Engine  # noqa: E402
from symbiont.serve.sequence import Request  # noqa: E402

MODES = ("coserve", "static", "temporal", "gate")
UNBOUNDED_S = 1e9  # a slot no window exceeds


class StaticSplit(CoServe):
    """After every iteration, a fixed share of the target for the job, whatever the load."""

    def __init__(self, slo_s: float, cost: CostModel, share: float):
        super().__init__(slo_s, cost)
        self.share = share

    def _slot_for(self, c: int, need: _Need, from_engine: bool = True) -> Slot | None:
        room = self.slo_s * self.share
        return Slot(c, self.slo_s, room, from_engine, forced=True)


class Temporal(CoServe):
    """After every iteration, a whole pass of the job's step (forward or backward)."""

    def _slot_for(self, c: int, need: _Need, from_engine: bool = True) -> Slot | None:
        return Slot(c, UNBOUNDED_S, UNBOUNDED_S, from_engine)


class Stopped(Exception):
    pass


class Job:
    """A LoRA job training on synthetic sequences through the shared executor."""

    def __init__(self, path: str, executor, gate: PriorityGate, args):
        self.stop = threading.Event()
        self.gate = gate
        self.model = self._model(path, TrainingExecutor(executor, gate, self._check))
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad], lr=1e-4
        )
        vocab = self.model.config.vocab_size
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(3, vocab, (args.ft_batch, args.ft_length), generator=g)
        self.labels = self.ids.clone()
        self.labels[:, : args.ft_length // 4] = IGNORE_INDEX  # a prompt without loss
        self.tokens = 0  # of finished micro-batches
        self.updates, self.update_s = 0, 0.0  # optimizer steps and their seconds

    @staticmethod
    def _model(path, executor):
        torch.manual_seed(0)
        model = load_client(path, executor)
        config = peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")
        return peft.get_peft_model(model, config)

    def _check(self) -> None:
        if self.stop.is_set():
            raise Stopped

    def run(self, coserve: CoServe | None, plan: int | None) -> None:
        """Train until stopped: windowed steps of `plan` positions per window (None: cut to
        fit each slot) in `coserve`'s slots, the optimizer step in the last one's slot;
        else whole steps."""
        self.updates = 0
        try:
            while not self.stop.is_set():
                if coserve is None:
                    self.model(input_ids=self.ids, labels=self.labels).loss.backward()
                    self._update()
                else:
                    step = WindowedStep(self.model, self.ids, self.labels, plan=plan)
                    coserve.run_step(step, self._check, self._update)
                self.tokens += self.ids.numel()
        except Stopped:
            self.optimizer.zero_grad(set_to_none=True)

    def _update(self) -> None:
        started = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.updates += 1
        self.update_s += time.perf_counter() - started


def arrivals(rate: float, seconds: float, seed: int = 0) -> list[float]:
    rng, t, out = random.Random(seed), 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            return out
        out.append(t)


def drive(engine: Engine, times: list[float], args, vocab: int) -> dict:
    """Replay the arrivals; returns per-request token timestamps and the elapsed time."""
    rng = random.Random(1)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    stamps: dict[str, list[float]] = {}
    start, next_i = time.perf_counter(), 0
    while next_i < len(times) or engine.has_work():
        now = time.perf_counter() - start
        while next_i < len(times) and times[next_i] <= now:
            prompt = [rng.randrange(3, vocab) for _ in range(args.prompt)]
            engine.add_request(Request(f"r{next_i}", prompt, None, params))
            stamps[f"r{next_i}"] = []
            next_i += 1
        if not engine.has_work():
            time.sleep(min(0.002, max(times[next_i] - now, 0)) if next_i < len(times) else 0)
            continue
        for output in engine.step():
            if output.error:
                raise RuntimeError(output.error)
            stamp = time.perf_counter()
            stamps[output.request_id] += [stamp] * (
                output.completion_tokens - len(stamps[output.request_id])
            )
    return {"stamps": stamps, "elapsed": time.perf_counter() - start}


def summarize(result: dict | None, slo_s: float) -> dict:
    if result is None:
        return {}
    tpots = [
        (s[-1] - s[0]) / (len(s) - 1) for s in result["stamps"].values() if len(s) > 1
    ]  # seconds per output token after the first, per request
    tokens = sum(len(s) for s in result["stamps"].values())
    return {
        "requests": len(tpots),
        "attainment": sum(t <= slo_s for t in tpots) / max(len(tpots), 1),
        "tpot_p50_ms": 1e3 * statistics.median(tpots) if tpots else 0.0,
        "tpot_p90_ms": 1e3 * statistics.quantiles(tpots, n=10)[-1] if len(tpots) > 1 else 0.0,
        "tokens_per_s": tokens / result["elapsed"],
    }


def phase(path, executor, job: Job | None, mode: str | None, rate: float, args, cost):
    """One run: inference at `rate` (0: none) beside the job in `mode` (None: no job)."""
    config = EngineConfig(max_running=64, max_batched_tokens=256, num_blocks=2048)
    engine = Engine.from_pretrained(path, executor=executor, config=config)
    gate = job.gate if job is not None else PriorityGate()
    give_inference_priority(engine.model, gate)
    slo = args.slo_ms / 1e3
    coserve = None
    if mode == "coserve":
        coserve = CoServe(slo, cost)
    elif mode == "static":
        coserve = StaticSplit(slo, cost, args.static_share)
    elif mode == "temporal":
        coserve = Temporal(slo, cost)
    if coserve is not None:
        engine.iteration_hook = coserve.after_iteration
    worker = None
    plan = None
    if mode in ("coserve", "static") and not args.adaptive:
        plan = plan_positions(cost, slo, args.ft_batch, args.ft_length)
    if job is not None:
        job.stop.clear()
        job.tokens, job.update_s = 0, 0.0
        worker = threading.Thread(target=job.run, args=(coserve, plan), daemon=True)
        worker.start()
    started = time.perf_counter()
    if rate > 0:
        result = drive(engine, arrivals(rate, args.seconds), args, engine.runner.vocab_size)
    else:
        result = None
        time.sleep(args.seconds)
    elapsed = time.perf_counter() - started
    if job is not None:
        job.stop.set()
        worker.join(60)
    out = summarize(result, slo)
    if job is not None:
        out["ft_tokens_per_s"] = job.tokens / elapsed
    if coserve is not None:
        out["engine_slots"] = sum(r.slot.from_engine for r in coserve.history)
        out["idle_slots"] = sum(not r.slot.from_engine for r in coserve.history)
        out["margin"] = coserve.margin
        # where the job's time went (seconds of the phase): windows in slots, the optimizer
        # step, waiting for a slot; and the planned positions per window
        out["in_slots_s"] = sum(r.seconds - r.finish_s for r in coserve.history)
        out["windows"] = sum(sum(r.windows) for r in coserve.history)
        out["waiting_s"] = coserve.waited_s
        out["plan"] = plan
    if job is not None:
        out["optimizer_s"] = job.update_s
        out["elapsed_s"] = elapsed
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[2.0, 8.0, 16.0])
    parser.add_argument("--seconds", type=float, default=8.0, help="per phase")
    parser.add_argument("--slo-ms", type=float, default=100.0, help="TPOT target")
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens per request")
    parser.add_argument("--tokens", type=int, default=32, help="output tokens per request")
    parser.add_argument("--ft-batch", type=int, default=4, help="fine-tuning micro-batch")
    parser.add_argument("--ft-length", type=int, default=64, help="fine-tuning sequence")
    parser.add_argument("--static-share", type=float, default=0.5, help="static: job's share")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument(
        "--adaptive",
        action="store_true",
        help="coserve/static: cut each window to fit its slot instead of a fixed window plan",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--plot", default=None, help="write a PNG plot here")
    parser.add_argument("--json", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = str(default_model())
    executor = BaseExecutor.from_pretrained(path)
    gate = PriorityGate()
    job = Job(path, executor, gate, args)
    cost = CostModel()
    profile(job.model, cost, job.model.config.vocab_size, rows=args.ft_batch)
    print("cost model (s):", [f"{w:.2e}" for w in cost.coefficients], flush=True)
    results = {}
    for rate in args.rates:
        key = f"job alone @ {rate:g}"  # measured next to each rate: the machine's load drifts
        results[key] = phase(path, executor, job, None, 0, args, cost)
        print(key, results[key], flush=True)
        key = f"inference alone @ {rate:g}"
        results[key] = phase(path, executor, None, None, rate, args, cost)
        print(key, results[key], flush=True)
        for mode in args.modes:
            key = f"{mode} @ {rate:g}"
            results[key] = phase(path, executor, job, mode, rate, args, cost)
            print(key, results[key], flush=True)
    report(results, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    if args.plot:
        plot(results, args)


def report(results: dict, args) -> None:
    print(f"\nTPOT target {args.slo_ms:g} ms")
    print("| rate (req/s) | mode | SLO attained | TPOT P50 / P90 (ms) | inference tok/s (vs alone) "
          "| fine-tuning tok/s (vs job alone) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for rate in args.rates:
        base = results[f"inference alone @ {rate:g}"]
        alone = results[f"job alone @ {rate:g}"]["ft_tokens_per_s"]
        print(f"| {rate:g} | job alone | - | - | - | {alone:.0f} (1.00x) |")
        rows = [("inference alone", base)] + [(m, results[f"{m} @ {rate:g}"]) for m in args.modes]
        for mode, r in rows:
            ft = r.get("ft_tokens_per_s")
            ft_text = f"{ft:.0f} ({ft / alone:.2f}x)" if ft is not None else "-"
            print(
                f"| {rate:g} | {mode} | {100 * r['attainment']:.0f}% | "
                f"{r['tpot_p50_ms']:.1f} / {r['tpot_p90_ms']:.1f} | "
                f"{r['tokens_per_s']:.0f} ({r['tokens_per_s'] / base['tokens_per_s']:.2f}x) | "
                f"{ft_text} |"
            )


def plot(results: dict, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    alone = [results[f"job alone @ {rate:g}"]["ft_tokens_per_s"] for rate in args.rates]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for mode in args.modes:
        rows = [results[f"{mode} @ {rate:g}"] for rate in args.rates]
        left.plot(args.rates, [100 * r["attainment"] for r in rows], "o-", label=mode)
        ratios = [r["ft_tokens_per_s"] / a for r, a in zip(rows, alone, strict=True)]
        right.plot(args.rates, ratios, "o-", label=mode)
    left.axhline(90, color="grey", ls="--", lw=1)
    right.axhline(0.8, color="grey", ls="--", lw=1)
    left.set(xlabel="inference load (req/s)", ylabel=f"requests within {args.slo_ms:g} ms TPOT (%)")
    right.set(xlabel="inference load (req/s)", ylabel="fine-tuning throughput / job alone")
    left.legend()
    fig.suptitle("Co-serving a LoRA job with Poisson inference (default model)")
    fig.tight_layout()
    fig.savefig(args.plot, dpi=110)
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
