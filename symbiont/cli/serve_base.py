"""`symbiont serve-base`: load a base once and serve it to clients in other processes/hosts."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

HELP = "serve a base model's frozen layers to clients in other processes or on other hosts"
log = logging.getLogger("symbiont.service")


def register(subparsers) -> None:
    parser = subparsers.add_parser("serve-base", help=HELP, description=HELP)
    add_arguments(parser)
    parser.set_defaults(func=run)


def add_arguments(parser) -> None:
    parser.add_argument("--model", required=True, help="local checkpoint folder of the base")
    parser.add_argument(
        "--bind",
        action="append",
        metavar="URL",
        help="endpoint to listen on, repeatable: tcp://HOST:PORT (tcp://127.0.0.1:* picks a "
        "free port) or ipc:///path (default tcp://127.0.0.1:7100). Any non-loopback "
        "address needs --token",
    )
    parser.add_argument(
        "--token",
        default=os.environ.get("SYMBIONT_TOKEN"),
        help="shared secret clients must present (default $SYMBIONT_TOKEN)",
    )
    parser.add_argument("--device", default="cpu", help="where the base weights live (cpu, cuda)")
    parser.add_argument("--dtype", default=None, help="base dtype (default: the checkpoint's)")
    parser.add_argument(
        "--policy",
        default="opportunistic",
        choices=["opportunistic", "lockstep", "no-lockstep"],
        help="batching policy (default opportunistic)",
    )
    parser.add_argument(
        "--max-wait-ms", type=float, default=5.0, help="cap on any call's batching wait (ms)"
    )
    parser.add_argument(
        "--wait-per-token-us",
        type=float,
        default=20.0,
        help="batching wait a call may spend per token it carries (µs)",
    )
    parser.add_argument("--max-batch-tokens", type=int, default=8192)
    parser.add_argument("--max-call-mb", type=float, default=1024, help="largest call accepted")
    parser.add_argument("--spin-us", type=float, default=2000.0, help="shared-memory spin window")
    parser.add_argument("--no-shm", action="store_true", help="refuse shared-memory clients")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads for the matmuls (default: one per core in --cpus, else torch's choice)",
    )
    parser.add_argument(
        "--cpus",
        type=_cpu_list,
        default=None,
        metavar="LIST",
        help="run on these cores only, e.g. 0 or 0-3 or 0,2: dedicates them to the base so "
        "clients on the other cores do not slow it (and it does not slow them)",
    )
    parser.add_argument(
        "--ready-file", type=Path, help="write {endpoints, pid} as JSON here once listening"
    )
    parser.add_argument(
        "--parent-pid", type=int, help="exit when this process is gone (for supervisors, tests)"
    )


def run(args) -> int:
    import torch

    from symbiont.executor.base import BaseExecutor
    from symbiont.service import BatchingPolicy, ExecutorServer, ServiceConfig
    from symbiont.transport.shm import cores

    host_cores = cores()
    if args.cpus:
        _pin(args.cpus)
    threads = args.threads or (len(args.cpus) if args.cpus else None)
    if threads:
        torch.set_num_threads(threads)
    config = ServiceConfig(
        bind=tuple(args.bind or ["tcp://127.0.0.1:7100"]),
        token=args.token or None,
        policy=BatchingPolicy(
            kind=args.policy,
            max_wait_s=args.max_wait_ms * 1e-3,
            wait_per_token_s=args.wait_per_token_us * 1e-6,
            max_batch_tokens=args.max_batch_tokens,
        ),
        max_call_bytes=int(args.max_call_mb * 2**20),
        spin_us=args.spin_us,
        allow_shm=not args.no_shm,
        host_cores=host_cores,
    )
    executor = BaseExecutor.from_pretrained(args.model, device=args.device, dtype=args.dtype)
    server = ExecutorServer(executor, config)
    endpoints = server.bind()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: server.stop())
    log.info(
        "serving %s (%d layers, %s, fingerprint %s) on %s, policy %s%s",
        args.model,
        len(executor.manifest.layers),
        executor.manifest.dtype,
        executor.manifest.fingerprint,
        ", ".join(endpoints),
        config.policy.kind,
        ", token required" if config.token else "",
    )
    if args.parent_pid:
        _exit_with(args.parent_pid, server)
    if args.ready_file:
        ready = {"endpoints": endpoints, "pid": os.getpid()}
        tmp = args.ready_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(ready))
        tmp.replace(args.ready_file)
    server.serve_forever()
    log.info("stopped")
    return 0


def _pin(cpus: set[int]) -> None:
    """Every thread of this process onto `cpus`; threads started later inherit the mask."""
    tasks = Path("/proc/self/task")
    for tid in [int(t.name) for t in tasks.iterdir()] if tasks.is_dir() else [0]:
        with contextlib.suppress(ProcessLookupError):  # a thread that just ended
            os.sched_setaffinity(tid, cpus)


def _cpu_list(text: str) -> set[int]:
    """'0-3,6' -> {0, 1, 2, 3, 6}, checked against the cores this process may use."""
    if not hasattr(os, "sched_setaffinity"):
        raise argparse.ArgumentTypeError("pinning to cores needs Linux; leave out --cpus")
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: use core numbers like 0 or 0-3 or 0,2"
        ) from None
    allowed = os.sched_getaffinity(0)
    if not cpus or not cpus <= allowed:
        raise argparse.ArgumentTypeError(
            f"{text!r}: this machine lets us use cores {_ranges(allowed)}; pick among those"
        )
    return cpus


def _ranges(cpus: set[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


def _exit_with(pid: int, server) -> None:
    """Stop `server` once process `pid` has exited."""

    def watch():
        while True:
            time.sleep(1.0)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                log.info("parent process %d is gone: stopping", pid)
                server.stop()
                return
            except PermissionError:
                pass

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()
