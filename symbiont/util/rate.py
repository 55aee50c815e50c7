"""Events per second over a sliding window: the one rate meter behind `symbiont stats`
(base tokens/s) and the serving metrics (generated tokens/s)."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable


class RateWindow:
    """Counts added over the last `window_s` seconds, kept in one-second buckets, so
    `add` is O(1) and cheap enough for a hot path. Thread-safe."""

    def __init__(self, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0 seconds, got {window_s}")
        self.window_s = window_s
        self._clock = clock
        self._started = clock()
        self._buckets: deque[list[int]] = deque()  # [whole second, count]
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        second = int(self._clock())
        with self._lock:
            if self._buckets and self._buckets[-1][0] == second:
                self._buckets[-1][1] += n
            else:
                self._buckets.append([second, n])
                self._forget_before(second)

    def rate(self) -> float:
        """Count per second over the window (over the uptime, while that is shorter)."""
        now = self._clock()
        with self._lock:
            self._forget_before(int(now))
            total = sum(count for _, count in self._buckets)
        return total / max(min(self.window_s, now - self._started), 1e-9)

    def _forget_before(self, second: int) -> None:
        while self._buckets and self._buckets[0][0] <= second - self.window_s:
            self._buckets.popleft()
