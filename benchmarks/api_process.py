"""`symbiont serve` (its API process) against `symbiont serve --no-api-process`, in one run.

Both servers are started in turn on the same checkpoint, limits and thread count, and
replay the same seeded streaming traces as `benchmarks/peers/vllm_cpu.py` (its load
generator and checkpoints are reused: base model, closed loop with --users clients and
Poisson arrivals, short and long prompts). Each round runs every scenario on both
servers, alternating which goes first; the ratios are `API process / in-process`
per round (throughput: above 1 is better; TTFT, ITL: below 1 is better).

    python benchmarks/api_process.py --model small --rounds 2
    python benchmarks/api_process.py --model 100m --requests 16 --rounds 1
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def load_harness():
    spec = importlib.util.spec_from_file_location("vllm_cpu", HERE / "peers" / "vllm_cpu.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["vllm_cpu"] = module
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> int:
    harness = load_harness()
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="small", help="'small', '100m', '500m' or a folder")
    p.add_argument("--rounds", type=int, default=2, help="rounds of both servers")
    p.add_argument("--loads", default="closed,poisson", help="closed and/or poisson")
    p.add_argument("--prompts", default="short,long", help="short and/or long")
    p.add_argument("--requests", type=int, default=48, help="requests per scenario")
    p.add_argument("--users", type=int, default=16, help="closed-loop concurrent clients")
    p.add_argument("--rate", type=float, default=8.0, help="Poisson arrivals per second")
    p.add_argument("--threads", type=harness.threads_arg, default=1, help="torch threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=HERE / "results" / "api-process")
    args = p.parse_args(argv)
    # what the harness's trace and server helpers read, at its defaults
    args.short, args.long, args.output_len, args.zipf = (16, 64), (384, 640), (32, 96), 1.0
    bench = harness.load_serve_bench()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.model in harness.SIZES:
        folder = "small-llama" if args.model == "small" else f"llama-{args.model}"
        model = str(harness.sized_checkpoint(args.out / folder, args.model, args.seed))
    else:
        model = args.model
    vocab = harness.AutoConfig_vocab(model)
    lim = harness.Limits(32, 1024, 1024, 8, args.threads)
    scenarios = [
        harness.Scenario(0, load, kind)
        for load in args.loads.split(",")
        for kind in args.prompts.split(",")
    ]
    traces, warm_trace = harness.scenario_traces(bench, args, 0, scenarios, vocab)
    warm = [bench.TraceItem(0, 0, item.prompt, 4) for item in warm_trace[:4]]
    ratios: dict = {s: [] for s in scenarios}
    for r in range(args.rounds):
        order = ("in-process", "api-process") if r % 2 == 0 else ("api-process", "in-process")
        measured = {}
        for system in order:
            port = harness.free_port()
            command = harness.symbiont_command(model, [], port, lim)
            if system == "in-process":
                command.append("--no-api-process")
            log = args.out / f"{system}-{r}.log"
            env = harness.server_env(args.threads, peer=False)
            with harness.running_server(system, command, env, port, log, 600) as url:
                asyncio.run(harness.drive(url, warm, ["base"], users=None))
                for s in scenarios:
                    users = args.users if s.load == "closed" else None
                    stats, seconds = asyncio.run(harness.drive(url, traces[s], ["base"], users))
                    result = bench.Result(
                        system, stats["tokens"], seconds, stats["ttft"], stats["itl"]
                    )
                    measured[(s, system)] = harness.summary(result)
                    print(f"round {r} {s.label:<24} {result.row()}", flush=True)
        for s in scenarios:
            ours, base = measured[(s, "api-process")], measured[(s, "in-process")]
            ratios[s].append({m: ours[m] / base[m] for m in harness.METRICS})
    print("\nAPI process / in-process, median over rounds (per-round values in brackets)")
    print(f"{'scenario':<24} {'throughput':>22} {'TTFT p50':>22} {'ITL p50':>22} {'ITL p99':>22}")
    for s in scenarios:
        cells = []
        for m in ("tok_s", "ttft_p50", "itl_p50", "itl_p99"):
            values = [x[m] for x in ratios[s]]
            each = ", ".join(f"{v:.2f}" for v in values)
            cells.append(f"{statistics.median(values):.2f}x [{each}]".rjust(22))
        print(f"{s.label:<24} " + " ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
