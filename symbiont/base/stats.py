"""Live statistics of the executor service, reported by `symbiont stats URL`."""

from __future__ import annotations

import time
from dataclasses import dataclass

from symbiont.util.rate import RateWindow

WINDOW_S = 10.0  # tokens/s is measured over this many recent seconds


@dataclass
class LayerStats:
    batches: int = 0
    calls: int = 0
    tokens: int = 0
    queue_wait_s: float = 0.0  # summed over calls: from arrival to the start of its batch
    compute_s: float = 0.0

    def to_dict(self) -> dict:
        batches, calls = max(self.batches, 1), max(self.calls, 1)
        return {
            "batches": self.batches,
            "calls": self.calls,
            "tokens": self.tokens,
            "mean_batch_calls": self.calls / batches,
            "mean_batch_tokens": self.tokens / batches,
            "mean_queue_wait_ms": 1e3 * self.queue_wait_s / calls,
            "mean_compute_ms": 1e3 * self.compute_s / batches,
        }


class Stats:
    """Counters updated once per batch; cheap enough for the hot path."""

    def __init__(self, names: list[str]):
        self.names = names
        self.layers: dict[int, LayerStats] = {}
        self.started = time.monotonic()
        self.tokens = 0
        self.recent = RateWindow(WINDOW_S)
        self.refused = 0
        self.errors = 0
        self.split_batches = 0  # computed in parts over the workers (a lone client's)

    def record(
        self,
        layer: int,
        calls: int,
        tokens: int,
        waited_s: float,
        started: float,
        ended: float | None = None,
    ):
        """One batch of `calls` on `layer`, computed from monotonic time `started` to
        `ended` (default: now)."""
        entry = self.layers.get(layer)
        if entry is None:
            entry = self.layers[layer] = LayerStats()
        now = time.monotonic() if ended is None else ended
        entry.batches += 1
        entry.calls += calls
        entry.tokens += tokens
        entry.queue_wait_s += waited_s
        entry.compute_s += now - started
        self.tokens += tokens
        self.recent.add(tokens)

    def snapshot(self, sessions: list[dict], policy: dict) -> dict:
        now = time.monotonic()
        total = LayerStats()
        for entry in self.layers.values():
            for name in ("batches", "calls", "tokens", "queue_wait_s", "compute_s"):
                setattr(total, name, getattr(total, name) + getattr(entry, name))
        return {
            "uptime_s": now - self.started,
            "policy": policy,
            "clients": sessions,
            "tokens_per_s": self.recent.rate(),
            "refused": self.refused,
            "errors": self.errors,
            "split_batches": self.split_batches,
            "total": total.to_dict(),
            "layers": {self.names[i]: e.to_dict() for i, e in sorted(self.layers.items())},
        }
