"""What serving 100 mixed-rank LoRA adapters costs against the base alone (issue 17).

    python benchmarks/adapter_overhead.py                  # ~100M Llama, about 3 minutes
    python benchmarks/adapter_overhead.py --targets all --requests 32 --repeats 2

One process, one base executor shared by every engine (in-process, no HTTP), on a Llama
built from config (98.6M parameters: hidden 768, 12 layers, 12 heads, MLP 2048, vocab
8192; random weights, built once into --work). --adapters LoRA adapters are written into
--work, ranks cycling through --ranks, on the attention projections (q/k/v/o, as the vLLM
harness uses) or, with --targets all, on every linear layer of the decoder.

The same trace (--requests prompts of random token ids, lengths drawn from --prompt-len,
--max-tokens greedy tokens each, EOS ignored) is submitted at once, so the engine keeps
--max-running sequences in flight (a closed loop with no think time). Request i uses
adapter perm[i % adapters] for a seeded permutation, so every batch mixes as many distinct
adapters as it has sequences: the worst case for grouping rows by adapter (--zipf S draws
adapters with Zipf popularity instead, as benchmarks/serve.py does). Runs, each
--repeats times, interleaved so a loaded machine moves them alike:

  base               an engine with no adapter loaded
  base rows          the adapters' engine, every request on the base (no adapter math)
  100 resident       every adapter resident in a slot (--max-loras = --adapters): the
                     cost of the adapter math, not of loading
  cache N            --adapter-dir with --max-loras N below the working set: adapters come
                     from the host tier into N slots as requests need them (--cache-slots,
                     0 skips it)
  100 resident, torch rows
                     (--rows-ab) the resident run with decoding tokens' LoRA through
                     PyTorch's embedding_bag, not symbiont's CPU kernel (lora_rows.cpp):
                     an engine of its own, loaded as where the kernel cannot be built
                     (B in rows, as embedding_bag reads it)

Prints generated tokens per CPU second of the process (prefill included; with one torch
thread, CPU time is what the work cost, and it moves far less than wall time when other
jobs share the cores), the same per wall second, the median decode-only step's CPU time,
and the ratios to "base" from the same repeat (median over repeats). --breakdown adds
where the adapters' run spends its CPU time: the base calls inside adapter layers, the
adapter math around them, and the per-step adapter metadata (`adapter_batch`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LLAMA_100M = dict(
    vocab_size=8192, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
    num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=1024,
    tie_word_embeddings=False,
)  # fmt: skip
TARGETS = {
    "attn": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "all": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}


def build_checkpoint(folder: Path) -> Path:
    """The ~100M Llama (random weights, seed 0) with the default model's tokenizer (its
    2048 ids fit the 8192-token vocabulary), built once."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    import symbiont

    if not (folder / "config.json").is_file():
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**LLAMA_100M)).save_pretrained(folder)
        AutoTokenizer.from_pretrained(symbiont.default_model()).save_pretrained(folder)
    return folder


def build_adapters(model: Path, folder: Path, n: int, ranks: list[int], targets: str) -> list[Path]:
    """n LoRA adapters, rank ranks[i % len(ranks)], random A and B (std 0.02), alpha 2r;
    written once (a folder per adapter, named by index, rank and targets)."""
    import peft
    from transformers import AutoModelForCausalLM

    paths = [folder / f"a{i:03d}-r{ranks[i % len(ranks)]}-{targets}" for i in range(n)]
    missing = [i for i, p in enumerate(paths) if not (p / "adapter_config.json").is_file()]
    if not missing:
        return paths
    base = AutoModelForCausalLM.from_pretrained(model)
    by_rank = defaultdict(list)
    for i in missing:
        by_rank[ranks[i % len(ranks)]].append(i)
    for rank, indices in by_rank.items():
        config = peft.LoraConfig(
            r=rank, lora_alpha=2 * rank, target_modules=TARGETS[targets], task_type="CAUSAL_LM"
        )
        adapted = peft.get_peft_model(base, config)
        for i in indices:
            gen = torch.Generator().manual_seed(1000 + i)
            with torch.no_grad():
                for name, param in adapted.named_parameters():
                    if "lora_" in name:
                        param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
            adapted.save_pretrained(paths[i])
        base = adapted.unload()  # the plain model back, for the next rank
    return paths


