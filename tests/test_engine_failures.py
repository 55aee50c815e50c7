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


def test_a_cancelled_submit_neither_runs_nor_stops_the_engine(base):
    """A handler's task cancelled while its submit waits for the engine thread (a
    shutdown, a timeout): settling the cancelled future raised in the engine thread,
    which then failed every request and refused all new ones until a restart."""
    import asyncio
    import threading

    from symbiont.serve.async_engine import AsyncEngine

    engine = Engine(load_client(base, BaseExecutor.from_pretrained(base)), CONFIG)
    failures, added = [], []
    add_request = engine.add_request
    engine.add_request = lambda request: added.append(request.request_id) or add_request(request)
    step, gate = engine.step, threading.Event()
    engine.step = lambda: gate.wait(10) and step()  # holds the thread until the cancel
    server = AsyncEngine(engine, on_failure=failures.append).start()
    busy_prompt, later = prompts(2, seed=3)

    async def scenario():
        busy = await server.submit(
            Request("busy", busy_prompt, None, SamplingParams(max_tokens=30, temperature=0.0))
        )
        victim = asyncio.create_task(server.submit(Request("victim", later, None, GREEDY)))
        await asyncio.sleep(0)  # its command is queued behind the busy request's steps
        victim.cancel()
        with pytest.raises(asyncio.CancelledError):
            await victim
        gate.set()
        outputs = [o async for o in busy]
        after = await server.submit(Request("after", later, None, GREEDY))
        return outputs, [o async for o in after]

    try:
        busy_outputs, after_outputs = asyncio.run(scenario())
        assert server.alive and not failures, failures
        assert busy_outputs[-1].finished and busy_outputs[-1].error is None
        assert after_outputs[-1].finished and after_outputs[-1].error is None
        assert "victim" not in added, "a cancelled submit still added its request"
    finally:
        server.stop()


def test_a_failing_co_serving_hook_leaves_inference_running(base, caplog):
    """An error in the hook that paces fine-tuning jobs (a NaN SLO once did it) escaped
    `Engine.step` and stopped the engine for every request."""
    engine = Engine(load_client(base, BaseExecutor.from_pretrained(base)), CONFIG)

    def hook(tokens, seconds):
        raise ValueError("cannot convert float NaN to integer")

    engine.iteration_hook = hook
    prompt = prompts(1, seed=3)[0]
    got = engine.generate([prompt], None, GREEDY)[0]
    assert got == Reference(base, {}).generate(prompt, None, GREEDY.max_tokens)
    assert engine.iteration_hook is None, "the failing hook is taken out"
    assert "without pacing" in caplog.text
