"""torch's products against oneDNN's on the same plain weights, on this CPU (issue 17).

    python benchmarks/onednn_matmul.py
    python benchmarks/onednn_matmul.py --rows 64,256 --threads 2

What `serve-base --matmul onednn` changes (symbiont/base/onednn.py), per layer shape of the
benchmark models (98M: hidden 768, MLP 2048; 443M: hidden 1024, MLP 4096), for each row
count: the forward `x Wᵀ` as `F.linear` (MKL's sgemm on a CPU) against oneDNN's linear on
the same weight, and the backward `grad_y W` as `mm` against oneDNN's linear on the
weight's transposed view. Interleaved round after round, best of --rounds; prints µs,
GFLOP/s and torch / oneDNN (above 1: oneDNN faster), and the largest difference between
the two results relative to the output scale.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402, N812 - torch's own alias

from symbiont.base.onednn import can_use_onednn, onednn_linear  # noqa: E402

SHAPES = (  # (in, out)
    (768, 2304), (768, 768), (768, 4096), (2048, 768),  # 98M: fused q/k/v, o, gate/up, down
    (1024, 3072), (1024, 8192), (4096, 1024),  # 443M
)  # fmt: skip


def mean_us(fn, reps: int) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e6


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rows", default="1,8,64,256", help="row counts (tokens per call)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    if not can_use_onednn("cpu", torch.float32):
        print("SKIP: this torch build has no oneDNN (mkldnn)")
        return 0
    torch.set_num_threads(args.threads)
    rows_list = [int(r) for r in args.rows.split(",")]
    print(
        f"{cpu_name()}, torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), "
        f"{args.threads} thread(s), best of {args.rounds}"
    )
    print(
        "| call | in | out | rows | torch µs | oneDNN µs | torch GFLOP/s | oneDNN GFLOP/s "
        "| torch / oneDNN | max diff / scale |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    g = torch.Generator().manual_seed(0)
    ratios = []
    for n_in, n_out in SHAPES:
        w = torch.randn(n_out, n_in, generator=g) / n_in**0.5
        for rows in rows_list:
            x = torch.randn(rows, n_in, generator=g)
            grad_y = torch.randn(rows, n_out, generator=g)
            flop = 2 * rows * n_in * n_out
            reps = max(3, int(2e8 // flop))
            for call, torch_fn, onednn_fn in (
                ("forward", lambda: F.linear(x, w), lambda: onednn_linear(x, w, None)),  # noqa: B023
                ("backward", lambda: grad_y @ w, lambda: onednn_linear(grad_y, w.t(), None)),  # noqa: B023
            ):
                want, got = torch_fn(), onednn_fn()
                diff = float((got - want).abs().max() / want.abs().max())
                t_us = o_us = float("inf")
                for _ in range(args.rounds):  # in turn, so a changing load hits both alike
                    t_us = min(t_us, mean_us(torch_fn, reps))
                    o_us = min(o_us, mean_us(onednn_fn, reps))
                ratios.append(t_us / o_us)
                print(
                    f"| {call} | {n_in} | {n_out} | {rows} | {t_us:.1f} | {o_us:.1f} | "
                    f"{flop / t_us / 1e3:.0f} | {flop / o_us / 1e3:.0f} | {t_us / o_us:.2f}x "
                    f"| {diff:.1e} |",
                    flush=True,
                )
    ratios.sort()
    print(
        f"\ntorch / oneDNN: median {ratios[len(ratios) // 2]:.2f}x, range {ratios[0]:.2f}-{ratios[-1]:.2f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