class StepTimer:
    """CPU time of every `Engine.step` (this thread's: other processes on a loaded
    machine do not count), and whether it only decoded (one token per scheduled
    sequence), read from what the runner prepared."""

    def __init__(self, engine):
        self.decode_steps: list[tuple[float, int]] = []  # (CPU seconds, sequences)
        self._decode_only, self._batch = False, 0
        prepare, step = engine.runner.prepare, engine.step

        def timed_prepare(scheduled):
            self._decode_only = all(item.n_tokens == 1 for item in scheduled)
            self._batch = len(scheduled)
            return prepare(scheduled)

        def timed_step():
            self._decode_only = False
            start = time.thread_time()
            out = step()
            if self._decode_only:
                self.decode_steps.append((time.thread_time() - start, self._batch))
            return out

        engine.runner.prepare, engine.step = timed_prepare, timed_step

    def reset(self) -> None:
        self.decode_steps.clear()

    def median_ms(self) -> float:
        return 1000 * statistics.median(s for s, _ in self.decode_steps)

    def median_batch(self) -> float:
        return statistics.median(b for _, b in self.decode_steps)


class Breakdown:
    """CPU time inside `AdapterLayer.forward`, inside its base calls, and in
    `adapter_batch`, while `active` (the adapter math is the layer's time less its
    base's)."""

    def __init__(self, engine):
        import symbiont.serve.model_runner as runner_module
        from symbiont.serve.adapters import AdapterLayer

        self.total = defaultdict(float)
        self.active = False
        self.steps = 0
        for module in engine.model.modules():
            if isinstance(module, AdapterLayer):
                module.forward = self._wrap("adapter layers", module.forward)
                module.base.forward = self._wrap("base inside adapter layers", module.base.forward)
        runner_module.adapter_batch = self._wrap("adapter_batch", runner_module.adapter_batch)
        engine.runner.forward = self._wrap("forward", engine.runner.forward)

    def _wrap(self, name, fn):
        def timed(*args, **kw):
            if not self.active:
                return fn(*args, **kw)
            start = time.thread_time()
            try:
                return fn(*args, **kw)
            finally:
                self.total[name] += time.thread_time() - start

        return timed


def make_trace(args, vocab: int, n_adapters: int):
    gen = torch.Generator().manual_seed(args.seed)
    lo, hi = args.prompt_len
    lengths = torch.randint(lo, hi + 1, (args.requests,), generator=gen).tolist()
    prompts = [torch.randint(10, vocab, (n,), generator=gen).tolist() for n in lengths]
    order = torch.randperm(n_adapters, generator=gen).tolist()
    if not args.zipf:
        return prompts, [order[i % n_adapters] for i in range(args.requests)]
    popularity = 1.0 / torch.arange(1, n_adapters + 1, dtype=torch.float64) ** args.zipf
    picks = torch.multinomial(popularity, args.requests, replacement=True, generator=gen)
    return prompts, [order[i] for i in picks.tolist()]


def run(engine, prompts, names, params, timer: StepTimer) -> tuple[float, float, float, float]:
    """-> (generated tokens per CPU second, median decode-only step CPU ms, median decode
    batch, generated tokens per wall second). CPU time is the process's (the cache's
    loader threads count): on a shared machine it moves far less than wall time."""
    timer.reset()
    start, cpu = time.perf_counter(), time.process_time()
    outputs = engine.generate(prompts, names, params)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    tokens = sum(len(o) for o in outputs)
    assert tokens == len(prompts) * params.max_tokens, "EOS is ignored: every request runs out"
    return tokens / cpu_seconds, timer.median_ms(), timer.median_batch(), tokens / seconds


