"""Round trip between two processes that sleep between messages, by wake-up mechanism:
what a shared-memory call costs `serve-base` and a client when neither may spin.

- `zmq`: a message each way over a ZeroMQ IPC socket (PAIR), what a RING doorbell was:
  each message passes the sender's and the receiver's ZeroMQ I/O threads.
- `pipe`: a byte each way through a pipe (how a client now wakes the executor, and the
  executor the client).
- `futex`: a futex wake each way on a word of shared memory (the alternative measured
  and not taken: no faster in the fine-tuning benchmark, and it needs ctypes and x86-64).

    python benchmarks/wakeups.py [--trips 4000] [--busy 0|1]

`--busy 1` runs a process spinning on a core meanwhile (cores taken, as when workers
compute). Prints microseconds per round trip and each mechanism against `zmq`.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import multiprocessing as mp
import os
import platform
import sys
import tempfile
import time

_SYS_FUTEX_X86_64, _FUTEX_WAIT, _FUTEX_WAKE = 202, 0, 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Futexes:
    """Two 32-bit words (ping, pong) in shared memory, each a futex."""

    def __init__(self, area: mmap.mmap):
        self.words = (ctypes.c_int32 * 2).from_buffer(area)
        self.base = ctypes.addressof(self.words)
        self.libc = ctypes.CDLL(None, use_errno=True)  # its calls release the GIL
        self.timeout = _Timespec(0, 50_000_000)

    def wait(self, index: int, seen: int) -> None:
        addr = ctypes.c_void_p(self.base + 4 * index)
        args = (_FUTEX_WAIT, ctypes.c_int(seen), ctypes.byref(self.timeout), None, 0)
        self.libc.syscall(_SYS_FUTEX_X86_64, addr, *args)

    def wake(self, index: int) -> None:
        addr = ctypes.c_void_p(self.base + 4 * index)
        self.libc.syscall(_SYS_FUTEX_X86_64, addr, _FUTEX_WAKE, ctypes.c_int(1), None, None, 0)


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


def _futex_peer(area: mmap.mmap, trips: int) -> None:
    futex = _Futexes(area)
    for seq in range(1, trips + 1):
        while (seen := futex.words[0]) != seq:
            futex.wait(0, seen)
        futex.words[1] = seq
        futex.wake(1)


def futex_round_trip(trips: int) -> float:
    area = mmap.mmap(-1, 4096)  # shared with the forked peer
    futex = _Futexes(area)
    peer = mp.Process(target=_futex_peer, args=(area, trips + 1))
    peer.start()
    started = 0.0
    for seq in range(1, trips + 2):
        if seq == 2:
            started = time.perf_counter()
        futex.words[0] = seq
        futex.wake(0)
        while (seen := futex.words[1]) != seq:
            futex.wait(1, seen)
    seconds = time.perf_counter() - started
    peer.join()
    return seconds / trips


def _spin() -> None:
    while True:
        pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trips", type=int, default=4000, help="round trips per mechanism")
    parser.add_argument("--busy", type=int, default=0, help="processes spinning meanwhile")
    args = parser.parse_args()
    if sys.platform != "linux" or platform.machine().lower() not in {"x86_64", "amd64"}:
        print("SKIP: the futex syscall number here is Linux x86-64's")
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
