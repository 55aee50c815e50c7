"""Prefill attention of chunks: one SDPA call, SDPA in blocks of queries, and symbiont's
chunk kernel (issue 17).

    python benchmarks/chunk_attention.py                       # kernel table, engine on `small`
    python benchmarks/chunk_attention.py --engine-only --model 100m --requests 24

PyTorch's CPU attention kernel works through keys 512 at a time; with a causal mask or
an explicit one it still computes every score of a 512-key block, so a first chunk of up
to 512 tokens spends half its work on scores the mask then drops. Session 13 ran a chunk
of CHUNK_BLOCKS_MIN tokens or more CHUNK_BLOCK queries at a time, each block over the keys
up to its last query (`_chunk_in_blocks` in symbiont/serve/attention.py: what the engine
does where the chunk kernel does not apply). Session 17 added the chunk kernel
(`DecodeKernel.chunk`, symbiont/kernels/csrc/chunk_attention.cpp), the engine's default on a
CPU in float32. Two measurements, one thread, variants interleaved round after round
(each figure the fastest of --rounds):

1. Kernel: one layer's attention for chunks of several lengths, with and without context
   before them, with 4, 12 or 16 query heads on fewer KV heads: one SDPA call (is_causal
   for a first chunk, the group's mask for a later one), SDPA in blocks, and the chunk
   kernel. Prints ms, the kernel's GFLOP/s (causal multiply-adds only) and ratios.
2. Engine (--model: `small`, `100m`, `500m`, the head_dim-64 Llamas of the vLLM harness
   built into --work, or a Llama checkpoint folder; `none` skips it): requests with prompts
   of --prompt-len tokens and --max-tokens greedy tokens, 16 at a time as users of a
   closed loop send them, through `Engine.step` (no HTTP), with chunks through one SDPA
   call, SDPA in blocks, and the kernel (decode steps through the decode kernel in all
   three). Prints seconds in steps that prefill, in decode-only steps, and generated
   tokens per second, with the ratio, and whether the arms generated the same tokens
   (float32 rounding differs between them, so a near tie may break another way).
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

from symbiont.serve import attention, decode_kernel  # noqa: E402
from symbiont.serve.context import AttnGroup  # noqa: E402

CASES = [  # (chunk length, context before it, query heads, KV heads, head dim)
    (64, 0, 4, 2, 64),
    (128, 0, 4, 2, 64),
    (256, 0, 4, 2, 64),
    (512, 0, 4, 2, 64),
    (1024, 0, 4, 2, 64),
    (512, 300, 4, 2, 64),
    (256, 600, 4, 2, 64),
    (64, 0, 12, 4, 64),
    (512, 0, 12, 4, 64),
    (512, 512, 12, 4, 64),
    (512, 0, 16, 4, 128),
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

    found = decode_kernel.load()
    if found is None:
        raise SystemExit(
            f"the CPU kernels cannot be built here: {decode_kernel.unavailable_reason()}"
        )

    def kernel():  # [m, heads, hd], as the engine takes it
        return found.chunk(q[0], k[0], v[0], start, None, scale)

    want = one()
    err = max(
        float((want - blocks()).abs().max()),
        float((want[0].transpose(0, 1) - kernel()).abs().max()),
    )
    return {"one call": one, "blocks": blocks, "kernel": kernel}, err


def fastest(fn, reps: int) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def run_kernel(rounds: int, max_chunk: int) -> None:
    print(
        "| chunk | context before | heads | head dim | one call ms | blocks ms | kernel ms | "
        "kernel GFLOP/s | blocks / kernel | one call / kernel | max diff |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for m, start, heads, kv_heads, hd in [case for case in CASES if case[0] <= max_chunk]:
        arms, err = kernel_case(m, start, heads, kv_heads, hd)
        reps = max(2, int(2e8 // (heads * m * (start + m) * hd)))
        for fn in arms.values():
            fn()  # warm
        best = dict.fromkeys(arms, float("inf"))
        for _ in range(rounds):
            for name, fn in arms.items():
                best[name] = min(best[name], fastest(fn, reps))
        flops = 4 * heads * hd * (m * start + m * (m + 1) / 2)  # scores and values, causal
        one, blocks, kernel = best["one call"], best["blocks"], best["kernel"]
        print(
            f"| {m} | {start} | {heads}/{kv_heads} | {hd} | {one * 1e3:.2f} | "
            f"{blocks * 1e3:.2f} | {kernel * 1e3:.2f} | {flops / kernel / 1e9:.0f} | "
            f"{blocks / kernel:.2f}x | {one / kernel:.2f}x | {err:.1e} |",
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
        max_running=32,
        max_batched_tokens=args.max_batched_tokens,
        max_queue=max(args.requests, args.users, 4),  # the warm-up sends 4
    )
    model = args.model
    if model in ("small", "100m", "500m"):
        from vllm_cpu import sized_checkpoint

        model = str(sized_checkpoint(args.work / f"llama-{model}", model, seed=0))
    engine = Engine.from_pretrained(
        model, config=config, executor=open_executor(model, prepack=True)
    )
    if engine.runner.decode_kernel is None:
        raise SystemExit(
            f"the CPU kernels cannot be built here: {decode_kernel.unavailable_reason()}"
        )
    on = attention.CHUNK_BLOCKS_MIN
    applies = decode_kernel.DecodeKernel.__dict__["chunk_applies"]  # the staticmethod
    arms = {  # (CHUNK_BLOCKS_MIN, chunk kernel on)
        "one call": (1 << 40, False),
        "blocks": (on, False),
        "kernel": (on, True),
    }
    engine_run(engine, argparse.Namespace(**{**vars(args), "requests": 4, "users": 4}), 99)
    results = {name: [] for name in arms}
    outputs = {}
    try:
        for r in range(args.rounds):
            for name, (threshold, kernel_on) in (
                arms.items() if r % 2 == 0 else reversed(arms.items())
            ):
                attention.CHUNK_BLOCKS_MIN = threshold
                decode_kernel.DecodeKernel.chunk_applies = (
                    applies if kernel_on else staticmethod(lambda *a: False)
                )
                times, tokens = engine_run(engine, args, seed=r)
                outputs.setdefault(r, {})[name] = tokens
                results[name].append(times)
    finally:
        attention.CHUNK_BLOCKS_MIN = on
        decode_kernel.DecodeKernel.chunk_applies = applies
    same = all(len({str(t) for t in arms_out.values()}) == 1 for arms_out in outputs.values())
    n_tokens = args.requests * args.max_tokens
    print(
        f"\nengine: {args.requests} requests, prompts {args.prompt_len[0]}-{args.prompt_len[1]} "
        f"tokens, {args.max_tokens} greedy tokens each, {args.users} users, "
        f"--max-batched-tokens {args.max_batched_tokens}, {args.rounds} rounds (best of each); "
        f"same tokens in every arm: {same}"
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
    p.add_argument(
        "--max-chunk", type=int, default=1 << 20, help="kernel table: chunks up to this long"
    )
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
        run_kernel(args.rounds, args.max_chunk)
    if args.model != "none":
        run_engine(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
