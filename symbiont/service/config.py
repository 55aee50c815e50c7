"""Configuration of the executor service and of its batching policy."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from symbiont.transport.urls import check_url, is_loopback


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

    kind: PolicyKind = PolicyKind.OPPORTUNISTIC
    max_wait_s: float = 0.005
    wait_per_token_s: float = 20e-6
    max_batch_tokens: int = 8192

    def __post_init__(self):
        object.__setattr__(self, "kind", PolicyKind(self.kind))
        if self.max_wait_s < 0 or self.wait_per_token_s < 0:
            raise ValueError("BatchingPolicy waits must be >= 0 seconds")
        if self.max_batch_tokens < 1:
            raise ValueError("BatchingPolicy.max_batch_tokens must be >= 1")

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
    when the executor is pinned to a few of them).
    """

    bind: tuple[str, ...] = ("tcp://127.0.0.1:7100",)
    token: str | None = None
    policy: BatchingPolicy = field(default_factory=BatchingPolicy)
    max_call_bytes: int = 1 << 30
    session_timeout_s: float = 600.0
    spin_us: float = 2000.0
    allow_shm: bool = True
    host_cores: int | None = None

    def __post_init__(self):
        if not self.bind:
            raise ValueError("ServiceConfig.bind needs at least one endpoint")
        for url in self.bind:
            check_url(url)
        exposed = [url for url in self.bind if not is_loopback(url)]
        if exposed and not self.token:
            raise ValueError(
                f"{', '.join(exposed)} is reachable from other hosts: pass --token (or set "
                "SYMBIONT_TOKEN) so that only clients presenting it are served"
            )
        if self.max_call_bytes < 1:
            raise ValueError("ServiceConfig.max_call_bytes must be positive")
