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
from symbiont.serve import (
    Engine,
    EngineConfig,
    Request,
    SamplingParams,
    attention,
    decode_kernel,
)
from symbiont.serve.context import AttnGroup
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


LONG = EngineConfig(max_running=4, max_batched_tokens=240, block_size=16, num_blocks=96)


@pytest.fixture(scope="module", params=["llama_gqa", "mistral_window"])
def long_variant(request, tmp_path_factory):
    arch, extra = VARIANTS[request.param]
    extra = {**extra, "max_position_embeddings": 512}
    if "sliding_window" in extra:
        extra["sliding_window"] = 100  # shorter than the long chunks, longer than a block
    config = {**ARCHS[arch].config, **extra}
    base = build_checkpoint(
        dataclasses.replace(ARCHS[arch], config=config), tmp_path_factory.mktemp(request.param)
    )
    return base, Reference(base, {})


@pytest.mark.parametrize("through", ["kernel", "sdpa_blocks"])
def test_long_chunks_as_vanilla(long_variant, through, monkeypatch):
    """Long prefill chunks, a first one over its own keys and a continued one over its
    context in the pool, through the CPU chunk kernel (the default) or, without it, SDPA
    in blocks of queries (CHUNK_BLOCKS_MIN tokens or more). Every sampled row's logits
    against vanilla, and the greedy tokens."""
    base, reference = long_variant
    chunks = []
    if through == "kernel":
        real = decode_kernel.DecodeKernel.chunk

        def spy(self, q, k, v, start, window, scale):
            chunks.append((q.shape[1], start))
            return real(self, q, k, v, start, window, scale)

        monkeypatch.setattr(decode_kernel.DecodeKernel, "chunk", spy)
        config = LONG
    else:
        real_blocks = attention._chunk_in_blocks

        def spy(q, k, v, mask, start, scale):
            chunks.append((q.shape[2], start))
            return real_blocks(q, k, v, mask, start, scale)

        monkeypatch.setattr(attention, "_chunk_in_blocks", spy)
        config = dataclasses.replace(LONG, decode_kernel=False)
    engine = engine_for(base, config)
    if through == "kernel" and engine.runner.decode_kernel is None:
        pytest.skip(f"CPU kernels not built here: {decode_kernel.unavailable_reason()}")
    rows = []
    run = engine.runner.run

    def recording_run(scheduled):
        logits = run(scheduled)
        sampled = [item for item in scheduled if item.samples]
        for item, row in zip(sampled, logits.sampling, strict=True):
            rows.append((item.seq.token_ids[: item.start + item.n_tokens], row))
        return logits

    monkeypatch.setattr(engine.runner, "run", recording_run)
    batch = prompts(1, seed=11, low=230, high=230) + prompts(1, seed=12, low=450, high=450)
    got = engine.generate(batch, [None, None], SamplingParams(max_tokens=3, temperature=0.0))
    assert any(start == 0 for _, start in chunks), chunks
    assert any(start > 0 and m >= attention.CHUNK_BLOCKS_MIN for m, start in chunks), chunks
    for prompt, tokens in zip(batch, got, strict=True):
        assert tokens == reference.generate(prompt, None, 3)
    for tokens, row in rows:
        want = reference.logits(tokens, None)[-1]
        assert torch.allclose(row, want, atol=LOGITS_ATOL), float((row - want).abs().max())


@pytest.mark.parametrize("window", [None, 50])
@pytest.mark.parametrize("start", [0, 37])
def test_a_chunk_in_blocks_equals_one_masked_call(start, window):
    """`_chunk_in_blocks` against one SDPA call under the same mask: a chunk length that
    is no multiple of the block, grouped query heads, with and without context before."""
    m, heads, kv_heads, hd = 203, 4, 2, 16
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, heads, m, hd, generator=g)
    k, v = (torch.randn(1, kv_heads, start + m + 5, hd, generator=g) for _ in range(2))
    group = AttnGroup(
        n_seqs=1,
        n_queries=m,
        span=(0, m),
        tokens=None,
        blocks=None,
        kv_width=start + m + 5,  # a gathered context is wider than the chunk needs
        q_pos=torch.arange(start, start + m)[None],
        kv_len=torch.tensor([start + m]),
        start=start,
    )
    mask = group.mask(window, q.dtype)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=0.25, enable_gqa=True
    )
    got = attention._chunk_in_blocks(q, k, v, mask, start, 0.25)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
