"""Round trip between two processes that sleep between messages, by wake-up mechanism:
what a shared-memory call costs `serve-base` and a client when neither may spin.

- `zmq`: a message each way over a ZeroMQ IPC socket (PAIR), what a RING doorbell was:
  each message passes the sender's and the receiver's ZeroMQ I/O threads.
- `pipe`: a byte each way through a pipe (how a client now wakes the executor).
- `futex`: a futex wake each way on a shared-memory segment's control block (how the
  executor now wakes a client), via `symbiont.protocol.shm.Segment`.

    python benchmarks/wakeups.py [--trips 4000] [--busy 0|1]

`--busy 1` runs a process spinning on a core meanwhile (cores taken, as when workers
compute). Prints microseconds per round trip and each mechanism against `zmq`.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from symbiont.protocol import shm  # noqa: E402

SLOT_PING, SLOT_PONG = shm.REQ_SEQ, shm.RESP_SEQ


def _zmq_peer(url: str, trips: int) -> None:
    import zmq

    sock = zmq.Context().socket(zmq.PAIR)
    sock.connect(url)
    for _ in range(trips):
        sock.send(sock.recv())


def zmq_round_trip(trips: int) -> float:
    import zmq

    url = f"ipc://{tempfile.mkdtemp()}/wakeups.sock"
    sock = zmq.Context().socket(zmq.PAIR)
    sock.bind(url)
    peer = mp.Process(target=_zmq_peer, args=(url, trips + 1))
    peer.start()
    sock.send(b"x")
    sock.recv()
    started = time.perf_counter()
    for _ in range(trips):
        sock.send(b"x")
        sock.recv()
    seconds = time.perf_counter() - started
    peer.join()
    return seconds / trips


def _pipe_peer(ping: int, pong: int, trips: int) -> None:
    for _ in range(trips):
        os.read(ping, 1)
        os.write(pong, b"x")


def pipe_round_trip(trips: int) -> float:
    ping_r, ping_w = os.pipe()
    pong_r, pong_w = os.pipe()
    peer = mp.Process(target=_pipe_peer, args=(ping_r, pong_w, trips + 1))
    peer.start()
    os.write(ping_w, b"x")
    os.read(pong_r, 1)
    started = time.perf_counter()
    for _ in range(trips):
        os.write(ping_w, b"x")
        os.read(pong_r, 1)
    seconds = time.perf_counter() - started
    peer.join()
    return seconds / trips


def _futex_peer(path: str, trips: int) -> None:
    segment = shm.Segment.open(path, 4096)
    ctrl = segment.ctrl
    for seq in range(1, trips + 1):
        while (seen := ctrl[SLOT_PING]) != seq:
            segment.sleep_on(SLOT_PING, seen, 0.05)
        ctrl[SLOT_PONG] = seq
        segment.wake(SLOT_PONG)


def futex_round_trip(trips: int) -> float:
    segment = shm.Segment.create(4096)
    ctrl = segment.ctrl
    peer = mp.Process(target=_futex_peer, args=(segment.path, trips + 1))
    peer.start()
    started = 0.0
    for seq in range(1, trips + 2):
        if seq == 2:
            started = time.perf_counter()
        ctrl[SLOT_PING] = seq
        segment.wake(SLOT_PING)
        while (seen := ctrl[SLOT_PONG]) != seq:
            segment.sleep_on(SLOT_PONG, seen, 0.05)
    seconds = time.perf_counter() - started
    peer.join()
    segment.close()
    return seconds / trips


def _spin() -> None:
    while True:
        pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trips", type=int, default=4000, help="round trips per mechanism")
    parser.add_argument("--busy", type=int, default=0, help="processes spinning meanwhile")
    args = parser.parse_args()
    if not (shm.AVAILABLE and shm.FUTEX_SAFE):
        print("SKIP: futexes on shared memory need Linux on x86-64")
        return 0
    mp.set_start_method("fork")
    spinners = [mp.Process(target=_spin, daemon=True) for _ in range(args.busy)]
    for s in spinners:
        s.start()
    try:
        results = {
            "zmq": zmq_round_trip(args.trips),
            "pipe": pipe_round_trip(args.trips),
            "futex": futex_round_trip(args.trips),
        }
    finally:
        for s in spinners:
            s.terminate()
    print(f"{args.trips} round trips each, {args.busy} spinning process(es) beside")
    for name, seconds in results.items():
        ratio = seconds / results["zmq"]
        print(f"  {name:6s} {seconds * 1e6:7.1f} us per round trip   {ratio:.2f}x of zmq")
    return 0


if __name__ == "__main__":
    sys.exit(main())
