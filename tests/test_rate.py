"""The one rate meter behind `symbiont stats` tokens/s and the serving metrics."""

from __future__ import annotations

import threading

import pytest

from symbiont.util.rate import RateWindow


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_rate_over_the_window_forgets_old_counts():
    clock = Clock()
    meter = RateWindow(10.0, clock)
    for _ in range(20):  # 100 per second for 20 s
        clock.now += 1.0
        meter.add(100)
    assert meter.rate() == pytest.approx(100.0, rel=0.11)
    clock.now += 30.0  # nothing for longer than the window
    assert meter.rate() == 0.0


def test_rate_while_the_uptime_is_shorter_than_the_window():
    clock = Clock()
    meter = RateWindow(10.0, clock)
    clock.now += 2.0
    meter.add(50)
    assert meter.rate() == pytest.approx(25.0), "50 in the first 2 s is 25/s, not 5/s"


def test_adds_from_many_threads_are_all_counted():
    clock = Clock()
    meter = RateWindow(60.0, clock)
    threads = [
        threading.Thread(target=lambda: [meter.add(1) for _ in range(1000)]) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    clock.now += 1.0
    assert meter.rate() == pytest.approx(4000.0), "every add of every thread counts once"


def test_a_window_must_be_positive():
    with pytest.raises(ValueError, match="window_s must be > 0"):
        RateWindow(0)
