"""One supervisor for every process that the CLI, the demo, tests and benchmarks start.

- `spawn(name, argv, workdir)` starts `python -m symbiont <argv>` as a `Job` (no fork after
  torch started threads; stdout and stderr to files in `workdir`).
- `ServerProcess(model, ...)` starts `symbiont serve-base` through `spawn`, waits until it
  listens (its ready file) and knows its endpoints; the child watches our pid and exits by
  itself if we die without stopping it. It is the one way to start serve-base.
- `finished`, `reap`, `stop`, `check` end jobs: SIGTERM, then SIGKILL after a grace period.

Memory: a job started with `pss_interval_s` has its peak PSS (proportional set size:
shared pages divided among the processes that map them) sampled from
/proc/PID/smaps_rollup while it runs. Only on request: each read walks the process's page
tables under its memory-map lock, which for a serve-base or a training job took ~11% of
two cores at one read per job every 0.2 s (BENCHMARKS.md, issue 17, session 21). Peak RSS
from wait4 is no use here: a child's `ru_maxrss` starts at its parent's peak (fork copies
it, exec keeps it), so every child reported the parent's size.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

PSS_INTERVAL_S = 0.2


@dataclass
class Job:
    """A child process and where its output goes."""

    name: str
    process: subprocess.Popen
    log: Path  # stderr (and stdout unless split_stdout)
    returncode: int | None = None
    peak_pss: int | None = None  # bytes, highest sampled PSS (None: never sampled)
    pss_interval_s: float | None = None  # seconds between PSS reads (None: not sampled)
    _sampler: threading.Thread | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        return self.process.pid


def spawn(
    name: str,
    argv: list[str],
    workdir: Path,
    *,
    threads: int | None = 1,
    split_stdout: bool = False,
    python: list[str] | None = None,
    env: dict[str, str] | None = None,
    pss_interval_s: float | None = None,
) -> Job:
    """Start `python -m symbiont <argv>` (or `python <python...>` for a script); stderr to
    workdir/<name>.log, stdout there too or, with split_stdout, to workdir/<name>.out.
    `threads` sets OMP_NUM_THREADS (None: inherit); `env` adds variables. With
    `pss_interval_s` (e.g. PSS_INTERVAL_S), the job's peak PSS is sampled that often while
    it runs; a caller may change `job.pss_interval_s` later, e.g. to read less often once
    the peak is reached."""
    workdir = Path(workdir)
    log = workdir / f"{name}.log"
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    out_path = workdir / f"{name}.out" if split_stdout else None
    command = [sys.executable, *(python or ["-m", "symbiont", *argv])]
    with open(log, "wb") as err, open(out_path or os.devnull, "wb") as out:
        process = subprocess.Popen(
            command, stdout=out if split_stdout else err, stderr=err, env=env
        )
    job = Job(name, process, log, pss_interval_s=pss_interval_s)
    if pss_interval_s is not None:
        job._sampler = threading.Thread(target=_sample_pss, args=(job,), daemon=True)
        job._sampler.start()
    return job


def finished(job: Job) -> bool:
    """Whether the job has exited (reaping it if so)."""
    if job.returncode is None and job.process.poll() is not None:
        job.returncode = job.process.returncode
    return job.returncode is not None


def reap(job: Job) -> Job:
    """Wait for the job to exit and record its exit code."""
    if job.returncode is None:
        job.returncode = job.process.wait()
    if job._sampler is not None:
        job._sampler.join()
    return job


def stop(job: Job, timeout_s: float = 20) -> Job:
    """Ask the job to stop (SIGTERM), kill it if it does not within `timeout_s`, reap it."""
    if not finished(job):
        job.process.terminate()
        try:
            job.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            job.process.kill()
    return reap(job)


def check(job: Job) -> None:
    """Raise with the end of its log if the job failed."""
    if job.returncode:
        raise RuntimeError(f"{job.name} failed (exit {job.returncode}):\n{tail(job.log)}")


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def pss(pid: int) -> int | None:
    """Proportional set size of process `pid` in bytes (None if it is gone or unreadable)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as rollup:
            for line in rollup:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def _sample_pss(job: Job) -> None:
    # poll(), not wait(): the pid stays ours (a zombie) until the supervisor reaps it.
    while job.returncode is None and job.process.poll() is None:
        now = pss(job.pid)
        if now is not None and (job.peak_pss is None or now > job.peak_pss):
            job.peak_pss = now
        time.sleep(job.pss_interval_s or PSS_INTERVAL_S)


class ServerProcess:
    """`symbiont serve-base` as a child; stops with `stop()`, `with`, or when we exit.

    bind defaults to a free loopback TCP port plus an IPC socket in a private folder;
    `args` are more serve-base flags; logs go to `workdir` (default: that folder). The
    private folder is removed once the server has stopped, unless it failed and the log
    there is what tells why (`log_text()` still returns the log after a clean stop).
    """

    def __init__(
        self,
        model,
        *,
        bind: tuple[str, ...] | None = None,
        args=(),
        workdir: Path | None = None,
        threads: int | None = None,
        pss_interval_s: float | None = None,
    ):
        self.folder = Path(tempfile.mkdtemp(prefix="symbiont-serve-"))
        self.bind = bind or ("tcp://127.0.0.1:*", f"ipc://{self.folder}/base.sock")
        self.model = Path(model)
        self.args = tuple(str(a) for a in args)
        self.workdir = Path(workdir) if workdir else self.folder
        self.threads = threads
        self.pss_interval_s = pss_interval_s  # see spawn
        self.endpoints: list[str] = []
        self.job: Job | None = None
        self._final_log: str | None = None  # the log, read before its folder went

    @property
    def proc(self) -> subprocess.Popen | None:
        return self.job.process if self.job else None

    @property
    def log(self) -> Path:
        return self.workdir / "serve-base.log"

    def start(self, timeout_s: float = 180.0) -> ServerProcess:
        ready = self.folder / "ready.json"
        argv = ["serve-base", "--model", str(self.model)]
        for url in self.bind:
            argv += ["--bind", url]
        argv += ["--ready-file", str(ready), "--parent-pid", str(os.getpid())]
        if self.threads is not None:
            argv += ["--threads", str(self.threads)]
        self.job = spawn(
            "serve-base",
            [*argv, *self.args],
            self.workdir,
            threads=self.threads,
            pss_interval_s=self.pss_interval_s,
        )
        deadline = time.monotonic() + timeout_s
        while not ready.exists():
            if finished(self.job) or time.monotonic() > deadline:
                stop(self.job)  # not self.stop(): the log stays where the message says
                raise RuntimeError(f"serve-base did not start; see {self.log}:\n{tail(self.log)}")
            time.sleep(0.05)
        self.endpoints = json.loads(ready.read_text())["endpoints"]
        return self

    def url(self, scheme: str = "tcp") -> str:
        """The first bound endpoint of `scheme` ('tcp' or 'ipc')."""
        return next(u for u in self.endpoints if u.startswith(f"{scheme}://"))

    def log_text(self) -> str:
        if self.log.exists():
            return self.log.read_text(errors="replace")
        return self._final_log or ""

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after `timeout_s`; returns the exit code."""
        if self.job is None:
            shutil.rmtree(self.folder, ignore_errors=True)
            return None
        stop(self.job, timeout_s)
        if self.workdir != self.folder:
            shutil.rmtree(self.folder, ignore_errors=True)
        elif self.job.returncode == 0 and self.folder.exists():
            self._final_log = self.log_text()
            shutil.rmtree(self.folder, ignore_errors=True)
        return self.job.returncode

    def __enter__(self) -> ServerProcess:
        return self.start() if self.job is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
