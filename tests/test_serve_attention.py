"""The serving engine's paged attention against vanilla transformers, where attention
differs between families: sliding windows shorter than the prompts (Mistral, Gemma 2's
and Gemma 3's alternating local/global layers), logit soft-capping (Gemma 2), grouped
query heads (all of them: 4 query heads on 2 KV heads).

Prompts are longer than the windows and the token budget is small, so every path of
`symbiont/serve/attention.py` runs: a first chunk attending over its own keys, later
chunks gathering their context from the paged pool, decoding sequences of different
lengths batched under one mask and read in place from their aligned block runs
(tests/test_kv_runs.py mixes those with decoding sequences on scattered blocks).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from symbiont import BaseExecutor, load_client
from symbiont.serve import Engine, EngineConfig, Request, SamplingParams
from tests.test_serve_common import Reference, prompts
from tests.tiny_models import ARCHS, build_checkpoint

LOGITS_ATOL = 1e-4  # fp32; batching changes summation order, not math
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
CHUNKED = EngineConfig(max_running=5, max_batched_tokens=9, block_size=4, num_blocks=96)
WIDE = EngineConfig(max_running=8, max_batched_tokens=256, block_size=4, num_blocks=96)

VARIANTS = {
    "mistral_window": ("mistral", {"sliding_window": 5}),
    "gemma2_softcap_window": ("gemma2", {"sliding_window": 6, "attn_logit_softcapping": 0.1}),
    "gemma3_window": ("gemma3", {"sliding_window": 6}),
    "llama_gqa": ("llama", {}),
}


@pytest.fixture(scope="module")
def variant(request, tmp_path_factory):
    arch, extra = VARIANTS[request.param]
    config = {**ARCHS[arch].config, **extra}
    base = build_checkpoint(
        dataclasses.replace(ARCHS[arch], config=config), tmp_path_factory.mktemp(request.param)
    )
    return base, Reference(base, {})


def engine_for(base, config) -> Engine:
    return Engine(load_client(base, BaseExecutor.from_pretrained(base)), config)


@pytest.mark.parametrize("variant", list(VARIANTS), indirect=True)
@pytest.mark.parametrize("config", [CHUNKED, WIDE], ids=["chunked", "wide"])
def test_greedy_output_equals_vanilla(variant, config):
    base, reference = variant
    batch = prompts(6, seed=5, low=3, high=20)
    engine = engine_for(base, config)
    for prompt, got in zip(batch, engine.generate(batch, [None] * 6, GREEDY), strict=True):
        assert got == reference.generate(prompt, None, GREEDY.max_tokens)


@pytest.mark.parametrize("variant", list(VARIANTS), indirect=True)
def test_logits_of_a_mixed_step_within_tolerance(variant, monkeypatch):
    """One iteration holding decoding sequences of different lengths, a continued chunk
    and a first chunk; every sampled row's logits against vanilla on the same tokens."""
    base, reference = variant
    engine = engine_for(base, dataclasses.replace(WIDE, max_batched_tokens=24))
    params = SamplingParams(max_tokens=6, temperature=0.0)
    for i, p in enumerate(prompts(3, seed=7, low=5, high=7)):
        engine.add_request(Request(f"a{i}", p, None, params))
    engine.step()  # all three prefilled
    engine.step()  # decoding
    late = prompts(1, seed=8, low=30, high=30) + prompts(1, seed=9, low=12, high=12)
    for i, p in enumerate(late):
        engine.add_request(Request(f"b{i}", p, None, params))
    engine.step()  # 3 decodes + the first 21 tokens of b0
    steps = []
    run = engine.runner.run

    def recording_run(scheduled):
        steps.append(
            [
                (item.start, item.n_tokens, item.seq.token_ids[: item.start + item.n_tokens])
                for item in scheduled
                if item.samples
            ]
        )
        return steps[-1].append(run(scheduled)) or steps[-1][-1]

    monkeypatch.setattr(engine.runner, "run", recording_run)
    engine.step()  # 3 decodes + b0's last 9 tokens (continued) + b1's 12 (first chunk)
    *items, logits = steps[0]
    kinds = sorted((start > 0, n) for start, n, _ in items)
    assert kinds == [(False, 12), (True, 1), (True, 1), (True, 1), (True, 9)], kinds
    for row, (_, _, tokens) in zip(logits.sampling, items, strict=True):
        want = reference.logits(tokens, None)[-1]
        assert torch.allclose(row, want, atol=LOGITS_ATOL), float((row - want).abs().max())


@pytest.mark.parametrize("variant", ["gemma2_softcap_window"], indirect=True)
def test_schedule_order_does_not_change_logits(variant):
    """Decoding sequences out of flat order take the gathered-query path: same logits."""
    base, _ = variant
    outputs = []
    for reverse in (False, True):
        engine = engine_for(base, WIDE)
        for i, p in enumerate(prompts(4, seed=9, low=5, high=15)):
            engine.add_request(Request(f"r{i}", p, None, GREEDY))
        engine.step()  # prefill every prompt
        engine.step()
        scheduled = engine.scheduler.schedule()  # four decoding sequences
        assert len(scheduled) == 4 and all(item.n_tokens == 1 for item in scheduled)
        logits = engine.runner.run(scheduled[::-1] if reverse else scheduled).sampling
        outputs.append(logits.flip(0) if reverse else logits)
    torch.testing.assert_close(outputs[0], outputs[1], atol=LOGITS_ATOL, rtol=0)
