"""Base products of a few rows: MKL (torch's `F.linear`), oneDNN on packed weights, and
symbiont's few-rows kernel (symbiont/kernels/few_rows.py) (issue 17).

    python benchmarks/few_rows.py                              # products, engine on `small`
    python benchmarks/few_rows.py --products-only --working-set 256
    python benchmarks/few_rows.py --engine-only --executor onednn --model 100m

A decode step with one to a few sequences multiplies a few rows by every base weight. On
AMD EPYC, torch sends those to MKL's generic code path (`mkl_blas_def_xsgemv`). Two
measurements, one thread unless --threads, arms interleaved round after round:

1. Products: the layers of the 4.0M-parameter and 97.5M-parameter Llamas of the vLLM
   harness (fused q/k/v, o, fused gate/up, down, lm_head) at 1, 2, 4 and 7 rows. Each arm
   cycles through copies of the weight filling --working-set MB, so the weights come from
   beyond the core's caches as in a real step, not from L2. Prints µs per product (the
   fastest of --rounds), GB/s of weights read, and MKL / kernel and oneDNN / kernel.
2. Engine (--model: `small`, `100m`, `500m`, built as the vLLM harness builds them into
   --work, or a Llama folder; `none` skips it): --batch sequences decode together through
   `Engine.step` (no HTTP) on the executor --executor names: `prepack` (what `symbiont
   serve` runs: packed big layers, small layers plain below their packed copy's rows) or
   `onednn` (what `serve-base --matmul onednn` computes, in-process). Blocks of --steps
   decode steps alternate between the executor with the kernel and without it (torch's
   products instead). Prints ms per step (median over the blocks) and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks" / "peers"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402, N812 - torch's own alias

from symbiont.kernels import library  # noqa: E402
from symbiont.kernels.few_rows import FewRows  # noqa: E402

SHAPES = {  # model -> (name, in, out) of its products
    "small": [("q/k/v", 256, 512), ("o", 256, 256), ("gate/up", 256, 1376), ("down", 688, 256)],
    "100m": [
        ("q/k/v", 768, 2304),
        ("o", 768, 768),
        ("gate/up", 768, 4096),
        ("down", 2048, 768),
        ("lm_head", 768, 8192),
    ],
}
ROWS = (1, 2, 4, 7)


def fastest_per_call(fn, weights: list, rounds: int) -> float:
    """µs per call of fn(w) over the weights, the fastest of `rounds` passes."""
    for w in weights:
        fn(w)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for w in weights:
            fn(w)
        best = min(best, (time.perf_counter() - start) / len(weights))
    return best * 1e6


def run_products(kernel: FewRows, args) -> None:
    print(
        f"\nProducts, {torch.get_num_threads()} thread(s), weights cycling through "
        f"{args.working_set} MB; µs per product (fastest of {args.rounds}), GB/s of weights\n"
    )
    print("| model | layer | in x out | rows | MKL µs | oneDNN packed µs | kernel µs | kernel GB/s "
          "| MKL / kernel | oneDNN / kernel |")  # fmt: skip
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for model, shapes in SHAPES.items():
        for name, width, out in shapes:
            copies = max(2, int(args.working_set * 1e6 / (width * out * 4)))
            weights = [torch.randn(out, width) for _ in range(copies)]
            packed = [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in weights]
            for rows in ROWS:
                x = torch.randn(rows, width)
                times = {"mkl": [], "onednn": [], "kernel": []}
                arms = {
                    "mkl": (lambda w, x=x: F.linear(x, w), weights),
                    "onednn": (
                        lambda w, x=x: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
                        packed,
                    ),
                    "kernel": (lambda w, x=x: kernel(x, w, None), weights),
                }  # fmt: skip
                for r in range(args.rounds):  # interleaved: a drifting machine moves all
                    for arm in list(arms)[r % 3 :] + list(arms)[: r % 3]:
                        fn, ws = arms[arm]
                        times[arm].append(fastest_per_call(fn, ws, 1))
                mkl, onednn, ours = (min(times[a]) for a in ("mkl", "onednn", "kernel"))
                gbs = width * out * 4 / ours / 1e3
                print(
                    f"| {model} | {name} | {width}x{out} | {rows} | {mkl:.1f} | {onednn:.1f} | "
                    f"{ours:.1f} | {gbs:.0f} | {mkl / ours:.2f}x | {onednn / ours:.2f}x |",
                    flush=True,
                )
            del weights, packed


def checkpoint(args) -> str:
    if args.model in ("small", "100m", "500m"):
        from vllm_cpu import sized_checkpoint

        folder = "small-llama" if args.model == "small" else f"llama-{args.model}"
        return str(sized_checkpoint(args.work / folder, args.model, seed=0))
    return args.model


def run_engine(kernel: FewRows, args) -> None:
    from symbiont.serve import EngineConfig, SamplingParams
    from symbiont.serve.engine import Engine
    from symbiont.serve.sequence import Request
    from symbiont.tenant import open_executor

    model = checkpoint(args)
    if args.executor == "prepack":
        executor = open_executor(model, prepack=True)
    else:
        executor = open_executor(model, matmul="onednn")
    print(
        f"\nEngine, {model}, executor {type(executor).__name__}, {torch.get_num_threads()} "
        f"thread(s), blocks of {args.steps} decode steps alternating, {args.rounds} rounds\n"
    )
    print("| sequences | torch's products ms/step | with the kernel ms/step | ratio |")
    print("|---:|---:|---:|---:|")
    for batch in args.batch:
        config = EngineConfig(max_running=batch, max_batched_tokens=1024, max_queue=batch)
        engine = Engine.from_pretrained(model, config=config, executor=executor)
        steps_needed = 2 * args.rounds * args.steps + 8
        params = SamplingParams(temperature=0.0, max_tokens=steps_needed, ignore_eos=True)
        vocab = engine.runner.vocab_size
        for i in range(batch):
            prompt = [(7 * i + j) % (vocab - 10) + 10 for j in range(args.prompt_len)]
            engine.add_request(Request(f"few-rows-{batch}-{i}", prompt, None, params))
        while not all(
            s.num_computed >= s.prompt_len for r in engine.requests.values() for s in r.sequences
        ):
            engine.step()  # prefill
        times = {"torch": [], "kernel": []}
        for r in range(args.rounds):
            for arm in ("torch", "kernel") if r % 2 else ("kernel", "torch"):
                executor.few_rows = kernel if arm == "kernel" else None
                start = time.perf_counter()
                for _ in range(args.steps):
                    engine.step()
                times[arm].append((time.perf_counter() - start) / args.steps * 1e3)
        executor.few_rows = kernel
        base, ours = statistics.median(times["torch"]), statistics.median(times["kernel"])
        print(f"| {batch} | {base:.3f} | {ours:.3f} | {base / ours:.2f}x |", flush=True)
        engine.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="small", help="small, 100m, 500m, a Llama folder, or none")
    p.add_argument(
        "--work", type=Path, default=REPO / "benchmarks" / "peers" / "results", help="models"
    )
    p.add_argument("--executor", choices=("prepack", "onednn"), default="prepack")
    p.add_argument("--products-only", action="store_true", help="skip the engine")
    p.add_argument("--engine-only", action="store_true", help="skip the products table")
    p.add_argument("--working-set", type=int, default=64, help="MB of weights each arm cycles")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--batch", type=lambda s: [int(b) for b in s.split(",")], default=[1, 2, 4],
        help="sequences decoding together, comma-separated",
    )  # fmt: skip
    p.add_argument("--steps", type=int, default=20, help="decode steps per block")
    p.add_argument("--prompt-len", type=int, default=16)
    args = p.parse_args(argv)
    if args.engine_only and args.model == "none":
        p.error("--engine-only needs a --model")
    torch.set_num_threads(args.threads)
    kernel = FewRows.load()
    if kernel is None:
        print(f"SKIP: the CPU kernels cannot be built here: {library.unavailable_reason()}")
        return 0
    if not args.engine_only:
        run_products(kernel, args)
    if args.model != "none" and not args.products_only:
        run_engine(kernel, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
