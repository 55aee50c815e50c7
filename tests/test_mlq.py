"""Chameleon's multi-level queue scheduler (symbiont/serve/mlq.py): weighted request
size, queues by elbow K-means, a fast lane for small requests, no starvation."""

from __future__ import annotations

import random

import pytest

from symbiont.serve import Engine, EngineConfig, Request, SamplingParams
from symbiont.serve.config import SchedulerPolicy
from symbiont.serve.mlq import MLQScheduler, RunningMeanPredictor, elbow_k, kmeans_1d
from tests.test_serve_common import Reference, prompts

MLQ = EngineConfig(
    max_running=4, max_batched_tokens=32, block_size=4, num_blocks=16, scheduler="mlq"
)  # 64 tokens of KV: two large requests cannot run together


@pytest.fixture(scope="module")
def base(checkpoints):
    return checkpoints("llama")


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def test_fifo_stays_the_default():
    assert EngineConfig().scheduler is SchedulerPolicy.FIFO


def test_weighted_request_size_weights_each_normalised_term(base):
    engine = Engine.from_pretrained(base, config=MLQ)
    scheduler = engine.scheduler
    assert isinstance(scheduler, MLQScheduler)
    engine.add_request(Request("big", [3] * 20, None, greedy(40)))
    engine.add_request(Request("r", [3] * 10, None, greedy(20)))
    seq = engine.requests["r"].sequences[0]
    want = 0.3 * 10 / 20 + 0.5 * 20 / 40  # each term over the largest seen; no adapter
    assert scheduler.wrs(seq) == pytest.approx(want)
    assert scheduler.size((20.0, 20.0, 0.0)) == pytest.approx(0.3 + 0.25)


def test_output_predictor_is_a_running_mean_per_adapter_capped_by_max_tokens():
    predictor = RunningMeanPredictor()
    assert predictor.predict("a", 50) == 50, "no history: assume max_tokens"
    for n in (10, 20, 30):
        predictor.observe("a", n)
    predictor.observe("b", 100)
    assert predictor.predict("a", 50) == 20
    assert predictor.predict("a", 5) == 5, "capped by max_tokens"
    assert predictor.predict("new", 500) == pytest.approx(40), "unknown adapter: all requests"


def test_elbow_picks_the_number_of_groups_and_midpoint_cutoffs():
    rng = random.Random(0)
    assert elbow_k([0.2] * 50)[0] == 1
    assert elbow_k([rng.gauss(0.5, 0.05) for _ in range(200)])[0] == 1, "one blob is one queue"
    two = [rng.gauss(0.1, 0.01) for _ in range(100)] + [rng.gauss(0.8, 0.02) for _ in range(20)]
    k, centroids = elbow_k(two)
    assert k == 2 and centroids[0] == pytest.approx(0.1, abs=0.01)
    three = two + [rng.gauss(0.4, 0.01) for _ in range(50)]
    assert elbow_k(three)[0] == 3
    even = [c + rng.gauss(0, 0.001) for c in (0.1, 0.3, 0.5, 0.7, 0.9, 1.1) for _ in range(20)]
    assert elbow_k(even)[0] == 2, "evenly spread sizes: no cluster is worth a third queue"
    apart = [c + rng.gauss(0, 0.01) for c in (1, 10, 100, 1e3, 1e4) for _ in range(20)]
    assert elbow_k(apart)[0] == 4, "five groups far apart: still at most four queues"
    # the raw objective always prefers more clusters: that is why the elbow decides
    assert kmeans_1d(two, 4)[1] < kmeans_1d(two, 2)[1]


def _step_until(engine: Engine, done, limit: int = 500) -> int:
    for steps in range(1, limit + 1):
        engine.step()
        if done():
            return steps
    raise AssertionError("did not finish within the step limit")


def _queue_up(engine: Engine, small: int):
    """Two large requests (44 KV tokens each: one at a time) then `small` small ones."""
    large = [Request(f"large{i}", [5, 6, 7, 8], None, greedy(40)) for i in range(2)]
    smalls = [Request(f"small{i}", [9, 10, 11], None, greedy(3)) for i in range(small)]
    for request in large + smalls:
        engine.add_request(request)
    return large, smalls


@pytest.mark.parametrize("policy", ["fifo", "mlq"])
def test_small_requests_pass_a_large_one_only_with_mlq(base, policy, one_thread):
    """FIFO keeps the small requests behind the second large one (head-of-line
    blocking); MLQ puts them in a faster queue, so they finish while it waits."""
    config = EngineConfig(
        max_running=4, max_batched_tokens=32, block_size=4, num_blocks=16, scheduler=policy
    )
    engine = Engine.from_pretrained(base, config=config)
    large, smalls = _queue_up(engine, small=6)
    if policy == "mlq":
        engine.scheduler.refresh()
        levels = engine.scheduler.levels
        assert len(levels) == 2
        assert sum(level.quota for level in levels) == pytest.approx(64), "quotas split KV"
        assert levels[0].quota >= 6 and levels[1].quota >= 44, "a queue fits its largest"
    _step_until(engine, lambda: all(r.finished for r in smalls))
    second_started = large[1].first_token_time is not None
    assert second_started is (policy == "fifo"), "MLQ smalls waited, or FIFO ones jumped"
    _step_until(engine, lambda: all(r.finished for r in large))


def test_a_flood_of_small_requests_does_not_starve_a_large_one(base, one_thread):
    engine = Engine.from_pretrained(base, config=MLQ)
    large, smalls = _queue_up(engine, small=8)
    engine.scheduler.refresh()
    flood: list[Request] = []

    def more_small_and_done() -> bool:
        for _ in range(2):  # more arrive each iteration than a step finishes
            flood.append(Request(f"flood{len(flood)}", [9, 10, 11], None, greedy(3)))
            engine.add_request(flood[-1])
        return all(r.finished for r in large)

    steps = _step_until(engine, more_small_and_done, limit=400)
    assert engine.scheduler.num_waiting > 0, "the flood was not a flood"
    served = sum(r.finished for r in flood)
    assert served >= 10, f"only {served} small requests ran while the large ones did"
    assert all(r.error is None for r in large) and steps < 400


def test_mlq_outputs_equal_vanilla_under_reordering(base, one_thread):
    reference = Reference(base, {})
    engine = Engine.from_pretrained(base, config=MLQ)
    batch = prompts(9, seed=4)
    sizes = [2, 9, 3, 12, 2, 4, 10, 2, 3]
    requests = [
        Request(f"r{i}", p, None, greedy(n))
        for i, (p, n) in enumerate(zip(batch, sizes, strict=True))
    ]
    for request in requests:
        engine.add_request(request)
    engine.scheduler.refresh()
    _step_until(engine, lambda: all(r.finished for r in requests))
    for request, n in zip(requests, sizes, strict=True):
        assert request.sequences[0].output_ids == reference.generate(request.prompt_ids, None, n)
