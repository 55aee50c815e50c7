"""KV blocks as aligned contiguous runs, and decoding attention that reads them in place.

The allocator (symbiont/serve/kv_cache.py) hands a sequence one run of blocks aligned to
its size class when one is free and scattered blocks when the pool is fragmented; the
model runner puts decoding sequences whose runs share a lattice in one strided view of the
pool (`PoolRows`), the others in the gathered group. Both kinds are mixed here in one
decode step (and in chunked prefills, whose later chunks on runs also read in place), on
both sides of the view's waste limit, with sliding windows, soft-capping,
grouped-query heads, a prefix-tuning adapter (its keys written into the first KV slots)
and sequences that finish and free runs that later ones reuse; every sampled row's logits
must be within 1e-4 (fp32) of vanilla transformers on the same tokens, and greedy tokens
equal.
"""

from __future__ import annotations

import dataclasses

import peft
import pytest
import torch

from symbiont import BaseExecutor, load_client
from symbiont.serve import Engine, EngineConfig, SamplingParams
from symbiont.serve.kv_cache import BlockAllocator, OutOfBlocks, PagedKVCache
from symbiont.serve.model_runner import MAX_ROWS_PER_SEQ
from tests.test_serve_common import Reference, prompts, save_adapter
from tests.tiny_models import ARCHS, build_checkpoint

LOGITS_ATOL = 1e-4  # fp32; batching changes summation order, not math
PARAMS = SamplingParams(max_tokens=6, temperature=0.0)
# prompts of 5-10 tokens + 6 new ones: 3-4 blocks of 4, size class 4
CONFIG = EngineConfig(max_running=8, max_batched_tokens=256, block_size=4, num_blocks=48)

VARIANTS = {
    "llama_gqa": ("llama", {}),
    "mistral_window": ("mistral", {"sliding_window": 5}),
    "gemma2_softcap_window": ("gemma2", {"sliding_window": 6, "attn_logit_softcapping": 0.1}),
    "gemma3_window": ("gemma3", {"sliding_window": 6}),
}


# -- the allocator ------------------------------------------------------------------


def test_runs_start_at_a_multiple_of_their_size_class():
    allocator = BlockAllocator(64)
    nine, three, sixteen, one = (allocator.allocate(n) for n in (9, 3, 16, 1))
    assert nine == list(range(0, 9))  # class 16
    assert three == list(range(12, 15))  # class 4: 0, 4 and 8 are taken
    assert sixteen == list(range(16, 32))
    assert one == [9]
    assert all(allocator.is_run(b) for b in (nine, three, sixteen, one))
    assert allocator.num_free == 64 - 29


def test_a_fragmented_pool_gives_scattered_blocks_then_runs_again_once_freed():
    allocator = BlockAllocator(16)
    singles = [allocator.allocate(1) for _ in range(16)]
    assert [b[0] for b in singles] == list(range(16))
    for block in (1, 2, 3, 5, 6, 9):  # free stretches of 3, 2 and 1 blocks
        allocator.free(singles[block])
    four = allocator.allocate(4)  # no 4 free in a row: scattered, from the top down
    assert four == [9, 6, 5, 3] and not allocator.is_run(four)
    three = allocator.allocate(2)  # no free pair starts at an even block: 1-2, unaligned
    assert three == [1, 2] and allocator.is_run(three)
    assert allocator.num_free == 0 and not allocator.can_allocate(1)
    with pytest.raises(OutOfBlocks, match="asked for 1 KV blocks, 0 free"):
        allocator.allocate(1)
    allocator.free(four)
    allocator.free(three)
    for block in (0, 4, 7, 8, 10, 11, 12, 13, 14, 15):
        allocator.free(singles[block])
    assert allocator.num_free == 16
    assert allocator.allocate(16) == list(range(16))  # one run again, freed runs reused


def test_a_run_that_fits_only_unaligned_is_still_one_run():
    allocator = BlockAllocator(8)
    first = allocator.allocate(1)  # block 0
    run = allocator.allocate(5)  # class 8 cannot start at 0: the lowest free 5 in a row
    assert first == [0] and run == [1, 2, 3, 4, 5] and allocator.is_run(run)
    allocator.free(run)
    assert not allocator.is_run(run) and allocator.num_free == 7


def test_freeing_twice_and_bad_sizes_are_refused():
    allocator = BlockAllocator(4)
    blocks = allocator.allocate(2)
    allocator.free(blocks)
    with pytest.raises(RuntimeError, match="KV block 0 was freed twice"):
        allocator.free(blocks)
    with pytest.raises(ValueError, match="num_blocks must be at least 1"):
        BlockAllocator(0)


