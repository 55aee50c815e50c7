"""Prefill attention of long chunks: one call against blocks of queries (issue 17).

    python benchmarks/chunk_attention.py                       # kernel, engine on `small`
    python benchmarks/chunk_attention.py --engine-only --model 100m --requests 24

PyTorch's CPU attention kernel works through keys 512 at a time; with a causal mask or
an explicit one it still computes every score of a 512-key block, so a first chunk of up
to 512 tokens spends half its work on scores the mask then drops, and a later chunk
(context, then its own keys) the same on its own keys. `symbiont/serve/attention.py`
runs a chunk of CHUNK_BLOCKS_MIN tokens or more CHUNK_BLOCK queries at a time, each block
over the keys up to its last query (`_chunk_in_blocks`). Two measurements, one thread,
variants interleaved round after round (each figure the fastest of --rounds):

1. Kernel: one layer's attention for chunks of several lengths, with and without context
   before them and with 4 or 12 query heads (head_dim 64), as one SDPA call (is_causal for
   a first chunk, the group's mask for a later one) and in blocks. Prints ms and the ratio.
2. Engine (--model: `small`, `100m`, `500m`, the head_dim-64 Llamas of the vLLM harness
   built into --work, or a Llama checkpoint folder; `none` skips it): requests with prompts of
   --prompt-len tokens and --max-tokens greedy tokens, 16 at a time as users of a closed
   loop send them, through `Engine.step` (no HTTP), with the blocks on and off
   (CHUNK_BLOCKS_MIN set beyond any chunk). Prints seconds in steps that prefill, in
   decode-only steps, and generated tokens per second, with the ratio; the generated
   tokens of both arms must be equal.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks" / "peers"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402, N812 - torch's own alias

from symbiont.serve import attention  # noqa: E402
from symbiont.serve.context import AttnGroup  # noqa: E402

CASES = [  # (chunk length, context before it, query heads, KV heads)
    (128, 0, 4, 2),
    (256, 0, 4, 2),
    (512, 0, 4, 2),
    (640, 0, 4, 2),
    (1024, 0, 4, 2),
    (512, 300, 4, 2),
    (256, 600, 4, 2),
    (512, 0, 12, 12),
    (1024, 0, 12, 12),
    (512, 512, 12, 12),
]


def kernel_case(m: int, start: int, heads: int, kv_heads: int, hd: int = 64):
    g = torch.Generator().manual_seed(m + start)
    width = start + m
    q = torch.randn(1, heads, m, hd, generator=g)
    k, v = (torch.randn(1, kv_heads, width, hd, generator=g) for _ in range(2))
    group = AttnGroup(
        1, m, (0, m), None, None, width, torch.arange(start, width)[None], torch.tensor([width])
    )
    mask = group.mask(None, q.dtype)
    scale = hd**-0.5
    if start == 0:

        def one():
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=True
            )
    else:

        def one():
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scale, enable_gqa=True
            )

    def blocks():
        return attention._chunk_in_blocks(q, k, v, mask, start, scale)

    err = float((one() - blocks()).abs().max())
    return one, blocks, err


def fastest(fn, reps: int) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def run_kernel(rounds: int) -> None:
    print(
        "| chunk | context before | heads | one call ms | blocks ms | one call / blocks | max diff |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for m, start, heads, kv_heads in CASES:
        one, blocks, err = kernel_case(m, start, heads, kv_heads)
        reps = max(2, int(2e8 // (heads * m * (start + m) * 64)))
        one(), blocks()  # warm
        best = {"one": float("inf"), "blocks": float("inf")}
        for _ in range(rounds):
            best["one"] = min(best["one"], fastest(one, reps))
            best["blocks"] = min(best["blocks"], fastest(blocks, reps))
        print(
            f"| {m} | {start} | {heads}/{kv_heads} | {best['one'] * 1e3:.2f} | "
            f"{best['blocks'] * 1e3:.2f} | {best['one'] / best['blocks']:.2f}x | {err:.1e} |",
            flush=True,
        )


def engine_run(engine, args, seed: int) -> tuple[dict, list]:
    from symbiont.decoding import SamplingParams
    from symbiont.serve.sequence import Request

    g = torch.Generator().manual_seed(seed)
    vocab = engine.runner.vocab_size
    lo, hi = args.prompt_len

    def request(i: int):
        n = int(torch.randint(lo, hi + 1, (1,), generator=g))
        prompt = torch.randint(10, vocab, (n,), generator=g).tolist()
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        return Request(f"r{i}", prompt, None, params)

    live = [request(i) for i in range(args.users)]
    sent, done = len(live), []
    for r in live:
        engine.add_request(r)
    times = {"prefill": 0.0, "decode": 0.0}
    while live:
        prefilling = any(s.num_computed < s.prompt_len for r in live for s in r.sequences)
        start = time.perf_counter()
        engine.step()
        times["prefill" if prefilling else "decode"] += time.perf_counter() - start
        for r in [r for r in live if all(s.finished for s in r.sequences)]:
            live.remove(r)
            done.append(r)
            if sent < args.requests:
                live.append(request(sent))
                engine.add_request(live[-1])
                sent += 1
    tokens = [
        list(s.output_ids) for r in sorted(done, key=lambda r: r.request_id) for s in r.sequences
    ]
    return times, tokens


def run_engine(args) -> None:
    from symbiont.serve import EngineConfig
    from symbiont.serve.engine import Engine
    from symbiont.tenant import open_executor

    config = EngineConfig(
        max_running=32, max_batched_tokens=args.max_batched_tokens, max_queue=args.requests
    )
    model = args.model
    if model in ("small", "100m", "500m"):
        from vllm_cpu import sized_checkpoint

        model = str(sized_checkpoint(args.work / f"llama-{model}", model, seed=0))
    engine = Engine.from_pretrained(
        model, config=config, executor=open_executor(model, prepack=True)
    )
    on = attention.CHUNK_BLOCKS_MIN
    arms = {"one call": 1 << 40, "blocks": on}
    engine_run(engine, argparse.Namespace(**{**vars(args), "requests": 4, "users": 4}), 99)
    results = {name: [] for name in arms}
    outputs = {}
    for r in range(args.rounds):
        for name, threshold in arms.items() if r % 2 == 0 else reversed(arms.items()):
            attention.CHUNK_BLOCKS_MIN = threshold
            times, tokens = engine_run(engine, args, seed=r)
            outputs.setdefault(r, []).append(tokens)
            results[name].append(times)
    attention.CHUNK_BLOCKS_MIN = on
    same = all(a == b for a, b in outputs.values())
    n_tokens = args.requests * args.max_tokens
    print(
        f"\nengine: {args.requests} requests, prompts {args.prompt_len[0]}-{args.prompt_len[1]} "
        f"tokens, {args.max_tokens} greedy tokens each, {args.users} users, "
        f"--max-batched-tokens {args.max_batched_tokens}, {args.rounds} rounds (best of each); "
        f"same tokens in both arms: {same}"
    )
    print("| arm | prefill steps s | decode steps s | tokens/s | vs one call |")
    print("|---|---:|---:|---:|---:|")
    best = {
        name: min(runs, key=lambda t: t["prefill"] + t["decode"]) for name, runs in results.items()
    }
    base = best["one call"]["prefill"] + best["one call"]["decode"]
    for name, t in best.items():
        total = t["prefill"] + t["decode"]
        print(
            f"| {name} | {t['prefill']:.2f} | {t['decode']:.2f} | {n_tokens / total:.1f} | "
            f"{base / total:.2f}x |"
        )
    if not same:
        raise SystemExit("the two arms generated different tokens")


def parse_range(text: str) -> tuple[int, int]:
    lo, hi = (int(v) for v in text.split(":"))
    if not 0 < lo <= hi:
        raise argparse.ArgumentTypeError(f"expected LO:HI with 0 < LO <= HI, got {text!r}")
    return lo, hi


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="small", help="small, 100m, 500m, a Llama folder, or none")
    p.add_argument(
        "--work", type=Path, default=REPO / "benchmarks" / "peers" / "results", help="models"
    )
    p.add_argument("--engine-only", action="store_true", help="skip the kernel table")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--users", type=int, default=16, help="requests in flight (closed loop)")
    p.add_argument("--prompt-len", type=parse_range, default=(384, 640))
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-batched-tokens", type=int, default=1024)
    args = p.parse_args(argv)
    if args.engine_only and args.model == "none":
        p.error("--engine-only needs a --model")
    torch.set_num_threads(args.threads)
    if not args.engine_only:
        run_kernel(args.rounds)
    if args.model != "none":
        run_engine(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
