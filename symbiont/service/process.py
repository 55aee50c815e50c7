"""Start `serve-base` as a child process and wait until it listens (tests, benchmarks, scripts)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


class ServerProcess:
    """A `python -m symbiont.service` child; stops with `stop()`, `with`, or when we exit.

    bind defaults to a free loopback TCP port plus an IPC socket in a private folder.
    The child watches our pid and exits by itself if we die without stopping it.
    """

    def __init__(self, model, *, bind: tuple[str, ...] | None = None, args: tuple = ()):
        self.folder = Path(tempfile.mkdtemp(prefix="symbiont-serve-"))
        self.bind = bind or ("tcp://127.0.0.1:*", f"ipc://{self.folder}/base.sock")
        self.model = Path(model)
        self.args = tuple(str(a) for a in args)
        self.endpoints: list[str] = []
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 120.0) -> ServerProcess:
        ready = self.folder / "ready.json"
        command = [sys.executable, "-m", "symbiont.service", "--model", str(self.model)]
        for url in self.bind:
            command += ["--bind", url]
        command += ["--ready-file", str(ready), "--parent-pid", str(os.getpid()), *self.args]
        self.log = self.folder / "serve-base.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"serve-base did not start:\n{self.log_text()}")
            time.sleep(0.05)
        self.endpoints = json.loads(ready.read_text())["endpoints"]
        return self

    def url(self, scheme: str) -> str:
        """The first bound endpoint of `scheme` ('tcp' or 'ipc')."""
        return next(u for u in self.endpoints if u.startswith(f"{scheme}://"))

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after `timeout_s`; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
