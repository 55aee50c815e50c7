"""Many LoRA adapters of different ranks in one batch, on both LoRA paths of
`AdapterLayer`: rows read in place per token (`LoraRows`, adapters with few tokens in the
iteration) and slot groups gathered once (`LoraBucket`, adapters with many). Each
request equals vanilla transformers + peft with its adapter alone, and base rows are
untouched by the adapter math."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from symbiont import BaseExecutor, load_client
from symbiont.serve import Engine, EngineConfig, Request, SamplingParams
from symbiont.serve.adapters import (
    DENSE_MIN_TOKENS,
    RANK_CHUNK,
    AdapterLayer,
    LoraWeights,
    adapter_batch,
    bucket_rank,
)
from symbiont.serve.context import use_context
from tests.test_serve_common import Reference, lora_config, prompts, save_adapter
from tests.tiny_models import ARCHS

LOGITS_ATOL = 1e-4
# Ranks on both sides of the 16-rank chunks of Aᵀ, rounded up into every bucket up to 48.
RANKS = (1, 3, 8, 13, 16, 17, 24, 33, 48)
MAX_RANK = 48
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
CONFIG = EngineConfig(
    max_running=24, max_batched_tokens=256, block_size=4, num_blocks=256, max_lora_rank=MAX_RANK
)


@pytest.fixture(scope="module")
def many(checkpoints, tmp_path_factory):
    """(checkpoint, adapters, reference): one LoRA per rank of RANKS, every linear layer
    or only the attention projections, alternately."""
    base = checkpoints("llama")
    folder = tmp_path_factory.mktemp("many-adapters")
    attention = list(ARCHS["llama"].attention)
    adapters = {}
    for i, rank in enumerate(RANKS):
        targets = "all-linear" if i % 2 == 0 else attention
        config = lora_config("llama", rank, targets=targets)
        adapters[f"r{rank}"] = save_adapter(base, config, folder / f"r{rank}", seed=100 + i)
    return base, adapters, Reference(base, adapters)


def engine_for(base, adapters) -> Engine:
    engine = Engine(load_client(base, BaseExecutor.from_pretrained(base)), CONFIG)
    for name, path in adapters.items():
        engine.load_adapter(name, path)
    return engine


def test_every_rank_mixed_with_the_base_equals_vanilla_peft(many):
    """Decoding rows of nine adapters and the base in one batch, plus nine requests of one
    adapter, whose decode tokens take the grouped path, all equal vanilla alone."""
    base, adapters, reference = many
    engine = engine_for(base, adapters)
    crowd = ["r17"] * (DENSE_MIN_TOKENS + 1)  # one adapter with enough tokens to group
    names = [None, *adapters, None, *crowd]
    batch = prompts(len(names), seed=21, low=2, high=14)  # chunks below and above the bar
    outputs = engine.generate(batch, names, GREEDY)
    for prompt, name, got in zip(batch, names, outputs, strict=True):
        want = reference.generate(prompt, name, GREEDY.max_tokens)
        assert got == want, f"adapter {name}: batched output differs from vanilla peft alone"


def test_logits_of_many_ranks_within_tolerance_of_vanilla(many, monkeypatch):
    base, adapters, reference = many
    engine = engine_for(base, adapters)
    captured = []
    forward = engine.runner.forward
    monkeypatch.setattr(
        engine.runner, "forward", lambda b: captured.append(forward(b)) or captured[-1]
    )
    names = [None, *adapters, None]
    batch = prompts(len(names), seed=4, low=2, high=6)
    one = SamplingParams(max_tokens=2, temperature=0.0)
    requests = [
        Request(f"m{i}", p, n, one) for i, (p, n) in enumerate(zip(batch, names, strict=True))
    ]
    for request in requests:
        engine.add_request(request)
    engine.step()  # every prompt whole, each adapter's chunk below the grouping bar
    engine.step()  # one decode token per request: rows read in place
    for step, logits in enumerate(captured):
        assert logits.shape[0] == len(batch)
        for i, (request, name) in enumerate(zip(requests, names, strict=True)):
            tokens = request.prompt_ids + request.sequences[0].output_ids[:step]
            want, got = reference.logits(tokens, name)[-1], logits[i]
            assert torch.allclose(got, want, atol=LOGITS_ATOL), (
                f"step {step}, request {i} ({name}): max |diff| "
                f"{float((got - want).abs().max()):.2e}"
            )


def _layer_with_slots(ranks, d_in, d_out, max_rank, dtype=torch.float32):
    """An AdapterLayer with a LoRA of ranks[s - 1] in slot s; its weights by slot."""
    torch.manual_seed(0)
    slots = len(ranks) + 1
    base = torch.nn.Linear(d_in, d_out).to(dtype)
    layer = AdapterLayer(base, d_in, d_out, slots)
    registry = SimpleNamespace(
        slot_bucket=[0] * slots, slot_is_ia3=[False] * slots, slot_is_dora=[False] * slots
    )
    weights = {}
    for s, r in enumerate(ranks, start=1):
        weights[s] = LoraWeights(
            torch.randn(r, d_in).to(dtype), torch.randn(d_out, r).to(dtype), 0.25 + s / 8
        )
        layer.put(s, weights[s], max_rank)
        registry.slot_bucket[s] = bucket_rank(r, max_rank)
    return layer, registry, weights


@pytest.mark.parametrize("dense_min", [1, DENSE_MIN_TOKENS, 10**9], ids=["grouped", "mix", "rows"])
def test_both_paths_equal_a_per_token_reference_and_leave_base_rows_alone(dense_min):
    """Slots of ranks across chunk and bucket boundaries, tokens of one slot spread out
    and interleaved with base tokens: y_t = x_t W + x_t A_sᵀ B_sᵀ·scale_s, and the rows
    of slot 0 are exactly the base layer's output."""
    ranks = (1, 5, 16, 17, 31, 40)
    d_in, d_out = 24, 20
    layer, registry, weights = _layer_with_slots(ranks, d_in, d_out, max_rank=40)
    assert layer.lora_a_t.shape[1] == -(-40 // RANK_CHUNK)
    g = torch.Generator().manual_seed(1)
    token_slots = torch.randint(0, len(ranks) + 1, (60,), generator=g)
    token_slots[:12] = 3  # one slot with enough tokens for the grouped path
    token_slots = token_slots[torch.randperm(60, generator=g)]
    x = torch.randn(60, d_in)
    batch = adapter_batch(token_slots, registry, dense_min=dense_min)
    assert (batch.lora_rows is not None) == (dense_min > 1)
    assert bool(batch.lora) == (dense_min < 10**9)
    with torch.no_grad(), use_context(SimpleNamespace(adapters=batch)):
        got = layer(x)
        plain = layer.base(x)
    want = plain.clone()
    for t, s in enumerate(token_slots.tolist()):
        if s:
            w = weights[s]
            want[t] += (x[t] @ w.a.T @ w.b.T) * w.scale
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (got - want).abs().max()
    base_rows = token_slots == 0
    assert torch.equal(got[base_rows], plain[base_rows]), "adapter math touched base rows"


def test_rows_of_every_token_add_to_the_whole_batch():
    """Every token a LoRA row, in order (a pure decode step of adapted requests): the
    delta is added to the whole output at once."""
    layer, registry, weights = _layer_with_slots((4, 16, 32), 16, 12, max_rank=32)
    token_slots = torch.tensor([3, 1, 2, 3, 1])
    batch = adapter_batch(token_slots, registry)
    assert batch.lora_rows is not None and batch.lora_rows.all_tokens and not batch.lora
    x = torch.randn(5, 16)
    with torch.no_grad(), use_context(SimpleNamespace(adapters=batch)):
        got = layer(x)
        want = layer.base(x)
    for t, s in enumerate(token_slots.tolist()):
        want[t] += (x[t] @ weights[s].a.T @ weights[s].b.T) * weights[s].scale
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_base_only_step_takes_the_short_path_with_the_same_batch():
    """A step whose tokens all use no adapter skips sorting (`any_adapter=False`, what the
    runner passes then): the batch it gets equals the full path's."""
    layer, registry, _ = _layer_with_slots((4, 16), 16, 12, max_rank=16)
    registry.slot_is_ia3[2] = registry.slot_is_dora[1] = True  # loaded, not used
    zeros = torch.zeros(7, dtype=torch.long)
    short, full = adapter_batch(zeros, registry, any_adapter=False), adapter_batch(zeros, registry)
    assert (short.lora, short.has_ia3, short.has_dora, short.lora_rows) == ((), False, False, None)
    assert (full.lora, full.has_ia3, full.has_dora, full.lora_rows) == ((), False, False, None)
    assert torch.equal(short.token_slots, zeros)
    x = torch.randn(7, 16)
    with torch.no_grad(), use_context(SimpleNamespace(adapters=short)):
        assert torch.equal(layer(x), layer.base(x))


def test_reused_slot_keeps_no_rows_of_its_previous_adapter():
    """A slot refilled with a lower rank reads zeros where the old adapter's higher ranks
    were (both paths)."""
    layer, registry, _ = _layer_with_slots((40,), 16, 12, max_rank=40)
    small = LoraWeights(torch.randn(3, 16), torch.randn(12, 3), 0.5)
    layer.put(1, small, 40)
    registry.slot_bucket[1] = bucket_rank(3, 40)
    x = torch.randn(9, 16)
    want = layer.base(x) + (x @ small.a.T @ small.b.T) * small.scale
    for dense_min in (1, 10**9):
        batch = adapter_batch(torch.ones(9, dtype=torch.long), registry, dense_min=dense_min)
        with torch.no_grad(), use_context(SimpleNamespace(adapters=batch)):
            got = layer(x)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), dense_min


def test_rows_path_in_bfloat16_matches_the_grouped_path():
    """Half-precision stacks: the in-place rows and the grouped bmm agree within bf16
    rounding (embedding_bag takes per-sample weights in the table's dtype)."""
    layer, registry, _ = _layer_with_slots((8, 24), 32, 32, max_rank=32, dtype=torch.bfloat16)
    token_slots = torch.tensor([1, 2, 0, 2, 1, 1])
    x = torch.randn(6, 32, dtype=torch.bfloat16)
    outs = []
    for dense_min in (1, 10**9):
        batch = adapter_batch(token_slots, registry, dense_min=dense_min)
        with torch.no_grad(), use_context(SimpleNamespace(adapters=batch)):
            outs.append(layer(x).float())
    assert torch.allclose(outs[0], outs[1], rtol=2e-2, atol=2e-2)
