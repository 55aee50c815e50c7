"""Chameleon's multi-level queue scheduler (`--scheduler mlq`): small requests get a fast
lane, large ones keep a share of the capacity and never starve.

Each request gets a weighted request size at arrival,

    WRS = 0.3 * input / max input + 0.5 * predicted output / max predicted output
          + 0.2 * adapter rank / max rank

(maxima over the requests seen, so each term spans [0, 1] whatever the workload's scale;
the output predictor is pluggable, by default a running mean of each adapter's output
lengths capped by the request's `max_tokens`), and waits in
the queue whose WRS range holds it. Queues come from 1-D K-means over recent WRS values
with K <= 4 chosen by the elbow: the smallest K after which one more cluster no longer
cuts the within-cluster sum of squares to `ELBOW_RATIO` of what it was (the raw minimum
always picks the largest K). Cut-offs are the midpoints between centroids. The queues,
cut-offs and quotas are recomputed every `mlq_refresh_s` (first after `WARMUP` arrivals).

Admission runs in Chameleon's two phases over the KV capacity (tokens reserved for
prompt + `max_tokens`, the unit every request is charged in):
1. from the smallest queue up, each queue admits in arrival order while its running
   requests stay within its quota (an empty queue always admits its head, so a request
   larger than its quota still runs);
2. the quota left unused by queues with nothing waiting is handed out, smallest first.
A queue whose head waits keeps its unused quota, so small requests cannot take it all;
a queue with nothing running whose head found no room (running slots or KV blocks taken)
admits first in the next iteration, and nothing else is admitted until it fits: a flood
of small requests cannot starve a large one.

Quotas: T_min = S * E * (lambda + 1/SLO) per queue (S: its largest request, E: its mean
service time, lambda: its arrival rate; our reconstruction of Chameleon's), at least S;
if they exceed the capacity, what exceeds the S's is cut in proportion (each queue keeps
room for its largest request while the S's fit); what remains of the capacity is split in
proportion to K, K-1, ..., 1 (smaller queues more). Bypass: when the head of a queue waits for a slot for its adapter (every slot is
used by running requests), younger requests of the queue may pass it while all requests
that passed such a head hold at most `SQUASH_LIMIT` (5%) of the capacity; a head whose
adapter is still loading (off the step thread) is passed freely, as in FIFO. We never
preempt, so nothing is squashed: the limit bounds how long bypassing can delay the head.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from symbiont.decoding import FinishReason
from symbiont.serve.config import EngineConfig
from symbiont.serve.kv_cache import PagedKVCache
from symbiont.serve.scheduler import Admit, ScheduledSeq, Scheduler
from symbiont.serve.sequence import SeqStatus, Sequence

__all__ = ["MLQScheduler", "OutputPredictor", "RunningMeanPredictor", "elbow_k", "kmeans_1d"]

MAX_QUEUES = 4
ELBOW_RATIO = 0.25  # one more queue must cut the WCSS to a quarter to be worth it
WARMUP = 32  # arrivals before the first clustering (one queue until then)
RECENT = 1024  # arrivals the clustering looks at
SQUASH_LIMIT = 0.05  # share of the capacity requests that bypassed a head may hold


@dataclass(frozen=True)
class WRSWeights:
    input: float = 0.3
    output: float = 0.5
    rank: float = 0.2


class OutputPredictor(Protocol):
    def predict(self, key: object, max_tokens: int) -> float: ...

    def observe(self, key: object, output_tokens: int) -> None: ...


class RunningMeanPredictor:
    """Output tokens a request will generate: the mean of what its adapter's requests
    generated so far (else of all requests; else `max_tokens`), capped by `max_tokens`."""

    def __init__(self):
        self._means: dict[object, tuple[int, float]] = {}
        self._all = (0, 0.0)

    def predict(self, key: object, max_tokens: int) -> float:
        n, mean = self._means.get(key, self._all)
        return float(max_tokens) if n == 0 else min(mean, float(max_tokens))

    def observe(self, key: object, output_tokens: int) -> None:
        self._means[key] = _updated(self._means.get(key, (0, 0.0)), output_tokens)
        self._all = _updated(self._all, output_tokens)


def _updated(state: tuple[int, float], value: float) -> tuple[int, float]:
    n, mean = state
    return n + 1, mean + (value - mean) / (n + 1)


def kmeans_1d(values: list[float], k: int, iters: int = 50) -> tuple[list[float], float]:
    """K-means of scalars -> (sorted centroids, WCSS): Lloyd from two deterministic seeds
    (quantiles; farthest points from the mean), the better kept."""
    data = sorted(values)
    n = len(data)
    quantiles = {data[min(n - 1, (2 * i + 1) * n // (2 * k))] for i in range(k)}
    runs = [_lloyd(data, sorted(seeds), iters) for seeds in (quantiles, _farthest(data, k))]
    return min(runs, key=lambda run: (-len(run[0]), run[1]))


def _farthest(data: list[float], k: int) -> set[float]:
    seeds = [sum(data) / len(data)]
    while len(seeds) < k:
        seeds.append(max(data, key=lambda v: min(abs(v - c) for c in seeds)))
    return set(seeds)


def _lloyd(data: list[float], centroids: list[float], iters: int) -> tuple[list[float], float]:
    for _ in range(iters):
        groups = _assign(data, centroids)
        updated = [sum(g) / len(g) for g in groups if g]
        if updated == centroids:
            break
        centroids = updated
    groups = _assign(data, centroids)
    wcss = sum((v - c) ** 2 for g, c in zip(groups, centroids, strict=True) for v in g)
    return centroids, wcss


def _assign(data: list[float], centroids: list[float]) -> list[list[float]]:
    cuts = midpoints(centroids)
    groups: list[list[float]] = [[] for _ in centroids]
    for v in data:
        groups[bisect.bisect_right(cuts, v)].append(v)
    return groups


def midpoints(centroids: list[float]) -> list[float]:
    return [(a + b) / 2 for a, b in zip(centroids, centroids[1:], strict=False)]


def elbow_k(values: list[float], k_max: int = MAX_QUEUES) -> tuple[int, list[float]]:
    """(K, its centroids): the smallest K whose next cluster cuts WCSS by less than the
    elbow ratio."""
    best = kmeans_1d(values, 1)
    for k in range(2, min(k_max, len(set(values))) + 1):
        trial = kmeans_1d(values, k)
        if len(trial[0]) < k or trial[1] > ELBOW_RATIO * best[1]:
            break
        best = trial
    return len(best[0]), best[0]


@dataclass
class _Level:
    quota: float
    served: tuple[int, float] = (0, 0.0)  # (count, mean seconds admitted -> finished)


class MLQScheduler(Scheduler):
    def __init__(
        self,
        config: EngineConfig,
        kv_cache: PagedKVCache,
        max_model_len: int,
        cache=None,
        predictor: OutputPredictor | None = None,
        weights: WRSWeights = WRSWeights(),
        virtual_tokens=None,
    ):
        super().__init__(config, kv_cache, max_model_len, cache, virtual_tokens)
        self.predictor = predictor or RunningMeanPredictor()
        self.weights = weights
        self.capacity = kv_cache.num_slots  # tokens of KV: what quotas divide
        self.cutoffs: list[float] = []
        self.levels = [_Level(float(self.capacity))]
        self._recent: deque[tuple[float, tuple, int]] = deque(maxlen=RECENT)  # t, terms, cost
        self._largest = (0.0, 0.0, 0.0)  # largest input, predicted output, rank seen
        self._refreshed: float | None = None
        self._bypassing: set[Sequence] = set()
        self._starving: int | None = None  # queue that admits first next iteration

    # -- arrival -----------------------------------------------------------------------

    def add(self, seqs: list[Sequence]) -> None:
        super().add(seqs)
        now = time.monotonic()
        for seq in seqs:
            terms = self.terms(seq)
            self._largest = tuple(map(max, self._largest, terms))
            seq.level = self.level_of(self.size(terms))
            self._recent.append((now, terms, self.reserved_len(seq)))
        if self._due(now):
            self.refresh(now)

    def terms(self, seq: Sequence) -> tuple[float, float, float]:
        """(input tokens, predicted output tokens, adapter rank) of a request."""
        predicted = self.predictor.predict(_key(seq), seq.params.max_tokens)
        return float(seq.prompt_len), predicted, float(seq.adapter_rank)

    def size(self, terms: tuple[float, float, float]) -> float:
        """WRS: each term over the largest seen so far (so each spans [0, 1]), weighted."""
        w = self.weights
        n_in, n_out, n_rank = (max(m, 1.0) for m in self._largest)
        return w.input * terms[0] / n_in + w.output * terms[1] / n_out + w.rank * terms[2] / n_rank

    def wrs(self, seq: Sequence) -> float:
        """Weighted request size of `seq` (input, predicted output, adapter rank)."""
        return self.size(self.terms(seq))

    def _due(self, now: float) -> bool:
        if self._refreshed is None:
            return len(self._recent) >= WARMUP
        return now - self._refreshed >= self.config.mlq_refresh_s

    # -- queues and quotas ---------------------------------------------------------------

    def refresh(self, now: float | None = None) -> None:
        """Recompute queues (elbow K-means over recent WRS), cut-offs and quotas."""
        now = time.monotonic() if now is None else now
        self._refreshed = now
        if not self._recent:
            return
        _, centroids = elbow_k([self.size(terms) for _, terms, _ in self._recent])
        served = self._service_times()
        self.cutoffs = midpoints(centroids)
        self.levels = [_Level(0.0, served.get(i, (0, 0.0))) for i in range(len(centroids))]
        for seq in self.waiting:
            seq.level = self.level_of(self.wrs(seq))
        for seq in self.running:
            seq.level = min(seq.level, len(self.levels) - 1)
        self._set_quotas(now)

    def level_of(self, size: float) -> int:
        return bisect.bisect_right(self.cutoffs, size)

    def _service_times(self) -> dict[int, tuple[int, float]]:
        """Old levels' service times, kept when the number of queues is unchanged."""
        return {i: level.served for i, level in enumerate(self.levels)}

    def _set_quotas(self, now: float) -> None:
        k, slo = len(self.levels), self.config.mlq_slo_s
        window = max(now - self._recent[0][0], 1e-3)
        largest, arrivals = [0.0] * k, [0] * k
        for _, terms, cost in self._recent:
            i = self.level_of(self.size(terms))
            largest[i], arrivals[i] = max(largest[i], float(cost)), arrivals[i] + 1
        overall = [lv.served[1] for lv in self.levels if lv.served[0]]
        default_e = sum(overall) / len(overall) if overall else slo
        need = []
        for i, level in enumerate(self.levels):
            e = level.served[1] if level.served[0] else default_e
            t_min = largest[i] * e * (arrivals[i] / window + 1 / slo)
            need.append(max(t_min, largest[i]))
        need = _fit(need, largest, float(self.capacity))
        spare = self.capacity - sum(need)
        shares = [k - i for i in range(k)]
        for i, level in enumerate(self.levels):
            level.quota = need[i] + spare * shares[i] / sum(shares)

    # -- admission -----------------------------------------------------------------------

    def admit_waiting(self, batch: list[ScheduledSeq], budget: int) -> int:
        queues: list[list[Sequence]] = [[] for _ in self.levels]
        for seq in self.waiting:
            queues[min(seq.level, len(queues) - 1)].append(seq)
        used = [0.0] * len(self.levels)
        for seq in self.running:
            used[min(seq.level, len(used) - 1)] += self.reserved_len(seq)
        order = list(range(len(queues)))
        starving = (
            self._starving if self._starving is not None and self._starving < len(queues) else None
        )
        if starving is not None:  # a queue with nothing running whose head found no room
            order.remove(starving)
            order.insert(0, starving)
        self._starving = None
        # a sequence waiting for a slot keeps its reservation across iterations: smaller
        # queues, served first, may not take the slot it waits for (see Scheduler)
        self._slot_blocked = self.head_waits_for_slot()
        blocked = [False] * len(self.levels)
        for i in order:  # phase 1: within quotas
            budget, blocked[i], no_room = self._admit_queue(queues[i], i, used, batch, budget, None)
            if no_room and used[i] == 0 and queues[i]:
                self._starving = i  # first next time; until then nothing else takes room
                if i == starving:
                    return budget
        spare = sum(
            max(0.0, lv.quota - used[i])
            for i, lv in enumerate(self.levels)
            if not blocked[i] and not queues[i]
        )
        for i, queue in enumerate(queues):  # phase 2: the spare of idle queues
            if budget <= 0 or spare <= 0:
                break
            before = sum(used)
            budget, _, _ = self._admit_queue(queue, i, used, batch, budget, spare)
            spare -= sum(used) - before
        return budget

    def _admit_queue(self, queue, i, used, batch, budget, spare) -> tuple[int, bool, bool]:
        """Admit from one queue in arrival order, within its quota (phase 1) or within
        `spare` (phase 2) -> (budget left, whether a request is left waiting, whether the
        engine had no room for it)."""
        head_waiting = False
        for seq in list(queue):
            if budget <= 0:
                return budget, True, False
            cost = self.reserved_len(seq)
            if not self._fits(cost, i, used, spare) or (
                head_waiting and not self._may_bypass(cost)
            ):
                return budget, True, False
            verdict = self.try_admit(seq)
            if verdict is Admit.NO_ROOM:
                return budget, True, True
            if verdict is Admit.LOADING:
                continue  # loading off the step thread: passing it delays it in nothing
            if verdict is Admit.WAIT:
                head_waiting = True  # it needs a slot that is not free: bypass is limited
                continue
            if head_waiting:
                self._bypassing.add(seq)
            used[i] += cost
            queue.remove(seq)
            budget = self.start(seq, batch, budget)
        return budget, head_waiting, False

    def _fits(self, cost: int, i: int, used: list[float], spare: float | None) -> bool:
        if spare is not None:
            return cost <= spare
        return used[i] == 0 or used[i] + cost <= self.levels[i].quota

    def _may_bypass(self, cost: int) -> bool:
        held = sum(self.reserved_len(s) for s in self._bypassing)
        return held + cost <= SQUASH_LIMIT * self.capacity

    # -- completion --------------------------------------------------------------------

    def finish(self, seq: Sequence) -> None:
        was_running = seq.status is SeqStatus.RUNNING
        super().finish(seq)
        self._bypassing.discard(seq)
        if not was_running or seq.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH):
            return
        self.predictor.observe(_key(seq), len(seq.output_ids))
        if seq.admitted_at is not None and seq.level < len(self.levels):
            level = self.levels[seq.level]
            level.served = _updated(level.served, time.monotonic() - seq.admitted_at)


def _fit(need: list[float], floor: list[float], capacity: float) -> list[float]:
    """Scale `need` into `capacity`, keeping each queue's `floor` (its largest request)
    first where they all fit: only what exceeds the floors is cut, in proportion."""
    if sum(need) <= capacity:
        return need
    if sum(floor) >= capacity:
        return [f * capacity / sum(floor) for f in floor]
    extra = [n - f for n, f in zip(need, floor, strict=True)]
    scale = (capacity - sum(floor)) / sum(extra)
    return [f + x * scale for f, x in zip(floor, extra, strict=True)]


def _key(seq: Sequence) -> object:
    """Whose output lengths predict `seq`'s: its adapter (by name or pinned slot)."""
    return seq.cached_adapter or seq.adapter_slot
