"""What a split product costs on one CPU core per part (session 22): oneDNN on a block of
a weight's rows, of its columns (a strided view), and of x's rows, against the whole
product; a round trip through a thread pool; a product split in two over the calling
thread and a pool thread. One torch thread per thread, fp32, the 98M model's shapes.

    python benchmarks/results/cpu-2026-11-28-s22/split_costs.py
"""

import time
from concurrent.futures import ThreadPoolExecutor

import torch

from symbiont.base.onednn import onednn_linear

torch.set_num_threads(1)
pool = ThreadPoolExecutor(1, initializer=torch.set_num_threads, initargs=(1,))


def us(f, rounds=200):
    for _ in range(10):
        f()
    start = time.perf_counter()
    for _ in range(rounds):
        f()
    return (time.perf_counter() - start) / rounds * 1e6


def split_in_two(x, w):
    half = w.shape[0] // 2
    future = pool.submit(onednn_linear, x, w[half:], None)
    first = onednn_linear(x, w[:half], None)
    return torch.cat([first, future.result()], dim=1)


w, x = torch.randn(768, 768), torch.randn(64, 768)
print(f"[64, 768] x [768, 768]ᵀ whole:            {us(lambda: onednn_linear(x, w, None)):8.0f} µs")
print(
    f"  its first 384 weight rows (contiguous):  {us(lambda: onednn_linear(x, w[:384], None)):8.0f} µs"
)
print(
    f"  grad_y W whole (W's transposed view):    {us(lambda: onednn_linear(x, w.t(), None)):8.0f} µs"
)
print(
    f"  its first 384 columns (strided view):    {us(lambda: onednn_linear(x, w[:, :384].t(), None), 3):8.0f} µs"
)
print(
    f"  the same columns, copied contiguous:     {us(lambda: onednn_linear(x, w[:, :384].t().contiguous(), None)):8.0f} µs"
)
print(
    f"  32 of its 64 rows:                       {us(lambda: onednn_linear(x[:32], w.t(), None)):8.0f} µs"
)
print(f"thread-pool round trip (submit, result):   {us(lambda: pool.submit(int).result()):8.0f} µs")
for out in (768, 2304, 6144):
    w = torch.randn(out, 768)
    whole = us(lambda w=w: onednn_linear(x, w, None))
    split = us(lambda w=w: split_in_two(x, w))
    half = us(lambda w=w, out=out: onednn_linear(x, w[: out // 2], None))
    print(
        f"[64, 768] x [768, {out}]: whole {whole:6.0f} µs, split in two {split:6.0f} µs "
        f"(one half alone {half:6.0f} µs): {whole / split:.2f}x"
    )
