"""A lone client's prefill through serve-base, its products split over two workers or not
(session 22): one forward of a PROMPT-token sequence of the 98M model (what `generate
--executor` or `serve --executor` computes before its first token), through `serve-base
--threads 1 --matmul onednn` with `--workers 1` (every call on the loop's one thread) and
`--workers 2` (a lone client's large calls split over the loop and a worker), taken in
turn, ROUNDS times; the client computes on one thread, as the CLI's do on two cores.

    python benchmarks/results/cpu-2026-11-28-s22/prefill_lone_client.py MODEL_DIR [PROMPT] [ROUNDS]

MODEL_DIR: a checkpoint folder, e.g. the fp32 one multi_finetune.py builds for --model 100m.
"""

import statistics
import sys
import time

import torch

import symbiont
from symbiont.processes import ServerProcess

model_dir = sys.argv[1]
prompt = int(sys.argv[2]) if len(sys.argv) > 2 else 512
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 5
torch.set_num_threads(1)
ids = torch.randint(10, 1000, (1, prompt), generator=torch.Generator().manual_seed(0))
times = {1: [], 2: []}
bases = {
    workers: ServerProcess(
        model_dir, args=("--threads", "1", "--matmul", "onednn", "--workers", str(workers))
    ).start()
    for workers in times
}
try:
    for _ in range(rounds):
        for workers, base in bases.items():  # one client at a time: each base sees it alone
            with symbiont.connect(base.url("tcp"), checkpoint=model_dir) as executor:
                model = symbiont.load_client(model_dir, executor)
                with torch.no_grad():
                    model(ids)  # warm: the shared-memory segment, oneDNN's kernels
                    start = time.perf_counter()
                    model(ids)
                    times[workers].append(time.perf_counter() - start)
finally:
    for base in bases.values():
        base.stop()
one, two = (statistics.median(times[w]) for w in (1, 2))
print(
    f"{prompt}-token prefill, median of {rounds} rounds: --workers 1 {one * 1e3:.0f} ms, "
    f"--workers 2 {two * 1e3:.0f} ms: {one / two:.2f}x"
)
print("rounds (ms):", {w: [round(t * 1e3) for t in ts] for w, ts in times.items()})
