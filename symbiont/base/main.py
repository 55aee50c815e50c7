"""The serve-base process: load the frozen weights once, listen, serve until stopped.

`symbiont serve-base` parses its flags into the two configs and calls `serve()`; the
process pins itself to its cores first (so every thread it starts inherits the mask),
writes a ready file for supervisors, and stops on SIGINT/SIGTERM or when its parent dies.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

from symbiont.base.config import BaseProcessConfig, ServiceConfig

log = logging.getLogger("symbiont.base")


def serve(process: BaseProcessConfig, config: ServiceConfig, model: str) -> int:
    """Serve the base checkpoint in folder `model` as `process` and `config` say."""
    import torch

    from symbiont.base.executor import FEW_ROWS_MAX
    from symbiont.base.plan import load
    from symbiont.base.server import ExecutorServer

    _allow_files(4 * config.max_sessions + 256)
    if process.cpus:
        _pin(process.cpus)
    threads = process.num_threads or _default_threads(process.device, config.workers)
    if threads:
        torch.set_num_threads(threads)
    executor = load(model, device=process.device, dtype=process.dtype)
    if process.matmul == "onednn":
        from symbiont.base.onednn import OneDnnExecutor
        from symbiont.kernels.few_rows import FewRows

        executor = OneDnnExecutor(executor)  # refuses what oneDNN does not compute first
        executor.few_rows = FewRows.load()
        if executor.few_rows is None:
            from symbiont.kernels import library

            log.info(
                "products of under %d rows: torch's, as symbiont's CPU kernels could not "
                "be built (%s)",
                FEW_ROWS_MAX,
                library.unavailable_reason(),
            )
    if executor.device.type == "cuda":
        _hint_mps(executor.device)
    server = ExecutorServer(executor, config)
    endpoints = server.bind()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: server.stop())
    log.info(
        "serving %s (%d layers, %s, %s products%s on %s, fingerprint %s) on %s, policy %s%s",
        model,
        len(executor.manifest.layers),
        executor.manifest.dtype,
        executor.products,
        ""
        if executor.few_rows is None
        else f" (under {FEW_ROWS_MAX} rows: symbiont's few-rows kernel)",
        _threads_text(torch.get_num_threads(), config.workers, process),
        executor.manifest.fingerprint,
        ", ".join(endpoints),
        config.policy.kind,
        ", token required" if config.token else "",
    )
    if not config.token and config.allow_unauthenticated:
        log.warning("no token: any client that reaches %s may use this base", endpoints)
    if process.parent_pid:
        _exit_with(process.parent_pid, server)
    if process.ready_file:
        _write_ready(process.ready_file, endpoints)
    server.serve_forever()
    log.info("stopped")
    return 0


def _write_ready(path: Path, endpoints: list[str]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"endpoints": endpoints, "pid": os.getpid()}))
    tmp.replace(path)  # atomically: a supervisor never reads half of it


def _hint_mps(device) -> None:
    """Say, at start-up, what clients on this GPU need to be fast (they warn too)."""
    from symbiont.protocol import gpu_areas

    if gpu_areas.mps_running():
        log.info("NVIDIA MPS is running: clients on %s share its context with this one", device)
    else:
        log.info("clients that compute on %s too: %s", device, gpu_areas.MPS_HINT)


def _default_threads(device: str, workers: int) -> int | None:
    """Torch threads of each worker when --threads is not given: on a CPU, the cores but
    one, divided among the workers, so a client on this host keeps a core of its own (as
    a client leaves one to serve-base: symbiont/tenant.py). Every core had OpenMP threads
    that spin after each product, and a lone fine-tuning client beside them ran 3x
    (98M model) to 20x (the default model) slower than with --threads 1 on two cores.
    None (torch's choice) on a GPU, or where OMP_NUM_THREADS says."""
    if device != "cpu" or "OMP_NUM_THREADS" in os.environ:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, ((cores or 1) - 1) // workers)


def _threads_text(threads: int, workers: int, process: BaseProcessConfig) -> str:
    chose = not process.num_threads and process.device == "cpu"
    chose = chose and "OMP_NUM_THREADS" not in os.environ
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    why = ", a core left to clients" if chose and threads * workers < (cores or 1) else ""
    each = f"{threads} thread{'s' if threads > 1 else ''}"
    if workers == 1:
        return each + why
    return f"{workers} workers of {each}{why}"


def _allow_files(wanted: int) -> None:
    """Raise this process's soft limit on open files towards `wanted`: each shared-memory
    client holds three (its segment and two wake-up pipes) beside its connection, and a
    common soft limit of 1024 would refuse clients well before --max-sessions."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft != resource.RLIM_INFINITY and soft < wanted:  # clients would find nobody
        log.warning(
            "this process may open %d files (ulimit -n; hard limit %s), fewer than "
            "--max-sessions needs (%d): shared-memory clients beyond about %d will be "
            "refused; raise the limit or lower --max-sessions",
            soft, "unlimited" if hard == resource.RLIM_INFINITY else hard, wanted,
            max((soft - 256) // 4, 0),
        )  # fmt: skip


def _pin(cpus: set[int]) -> None:
    """Every thread of this process onto `cpus`; threads started later inherit the mask."""
    tasks = Path("/proc/self/task")
    for tid in [int(t.name) for t in tasks.iterdir()] if tasks.is_dir() else [0]:
        with contextlib.suppress(ProcessLookupError):  # a thread that just ended
            os.sched_setaffinity(tid, cpus)


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
