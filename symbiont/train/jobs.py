"""Running tenants as separate processes: one `serve-base` and any number of `symbiont`
subcommands against it, each reaped with its own peak resident memory.

Used by `symbiont demo` and `benchmarks/multi_finetune.py`. Children are started with
`python -m symbiont ...` (no fork after torch started threads), listen on loopback only,
and the executor exits by itself when the parent that started it is gone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Job:
    """A child process and where its output goes."""

    name: str
    process: subprocess.Popen
    log: Path  # stderr (and stdout unless split_stdout)
    peak_rss: int | None = None  # bytes, set by reap()
    returncode: int | None = None


def spawn(
    name: str, argv: list[str], workdir: Path, *, threads: int = 1, split_stdout: bool = False
) -> Job:
    """Start `python -m symbiont <argv>`; stderr to workdir/<name>.log, stdout there too
    or, with split_stdout, to workdir/<name>.out."""
    log = workdir / f"{name}.log"
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    out_path = workdir / f"{name}.out" if split_stdout else None
    with open(log, "wb") as err, open(out_path or os.devnull, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "symbiont", *argv],
            stdout=out if split_stdout else err,
            stderr=err,
            env=env,
        )
    return Job(name, process, log)


def start_base(
    model_dir, workdir: Path, *, threads: int = 1, timeout_s: float = 180
) -> tuple[Job, str]:
    """`symbiont serve-base` on a free loopback port; returns the job and its URL."""
    ready = workdir / "serve-base.ready.json"
    ready.unlink(missing_ok=True)
    argv = [
        "serve-base", "--model", str(model_dir), "--bind", "tcp://127.0.0.1:*",
        "--ready-file", str(ready), "--threads", str(threads), "--parent-pid", str(os.getpid()),
    ]  # fmt: skip
    job = spawn("serve-base", argv, workdir, threads=threads)
    deadline = time.monotonic() + timeout_s
    while not ready.is_file():
        if finished(job) or time.monotonic() > deadline:
            stop(job)
            raise RuntimeError(f"serve-base did not start; see {job.log}:\n{_tail(job.log)}")
        time.sleep(0.1)
    return job, json.loads(ready.read_text())["endpoints"][0]


def finished(job: Job) -> bool:
    """Whether the job has exited (reaping it, so its peak memory is recorded)."""
    return job.returncode is not None or _reap(job, block=False)


def reap(job: Job) -> Job:
    """Wait for the job to exit and record its exit code and peak resident memory."""
    if job.returncode is None:
        _reap(job, block=True)
    return job


def stop(job: Job, timeout_s: float = 20) -> Job:
    """Ask the job to stop (SIGTERM), kill it if it does not, and reap it."""
    if not finished(job):
        job.process.terminate()
        deadline = time.monotonic() + timeout_s
        while not finished(job) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not finished(job):
            job.process.kill()
    return reap(job)


def _reap(job: Job, *, block: bool) -> bool:
    # os.wait4, not Popen.poll/wait: only wait4 returns the child's resource usage.
    pid, status, usage = os.wait4(job.process.pid, 0 if block else os.WNOHANG)
    if pid == 0:
        return False
    job.returncode = os.waitstatus_to_exitcode(status)
    job.process.returncode = job.returncode
    job.peak_rss = usage.ru_maxrss * 1024  # Linux reports KiB
    return True


def check(job: Job) -> None:
    if job.returncode:
        raise RuntimeError(f"{job.name} failed (exit {job.returncode}):\n{_tail(job.log)}")


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
