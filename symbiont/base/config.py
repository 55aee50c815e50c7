"""Configuration of the executor service and of its batching policy."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from symbiont.protocol.urls import check_url, is_loopback


class PolicyKind(StrEnum):
    OPPORTUNISTIC = "opportunistic"  # per-call wait that grows with its size, capped
    LOCKSTEP = "lockstep"  # a layer runs once every active client has a call for it
    NO_LOCKSTEP = "no-lockstep"  # every call runs alone, first come first served


@dataclass(frozen=True)
class BatchingPolicy:
    """When a layer's queue runs (Symbiosis 3.7).

    Opportunistic: a call of n tokens is willing to wait `min(max_wait_s, n *
    wait_per_token_s)` for other clients' calls of the same layer to join it; a queue
    runs when its most impatient call's wait is over, when it holds `max_batch_tokens`,
    or at once when no other client is expected to add work before then (arrival-aware:
    the scheduler learns each client's call sequence and pace, see `Scheduler`; with
    every active client queued, the queue runs). So a one-token decode call waits microseconds,
    a fine-tuning call of thousands of tokens waits up to `max_wait_s`, and no call waits
    longer than `max_wait_s` for batching.
    """

    kind: PolicyKind = field(
        default=PolicyKind.OPPORTUNISTIC, metadata={"help": "batching policy", "flag": "--policy"}
    )
    max_wait_s: float = field(
        default=0.005,
        metadata={
            "help": "cap on any call's batching wait (ms)",
            "flag": "--max-wait-ms",
            "scale": 1e-3,
        },
    )
    wait_per_token_s: float = field(
        default=20e-6,
        metadata={
            "help": "batching wait a call may spend per token it carries (µs)",
            "flag": "--wait-per-token-us",
            "scale": 1e-6,
        },
    )
    max_batch_tokens: int = field(
        default=8192, metadata={"help": "a layer's queue runs once it holds this many tokens"}
    )

    def __post_init__(self):
        object.__setattr__(self, "kind", PolicyKind(self.kind))
        _check_range("--max-wait-ms", self.max_wait_s * 1e3, 0, MAX_WAIT_S * 1e3)
        _check_range("--wait-per-token-us", self.wait_per_token_s * 1e6, 0, MAX_WAIT_S * 1e6)
        if self.max_batch_tokens < 1:
            raise ValueError(f"--max-batch-tokens must be >= 1, got {self.max_batch_tokens}")

    def wait_for(self, tokens: int) -> float:
        """How long a call of `tokens` tokens may wait for company, in seconds."""
        return min(self.max_wait_s, tokens * self.wait_per_token_s)


@dataclass(frozen=True)
class ServiceConfig:
    """How `serve-base` listens and schedules.

    bind: endpoints to listen on (tcp://HOST:PORT, tcp://HOST:* for any free port,
    ipc:///path). Any endpoint that is not loopback needs `token`, which clients present
    in their handshake. spin_us: how long the loop keeps polling shared memory after
    the last call before it sleeps on the socket (the shared-memory fast path).
    host_cores: cores that the executor and its same-host clients share, which decides
    whether spinning pays (default: the cores this process may run on; pass the host's
    when the executor is pinned to a few of them). workers: how many batches (of
    different layers, from different clients) are computed at once, each on a thread of
    its own; the loop itself only takes calls and answers them meanwhile (with a single
    client, the loop computes its calls and splits the large ones over the workers, where
    the executor's products may be split: symbiont/base/server.py).
    """

    bind: tuple[str, ...] = field(
        default=("tcp://127.0.0.1:7100",),
        metadata={
            "help": "endpoint to listen on, repeatable: tcp://HOST:PORT (tcp://127.0.0.1:* picks a "
            "free port) or ipc:///path. Any non-loopback address needs --token",
            "metavar": "URL",
        },
    )
    token: str | None = field(
        default=None,
        metadata={"help": "shared secret clients must present", "env": "SYMBIONT_TOKEN"},
    )
    allow_unauthenticated: bool = field(
        default=False,
        metadata={
            "help": "serve a non-loopback address without --token: anyone who reaches it may use "
            "the base (only on a network you trust)"
        },
    )
    policy: BatchingPolicy = field(default_factory=BatchingPolicy)
    max_call_bytes: int = field(
        default=1 << 30,
        metadata={"help": "largest call accepted (MiB)", "flag": "--max-call-mb", "scale": 2**20},
    )
    session_timeout_s: float = 600.0
    max_sessions: int = field(
        default=256, metadata={"help": "clients served at once; a HELLO beyond is refused"}
    )
    new_session_timeout_s: float = field(
        default=10.0,
        metadata={"help": "seconds a session that has made no call yet is kept"},
    )
    spin_us: float = field(
        default=10000.0,
        metadata={
            "help": "shared-memory spin window after the last call (µs); spinning is on only "
            "while the loop and each same-host client can have a core"
        },
    )
    allow_shm: bool = field(
        default=True, metadata={"help": "refuse shared-memory clients", "flag": "--no-shm"}
    )
    gpu_area_bytes: int = field(
        default=1 << 30,
        metadata={
            "help": "GPU memory for the shared-memory areas of clients on this executor's GPU "
            "(CUDA IPC), all sessions together (MiB); beyond it clients get host areas",
            "flag": "--gpu-area-mb",
            "scale": 2**20,
        },
    )
    host_cores: int | None = None
    workers: int = field(
        default=1,
        metadata={
            "help": "batches run at once, each on its own thread with --threads torch threads: "
            "with several clients at different layers, --workers CORES --threads 1 keeps every "
            "core on a matmul without OpenMP's barriers (1: one batch at a time); with one "
            "client and --matmul onednn, its large products are split over the workers"
        },
    )

    def __post_init__(self):
        if self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")
        if not self.bind:
            raise ValueError("ServiceConfig.bind needs at least one endpoint")
        for url in self.bind:
            check_url(url)
        exposed = [url for url in self.bind if not is_loopback(url)]
        if exposed and not self.token and not self.allow_unauthenticated:
            raise ValueError(
                f"{', '.join(exposed)} is reachable from other hosts: pass --token (or set "
                "SYMBIONT_TOKEN) so that only clients presenting it are served, or "
                "--allow-unauthenticated to serve anyone who reaches it"
            )
        if self.max_call_bytes < 1:
            raise ValueError(f"--max-call-mb must be positive, got {self.max_call_bytes / 2**20:g}")
        if self.gpu_area_bytes < 0:
            raise ValueError(f"--gpu-area-mb must be >= 0, got {self.gpu_area_bytes / 2**20:g}")
        if self.max_sessions < 1:
            raise ValueError(f"--max-sessions must be >= 1, got {self.max_sessions}")
        _check_range("--new-session-timeout-s", self.new_session_timeout_s, 1e-3, 86400)
        _check_range("--spin-us", self.spin_us, 0, MAX_WAIT_S * 1e6)


MAX_WAIT_S = 60.0  # no batching wait or spin beyond a minute makes sense


def _check_range(flag: str, value: float, low: float, high: float) -> None:
    """A finite number in [low, high], else an error naming the flag."""
    if not math.isfinite(value) or not low <= value <= high:
        raise ValueError(f"{flag} must be a number in [{low:g}, {high:g}], got {value:g}")


def parse_cpus(text: str) -> frozenset[int]:
    """'0-3,6' -> {0, 1, 2, 3, 6}, checked against the cores this process may use."""
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError("pinning to cores needs Linux; leave out --cpus")
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    except ValueError:
        raise ValueError(f"{text!r}: use core numbers like 0 or 0-3 or 0,2") from None
    allowed = os.sched_getaffinity(0)
    if not cpus or not cpus <= allowed:
        cores = ",".join(map(str, sorted(allowed)))
        raise ValueError(f"{text!r}: this machine lets us use cores {cores}; pick among those")
    return frozenset(cpus)


parse_cpus.__name__ = "core list"  # argparse: "invalid core list value: ..."


@dataclass(frozen=True)
class BaseProcessConfig:
    """What the `serve-base` process loads and where it runs (its service is `ServiceConfig`).

    threads: torch threads of each worker for the matmuls (default: one per core of
    `cpus`, else on a CPU the cores but one divided among the workers: symbiont/base/main.py). ready_file and parent_pid serve supervisors (`symbiont.processes`).
    """

    model: str = field(metadata={"help": "local checkpoint folder of the base", "metavar": "DIR"})
    device: str = field(default="cpu", metadata={"help": "where the base weights live (cpu, cuda)"})
    dtype: str | None = field(
        default=None, metadata={"help": "base dtype (default: the checkpoint's)"}
    )
    threads: int | None = field(
        default=None,
        metadata={
            "help": "torch threads of each worker for the matmuls (default: one per core in "
            "--cpus; else on a CPU the cores but one, divided among --workers, so a client "
            "on this host keeps a core (OMP_NUM_THREADS, if set, decides instead); on a GPU, "
            "torch's choice)"
        },
    )
    matmul: str = field(
        default="torch",
        metadata={
            "help": "what computes the base's products: torch (F.linear: on a CPU, MKL; bitwise "
            "what a vanilla job computes) or onednn (oneDNN on the same weights, float32 on a "
            "CPU, forward and backward, no extra memory: 1.7-2.5x faster than torch's on an AMD "
            "EPYC, results within fp32 rounding of torch's; benchmarks/onednn_matmul.py "
            "measures your CPU; forward calls of 1-7 rows of Linear layers, as decoding "
            "clients send, run through symbiont's CPU kernel where it can be built: "
            "benchmarks/few_rows.py)",
            "choices": ("torch", "onednn"),
        },
    )
    cpus: frozenset[int] | None = field(
        default=None,
        metadata={
            "help": "run on these cores only, e.g. 0 or 0-3 or 0,2: dedicates them to the base "
            "so clients on the other cores do not slow it (and it does not slow them)",
            "metavar": "LIST",
            "type": parse_cpus,
        },
    )
    ready_file: Path | None = field(
        default=None,
        metadata={"help": "write {endpoints, pid} as JSON here once listening", "type": Path},
    )
    parent_pid: int | None = field(
        default=None, metadata={"help": "exit when this process is gone (for supervisors, tests)"}
    )

    def __post_init__(self):
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.threads}")
        from symbiont.util.device import check_device

        check_device(self.device)
        if self.matmul == "onednn" and (self.device != "cpu" or not _is_fp32(self.dtype)):
            raise ValueError(
                f"--matmul onednn computes float32 on the CPU, not "
                f"{self.dtype or 'the checkpoint dtype'} on {self.device}; use --matmul torch"
            )
        if self.ready_file is not None and not Path(self.ready_file).parent.is_dir():
            raise ValueError(
                f"--ready-file {self.ready_file}: its folder does not exist; create it first"
            )

    @property
    def num_threads(self) -> int | None:
        return self.threads or (len(self.cpus) if self.cpus else None)


def _is_fp32(dtype: str | None) -> bool:
    """Whether --dtype names float32 (None: the checkpoint's, checked once it is loaded)."""
    import torch

    return dtype is None or getattr(torch, dtype, None) is torch.float32
