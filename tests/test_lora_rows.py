"""symbiont's LoRA rows kernel (symbiont/kernels/lora_rows.py) against float64 LoRA terms,
the checks that keep its reads and writes inside the tensors, and the serving engine's
adapter layers with and without it (symbiont/serve/adapters.py). Also the huge-page
allocation of the stacks (symbiont/util/memory.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from symbiont.kernels import library
from symbiont.kernels.lora_rows import (
    MAX_CHUNKS,
    RANK_CHUNK,
    LoraRowsKernel,
    RowsIndex,
    block_b,
    unblock_b,
)
from symbiont.serve import adapters
from symbiont.serve.adapters import AdapterLayer, LoraWeights, adapter_batch, bucket_rank
from symbiont.serve.context import use_context
from symbiont.util import memory

ATOL_PER_TERM = 1e-6  # fp32 rounding of a sum of unit-scale terms, against float64


@pytest.fixture(scope="module")
def kernel() -> LoraRowsKernel:
    loaded = LoraRowsKernel.load()
    if loaded is None:
        pytest.skip(f"CPU kernels not built here: {library.unavailable_reason()}")
    return loaded


def stacks(ranks, d_in, d_out, r_max, seed=0, dtype=torch.float32):
    """Aᵀ [slots, chunks, in, 16] and B in blocks [slots, r_max / 8, out / 8, 8, 8] as
    AdapterLayer fills them (zero beyond each slot's rank), slot s + 1 holding ranks[s],
    in `dtype`."""
    g = torch.Generator().manual_seed(seed)
    slots, chunks = len(ranks) + 1, -(-r_max // RANK_CHUNK)
    a_t = torch.zeros(slots, chunks, d_in, RANK_CHUNK)
    b = torch.zeros(slots, r_max, d_out)
    for s, r in enumerate(ranks, start=1):
        a = torch.zeros(chunks * RANK_CHUNK, d_in)
        a[:r] = torch.randn(r, d_in, generator=g)
        a_t[s] = a.view(chunks, RANK_CHUNK, d_in).transpose(1, 2)
        b[s, :r] = torch.randn(r, d_out, generator=g)
    return a_t.to(dtype), block_b(b.to(dtype))


def reference(x, tokens, slots, ranks, a_t, b) -> torch.Tensor:
    """float64 y-increments [n_tokens, out] of each row: x[t] · A[s]ᵀ[:, :r] · B[s][:r]."""
    chunks, b = a_t.shape[1], unblock_b(b)  # [slots, r_max, out]
    delta = torch.zeros(x.shape[0], b.shape[2], dtype=torch.float64)
    for t, s, r in zip(tokens.tolist(), slots.tolist(), ranks.tolist(), strict=True):
        a = a_t[s].transpose(1, 2).reshape(chunks * RANK_CHUNK, -1)[:r].double()  # [r, in]
        delta[t] = (x[t].double() @ a.t()) @ b[s, :r].double()
    return delta


def call(kernel, x, y, tokens, slots, ranks, a_t, b) -> torch.Tensor:
    r_max = b.shape[1] * b.shape[3]
    index = RowsIndex.check(tokens, slots, ranks, x.shape[0], a_t.shape[0], a_t.shape[1], r_max)
    assert index is not None
    kernel(x, y, index, a_t, b)
    return y


# ranks: inside one chunk and one block of B, at and across their boundaries, the whole
# stack; input widths with and without a tail of fewer than 4 floats (the shrink's step);
# rows: a subset of the tokens, out of slot order
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d_in, d_out", [(24, 24), (16, 40), (96, 8), (5, 16)])
def test_rows_equal_float64_within_rounding(kernel, d_in, d_out, dtype):
    """Stacks in float32 or bfloat16: the float32 sums of the stacks' own values (bfloat16
    widened exactly) within fp32 rounding of a float64 reference."""
    ranks = (1, 5, 8, 16, 17, 31, 40, 48)
    a_t, b = stacks(ranks, d_in, d_out, r_max=48, seed=d_in + d_out, dtype=dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(14, d_in + 3, generator=g)[:, :d_in]  # rows 3 floats apart
    tokens = torch.tensor([0, 2, 3, 5, 6, 7, 9, 10, 13])
    slots = torch.tensor([8, 1, 3, 2, 4, 8, 6, 5, 7])
    ranks_of_rows = torch.tensor([ranks[s - 1] for s in slots.tolist()])
    y0 = torch.randn(14, d_out + 2, generator=g)[:, :d_out]  # rows 2 floats apart
    got = call(kernel, x, y0.clone(), tokens, slots, ranks_of_rows, a_t, b)
    want = y0.double() + reference(x, tokens, slots, ranks_of_rows, a_t, b)
    scale = (d_in * 48) ** 0.5
    assert torch.allclose(got.double(), want, rtol=0, atol=ATOL_PER_TERM * d_in * 48 * scale)
    untouched = torch.ones(14, dtype=torch.bool)
    untouched[tokens] = False
    assert torch.equal(got[untouched], y0[untouched]), "rows of other tokens changed"


def test_bucket_ranks_above_the_adapters_rank_read_zeros(kernel):
    """The engine passes the bucket rank (a power of two, up to r_max), which can exceed
    the slot's own rank: the padding of A and B is zero, so the result is the rank's."""
    a_t, b = stacks((3, 9), 32, 24, r_max=32)
    x = torch.randn(2, 32)
    tokens, slots = torch.tensor([0, 1]), torch.tensor([1, 2])
    exact_ranks = call(kernel, x, torch.zeros(2, 24), tokens, slots, torch.tensor([3, 9]), a_t, b)
    buckets = call(kernel, x, torch.zeros(2, 24), tokens, slots, torch.tensor([4, 16]), a_t, b)
    assert torch.allclose(exact_ranks, buckets, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_is_bitwise_the_same_alone_in_any_call_and_on_any_threads(kernel, dtype):
    if not library._openmp_flags():
        pytest.skip("the CPU kernels run on one thread here (no OpenMP runtime of torch's)")
    ranks = (8, 16, 33, 64)
    a_t, b = stacks(ranks, 200, 104, r_max=64, dtype=dtype)
    x = torch.randn(6, 200)
    tokens, slots = torch.arange(6), torch.tensor([1, 2, 3, 4, 2, 1])
    ranks_of_rows = torch.tensor([ranks[s - 1] for s in slots.tolist()])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = call(kernel, x, torch.zeros(6, 104), tokens, slots, ranks_of_rows, a_t, b)
        torch.set_num_threads(2)
        two = call(kernel, x, torch.zeros(6, 104), tokens, slots, ranks_of_rows, a_t, b)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    for j in range(6):
        alone = call(kernel, x, torch.zeros(6, 104), tokens[j : j + 1], slots[j : j + 1],
                     ranks_of_rows[j : j + 1], a_t, b)  # fmt: skip
        assert torch.equal(alone[j], one[j]), j


def test_a_nan_stays_in_its_tokens_row(kernel):
    a_t, b = stacks((8, 8), 16, 16, r_max=16)
    x = torch.randn(3, 16)
    x[1, 4] = float("nan")
    got = call(kernel, x, torch.zeros(3, 16), torch.arange(3), torch.tensor([1, 2, 1]),
               torch.tensor([8, 8, 8]), a_t, b)  # fmt: skip
    assert got[1].isnan().all() and not got[[0, 2]].isnan().any()


@pytest.mark.parametrize(
    "tokens, slots, ranks, why",
    [
        ([0, 4], [1, 1], [8, 8], "token past the batch"),
        ([-1, 1], [1, 1], [8, 8], "negative token"),
        ([1, 1], [1, 2], [8, 8], "a token twice: threads would race on its row"),
        ([2, 1], [1, 2], [8, 8], "tokens out of order"),
        ([0, 1], [1, 3], [8, 8], "slot past the stack"),
        ([0, 1], [-1, 1], [8, 8], "negative slot"),
        ([0, 1], [1, 2], [8, 17], "rank past the chunks of Aᵀ"),
        ([0, 1], [1, 2], [-1, 8], "negative rank"),
        ([0, 1], [1], [8, 8], "lengths differ"),
    ],
)
def test_out_of_range_rows_are_refused(tokens, slots, ranks, why):
    index = RowsIndex.check(
        torch.tensor(tokens), torch.tensor(slots), torch.tensor(ranks),
        n_tokens=4, num_slots=3, chunks=1, r_max=16,
    )  # fmt: skip
    assert index is None, why


def test_indices_of_another_form_are_refused_and_the_checked_ones_copied():
    one = torch.tensor([0])
    assert RowsIndex.check(torch.tensor(0), one, one + 8, 1, 2, 1, 16) is None  # 0-dim
    assert RowsIndex.check(one.float(), one + 1, one + 8, 1, 2, 1, 16) is None  # float
    tokens = torch.tensor([0, 1])
    index = RowsIndex.check(tokens, torch.tensor([1, 1]), torch.tensor([8, 8]), 2, 2, 1, 16)
    tokens[1] = 5  # changing the caller's tensor afterwards does not reach the checked one
    assert index.tokens.tolist() == [0, 1]


def test_rank_past_r_max_and_too_many_chunks_are_refused():
    rows = (torch.tensor([0]), torch.tensor([1]), torch.tensor([20]))
    assert RowsIndex.check(*rows, n_tokens=1, num_slots=2, chunks=2, r_max=16) is None
    assert RowsIndex.check(*rows, n_tokens=1, num_slots=2, chunks=2, r_max=32) is not None
    rows = (torch.tensor([0]), torch.tensor([1]), torch.tensor([8]))
    assert RowsIndex.check(*rows, n_tokens=1, num_slots=2, chunks=MAX_CHUNKS + 1, r_max=16) is None


def test_a_call_whose_tensors_differ_from_the_checked_shapes_is_refused(kernel):
    a_t, b = stacks((8,), 16, 24, r_max=16)
    index = RowsIndex.check(torch.tensor([0]), torch.tensor([1]), torch.tensor([8]), 2, 2, 1, 16)
    x, y = torch.randn(2, 16), torch.zeros(2, 24)
    kernel(x, y, index, a_t, b)  # as checked
    wrong = {
        "more tokens than checked": (torch.randn(3, 16), torch.zeros(3, 24), a_t, b),
        "fewer slots than checked": (x, y, a_t[:1], b[:1]),
        "x of another width": (torch.randn(2, 8), y, a_t, b),
        "float64": (x.double(), y.double(), a_t.double(), b.double()),
        "a strided stack": (x, y, a_t, b.transpose(1, 2).contiguous().transpose(1, 2)),
        "B in rows, not blocks": (x, y, a_t, unblock_b(b)),
        "y of another width": (x, torch.zeros(2, 16), a_t, b),
    }
    for why, (x_, y_, a_, b_) in wrong.items():
        with pytest.raises(ValueError, match="do not match the rows checked"):
            kernel(x_, y_, index, a_, b_)
        assert why


def test_fits_wants_float32_cpu_without_gradients():
    a_t, b = stacks((8,), 16, 24, r_max=16)
    x, y = torch.randn(2, 16), torch.zeros(2, 24)
    assert LoraRowsKernel.fits(x, y, a_t, b)
    assert LoraRowsKernel.fits(x, y, a_t.bfloat16(), b.bfloat16())
    assert not LoraRowsKernel.fits(x, y, a_t.bfloat16(), b)  # one dtype for both stacks
    # rows written from several threads may not share memory
    assert not LoraRowsKernel.fits(x, torch.zeros(1, 24).expand(2, 24), a_t, b)
    assert not LoraRowsKernel.fits(x, y, a_t, unblock_b(b))  # B in rows: the fallback's
    both = torch.zeros(2, 40)
    assert not LoraRowsKernel.fits(both[:, :16], both[:, 16:], a_t, b)
    assert not LoraRowsKernel.fits(x.requires_grad_(), y, a_t, b)
    assert not LoraRowsKernel.fits(
        x.detach().bfloat16(), y.bfloat16(), a_t.bfloat16(), b.bfloat16()
    )
    assert not LoraRowsKernel.fits(x.detach().t().contiguous().t(), y, a_t, b)


def _layer(ranks, d_in, d_out, max_rank, block_b=True):
    torch.manual_seed(0)
    slots = len(ranks) + 1
    layer = AdapterLayer(torch.nn.Linear(d_in, d_out), d_in, d_out, slots)
    layer.block_b = block_b
    registry = SimpleNamespace(
        slot_bucket=[0] * slots, slot_is_ia3=[False] * slots, slot_is_dora=[False] * slots
    )
    for s, r in enumerate(ranks, start=1):
        layer.put(s, LoraWeights(torch.randn(r, d_in), torch.randn(d_out, r), 0.5), max_rank)
        registry.slot_bucket[s] = bucket_rank(r, max_rank)
    return layer, registry


def test_adapter_layer_agrees_with_and_without_the_kernel(kernel, monkeypatch):
    """Decoding tokens (one per adapter) and base tokens mixed: the kernel's rows and
    PyTorch's embedding_bag rows agree within fp32 rounding, base rows untouched."""
    layer, registry = _layer((4, 16, 17, 32, 64), 80, 72, max_rank=64)
    token_slots = torch.tensor([3, 0, 1, 5, 2, 0, 4])
    batch = adapter_batch(token_slots, registry)
    assert batch.lora_rows is not None and not batch.lora
    x = torch.randn(7, 80)
    calls = []
    real = LoraRowsKernel.add_if_fits
    monkeypatch.setattr(LoraRowsKernel, "add_if_fits", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad(), use_context(SimpleNamespace(adapters=batch)):
        got = layer(x)
        monkeypatch.setattr(adapters, "rows_kernel", lambda: None)
        want = layer(x)
        plain = layer.base(x)
    assert calls == [1], "the kernel did not run"
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-4), (got - want).abs().max()
    assert torch.equal(got[token_slots == 0], plain[token_slots == 0])


