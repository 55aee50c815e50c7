"""Symbiosis Table 5 on CPU: no-lockstep vs lockstep vs opportunistic batching.

Heterogeneous clients (different LoRA ranks and batch sizes), each in its own process,
generate against one `serve-base` process; each policy gets a fresh server and the same
clients, started together. Printed side by side: throughput (generated tokens/s over
the whole run), mean request latency, and mean batch size (client calls per base-layer
run, from the server's statistics), with ratios against no-lockstep.

    python benchmarks/batching.py [--clients 1,2,4,8,16,32] [--new-tokens 8]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path

import torch

import symbiont
from symbiont.service.process import ServerProcess

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


def client(index: int, rows: int, args, url: str, start, results) -> None:
    """One tenant: its own LoRA rank and batch size, `requests` generate() calls in a row."""
    import peft

    torch.set_num_threads(1)
    torch.manual_seed(index)
    executor = symbiont.connect(url, label=f"client{index}-bs{rows}", spin_us=args.spin_us)
    rank = (4, 16)[index % 2]
    model = symbiont.load_client(args.model, executor)
    model = peft.get_peft_model(model, peft.LoraConfig(r=rank, target_modules=["q_proj", "v_proj"]))
    ids = torch.randint(3, 4096, (rows, args.prompt))
    gen = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    with torch.no_grad():
        model.generate(input_ids=ids[:, :4], max_new_tokens=2, do_sample=False)  # warm up
        start.wait()
        latencies = []
        for _ in range(args.requests):
            began = time.perf_counter()
            model.generate(input_ids=ids, **gen)
            latencies.append(time.perf_counter() - began)
    results.put((rows * args.new_tokens * args.requests, latencies, time.perf_counter()))
    executor.close()


def run_policy(policy: str, args) -> dict:
    spawn = multiprocessing.get_context("spawn")
    server_args = ["--policy", policy, "--threads", args.server_threads]
    server_args += [
        "--max-wait-ms",
        args.max_wait_ms,
        "--wait-per-token-us",
        args.wait_per_token_us,
    ]
    with ServerProcess(args.model, args=server_args) as server:
        url = server.url("ipc")
        start, results = spawn.Barrier(len(args.clients) + 1), spawn.Queue()
        procs = [
            spawn.Process(target=client, args=(i, rows, args, url, start, results))
            for i, rows in enumerate(args.clients)
        ]
        for proc in procs:
            proc.start()
        start.wait()
        began = time.perf_counter()
        outcomes = [results.get(timeout=1800) for _ in procs]
        for proc in procs:
            proc.join()
        with symbiont.connect(url, mode="zmq", label="bench") as probe:
            stats = probe.stats()
    makespan = max(done for _, _, done in outcomes) - began
    return {
        "throughput": sum(tokens for tokens, _, _ in outcomes) / makespan,
        "latency": statistics.mean(lat for _, lats, _ in outcomes for lat in lats),
        "batch": stats["total"]["mean_batch_calls"],
        "wait_ms": stats["total"]["mean_queue_wait_ms"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", default="1,2,4,8,16,32", help="batch size of each client")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--requests", type=int, default=1, help="generate() calls per client")
    parser.add_argument("--max-wait-ms", type=float, default=5.0)
    parser.add_argument("--wait-per-token-us", type=float, default=100.0)
    parser.add_argument("--server-threads", type=int, default=2)
    parser.add_argument("--spin-us", type=float, default=200.0, help="client spin window")
    parser.add_argument("--model", type=Path, help="checkpoint (default: built in a temp dir)")
    args = parser.parse_args()
    args.clients = [int(b) for b in args.clients.split(",")]
    if args.model is None:
        args.model = build_checkpoint(Path(tempfile.mkdtemp()) / "base", args.hidden, args.layers)
    print(
        f"base: llama hidden {args.hidden}, {args.layers} layers, fp32 on CPU; clients' batch "
        f"sizes {args.clients}, LoRA r=4/16 alternating, prompt {args.prompt}, "
        f"{args.new_tokens} new tokens x {args.requests} requests each"
    )
    rows = {policy: run_policy(policy, args) for policy in POLICIES}
    base = rows["no-lockstep"]
    print(
        f"{'policy':<15} {'tokens/s':>9} {'vs no-lock':>10} {'latency s':>10} "
        f"{'vs no-lock':>10} {'batch':>6} {'wait ms':>8}"
    )
    for policy, r in rows.items():
        print(
            f"{policy:<15} {r['throughput']:>9.1f} {r['throughput'] / base['throughput']:>9.2f}x "
            f"{r['latency']:>10.2f} {r['latency'] / base['latency']:>9.2f}x "
            f"{r['batch']:>6.2f} {r['wait_ms']:>8.2f}"
        )


if __name__ == "__main__":
    main()
