"""GFLOP/s of one torch thread's fp32 products of M rows by the 100m model's weight shapes
([768 or 3072, 768], 40 distinct weights so that they stream from memory), 5 passes.
Run alone, then two or four copies at once: `python gemm_rows.py M`."""

import sys
import time

import torch

torch.set_num_threads(1)
rows = int(sys.argv[1])
weights = [torch.randn(768 * 4 if i % 2 else 768, 768) for i in range(40)]
x = torch.randn(rows, 768)
for w in weights:  # warm-up
    torch.nn.functional.linear(x, w)
start = time.perf_counter()
for _ in range(5):
    for w in weights:
        torch.nn.functional.linear(x, w)
seconds = time.perf_counter() - start
flops = sum(2 * rows * w.shape[0] * w.shape[1] for w in weights) * 5
print(f"M={rows} {flops / seconds / 1e9:.1f} GFLOP/s")
