"""Symbiosis Table 5 on CPU: no-lockstep vs lockstep vs opportunistic batching.

Heterogeneous clients, each in its own process against one `serve-base` process: some
generate (greedy, different batch sizes), some fine-tune (LoRA, forward and backward
passes), with different LoRA adapters (rank 4 on q/v, rank 16 on q/k/v/o, alternating).
Every run gives every client the same work; each policy is run `--repeats` times,
interleaved (policy A, B, C, A, B, C, ...) so load from elsewhere on the machine hits all
policies alike, and the median run of each policy is printed side by side: throughput
(tokens generated or trained per second over the whole run, until the last client
finishes), mean generate() latency, mean fine-tuning step, mean batch size (client calls
per base-layer visit, from the server's statistics) and mean queue wait, with ratios
against no-lockstep. The client processes start once (imports dominate start-up) and
reconnect to a fresh server for each run.

By default (`--pin on`, with 2+ cores) the executor runs on the first core alone
(`serve-base --cpus`) and the clients share the others: the paper's setting, a base on
its own GPU serving clients whose own compute (attention, adapter, backward) runs
elsewhere. `--pin off` lets every process use every core, so executor and clients take
turns on the same cores.

    python benchmarks/batching.py [--clients gen:1,gen:2,gen:4,gen:8,gen:16,ft:2x32]
                                  [--repeats 5] [--new-tokens 8] [--requests 2] [--pin on|off]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

import symbiont
from symbiont.processes import ServerProcess

POLICIES = ("no-lockstep", "lockstep", "opportunistic")


def build_checkpoint(folder: Path, hidden: int, layers: int) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama",
        hidden_size=hidden,
        intermediate_size=int(2.75 * hidden),
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        vocab_size=4096,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def parse_client(spec: str) -> dict:
    """`gen:ROWS` (generates) or `ft:ROWSxLENGTH` (fine-tunes)."""
    kind, _, size = spec.partition(":")
    if kind == "gen":
        return {"kind": "gen", "rows": int(size), "length": 0}
    if kind == "ft":
        rows, _, length = size.partition("x")
        return {"kind": "ft", "rows": int(rows), "length": int(length)}
    raise SystemExit(f"client spec {spec!r}: use gen:ROWS or ft:ROWSxLENGTH")


def worker(index: int, job: dict, args, commands, start, results) -> None:
    """One tenant process: for each url it is sent, connect, warm up, wait for the start,
    do its work, report (work tokens, latencies, end time) and disconnect."""
    import logging

    import peft

    logging.getLogger("transformers").setLevel(logging.ERROR)
    if args.client_cpus:
        os.sched_setaffinity(0, args.client_cpus)
    torch.set_num_threads(1)
    targets = (["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj", "o_proj"])[index % 2]
    lora = peft.LoraConfig(r=(4, 16)[index % 2], target_modules=targets)
    gen_ids = torch.randint(3, 4096, (job["rows"], args.prompt), generator=_seed(index))
    ft_ids = torch.randint(3, 4096, (job["rows"], max(job["length"], 1)), generator=_seed(index))
    gen = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    while (url := commands.get()) is not None:
        executor = symbiont.connect(url, label=f"c{index}-{job['kind']}{job['rows']}")
        torch.manual_seed(index)
        model = peft.get_peft_model(symbiont.load_client(args.model, executor), lora)
        latencies, tokens = [], 0
        if job["kind"] == "gen":
            with torch.no_grad():
                model.generate(input_ids=gen_ids[:, :4], max_new_tokens=2, do_sample=False)
                start.wait()
                for _ in range(args.requests):
                    began = time.perf_counter()
                    model.generate(
                        input_ids=gen_ids, attention_mask=torch.ones_like(gen_ids), **gen
                    )
                    latencies.append(time.perf_counter() - began)
                    tokens += job["rows"] * args.new_tokens
        else:
            params = [p for p in model.parameters() if p.requires_grad]
            optimizer = torch.optim.AdamW(params, lr=1e-4)
            model.train()
            model(input_ids=ft_ids[:, :4], labels=ft_ids[:, :4]).loss.backward()  # warm up
            optimizer.zero_grad()
            start.wait()
            for _ in range(args.steps):
                began = time.perf_counter()
                model(input_ids=ft_ids, labels=ft_ids).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                latencies.append(time.perf_counter() - began)
                tokens += ft_ids.numel()
        results.put((index, tokens, latencies, time.perf_counter()))
        executor.close()


def _seed(index: int) -> torch.Generator:
    return torch.Generator().manual_seed(1000 + index)


def run_once(policy: str, args, commands, start, results) -> dict:
    server_args = ["--policy", policy]
    if args.server_threads:
        server_args += ["--threads", args.server_threads]
    server_args += ["--max-wait-ms", args.max_wait_ms]
    server_args += ["--wait-per-token-us", args.wait_per_token_us]
    if args.executor_cpus:
        server_args += ["--cpus", ",".join(map(str, sorted(args.executor_cpus)))]
    with ServerProcess(args.model, args=server_args) as server:
        url = server.url("ipc")
        for queue in commands:
            queue.put(url)
        start.wait(timeout=600)
        began = time.perf_counter()
        with symbiont.connect(url, mode="zmq", label="bench") as probe:
            warm = probe.stats()["total"]  # warm-up calls, left out of batch and busy
        outcomes = [results.get(timeout=1800) for _ in commands]
        with symbiont.connect(url, mode="zmq", label="bench") as probe:
            total = probe.stats()["total"]
    makespan = max(done for *_, done in outcomes) - began
    visits = max(total["batches"] - warm["batches"], 1)
    calls = max(total["calls"] - warm["calls"], 1)
    gen = [lat for i, _, lats, _ in outcomes if args.jobs[i]["kind"] == "gen" for lat in lats]
    ft = [lat for i, _, lats, _ in outcomes if args.jobs[i]["kind"] == "ft" for lat in lats]
    return {
        "throughput": sum(tokens for _, tokens, _, _ in outcomes) / makespan,
        "latency": statistics.mean(gen) if gen else float("nan"),
        "step": statistics.mean(ft) if ft else float("nan"),
        "batch": (total["calls"] - warm["calls"]) / visits,
        "wait_ms": (_sum(total, "queue_wait") - _sum(warm, "queue_wait")) / calls,
        "visits": visits,
        "busy": (_sum(total, "compute") - _sum(warm, "compute")) / 1e3 / makespan,
    }


def _sum(stats: dict, what: str) -> float:
    """Milliseconds summed over calls (queue_wait) or over layer visits (compute)."""
    if what == "queue_wait":
        return stats["mean_queue_wait_ms"] * stats["calls"]
    return stats["mean_compute_ms"] * stats["batches"]


def median_run(runs: list[dict]) -> dict:
    """Per metric, the median over the repetitions."""
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--clients",
        default="gen:1,gen:2,gen:4,gen:8,gen:16,ft:2x32",
        help="comma-separated gen:ROWS (generates) or ft:ROWSxLENGTH (fine-tunes)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="runs per policy, interleaved")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--requests", type=int, default=2, help="generate() calls per client")
    parser.add_argument("--steps", type=int, default=4, help="fine-tuning steps per client")
    parser.add_argument(
        "--max-wait-ms", type=float, default=20.0, help="opportunistic: cap on any call's wait"
    )
    parser.add_argument(
        "--wait-per-token-us",
        type=float,
        default=300.0,
        help="opportunistic: wait per token a call carries (the paper lets a 256-row call "
        "wait 50 ms, about 200 µs a token)",
    )
    parser.add_argument(
        "--server-threads", type=int, help="default: one per executor core (all if not pinned)"
    )
    parser.add_argument(
        "--pin",
        choices=["on", "off"],
        default="on" if len(os.sched_getaffinity(0)) >= 2 else "off",
        help="on (default with 2+ cores): the executor gets the first core to itself and the "
        "clients share the others, as a base on its own GPU serves clients elsewhere; "
        "off: every process on every core",
    )
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--model", type=Path, help="checkpoint (default: built in a temp dir)")
    args = parser.parse_args()
    args.jobs = [parse_client(spec) for spec in args.clients.split(",")]
    cores = sorted(os.sched_getaffinity(0))
    args.executor_cpus = {cores[0]} if args.pin == "on" else None
    args.client_cpus = set(cores[1:]) if args.pin == "on" else None
    policies = args.policies.split(",")
    if args.model is None:
        args.model = build_checkpoint(Path(tempfile.mkdtemp()) / "base", args.hidden, args.layers)
    print(
        f"base: llama hidden {args.hidden}, {args.layers} layers, fp32 on CPU; clients "
        f"{args.clients} (LoRA r=4 q/v and r=16 q/k/v/o alternating); generate: prompt "
        f"{args.prompt}, {args.new_tokens} new tokens x {args.requests} requests; fine-tune: "
        f"{args.steps} steps; {args.repeats} interleaved runs per policy, medians; "
        + (
            f"executor pinned to core {cores[0]}, clients to cores {cores[1:]}"
            if args.pin == "on"
            else "no pinning"
        ),
        flush=True,
    )
    spawn = multiprocessing.get_context("spawn")
    commands = [spawn.Queue() for _ in args.jobs]
    start, results = spawn.Barrier(len(args.jobs) + 1), spawn.Queue()
    procs = [
        spawn.Process(target=worker, args=(i, job, args, commands[i], start, results))
        for i, job in enumerate(args.jobs)
    ]
    for proc in procs:
        proc.start()
    runs: dict[str, list[dict]] = {policy: [] for policy in policies}
    try:
        for rep in range(args.repeats):
            for policy in policies[rep % len(policies) :] + policies[: rep % len(policies)]:
                r = run_once(policy, args, commands, start, results)
                runs[policy].append(r)
                print(
                    f"  run {rep + 1} {policy:<14} {r['throughput']:7.1f} tok/s "
                    f"latency {r['latency']:.2f} s batch {r['batch']:.2f} visits {r['visits']} "
                    f"executor busy {100 * r['busy']:.0f}%",
                    flush=True,
                )
    finally:
        for queue in commands:
            queue.put(None)
        for proc in procs:
            proc.join(timeout=30)
    rows = {policy: median_run(r) for policy, r in runs.items()}
    base = rows.get("no-lockstep", next(iter(rows.values())))
    print(
        f"{'policy':<15} {'tokens/s':>9} {'vs no-lock':>10} {'latency s':>10} "
        f"{'vs no-lock':>10} {'ft step s':>9} {'batch':>6} {'wait ms':>8} {'busy':>5}"
    )
    for policy, r in rows.items():
        print(
            f"{policy:<15} {r['throughput']:>9.1f} {r['throughput'] / base['throughput']:>9.2f}x "
            f"{r['latency']:>10.2f} {r['latency'] / base['latency']:>9.2f}x "
            f"{r['step']:>9.2f} {r['batch']:>6.2f} {r['wait_ms']:>8.2f} {100 * r['busy']:>4.0f}%"
        )


if __name__ == "__main__":
    main()