@pytest.mark.parametrize("d_out", [72, 20])
@pytest.mark.parametrize("ranks, max_rank", [((4, 16, 17, 64), 64), ((3, 12, 5, 9), 12)])
def test_b_in_blocks_serves_what_b_in_rows_does(kernel, d_out, ranks, max_rank):
    """On a CPU, B is held in the kernel's blocks where `out` is a multiple of 8 (else in
    rows; r_max rounded up to whole blocks): prefill tokens (grouped, bmm) get the same
    bits either way, and decoding tokens the same within fp32 rounding (kernel against
    embedding_bag), also after a slot is cleared and refilled at a lower rank."""
    blocked, _ = _layer(ranks, 40, d_out, max_rank=max_rank)
    plain, registry = _layer(ranks, 40, d_out, max_rank=max_rank, block_b=False)
    assert blocked.b_blocked == (d_out % 8 == 0) and not plain.b_blocked
    assert plain.r_max == max_rank
    assert blocked.r_max == (-(-max_rank // 8) * 8 if blocked.b_blocked else max_rank)
    prefill = torch.tensor([1] * 9 + [3] * 8 + [0, 2])  # two adapters of >= 8 tokens
    decode = torch.tensor([3, 0, 1, 4, 2])

    def agree():
        for token_slots in (prefill, decode):
            batch = adapter_batch(token_slots, registry)
            x = torch.randn(len(token_slots), 40)
            with torch.no_grad(), use_context(SimpleNamespace(adapters=batch)):
                got, want = blocked(x), plain(x)
            if token_slots is prefill:
                assert batch.lora and torch.equal(got[:17], want[:17])
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-4), (got - want).abs().max()

    agree()
    weights = LoraWeights(torch.randn(2, 40), torch.randn(d_out, 2), 0.5)
    for layer in (blocked, plain):
        layer.put(4, None, max_rank)
        layer.put(4, weights, max_rank)
    registry.slot_bucket[4] = bucket_rank(2, max_rank)
    agree()


def test_b_stays_in_rows_where_the_kernel_will_not_read_it(monkeypatch):
    """Blocks only for the kernel: without it (no compiler), or under a bfloat16 model
    (the kernel takes float32 x), B is held in rows, as `embedding_bag` reads it."""
    monkeypatch.setattr(adapters, "rows_kernel", lambda: None)
    assert not _layer((8,), 16, 24, max_rank=8)[0].b_blocked
    monkeypatch.undo()
    layer = AdapterLayer(torch.nn.Linear(16, 24).bfloat16(), 16, 24, 2)
    layer.put(1, LoraWeights(torch.randn(8, 16), torch.randn(24, 8), 0.5), 8)
    assert not layer.b_blocked and layer.lora_b.shape == (2, 8, 24)


def _flags_of_mapping(address: int) -> str:
    """The VmFlags of the mapping of this process that holds `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return line
    return ""


def test_the_stacks_are_zeros_and_on_huge_pages_where_linux_gives_them():
    small = memory.zeros(3, 5, dtype=torch.float32)
    assert torch.equal(small, torch.zeros(3, 5))
    big = memory.zeros(3, 1 << 20, dtype=torch.float32)  # 12 MiB
    assert big.shape == (3, 1 << 20) and big.is_contiguous() and not big.any()
    assert torch.equal(memory.zeros(5, 1 << 20, dtype=torch.bfloat16)[4], torch.zeros(1 << 20))
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.exists() or "[never]" in mode.read_text():
        pytest.skip("no transparent huge pages on this machine")
    assert big.data_ptr() % memory.HUGE_PAGE == 0, "the tensor starts on a huge page"
    # the advice is on its mapping ("hg"); whether Linux found free huge pages is its own
    assert " hg" in _flags_of_mapping(big.data_ptr()), _flags_of_mapping(big.data_ptr())


def test_huge_pages_elsewhere_change_nothing(monkeypatch):
    assert not memory.advise_huge_pages(4096, 100)  # no whole 2 MiB page inside
    monkeypatch.setattr(memory, "_madvise", lambda: None)
    assert not memory.advise_huge_pages(0, 1 << 30)
    assert torch.equal(memory.zeros(2, 1 << 21, dtype=torch.float32), torch.zeros(2, 1 << 21))


@pytest.mark.parametrize("pages", [[], ["--small-pages"]], ids=["huge", "small"])
def test_the_benchmark_runs(kernel, pages):
    """benchmarks/lora_rows.py at its smallest: both arms timed, their outputs compared."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [
            sys.executable, str(repo / "benchmarks" / "lora_rows.py"), "--tokens", "3",
            "--layers", "2", "--adapters", "5", "--width", "40", "--rounds", "1", *pages,
        ],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(repo)},
        timeout=300, check=True,
    )  # fmt: skip
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split()[0] for line in lines[1:3]] == ["kernel", "embedding_bag"], done.stdout
    ratio = lines[3]
    assert ratio.startswith("embedding_bag / kernel: ") and "x (largest difference" in ratio
    assert float(ratio.split("difference of one layer's outputs: ")[1].rstrip(")")) < 1e-5


