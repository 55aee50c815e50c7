"""Prometheus metrics of one server, in their own registry (several servers may share
a process, as in tests).

Adapter cache: lookups per tier (`hit` or `miss` in `resident`, then in `host`), loads
from disk by outcome, evictions per tier, load time, adapters per state. Requests per
adapter carry the adapter's name as a label for the first `MAX_ADAPTER_LABELS` names
seen, then `other`, so a server of thousands of adapters keeps a bounded number of
series."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from symbiont.serve.engine import Engine
from symbiont.serve.output import EngineObserver
from symbiont.util.rate import RateWindow

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_LOAD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
MAX_ADAPTER_LABELS = 50
BASE_LABEL = "(base)"
OTHER_LABEL = "other"
# Fine-tuned models are named ft:BASE:TENANT:SUFFIX:ID, and /metrics is open to anyone who
# reaches the server: one label for all of them, so no tenant's models are listed.
FINE_TUNED_LABEL = "(fine-tuned)"


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
        self.adapter_requests = Counter(
            "symbiont_adapter_requests",
            f"Requests queued per adapter (the first {MAX_ADAPTER_LABELS} names, then "
            f"{OTHER_LABEL!r}; {BASE_LABEL!r} for the base model)",
            ["adapter"],
            registry=r,
        )
        self._labelled: set[str] = set()
        self.cache_lookups = Counter(
            "symbiont_adapter_cache_lookups",
            "Requests for --adapter-dir adapters, by tier (resident, then host) and result",
            ["tier", "result"],
            registry=r,
        )
        self.loads = Counter(
            "symbiont_adapter_loads", "Adapter loads from disk, by outcome", ["outcome"], registry=r
        )
        self.load_time = Histogram(
            "symbiont_adapter_load_seconds",
            "Time to read and validate an adapter from disk into host memory",
            buckets=_LOAD_BUCKETS,
            registry=r,
        )
        self.evictions = Counter(
            "symbiont_adapter_evictions", "Adapters evicted, by tier left", ["tier"], registry=r
        )
        self.cache_states = Gauge(
            "symbiont_adapter_cache_adapters",
            "--adapter-dir adapters per state",
            ["state"],
            registry=r,
        )

    def attach(self, engine: Engine) -> None:
        self.queue.set_function(lambda: engine.scheduler.num_waiting)
        self.running.set_function(lambda: engine.scheduler.num_running)
        self.adapters.set_function(lambda: engine.adapters.num_loaded)
        if engine.cache is not None:
            from symbiont.serve.adapter_cache import AdapterState

            for state in AdapterState:
                gauge = self.cache_states.labels(state=str(state))
                gauge.set_function(lambda s=state: engine.cache.num_in(s))
        engine.observer = self

    def on_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def on_inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def on_tokens(self, n: int) -> None:
        self.tokens.inc(n)
        self._recent.add(n)

    def on_request(self, adapter: str | None) -> None:
        self.adapter_requests.labels(adapter=self._label(adapter)).inc()

    def _label(self, adapter: str | None) -> str:
        if adapter is None:
            return BASE_LABEL
        if adapter.startswith("ft:"):
            return FINE_TUNED_LABEL
        if adapter not in self._labelled and len(self._labelled) >= MAX_ADAPTER_LABELS:
            return OTHER_LABEL
        self._labelled.add(adapter)
        return adapter

    def on_adapter_cache(self, tier: str, hit: bool) -> None:
        self.cache_lookups.labels(tier=tier, result="hit" if hit else "miss").inc()

    def on_adapter_load(self, seconds: float, ok: bool) -> None:
        self.loads.labels(outcome="ok" if ok else "failed").inc()
        if ok:
            self.load_time.observe(seconds)

    def on_adapter_evict(self, tier: str) -> None:
        self.evictions.labels(tier=tier).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
