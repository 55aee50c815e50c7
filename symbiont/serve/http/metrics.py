"""Prometheus metrics of one server, in their own registry (several servers may share
a process, as in tests)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from symbiont.serve.engine import Engine
from symbiont.serve.output import EngineObserver
from symbiont.util.rate import RateWindow

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ServeMetrics(EngineObserver):
    def __init__(self, window_s: float = 10.0):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "symbiont_time_to_first_token_seconds",
            "Arrival to first generated token, per request",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "symbiont_inter_token_latency_seconds",
            "Time between consecutive tokens of a sequence",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            "symbiont_generated_tokens", "Tokens generated (all requests)", registry=r
        )
        self.requests = Counter(
            "symbiont_requests", "Requests finished, by outcome", ["outcome"], registry=r
        )
        self.queue = Gauge("symbiont_queue_length", "Sequences waiting to start", registry=r)
        self.running = Gauge("symbiont_running_requests", "Sequences being generated", registry=r)
        self.adapters = Gauge("symbiont_adapters_loaded", "Adapters loaded", registry=r)
        rate = Gauge(
            "symbiont_generation_tokens_per_second",
            f"Generated tokens per second over the last {window_s:g} s",
            registry=r,
        )
        self._recent = RateWindow(window_s)
        rate.set_function(self._recent.rate)

    def attach(self, engine: Engine) -> None:
        self.queue.set_function(lambda: engine.scheduler.num_waiting)
        self.running.set_function(lambda: engine.scheduler.num_running)
        self.adapters.set_function(lambda: engine.adapters.num_loaded)
        engine.observer = self

    def on_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def on_inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def on_tokens(self, n: int) -> None:
        self.tokens.inc(n)
        self._recent.add(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)