# -- adapters held in bfloat16 (--lora-dtype bfloat16) under a float32 model ---------------

LOGITS_ATOL = 1e-4  # fp32 rounding, as tests/test_serve_many_adapters.py


@pytest.fixture(scope="module")
def bf16_adapters(checkpoints, tmp_path_factory):
    """(checkpoint, adapters, reference): LoRA adapters saved in bfloat16, as bfloat16
    training saves them, alpha 2r (scale 2, a power of two), on every linear layer."""
    import peft
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from tests.test_serve_common import Reference, lora_config

    base = checkpoints("llama")
    folder = tmp_path_factory.mktemp("bf16-adapters")
    saved = {}
    for i, rank in enumerate((4, 16, 24)):
        torch.manual_seed(300 + i)
        model = peft.get_peft_model(
            AutoModelForCausalLM.from_pretrained(base), lora_config("llama", rank)
        )
        with torch.no_grad():
            for param in model.parameters():
                if param.requires_grad:
                    param.add_(torch.randn_like(param) * 0.2)
        model.to(torch.bfloat16).save_pretrained(folder / f"r{rank}")
        saved[f"r{rank}"] = folder / f"r{rank}"
        with safe_open(str(saved[f"r{rank}"] / "adapter_model.safetensors"), "pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}  # noqa: SIM118
    return base, saved, Reference(base, saved)


def bf16_engine(base, saved, lora_dtype="bfloat16"):
    from symbiont import BaseExecutor, load_client
    from symbiont.serve import Engine, EngineConfig

    config = EngineConfig(
        max_running=16, max_batched_tokens=128, block_size=4, num_blocks=128,
        max_lora_rank=32, lora_dtype=lora_dtype,
    )  # fmt: skip
    engine = Engine(load_client(base, BaseExecutor.from_pretrained(base)), config)
    for name, path in saved.items():
        engine.load_adapter(name, path)
    return engine


def stacks_of(engine) -> list[AdapterLayer]:
    return [m for m in engine.model.modules() if isinstance(m, AdapterLayer)]


@pytest.mark.parametrize("rows", ["kernel", "embedding_bag"])
def test_bfloat16_adapters_from_bfloat16_stacks_equal_vanilla_peft(
    kernel, bf16_adapters, rows, monkeypatch
):
    """Held in bfloat16 they are the very values saved, widened exactly: each request's
    greedy tokens equal vanilla peft's (which widens them to float32), decoding rows and a
    crowd on one adapter (the grouped path) in one batch. Without the kernel, rows go
    through embedding_bag, which rounds x to bfloat16: logits then within its rounding."""
    from symbiont.serve import SamplingParams
    from symbiont.serve.adapters import DENSE_MIN_TOKENS
    from tests.test_serve_common import prompts

    base, saved, reference = bf16_adapters
    calls = []
    if rows == "embedding_bag":
        monkeypatch.setattr(adapters, "rows_kernel", lambda: None)
    else:
        real = LoraRowsKernel.add_if_fits
        monkeypatch.setattr(LoraRowsKernel, "add_if_fits", lambda *a: calls.append(1) or real(*a))
    engine = bf16_engine(base, saved)
    layers = stacks_of(engine)
    assert layers and all(m.lora_b.dtype == torch.bfloat16 for m in layers)
    assert all(m.lora_a_t.dtype == torch.bfloat16 for m in layers)
    names = [None, *saved, None, *["r16"] * (DENSE_MIN_TOKENS + 1)]
    batch = prompts(len(names), seed=7, low=2, high=10)
    greedy = SamplingParams(max_tokens=5, temperature=0.0)
    outputs = engine.generate(batch, names, greedy)
    for prompt, name, got in zip(batch, names, outputs, strict=True):
        if rows == "kernel":
            want = reference.generate(prompt, name, greedy.max_tokens)
            assert got == want, f"adapter {name}: differs from vanilla peft"
        else:
            assert len(got) == greedy.max_tokens
    assert bool(calls) == (rows == "kernel")
    # logits of one decode step, every adapter on its own row
    captured = []
    forward = engine.runner.forward
    monkeypatch.setattr(
        engine.runner, "forward", lambda b: captured.append(forward(b)) or captured[-1]
    )
    one = [None, *saved]
    short = prompts(len(one), seed=9, low=3, high=6)
    engine.generate(short, one, SamplingParams(max_tokens=2, temperature=0.0))
    atol = LOGITS_ATOL if rows == "kernel" else 3e-2
    decode = captured[-1]
    assert decode.shape[0] == len(one)
    for i, name in enumerate(one):
        prompt = short[i]
        first = int(captured[0][i].argmax())
        want = reference.logits(prompt + [first], name)[-1]
        assert torch.allclose(decode[i], want, atol=atol), (
            name,
            float((decode[i] - want).abs().max()),
        )


def test_float32_adapters_in_bfloat16_stacks_are_rounded_and_take_half_the_memory(
    kernel, checkpoints, tmp_path
):
    """An adapter saved in float32 is rounded to bfloat16 when held so: its logits stay
    within bfloat16 rounding of vanilla's, and each stack takes half the bytes."""
    from tests.test_serve_common import Reference, lora_config, prompts, save_adapter

    base = checkpoints("llama")
    saved = {"r8": save_adapter(base, lora_config("llama", 8), tmp_path / "r8", seed=5)}
    reference = Reference(base, saved)
    wide, narrow = bf16_engine(base, saved, "float32"), bf16_engine(base, saved)
    for big, small in zip(stacks_of(wide), stacks_of(narrow), strict=True):
        assert small.lora_b.nbytes * 2 == big.lora_b.nbytes
        assert small.lora_a_t.nbytes * 2 == big.lora_a_t.nbytes
    prompt = prompts(1, seed=3, low=6, high=6)[0]
    want = reference.logits(prompt, "r8")[-1]
    from symbiont.serve import SamplingParams

    captured = []
    forward = narrow.runner.forward
    narrow.runner.forward = lambda b: captured.append(forward(b)) or captured[-1]
    narrow.generate([prompt], ["r8"], SamplingParams(max_tokens=1, temperature=0.0))
    last = captured[0][-1]
    assert not torch.allclose(last, want, atol=LOGITS_ATOL), "bfloat16 rounding should show"
    assert torch.allclose(last, want, atol=5e-2, rtol=2e-2), float((last - want).abs().max())


def test_lora_dtype_is_checked():
    from symbiont.serve import EngineConfig

    with pytest.raises(ValueError, match="--lora-dtype must be one of float32, bfloat16"):
        EngineConfig(lora_dtype="float16")


def test_serve_takes_the_lora_dtype_flag():
    import argparse

    from symbiont.cli import serve

    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    args = parser.parse_args(["serve", "--model", "m", "--lora-dtype", "bfloat16"])
    assert serve.configs(args).engine.lora_dtype == "bfloat16"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--model", "m", "--lora-dtype", "int8"])
