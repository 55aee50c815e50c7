"""Split-execution overhead: vanilla transformers+peft vs symbiont in-process, same model.

Runs a LoRA fine-tuning step loop and a greedy generate loop both ways, interleaving the
two so machine noise hits both alike, and prints the time ratio symbiont / vanilla
(1.00 = no overhead). Usage:

    python benchmarks/split_overhead.py [--hidden 512 --layers 4 --steps 10 --rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import peft
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import symbiont


def build_checkpoint(folder: str, hidden: int, layers: int, vocab: int) -> None:
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)


def with_lora(model):
    torch.manual_seed(1)
    return peft.get_peft_model(model, peft.LoraConfig(r=16, target_modules="all-linear"))


def train_loop(model, batch, steps: int) -> float:
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    model.train()
    start = time.perf_counter()
    for _ in range(steps):
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return time.perf_counter() - start


def generate_loop(model, prompt, new_tokens: int) -> float:
    model.eval()
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(
            prompt,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return time.perf_counter() - start


def per_call_us(module, x, calls: int = 5000) -> float:
    """Mean microseconds of one no-grad call of `module` on `x`."""
    with torch.no_grad():
        for _ in range(200):
            module(x)
        start = time.perf_counter()
        for _ in range(calls):
            module(x)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5, help="training steps per round")
    parser.add_argument("--new-tokens", type=int, default=32, help="generated tokens per round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))

    with tempfile.TemporaryDirectory() as folder:
        build_checkpoint(folder, args.hidden, args.layers, args.vocab)
        vanilla = with_lora(AutoModelForCausalLM.from_pretrained(folder))
        executor = symbiont.BaseExecutor.from_pretrained(folder)
        split = with_lora(symbiont.load_client(folder, executor))
        ids = torch.randint(0, args.vocab, (args.batch, args.seq))
        batch = {"input_ids": ids, "labels": ids}
        prompt = ids[:1, :16]

        one_token = torch.randn(1, 1, args.hidden)
        q_vanilla = vanilla.base_model.model.model.layers[0].self_attn.q_proj.base_layer
        q_split = split.base_model.model.model.layers[0].self_attn.q_proj.base_layer
        per_call = ([], [])

        results = {"train": ([], []), "generate": ([], [])}
        for model in (vanilla, split):  # warm-up: allocator, thread pool, caches
            train_loop(model, batch, 1)
            generate_loop(model, prompt, 4)
        for _ in range(args.rounds):
            for index, model in enumerate((vanilla, split)):
                results["train"][index].append(train_loop(model, batch, args.steps))
                results["generate"][index].append(generate_loop(model, prompt, args.new_tokens))
            per_call[0].append(per_call_us(q_vanilla, one_token))
            per_call[1].append(per_call_us(q_split, one_token))

    print(
        f"model: llama hidden={args.hidden} layers={args.layers} vocab={args.vocab}, LoRA r=16 "
        f"all-linear; train batch {args.batch}x{args.seq}, generate {args.new_tokens} tokens; "
        f"median of {args.rounds} interleaved rounds"
    )
    print(f"{'loop':<10}{'vanilla s':>12}{'symbiont s':>12}{'ratio':>8}")
    for loop, (v, s) in results.items():
        ratio = statistics.median(b / a for a, b in zip(v, s, strict=True))
        print(f"{loop:<10}{statistics.median(v):>12.3f}{statistics.median(s):>12.3f}{ratio:>8.3f}")
    plain, virt = (statistics.median(times) for times in per_call)
    print(
        f"one-token q_proj call: nn.Linear {plain:.1f} us, VirtLayer {virt:.1f} us "
        f"(+{virt - plain:.1f} us per base-layer call)"
    )


if __name__ == "__main__":
    main()
