"""Base weights repacked for oneDNN against the checkpoint's layout (issue 17).

    python benchmarks/prepack.py --model 100m --batch 8 --max-tokens 32 --repeats 3

Two measurements, each pair in the same run, interleaved (repeat r runs plain then packed):

1. Per layer shape: one `F.linear` on the plain `[out, in]` weight against oneDNN's linear
   on the same weight reordered once (`torch.ops.mkldnn._reorder_linear_weight`), at decode
   batch sizes; best of --repeats; the ratio plain / packed (above 1: packing wins). This
   is what chose `MIN_PACKED_WEIGHTS` in symbiont/base/prepack.py.
2. The serving engine (no HTTP) generating --max-tokens greedy tokens for --batch requests
   on --model, with a plain `BaseExecutor`, a `PrepackedExecutor` packing one product per
   big layer (as before session 11), one product per fused q/k/v and gate/up with small
   layers' packed copies used from 8 rows (sessions 11-12), and today's (the copies used
   from 2-8 rows by the product's size, `packed_min_rows`); tokens/s of each, ratios, and
   how many sequences came out token for token the plain ones. Arms take turns in every
   order.

--model: 'default' (the embedded model: every layer under the packing threshold, so the
first two arms run the same code), 'small' (4.0M), '100m' or '500m' (head_dim-64 Llamas
built like benchmarks/peers/vllm_cpu.py's, into --out), or a checkpoint folder. One torch
thread unless --threads.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks" / "peers"))

SHAPES = (  # (in, out): the default model's, then 100m's and 500m's layers
    (64, 64), (64, 176), (256, 688), (512, 512), (512, 1376),
    (768, 768), (768, 256), (768, 2048), (2048, 768), (1280, 3584), (3584, 1280),
)  # fmt: skip


def packed_linear(x, packed):
    import torch

    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def layer_ratios(rows: tuple[int, ...], repeats: int) -> list[tuple[int, int, int, float, float]]:
    """(rows, in, out, plain µs, packed µs) per shape and batch size, best of `repeats`."""
    import torch
    import torch.nn.functional as F  # noqa: N812 - torch's own alias

    out = []
    for n_in, n_out in SHAPES:
        weight = torch.randn(n_out, n_in)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 32)
        for m in rows:
            x = torch.randn(m, n_in)
            calls = max(10, int(5e7 / (m * n_in * n_out)))
            best = {"plain": float("inf"), "packed": float("inf")}
            arms = (
                ("plain", functools.partial(F.linear, x, weight)),
                ("packed", functools.partial(packed_linear, x, packed)),
            )
            for _ in range(repeats):
                for arm, fn in arms:
                    start = time.perf_counter()
                    for _ in range(calls):
                        fn()
                    best[arm] = min(best[arm], (time.perf_counter() - start) / calls)
            out.append((m, n_in, n_out, best["plain"] * 1e6, best["packed"] * 1e6))
    return out


# engine arms: name -> PrepackedExecutor's settings (None: the plain executor)
ENGINE_ARMS = {
    "plain": None,
    "packed per layer": {"min_rows": None, "fuse_siblings": False},  # before session 11
    "packed, copies from 8 rows": {"min_rows": 8},  # sessions 11-12
    "packed": {},  # fused products; small layers' copies from packed_min_rows (2-8) rows
}


def engine_tokens_per_s(model: str, arm: str, args) -> tuple[float, list[list[int]]]:
    import torch

    from symbiont import BaseExecutor, load_client
    from symbiont.base.prepack import PrepackedExecutor
    from symbiont.serve import Engine, EngineConfig, SamplingParams

    executor = BaseExecutor.from_pretrained(model, dtype=torch.float32)
    if ENGINE_ARMS[arm] is not None:
        executor = PrepackedExecutor(executor, **ENGINE_ARMS[arm])
    config = EngineConfig(max_running=args.batch, max_batched_tokens=1024)
    engine = Engine(load_client(model, executor), config)
    g = torch.Generator().manual_seed(0)
    vocab = engine.model.config.vocab_size
    prompts = [torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist()] * args.batch
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    engine.generate(prompts[:1], None, SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
    start = time.perf_counter()
    outputs = engine.generate(prompts, None, params)
    elapsed = time.perf_counter() - start
    return sum(map(len, outputs)) / elapsed, outputs


def resolve_model(name: str, out: Path) -> str:
    import symbiont

    if name == "default":
        return str(symbiont.default_model())
    if name in ("small", "100m", "500m"):
        from vllm_cpu import sized_checkpoint

        return str(sized_checkpoint(out / f"llama-{name}", name, seed=0))
    return name


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="100m", help="default, small, 100m, 500m or a folder")
    parser.add_argument("--batch", type=int, default=8, help="requests decoding together")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rows", default="1,8,32", help="batch sizes of the per-layer part")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "peers" / "results")
    parser.add_argument("--skip-layers", action="store_true", help="only the engine part")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    if not torch.backends.mkldnn.is_available():
        print("SKIP: this torch build has no oneDNN (mkldnn)")
        return 0
    if not args.skip_layers:
        rows = tuple(int(r) for r in args.rows.split(","))
        print("| rows | in | out | weights | plain µs | packed µs | plain / packed |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for m, n_in, n_out, plain, packed in layer_ratios(rows, args.repeats):
            print(
                f"| {m} | {n_in} | {n_out} | {n_in * n_out} | {plain:.1f} | {packed:.1f} "
                f"| {plain / packed:.2f}x |"
            )
    model = resolve_model(args.model, args.out)
    rates: dict[str, list[float]] = {arm: [] for arm in ENGINE_ARMS}
    outputs: dict[str, list] = {}
    for repeat in range(args.repeats):
        arms = list(ENGINE_ARMS)
        for arm in arms[repeat % len(arms) :] + arms[: repeat % len(arms)]:  # each order
            rate, outputs[arm] = engine_tokens_per_s(model, arm, args)
            rates[arm].append(rate)
    best = {arm: max(r) for arm, r in rates.items()}
    print(
        f"\nengine on {model}: {args.batch} requests x {args.max_tokens} tokens, "
        f"{args.threads} thread(s), best of {args.repeats}:"
    )
    for arm, rate in best.items():
        same = sum(a == b for a, b in zip(outputs["plain"], outputs[arm], strict=True))
        print(
            f"  {arm}: {rate:.1f} tokens/s, {rate / best['plain']:.2f}x plain; "
            f"{same}/{len(outputs[arm])} sequences token for token the plain ones"
        )
    print(f"  packed / packed per layer: {best['packed'] / best['packed per layer']:.2f}x")
    print(
        f"  packed / copies from 8 rows: {best['packed'] / best['packed, copies from 8 rows']:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