def test_slot_views_write_into_the_head_major_pools():
    """`pools` (what prefix tuning writes through) and `head_major` are one storage."""
    cache = PagedKVCache(num_blocks=4, block_size=2, device=torch.device("cpu"))
    like = torch.zeros(1, 3, 5)  # [n_tokens, kv_heads, head_dim]
    keys, values = cache.pools(0, like)
    assert keys.shape == (8, 3, 5)
    new = torch.arange(2 * 3 * 5, dtype=torch.float32).view(2, 3, 5)
    keys.index_copy_(0, torch.tensor([6, 1]), new)
    stored, _ = cache.head_major(0, like)
    assert stored.shape == (3, 8, 5) and stored.is_contiguous()
    assert torch.equal(stored[:, 6], new[0]) and torch.equal(stored[:, 1], new[1])
    assert cache.memory_bytes() == 2 * 8 * 3 * 5 * 4


# -- decoding attention over runs and scattered blocks ------------------------------


@pytest.fixture(scope="module")
def variant(request, tmp_path_factory):
    arch, extra = VARIANTS[request.param]
    config = {**ARCHS[arch].config, **extra}
    base = build_checkpoint(
        dataclasses.replace(ARCHS[arch], config=config), tmp_path_factory.mktemp(request.param)
    )
    return base, Reference(base, {})


def engine_for(base, config=CONFIG, adapters=None) -> Engine:
    engine = Engine(load_client(base, BaseExecutor.from_pretrained(base)), config)
    for name, path in (adapters or {}).items():
        engine.load_adapter(name, path)
    return engine


def hold(engine: Engine, free: set[int]) -> list[list[int]]:
    """Take every KV block but those in `free` (as other sequences would); -> the taken."""
    allocator = engine.kv_cache.allocator
    taken = [allocator.allocate(1) for _ in range(allocator.num_blocks)]
    for block in free:
        allocator.free(taken[block])
    return [b for b in taken if b[0] not in free]


def run_checked(engine: Engine, reference: Reference, batch, names, monkeypatch):
    """Generate `batch`, checking every sampled row's logits against vanilla;
    -> (outputs, attention groups of every step)."""
    decode_groups = []
    run, prepare = engine.runner.run, engine.runner.prepare

    def recording_prepare(scheduled):
        batch = prepare(scheduled)
        decode_groups.append(batch.ctx.attn_groups)
        return batch

    def checked_run(scheduled):
        logits = run(scheduled)
        rows = [item for item in scheduled if item.samples]
        for item, row in zip(rows, logits.sampling, strict=True):
            seq = item.seq
            tokens = seq.token_ids[: item.start - seq.num_virtual + item.n_tokens]
            name = names[int(seq.request_id.rsplit("-", 1)[1])]  # generate-<ns>-<index>
            want = reference.logits(tokens, name)[-1]
            assert torch.allclose(row, want, atol=LOGITS_ATOL), float((row - want).abs().max())
        return logits

    monkeypatch.setattr(engine.runner, "prepare", recording_prepare)
    monkeypatch.setattr(engine.runner, "run", checked_run)
    outputs = engine.generate(batch, names, PARAMS)
    for prompt, name, got in zip(batch, names, outputs, strict=True):
        assert got == reference.generate(prompt, name, PARAMS.max_tokens)
    return outputs, decode_groups


def kinds(groups, decode: bool = True) -> list[tuple[str, int]]:
    """('rows' | 'gathered', sequences) of a step's decode groups (or its later chunks)."""
    return sorted(
        ("rows" if g.rows is not None else "gathered", g.n_seqs)
        for g in groups
        if (g.n_queries == 1) == decode and (decode or g.rows is not None or g.blocks is not None)
    )


@pytest.mark.parametrize("variant", list(VARIANTS), indirect=True)
@pytest.mark.parametrize("budget", [256, 5], ids=["whole_prompts", "chunked"])
def test_runs_and_scattered_sequences_decode_together(variant, budget, monkeypatch, one_thread):
    """Blocks 0-7 hold two aligned runs; the rest of the free blocks are scattered (no
    4-aligned 4 in a row): two sequences read in place, two gathered, in one step. With
    a budget of 5 tokens, prompts are prefilled in chunks: later chunks of the sequences
    on runs read their context in place, those on scattered blocks gather it."""
    base, reference = variant
    config = dataclasses.replace(CONFIG, max_running=4, max_batched_tokens=budget)
    engine = engine_for(base, config)
    scattered = {9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23}
    held = hold(engine, set(range(8)) | scattered)
    batch = prompts(4, seed=3, low=5, high=10)
    _, steps = run_checked(engine, reference, batch, [None] * 4, monkeypatch)
    decodes = [kinds(groups) for groups in steps]
    if budget == 256:  # all four decode from the second step on
        assert [("gathered", 2), ("rows", 2)] in decodes
    assert {"gathered", "rows"} in [{kind for kind, _ in step} for step in decodes]
    chunks = {kind for groups in steps for kind, _ in kinds(groups, decode=False)}
    assert chunks == (set() if budget == 256 else {"rows", "gathered"})
    for blocks in held:
        engine.kv_cache.allocator.free(blocks)
    assert engine.kv_cache.allocator.num_free == CONFIG.num_blocks, "KV blocks leaked"


