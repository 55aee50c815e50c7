"""What each served PEFT method costs in a batch, against LoRA of the same rank (issue 14).

One engine (in-process, no HTTP) holds one adapter of every method on all linear layers
(prompt-learning ones: 8 virtual tokens). For each method, --requests requests of that
method alone run to --max-tokens greedy tokens (EOS ignored, so every run makes the same
number); then the same requests spread over every method and the base in one batch
("mixed"), and, as its baseline, spread over as many distinct LoRA adapters of rank 8 (the
LoRA folder loaded under 8 names) and the base ("lora-mixed"). Prints generated tokens per
second and ratios to the LoRA runs measured in the same process (best of --repeats), so a
loaded machine moves them alike.

    python benchmarks/serve_methods.py                 # default model, about a minute
    python benchmarks/serve_methods.py --requests 8 --max-tokens 16
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

RANK = 8
VIRTUAL = 8


def configs() -> dict:
    import peft

    every = "all-linear"
    return {
        "lora": peft.LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=every),
        "adalora": peft.AdaLoraConfig(
            init_r=RANK, target_r=RANK, total_step=10, target_modules=every
        ),
        "vera": peft.VeraConfig(r=RANK, target_modules=every),
        "loha": peft.LoHaConfig(r=2, alpha=4, target_modules=every),  # served at rank 4
        "lokr": peft.LoKrConfig(r=RANK, alpha=RANK, target_modules=every),
        "dora": peft.LoraConfig(r=RANK, lora_alpha=2 * RANK, use_dora=True, target_modules=every),
        "prompt": peft.PromptTuningConfig(num_virtual_tokens=VIRTUAL),
        "prefix": peft.PrefixTuningConfig(num_virtual_tokens=VIRTUAL),
    }


def make_adapters(model: str, folder: Path) -> dict[str, Path]:
    import peft
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    out = {}
    for name, config in configs().items():
        config.task_type = "CAUSAL_LM"
        adapted = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(model), config)
        with torch.no_grad():
            for _, param in adapted.named_parameters():
                if param.requires_grad:
                    param.add_(torch.randn_like(param) * 0.02)
        adapted.save_pretrained(folder / name)
        out[name] = folder / name
    return out


def tokens_per_second(engine, prompts, names, params) -> float:
    start = time.perf_counter()
    outputs = engine.generate(prompts, names, params)
    seconds = time.perf_counter() - start
    return sum(len(o) for o in outputs) / seconds


def main(argv=None) -> int:
    from symbiont.cli.flags import resolve_model
    from symbiont.serve import Engine, EngineConfig, SamplingParams

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="checkpoint folder or 'default'")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(args.threads)
    model = resolve_model(args.model)
    config = EngineConfig(max_running=32, max_batched_tokens=512, block_size=16, num_blocks=512)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = make_adapters(model, Path(tmp))
        engine = Engine.from_pretrained(model, config=config)
        for name, path in adapters.items():
            engine.load_adapter(name, path)
        for i in range(len(adapters)):
            engine.load_adapter(f"lora{i}", adapters["lora"])
        vocab = engine.runner.vocab_size
        g = torch.Generator().manual_seed(0)
        prompts = [
            torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist()
            for _ in range(args.requests)
        ]
        runs = {"base": [None] * args.requests}
        runs |= {name: [name] * args.requests for name in adapters}
        every = [None, *adapters]
        runs["mixed"] = [every[i % len(every)] for i in range(args.requests)]
        loras = [None, *(f"lora{i}" for i in range(len(adapters)))]
        runs["lora-mixed"] = [loras[i % len(loras)] for i in range(args.requests)]
        tokens_per_second(engine, prompts[:2], ["lora", "prefix"], params)  # warm up
        best = {k: 0.0 for k in runs}
        for _ in range(args.repeats):
            for run, names in runs.items():
                best[run] = max(best[run], tokens_per_second(engine, prompts, names, params))
    print(
        f"{args.requests} requests x {args.max_tokens} tokens, prompts of {args.prompt_len}, "
        f"{args.threads} thread(s), best of {args.repeats}"
    )
    print(f"{'run':10} {'tokens/s':>9} {'vs lora':>8}")
    for run, rate in best.items():
        print(f"{run:10} {rate:9.1f} {rate / best['lora']:8.2f}")
    ratio = best["mixed"] / best["lora-mixed"]
    print(f"mixed methods vs as many mixed LoRA adapters: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
