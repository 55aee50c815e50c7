"""LoRA rows of a decode step: symbiont's CPU kernel against PyTorch's embedding_bag.

A decode step of 32 sequences, each on another adapter, must read every one's A and B in
every adapted layer. This builds `--layers` AdapterLayers of the 98.6M Llama's attention
width (768) with 100 resident LoRA adapters (ranks 8, 16, 32, 64 in turn, as
benchmarks/adapter_overhead.py does) and times the adapter math of one step: every
layer's LoRA rows for `--tokens` tokens on distinct adapters (the base product is left
out). The arms alternate, `--rounds` times, in one process:

  kernel          symbiont/kernels/lora_rows.py (what the engine uses on a CPU in float32),
                  B in the kernel's blocks of 8 x 8
  embedding_bag   the same rows through PyTorch's two embedding_bags (its fallback), from
                  layers holding the same weights with B in rows, as it reads them

Both read stacks on huge pages unless --small-pages (symbiont/util/memory.py).
It prints each arm's fastest round, the bytes of A and B the step must read and the rate
that makes, and the ratio embedding_bag / kernel.

    python benchmarks/lora_rows.py [--tokens 32] [--layers 48] [--rounds 5] [--small-pages]
                                   [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from symbiont.serve import adapters  # noqa: E402
from symbiont.serve.adapters import (  # noqa: E402
    RANK_CHUNK,
    AdapterLayer,
    LoraWeights,
    adapter_batch,
    bucket_rank,
)
from symbiont.serve.context import use_context  # noqa: E402
from symbiont.util import memory  # noqa: E402


class NoBase(torch.nn.Module):
    """A base layer whose product is left out: zeros [n, out]."""

    def __init__(self, out_features: int):
        super().__init__()
        self.out_features = out_features
        self.weight = torch.nn.Parameter(torch.zeros(1), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(x.shape[0], self.out_features)


def build(args, block_b: bool) -> tuple[list[AdapterLayer], SimpleNamespace]:
    slots = args.adapters + 1
    registry = SimpleNamespace(
        slot_bucket=[0] * slots, slot_is_ia3=[False] * slots, slot_is_dora=[False] * slots
    )
    layers = []
    g = torch.Generator().manual_seed(0)
    for _ in range(args.layers):
        dtype = getattr(torch, args.dtype)
        layer = AdapterLayer(NoBase(args.width), args.width, args.width, slots, dtype)
        layer.block_b = block_b
        for s in range(1, slots):
            r = args.ranks[(s - 1) % len(args.ranks)]
            a, b = torch.randn(r, args.width, generator=g), torch.randn(args.width, r, generator=g)
            layer.put(s, LoraWeights(a * 0.02, b * 0.02, 2.0), max(args.ranks))
            registry.slot_bucket[s] = bucket_rank(r, max(args.ranks))
        layers.append(layer)
    return layers, registry


def step(layers, batch, x) -> None:
    with torch.no_grad(), use_context(SimpleNamespace(adapters=batch)):
        for layer in layers:
            layer(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=32, help="decoding sequences")
    parser.add_argument("--layers", type=int, default=48, help="adapted layers (12 x q/k/v/o)")
    parser.add_argument("--adapters", type=int, default=100)
    parser.add_argument(
        "--ranks", type=lambda s: [int(r) for r in s.split(",")], default=[8, 16, 32, 64]
    )
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--small-pages", action="store_true", help="stacks on 4 KiB pages")
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default="float32", help="of the stacks"
    )
    args = parser.parse_args()
    if args.tokens > args.adapters:
        raise SystemExit("--tokens must be at most --adapters (each token on its own adapter)")
    torch.set_num_threads(args.threads)
    kernel = adapters.rows_kernel()
    if kernel is None:
        from symbiont.kernels import library

        raise SystemExit(f"the CPU kernels cannot be built here: {library.unavailable_reason()}")
    if args.small_pages:
        memory.zeros = lambda *shape, dtype, device="cpu": torch.zeros(
            *shape, dtype=dtype, device=device
        )
    layers = {"kernel": build(args, block_b=True)[0]}
    layers["embedding_bag"], registry = build(args, block_b=False)
    assert layers["kernel"][0].b_blocked and not layers["embedding_bag"][0].b_blocked
    g = torch.Generator().manual_seed(1)
    token_slots = torch.randperm(args.adapters, generator=g)[: args.tokens] + 1
    batch = adapter_batch(token_slots, registry)
    x = torch.randn(args.tokens, args.width, generator=g)
    ranks = [registry.slot_bucket[s] for s in token_slots.tolist()]
    chunks = sum(-(-r // RANK_CHUNK) * RANK_CHUNK for r in ranks)  # Aᵀ is read in whole chunks
    nbytes = args.layers * (chunks + sum(ranks)) * args.width * getattr(torch, args.dtype).itemsize
    arms = {"kernel": kernel, "embedding_bag": None}
    best = dict.fromkeys(arms, float("inf"))
    results = {}
    for _ in range(args.rounds):
        for name, chosen in arms.items():
            adapters.rows_kernel = lambda chosen=chosen: chosen
            step(layers[name], batch, x)  # warm: the plan, the first touch
            start = time.perf_counter()
            step(layers[name], batch, x)
            best[name] = min(best[name], time.perf_counter() - start)
    for name, chosen in arms.items():
        adapters.rows_kernel = lambda chosen=chosen: chosen
        with torch.no_grad(), use_context(SimpleNamespace(adapters=batch)):
            results[name] = layers[name][0](x)
    gap = (results["kernel"] - results["embedding_bag"]).abs().max().item()
    pages = "4 KiB pages" if args.small_pages else "huge pages where Linux gives them"
    print(
        f"{args.tokens} tokens on distinct adapters (ranks {args.ranks}), {args.layers} layers "
        f"{args.width}x{args.width}, {args.threads} thread(s), {args.dtype} stacks on {pages}; "
        "a step reads "
        f"{nbytes / 1e6:.0f} MB of A and B; fastest of {args.rounds} rounds"
    )
    for name in arms:
        print(f"  {name:<14} {best[name] * 1e3:7.2f} ms  {nbytes / best[name] / 1e9:5.1f} GB/s")
    print(f"embedding_bag / kernel: {best['embedding_bag'] / best['kernel']:.2f}x "
          f"(largest difference of one layer's outputs: {gap:.1e})")  # fmt: skip


if __name__ == "__main__":
    main()