@pytest.mark.parametrize("variant", ["llama_gqa"], indirect=True)
@pytest.mark.parametrize("rows_between", [int(2 * MAX_ROWS_PER_SEQ) - 1, int(2 * MAX_ROWS_PER_SEQ)])
def test_the_view_limit_on_rows_computed_for_nothing(variant, rows_between, monkeypatch):
    """Two runs `rows_between` rows apart: the view would span rows_between + 1 rows for
    two sequences; at most MAX_ROWS_PER_SEQ rows per sequence it is read in place, past
    it the two are gathered. Same logits and tokens either way."""
    base, reference = variant
    engine = engine_for(base)
    held = hold(engine, {0, 1, 2, 3} | {4 * rows_between + b for b in range(4)})
    _, steps = run_checked(engine, reference, prompts(2, 4, 5, 10), [None] * 2, monkeypatch)
    view = rows_between + 1 <= MAX_ROWS_PER_SEQ * 2
    want = [("rows", 2)] if view else [("gathered", 2)]
    assert steps[-1] == [] or kinds(steps[-1]) == want  # the last step samples only
    assert want in [kinds(groups) for groups in steps]
    if view:
        rows = next(g.rows for groups in steps for g in groups if g.rows is not None)
        assert rows.n_rows == rows_between + 1 and rows.stride == 4 * CONFIG.block_size
    for blocks in held:
        engine.kv_cache.allocator.free(blocks)


@pytest.mark.parametrize("variant", ["llama_gqa"], indirect=True)
def test_a_run_that_fits_only_unaligned_is_gathered(variant, monkeypatch):
    """Blocks 1-4 are the only free ones: the sequence's run starts off its class's
    lattice, so no view holds it; it decodes from the gathered group."""
    base, reference = variant
    engine = engine_for(base)
    held = hold(engine, {1, 2, 3, 4})
    _, steps = run_checked(engine, reference, prompts(1, 12, 5, 10), [None], monkeypatch)
    assert [("gathered", 1)] in [kinds(groups) for groups in steps]
    for blocks in held:
        engine.kv_cache.allocator.free(blocks)


@pytest.mark.parametrize("variant", ["mistral_window"], indirect=True)
def test_runs_freed_by_finished_sequences_are_reused(variant, monkeypatch, one_thread):
    """More requests than running room, of different lengths: sequences finish, their
    runs are freed and handed to later ones, which decode in place beside older ones."""
    base, reference = variant
    engine = engine_for(base, dataclasses.replace(CONFIG, max_running=3, num_blocks=16))
    batch = prompts(7, seed=11, low=3, high=12)
    _, steps = run_checked(engine, reference, batch, [None] * 7, monkeypatch)
    assert sum(kinds(groups) == [("rows", 3)] for groups in steps) >= 3
    assert engine.kv_cache.allocator.num_free == 16 and not engine.kv_cache.allocator._runs


def test_prefix_tuning_keys_in_a_run_and_in_scattered_blocks(
    checkpoints, tmp_path, monkeypatch, one_thread
):
    """A prefix adapter writes its keys into a request's first KV slots at admission:
    read in place from a run, and gathered from scattered blocks, beside the base."""
    base = checkpoints("llama")
    config = peft.PrefixTuningConfig(num_virtual_tokens=5, task_type="CAUSAL_LM")
    adapters = {"prefix": save_adapter(base, config, tmp_path / "prefix", seed=3)}
    reference = Reference(base, adapters)
    engine = engine_for(base, dataclasses.replace(CONFIG, num_blocks=64), adapters)
    scattered = {17, 18, 19, 21, 22, 23, 25, 26, 27, 29, 30, 31, 33, 34, 35, 37, 38, 39}
    held = hold(engine, set(range(16)) | scattered)  # two runs of class 8
    names = ["prefix", "prefix", None, "prefix"]
    _, steps = run_checked(engine, reference, prompts(4, 6, 5, 10), names, monkeypatch)
    assert any(
        ("rows", 2) in kinds(groups) and ("gathered", 2) in kinds(groups) for groups in steps
    )
    for blocks in held:
        engine.kv_cache.allocator.free(blocks)
    assert engine.kv_cache.allocator.num_free == 64
