"""What it costs two processes to take turns on one GPU.

A client on the executor's GPU and the executor take turns at every call: the client
copies x into the shared area and syncs, the executor sees the call, runs the layer and
syncs, the client copies y out. Session 12 measured about 400 µs per call more than
in-process, whatever the call's size (BENCHMARKS.md, "On a GPU"). This isolates the
turn-taking from symbiont: two sides hand a turn back and forth through a counter in
host shared memory, each launching one tiny kernel and syncing in its turn.

  alone        one process takes both turns (the floor: two launches and two syncs)
  cpu peer     two processes, only one of them on the GPU (the host hand-off)
  gpu peer     two processes, both on the GPU (what a CUDA IPC call does)

It prints µs per exchange (both turns). Run it once as is and once under MPS
(`nvidia-cuda-mps-control -d` first): if the "gpu peer" row drops to the "cpu peer"
row, the gap is the GPU switching between two processes' contexts.

    python benchmarks/gpu_process_switch.py [--exchanges 5000]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from multiprocessing import shared_memory

import numpy as np
import torch


def _wait_for(counter: np.ndarray, value: int, peer=None) -> None:
    """Spin until the counter reads `value` (raises if the peer process died meanwhile)."""
    spins = 0
    while counter[0] != value:
        spins += 1
        if peer is not None and spins % 100_000 == 0 and not peer.is_alive():
            raise SystemExit(f"the peer process exited ({peer.exitcode}) before its turn")


def _peer(name: str, exchanges: int, on_gpu: bool) -> None:
    """The second side: takes every odd turn."""
    memory = shared_memory.SharedMemory(name=name)
    counter = np.ndarray((1,), dtype=np.int64, buffer=memory.buf)
    x = torch.zeros(16, device="cuda") if on_gpu else None
    if on_gpu:
        torch.cuda.synchronize()
    counter[0] = -1  # ready
    for turn in range(1, 2 * exchanges, 2):
        _wait_for(counter, turn)
        if on_gpu:
            x.add_(1)
            torch.cuda.synchronize()
        counter[0] = turn + 1
    del counter
    memory.close()


def alone(exchanges: int) -> float:
    x = torch.zeros(16, device="cuda")
    y = torch.zeros(16, device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(exchanges):
        x.add_(1)
        torch.cuda.synchronize()
        y.add_(1)
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / exchanges


def with_peer(exchanges: int, peer_on_gpu: bool) -> float:
    memory = shared_memory.SharedMemory(create=True, size=8)
    counter = np.ndarray((1,), dtype=np.int64, buffer=memory.buf)
    counter[0] = 0
    process = mp.get_context("spawn").Process(
        target=_peer, args=(memory.name, exchanges, peer_on_gpu)
    )
    process.start()
    x = torch.zeros(16, device="cuda")
    torch.cuda.synchronize()
    _wait_for(counter, -1, process)
    counter[0] = 0
    start = time.perf_counter()
    for turn in range(0, 2 * exchanges, 2):
        _wait_for(counter, turn, process)
        x.add_(1)
        torch.cuda.synchronize()
        counter[0] = turn + 1
    _wait_for(counter, 2 * exchanges, process)
    seconds = (time.perf_counter() - start) / exchanges
    process.join()
    del counter
    memory.close()
    memory.unlink()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--exchanges", type=int, default=5000)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this needs a CUDA GPU (and a torch build with CUDA)")
    print(f"{torch.cuda.get_device_name()}, {args.exchanges} exchanges, µs per exchange")
    alone(200)  # warm up: the context, the kernel
    rows = [
        ("alone", lambda: alone(args.exchanges)),
        ("cpu peer", lambda: with_peer(args.exchanges, peer_on_gpu=False)),
        ("gpu peer", lambda: with_peer(args.exchanges, peer_on_gpu=True)),
    ]
    for name, run in rows:
        print(f"{name:<10} {run() * 1e6:9.1f}")


if __name__ == "__main__":
    main()
