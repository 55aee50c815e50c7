"""Multi-tenant serving benchmark (issue 5): replay a seeded trace against `symbiont serve`.

Trace: Poisson arrivals at --rate requests/s; each request picks one of --adapters LoRA
adapters (ranks drawn from --ranks) with power-law (Zipf) popularity; prompt and output
lengths are drawn uniformly from fixed ranges with a fixed seed; outputs ignore EOS so
every system generates exactly the same number of tokens.

Systems, in the same run and process, on the same model and trace:
  symbiont+adapters  the server, every request with its adapter (mixed in each batch)
  symbiont base      (a) a server with no adapters loaded, every request on the base model
  peft static        (b) vanilla transformers + peft: all adapters loaded, static batches of
                     --static-batch requests in arrival order with `adapter_names`, given the
                     whole trace up front (no arrival waits, which favours it)

Prints throughput (generated tokens/s), TTFT and inter-token latency P50/P99, and the
ratios the issue asks for: adapter overhead vs (a) and speed-up vs (b).

    python benchmarks/serve.py                    # default model, 20 adapters
    python benchmarks/serve.py --adapters 100 --requests 200 --rate 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import torch


@dataclass(frozen=True)
class TraceItem:
    arrival: float  # seconds after the start
    adapter: int  # index into the adapter list
    prompt: list[int]
    max_tokens: int


def make_trace(args, vocab: int) -> list[TraceItem]:
    rng = np.random.default_rng(args.seed)
    gaps = rng.exponential(1.0 / args.rate, args.requests)
    popularity = 1.0 / np.arange(1, args.adapters + 1) ** args.zipf
    adapters = rng.choice(args.adapters, args.requests, p=popularity / popularity.sum())
    lo_p, hi_p = args.prompt_len
    lo_o, hi_o = args.output_len
    return [
        TraceItem(
            float(t),
            int(a),
            rng.integers(10, vocab, int(rng.integers(lo_p, hi_p + 1))).tolist(),
            int(rng.integers(lo_o, hi_o + 1)),
        )
        for t, a in zip(np.cumsum(gaps) - gaps[0], adapters, strict=True)
    ]


def make_adapters(model: str, n: int, ranks: list[int], folder: Path, seed: int) -> list[Path]:
    """n random LoRA adapters (q, k, v, o projections) with ranks cycling through `ranks`."""
    import peft
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    paths = []
    templates = {}
    for i in range(n):
        rank = ranks[i % len(ranks)]
        if rank not in templates:
            config = peft.LoraConfig(
                r=rank,
                lora_alpha=2 * rank,
                target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                task_type="CAUSAL_LM",
            )
            templates[rank] = peft.get_peft_model(
                AutoModelForCausalLM.from_pretrained(model), config
            )
        peft_model = templates[rank]
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_" in name:
                    param.copy_(torch.randn_like(param) * 0.02)
        paths.append(folder / f"a{i:03d}-r{rank}")
        peft_model.save_pretrained(paths[-1])
    return paths


@dataclass
class Result:
    name: str
    tokens: int
    seconds: float
    ttft: list[float]
    itl: list[float]

    @property
    def throughput(self) -> float:
        return self.tokens / self.seconds

    def row(self) -> str:
        def pct(values, q):
            return f"{np.percentile(values, q) * 1000:8.1f}" if values else "     n/a"

        return (
            f"{self.name:<20} {self.throughput:10.1f} {pct(self.ttft, 50)} {pct(self.ttft, 99)} "
            f"{pct(self.itl, 50)} {pct(self.itl, 99)}"
        )


async def replay(url: str, trace: list[TraceItem], models: list[str], name: str) -> Result:
    """Send the trace with its arrival times; stream every response."""
    ttft, itl, tokens = [], [], []
    limits = httpx.Limits(max_connections=len(trace) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        start = time.perf_counter()

        async def one(item: TraceItem) -> None:
            await asyncio.sleep(max(0.0, start + item.arrival - time.perf_counter()))
            body = {
                "model": models[item.adapter],
                "prompt": item.prompt,
                "max_tokens": item.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            sent, last, count = time.perf_counter(), None, 0
            async with client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    raise RuntimeError(
                        f"{name}: HTTP {response.status_code}: {await response.aread()}"
                    )
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    n = len(json.loads(line[6:])["choices"])
                    now = time.perf_counter()
                    if last is None:
                        ttft.append(now - sent)
                    else:
                        itl.append(now - last)
                    last, count = now, count + n
            tokens.append(count)

        await asyncio.gather(*(one(item) for item in trace))
        seconds = time.perf_counter() - start
    expected = sum(item.max_tokens for item in trace)
    assert sum(tokens) == expected, f"{name}: got {sum(tokens)} tokens, expected {expected}"
    return Result(name, sum(tokens), seconds, ttft, itl)


def run_server(args, model: str, adapters: list[Path], trace, name: str, use_adapters: bool):
    from symbiont.serve import EngineConfig
    from symbiont.serve.config import ServerConfig
    from symbiont.serve.http.server import BackgroundServer

    engine = EngineConfig(
        max_running=args.max_running,
        max_batched_tokens=args.max_batched_tokens,
        max_queue=len(trace) + 1,
        num_blocks=args.num_blocks,
        max_adapters=max(1, len(adapters)),
        max_lora_rank=max(args.ranks),
    )
    pairs = tuple((f"a{i}", str(p)) for i, p in enumerate(adapters)) if use_adapters else ()
    config = ServerConfig(
        model=model, adapters=pairs, port=0, engine=engine, served_model_name="base"
    )
    models = [f"a{i}" if use_adapters else "base" for i in range(args.adapters)]
    with BackgroundServer(config) as server:
        warm = trace[: min(4, len(trace))]
        asyncio.run(
            replay(
                server.url, [TraceItem(0, w.adapter, w.prompt, 4) for w in warm], models, "warmup"
            )
        )
        return asyncio.run(replay(server.url, trace, models, name))


def run_peft_static(args, model: str, adapters: list[Path], trace) -> Result:
    """Vanilla transformers + peft: mixed-adapter static batches (`adapter_names`)."""
    import peft
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model)
    peft_model = peft.PeftModel.from_pretrained(base, adapters[0], adapter_name="a0")
    for i, path in enumerate(adapters[1:], start=1):
        peft_model.load_adapter(path, adapter_name=f"a{i}")
    peft_model.eval()
    pad = base.generation_config.pad_token_id or 0
    start = time.perf_counter()
    for first in range(0, len(trace), args.static_batch):
        batch = trace[first : first + args.static_batch]
        width = max(len(item.prompt) for item in batch)
        ids = torch.tensor([[pad] * (width - len(i.prompt)) + i.prompt for i in batch])
        mask = torch.tensor([[0] * (width - len(i.prompt)) + [1] * len(i.prompt) for i in batch])
        new = max(item.max_tokens for item in batch)  # static: the batch runs to its longest
        with torch.no_grad():
            peft_model.generate(
                input_ids=ids,
                attention_mask=mask,
                adapter_names=[f"a{item.adapter}" for item in batch],
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=pad,
            )
    seconds = time.perf_counter() - start
    return Result("peft static (b)", sum(item.max_tokens for item in trace), seconds, [], [])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", help="checkpoint folder (default: symbiont.default_model())")
    p.add_argument("--adapters", type=int, default=20, help="number of LoRA adapters (20-100)")
    p.add_argument(
        "--ranks", type=lambda s: [int(x) for x in s.split(",")], default=[8, 16, 32, 64]
    )
    p.add_argument("--zipf", type=float, default=1.0, help="adapter popularity exponent")
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--rate", type=float, default=12.0, help="mean arrivals per second")
    p.add_argument("--prompt-len", type=lambda s: tuple(map(int, s.split(":"))), default=(16, 96))
    p.add_argument("--output-len", type=lambda s: tuple(map(int, s.split(":"))), default=(16, 64))
    p.add_argument("--max-running", type=int, default=32)
    p.add_argument("--max-batched-tokens", type=int, default=512)
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--static-batch", type=int, default=32)
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads (1 is steadiest on shared CPUs)"
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers import AutoConfig

    import symbiont

    model = args.model or str(symbiont.default_model())
    vocab = AutoConfig.from_pretrained(model).vocab_size
    trace = make_trace(args, vocab)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = make_adapters(model, args.adapters, args.ranks, Path(tmp), args.seed)
        used = len({item.adapter for item in trace})
        print(
            f"model {model}\n{args.requests} requests at {args.rate}/s over {args.adapters} "
            f"adapters (ranks {args.ranks}, {used} used), prompts {args.prompt_len}, "
            f"outputs {args.output_len}, {args.threads} threads",
            flush=True,
        )
        results = [
            run_server(args, model, adapters, trace, "symbiont+adapters", use_adapters=True),
            run_server(args, model, [], trace, "symbiont base (a)", use_adapters=False),
            run_peft_static(args, model, adapters, trace),
        ]
    print(
        f"\n{'system':<20} {'tokens/s':>10} {'TTFT p50':>8} {'TTFT p99':>8} {'ITL p50':>8} {'ITL p99':>8}  (ms)"
    )
    for result in results:
        print(result.row())
    ours, base, static = results
    offered = sum(i.max_tokens for i in trace) / max(trace[-1].arrival, 1e-9)
    print(f"\noffered load: {offered:.1f} tokens/s", end="")
    if base.throughput > 0.9 * offered:
        print("  (servers are arrival-bound: raise --rate to compare capacity)", end="")
    print()
    overhead = 1 - ours.throughput / base.throughput
    speedup = ours.throughput / static.throughput
    print(
        f"\nadapter overhead vs base alone (a): {overhead * 100:.1f}% throughput loss (goal < 10%)"
    )
    print(f"speed-up vs vanilla peft static batching (b): {speedup:.2f}x (goal >= 5x)")
    print(
        f"median TTFT ratio (adapters / base): {statistics.median(ours.ttft) / statistics.median(base.ttft):.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