def _resident_engine(model, executor, limits: dict, args, paths):
    """An engine with every adapter resident in a slot."""
    from symbiont.serve import Engine, EngineConfig

    config = EngineConfig(**limits, max_adapters=args.adapters, lora_dtype=args.lora_dtype)
    engine = Engine.from_pretrained(model, executor=executor, config=config)
    for path in paths:
        engine.load_adapter(path.name, path)
    return engine


def without_rows_kernel(work):
    """`work()` as where symbiont's CPU kernels cannot be built."""
    from symbiont.serve import adapters

    kernel = adapters.rows_kernel
    adapters.rows_kernel = lambda: None
    try:
        return work()
    finally:
        adapters.rows_kernel = kernel


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--work", type=Path, default=Path("/tmp/symbiont-adapter-overhead"))
    p.add_argument("--adapters", type=int, default=100)
    p.add_argument(
        "--ranks", type=lambda s: [int(x) for x in s.split(",")], default=[8, 16, 32, 64]
    )
    p.add_argument("--targets", choices=sorted(TARGETS), default="attn")
    p.add_argument(
        "--zipf",
        type=float,
        default=0.0,
        help="adapter popularity exponent (0: each adapter in turn, as distinct as can be)",
    )
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-len", type=lambda s: tuple(map(int, s.split(":"))), default=(16, 64))
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-running", type=int, default=32)
    p.add_argument("--max-batched-tokens", type=int, default=512)
    p.add_argument("--cache-slots", type=int, default=16, help="--max-loras of the cache run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--breakdown", action="store_true", help="time the adapter path too")
    p.add_argument(
        "--prepack",
        action="store_true",
        help="base weights in oneDNN's layout, as `symbiont serve` holds them by default "
        "(a faster base: the same adapter math weighs more against it)",
    )
    p.add_argument(
        "--rows-ab",
        action="store_true",
        help="one more run: the resident adapters with tokens' LoRA rows through PyTorch's "
        "embedding_bag instead of symbiont's CPU kernel (what the engine did before it)",
    )
    p.add_argument(
        "--lora-dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="the adapters' engines hold LoRA weights in this dtype (`symbiont serve "
        "--lora-dtype`; the adapters here are saved in float32, so bfloat16 rounds them: "
        "a timing, not an exactness, comparison)",
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from symbiont.decoding import SamplingParams
    from symbiont.serve import Engine, EngineConfig
    from symbiont.tenant import open_executor

    model = build_checkpoint(args.work / "llama-100m")
    t0 = time.perf_counter()
    # one folder per adapter under adapter_dir: the resident engine loads them by path,
    # the cache engine serves the folder as --adapter-dir (by folder name)
    adapter_dir = args.work / f"adapters-{args.adapters}-{args.targets}"
    paths = build_adapters(model, adapter_dir, args.adapters, args.ranks, args.targets)
    print(f"adapters ready in {time.perf_counter() - t0:.0f} s", flush=True)

    blocks = args.max_running * -(-(args.prompt_len[1] + args.max_tokens) // 16) + 16
    limits = dict(
        max_running=args.max_running,
        max_batched_tokens=args.max_batched_tokens,
        max_queue=args.requests + 1,
        num_blocks=blocks,
        max_lora_rank=max(args.ranks),
    )
    executor = open_executor(model, prepack=args.prepack)
    engines = {
        "base": Engine.from_pretrained(model, executor=executor, config=EngineConfig(**limits))
    }
    lora = _resident_engine(model, executor, limits, args, paths)
    engines["base rows"] = engines[f"{args.adapters} resident"] = lora
    torch_rows = f"{args.adapters} resident, torch rows"
    if args.rows_ab:
        engines[torch_rows] = without_rows_kernel(
            lambda: _resident_engine(model, executor, limits, args, paths)
        )
    if args.cache_slots:
        cache_config = EngineConfig(
            **limits, max_adapters=args.cache_slots, lora_dtype=args.lora_dtype
        )
        cache = Engine.from_pretrained(model, executor=executor, config=cache_config)
        cache.attach_adapter_dir(adapter_dir)
        engines[f"cache {args.cache_slots}"] = cache
    timers = {id(e): StepTimer(e) for e in set(engines.values())}

    vocab = lora.runner.vocab_size
    prompts, picks = make_trace(args, vocab, args.adapters)
    names = {run_name: [paths[i].name for i in picks] for run_name in engines}
    names["base"] = names["base rows"] = [None] * args.requests

    def run_as(run_name, *run_args):
        """`run`, with the LoRA rows kernel off for the torch-rows run."""
        if run_name == torch_rows:
            return without_rows_kernel(lambda: run(*run_args))
        return run(*run_args)

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    print(
        f"model {model} (98.6M), {args.adapters} LoRA adapters ranks {args.ranks} on "
        f"{'/'.join(TARGETS[args.targets])}, {args.requests} requests x {args.max_tokens} tokens, "
        f"prompts {args.prompt_len[0]}-{args.prompt_len[1]}, {args.max_running} running, "
        f"{args.threads} thread(s), {args.repeats} repeats, LoRA weights held in "
        f"{args.lora_dtype or 'the model dtype'}",
        flush=True,
    )
    for run_name, engine in engines.items():  # warm-up: first calls, the cache's host tier
        run_as(run_name, engine, prompts[: args.max_running], names[run_name][: args.max_running],
            SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
            timers[id(engine)])  # fmt: skip
    results = defaultdict(list)  # run -> [(tokens/CPU s, step CPU ms, batch, tokens/s)]
    for repeat in range(args.repeats):
        for run_name, engine in engines.items():
            results[run_name].append(
                run_as(run_name, engine, prompts, names[run_name], params, timers[id(engine)])
            )
            rate, step, batch, wall = results[run_name][-1]
            print(f"  repeat {repeat}: {run_name:<14} {rate:7.1f} tok/CPU-s {wall:7.1f} tok/s"
                  f"  decode step {step:6.1f} CPU ms (batch {batch:.0f})", flush=True)  # fmt: skip

    def median_ratio(run_name: str, field: int) -> float:
        pairs = zip(results[run_name], results["base"], strict=True)
        return statistics.median(mine[field] / base[field] for mine, base in pairs)

    def median(run_name: str, field: int) -> float:
        return statistics.median(r[field] for r in results[run_name])

    print(
        "\n| run | tokens per CPU s | vs base | decode step CPU ms | vs base | decode batch "
        "| tokens per wall s | vs base |\n|---|---:|---:|---:|---:|---:|---:|---:|"
    )
    for run_name in engines:
        print(
            f"| {run_name} | {median(run_name, 0):.1f} | {median_ratio(run_name, 0):.3f} "
            f"| {median(run_name, 1):.1f} | {median_ratio(run_name, 1):.3f} "
            f"| {median(run_name, 2):.0f} | {median(run_name, 3):.1f} "
            f"| {median_ratio(run_name, 3):.3f} |"
        )
    resident = f"{args.adapters} resident"
    cost, wall_cost = 1 - median_ratio(resident, 0), 1 - median_ratio(resident, 3)
    print(
        f"\n{resident}: throughput {100 * cost:.1f}% below base only per CPU second "
        f"({100 * wall_cost:.1f}% per wall second; target <= 10%)"
    )

    if args.breakdown:
        breakdown = Breakdown(lora)
        timer = timers[id(lora)]
        breakdown.active = True
        run(lora, prompts, names[resident], params, timer)
        breakdown.active = False
        total = breakdown.total
        math = total["adapter layers"] - total["base inside adapter layers"]
        print(f"\nwhere the {resident} run's CPU time goes (one more run):")
        for name, seconds in (
            ("forward", total["forward"]),
            ("  base calls inside adapter layers", total["base inside adapter layers"]),
            ("  adapter math in adapter layers", math),
            ("adapter_batch (per-step metadata)", total["adapter_batch"]),
        ):
            print(f"  {name:<38} {seconds:7.2f} s {100 * seconds / total['forward']:5.1f}%")
    for engine in set(engines.values()):
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
