"""A failing iteration fails the requests it ran and the engine goes on (issue 11 #10)."""

from __future__ import annotations

import pytest

from symbiont import BaseExecutor, load_client
from symbiont.serve import Engine, EngineConfig, FinishReason, Request, SamplingParams
from tests.test_serve_common import Reference, prompts

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
CONFIG = EngineConfig(max_running=4, max_batched_tokens=64, block_size=4, num_blocks=64)


@pytest.fixture(scope="module")
def base(checkpoints):
    return checkpoints("llama")


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(base, monkeypatch):
    engine = Engine(load_client(base, BaseExecutor.from_pretrained(base)), CONFIG)
    forward = engine.runner.forward
    calls = []

    def broken_once(batch):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("device fell over")
        return forward(batch)

    monkeypatch.setattr(engine.runner, "forward", broken_once)
    first, later = prompts(2, seed=1)
    victim = Request("victim", first, None, GREEDY)
    engine.add_request(victim)
    engine.step()
    outputs = engine.step()  # the failing iteration
    assert [o.request_id for o in outputs] == ["victim"] and outputs[0].finished
    assert "device fell over" in outputs[0].error
    assert victim.sequences[0].finish_reason is FinishReason.ERROR
    assert engine.kv_cache.allocator.num_free == CONFIG.num_blocks, "a failed request kept blocks"
    got = engine.generate([later], None, GREEDY)[0]
    assert got == Reference(base, {}).generate(later, None, GREEDY.max_tokens), (
        "the engine did not serve correctly after a failed iteration"
    )
