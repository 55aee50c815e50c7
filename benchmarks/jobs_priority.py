"""Inference latency while a fine-tuning job trains in the same `symbiont serve` process
(issue 15): what the inference-first gate of symbiont/jobs/priority.py buys.

One server (in this process, loopback) on the default model with a jobs dir. A closed-loop
client sends --requests greedy completions one after another per phase (--tokens output
tokens each, EOS ignored):

  alone            no job
  job, no gate     a LoRA job on symbiont/assets/sft.jsonl trains; its base-layer calls
                   do not wait for inference calls (the gate switched off)
  job, gate        the same job; fine-tuning calls wait while inference calls run (<= 50 ms)

Prints milliseconds per generated token (request latency / tokens; mean and P90) and the
job's training tokens/s in each phase, with the ratios against `alone` and `no gate`,
all measured in the same run.

    python benchmarks/jobs_priority.py
    python benchmarks/jobs_priority.py --requests 20 --tokens 32 --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import openai
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from symbiont.model.default import default_model  # noqa: E402
from symbiont.serve import EngineConfig  # noqa: E402
from symbiont.serve.config import ServerConfig  # noqa: E402
from symbiont.serve.http.server import BackgroundServer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10, help="requests per phase (>= 2)")
    parser.add_argument("--tokens", type=int, default=32, help="output tokens per request")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = default_model()
    with tempfile.TemporaryDirectory() as jobs_dir:
        config = ServerConfig(
            model=str(model), port=0, engine=EngineConfig(max_model_len=256), jobs_dir=jobs_dir
        )
        with BackgroundServer(config) as server:
            api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
            base = api.models.list().data[0].id
            results = {"alone": phase(api, base, args)}
            service = server._server.config.app.state.jobs
            job = start_job(api, base)
            gate = service.runner.gate
            original = gate.wait_for_inference
            gate.wait_for_inference = lambda: None  # no priority
            results["job, no gate"] = phase(api, base, args, service, job.id)
            gate.wait_for_inference = original
            results["job, gate"] = phase(api, base, args, service, job.id)
            api.fine_tuning.jobs.cancel(job.id)
    report(results, args)


def start_job(api, base: str):
    data = (REPO / "symbiont" / "assets" / "sft.jsonl").read_bytes()
    upload = api.files.create(file=("sft.jsonl", data), purpose="fine-tune")
    job = api.fine_tuning.jobs.create(
        model=base,
        training_file=upload.id,
        hyperparameters={"n_epochs": 50, "batch_size": 4},
        extra_body={"peft": {"method": "lora", "r": 8}, "checkpoint_every": 10_000},
    )
    while api.fine_tuning.jobs.retrieve(job.id).status != "running":
        time.sleep(0.05)
    time.sleep(1.0)  # past the job's start-up (model build, tokenization)
    return job


def phase(api, base: str, args, service=None, job_id: str | None = None) -> dict:
    """args.requests closed-loop greedy completions; ms per token of each request."""
    tokens_before = trained_tokens(service, job_id)
    started = time.perf_counter()
    per_token = []
    for _ in range(max(2, args.requests)):
        t0 = time.perf_counter()
        out = api.completions.create(
            model=base,
            prompt="Q: What is 20 plus 19?\nA:",
            max_tokens=args.tokens,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert out.usage.completion_tokens == args.tokens
        per_token.append((time.perf_counter() - t0) * 1000 / args.tokens)
    elapsed = time.perf_counter() - started
    trained = trained_tokens(service, job_id) - tokens_before
    return {
        "ms_per_token": statistics.fmean(per_token),
        "p90_ms_per_token": statistics.quantiles(per_token, n=10)[-1],
        "requests": len(per_token),
        "train_tokens_per_s": trained / elapsed if job_id else 0.0,
    }


def trained_tokens(service, job_id: str | None) -> int:
    """Tokens the job has trained on so far (its metrics.jsonl, one record per step)."""
    if job_id is None:
        return 0
    path = service.store.run_dir(job_id) / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return json.loads(lines[-1])["tokens"] if lines else 0


def report(results: dict, args) -> None:
    alone, free = results["alone"]["ms_per_token"], results["job, no gate"]
    print(f"{args.requests} requests of {args.tokens} tokens per phase, {args.threads} threads")
    print(
        f"{'phase':<14} {'ms/token':>9} {'p90':>7} {'vs alone':>9} {'requests':>9} {'train tok/s':>12}"
    )
    for name, r in results.items():
        print(
            f"{name:<14} {r['ms_per_token']:9.2f} {r['p90_ms_per_token']:7.2f} "
            f"{r['ms_per_token'] / alone:8.2f}x {r['requests']:9d} {r['train_tokens_per_s']:12.0f}"
        )
    gated = results["job, gate"]
    print(
        f"gate vs no gate: inference ms/token {gated['ms_per_token'] / free['ms_per_token']:.2f}x, "
        f"fine-tuning tokens/s {gated['train_tokens_per_s'] / max(free['train_tokens_per_s'], 1e-9):.2f}x"
    )


if __name__ == "__main__":
    main()
