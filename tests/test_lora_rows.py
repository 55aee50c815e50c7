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
from symbiont.kernels.lora_rows import MAX_CHUNKS, RANK_CHUNK, LoraRowsKernel, RowsIndex
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


def stacks(ranks, d_in, d_out, r_max, seed=0, pad=0):
    """Aᵀ [slots, chunks, in, 16] and B [slots, r_max, out] as AdapterLayer fills them
    (zero beyond each slot's rank), slot s + 1 holding ranks[s]; x rows `pad` floats apart
    beyond their width."""
    g = torch.Generator().manual_seed(seed)
    slots, chunks = len(ranks) + 1, -(-r_max // RANK_CHUNK)
    a_t = torch.zeros(slots, chunks, d_in, RANK_CHUNK)
    b = torch.zeros(slots, r_max, d_out)
    for s, r in enumerate(ranks, start=1):
        a = torch.zeros(chunks * RANK_CHUNK, d_in)
        a[:r] = torch.randn(r, d_in, generator=g)
        a_t[s] = a.view(chunks, RANK_CHUNK, d_in).transpose(1, 2)
        b[s, :r] = torch.randn(r, d_out, generator=g)
    return a_t, b


def reference(x, tokens, slots, ranks, a_t, b) -> torch.Tensor:
    """float64 y-increments [n_tokens, out] of each row: x[t] · A[s]ᵀ[:, :r] · B[s][:r]."""
    chunks = a_t.shape[1]
    delta = torch.zeros(x.shape[0], b.shape[2], dtype=torch.float64)
    for t, s, r in zip(tokens.tolist(), slots.tolist(), ranks.tolist(), strict=True):
        a = a_t[s].transpose(1, 2).reshape(chunks * RANK_CHUNK, -1)[:r].double()  # [r, in]
        delta[t] = (x[t].double() @ a.t()) @ b[s, :r].double()
    return delta


def call(kernel, x, y, tokens, slots, ranks, a_t, b) -> torch.Tensor:
    index = RowsIndex.check(
        tokens, slots, ranks, x.shape[0], a_t.shape[0], a_t.shape[1], b.shape[1]
    )
    assert index is not None
    kernel(x, y, index, a_t, b)
    return y


# ranks: inside one chunk, at and across chunk boundaries, the whole stack; widths with and
# without a tail of fewer than 8 floats; rows: a subset of the tokens, out of slot order
@pytest.mark.parametrize("d_in, d_out", [(24, 20), (16, 37), (96, 8), (5, 3)])
def test_rows_equal_float64_within_rounding(kernel, d_in, d_out):
    ranks = (1, 5, 8, 16, 17, 31, 40, 48)
    a_t, b = stacks(ranks, d_in, d_out, r_max=48, seed=d_in + d_out)
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


def test_a_row_is_bitwise_the_same_alone_in_any_call_and_on_any_threads(kernel):
    ranks = (8, 16, 33, 64)
    a_t, b = stacks(ranks, 200, 100, r_max=64)
    x = torch.randn(6, 200)
    tokens, slots = torch.arange(6), torch.tensor([1, 2, 3, 4, 2, 1])
    ranks_of_rows = torch.tensor([ranks[s - 1] for s in slots.tolist()])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = call(kernel, x, torch.zeros(6, 100), tokens, slots, ranks_of_rows, a_t, b)
        torch.set_num_threads(2)
        two = call(kernel, x, torch.zeros(6, 100), tokens, slots, ranks_of_rows, a_t, b)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    for j in range(6):
        alone = call(kernel, x, torch.zeros(6, 100), tokens[j : j + 1], slots[j : j + 1],
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


def test_rank_past_r_max_and_too_many_chunks_are_refused():
    rows = (torch.tensor([0]), torch.tensor([1]), torch.tensor([20]))
    assert RowsIndex.check(*rows, n_tokens=1, num_slots=2, chunks=2, r_max=16) is None
    assert RowsIndex.check(*rows, n_tokens=1, num_slots=2, chunks=2, r_max=32) is not None
    rows = (torch.tensor([0]), torch.tensor([1]), torch.tensor([8]))
    assert RowsIndex.check(*rows, n_tokens=1, num_slots=2, chunks=MAX_CHUNKS + 1, r_max=16) is None


def test_a_call_whose_tensors_differ_from_the_checked_shapes_is_refused(kernel):
    a_t, b = stacks((8,), 16, 12, r_max=16)
    index = RowsIndex.check(torch.tensor([0]), torch.tensor([1]), torch.tensor([8]), 2, 2, 1, 16)
    x, y = torch.randn(2, 16), torch.zeros(2, 12)
    kernel(x, y, index, a_t, b)  # as checked
    wrong = {
        "more tokens than checked": (torch.randn(3, 16), torch.zeros(3, 12), a_t, b),
        "fewer slots than checked": (x, y, a_t[:1], b[:1]),
        "x of another width": (torch.randn(2, 8), y, a_t, b),
        "float64": (x.double(), y.double(), a_t.double(), b.double()),
        "a strided stack": (x, y, a_t, b.transpose(1, 2).contiguous().transpose(1, 2)),
    }
    for why, (x_, y_, a_, b_) in wrong.items():
        with pytest.raises(ValueError, match="do not match the rows checked"):
            kernel(x_, y_, index, a_, b_)
        assert why


def test_fits_wants_float32_cpu_without_gradients():
    a_t, b = stacks((8,), 16, 12, r_max=16)
    x, y = torch.randn(2, 16), torch.zeros(2, 12)
    assert LoraRowsKernel.fits(x, y, a_t, b)
    assert not LoraRowsKernel.fits(x.requires_grad_(), y, a_t, b)
    assert not LoraRowsKernel.fits(
        x.detach().bfloat16(), y.bfloat16(), a_t.bfloat16(), b.bfloat16()
    )
    assert not LoraRowsKernel.fits(x.detach().t().contiguous().t(), y, a_t, b)


def _layer(ranks, d_in, d_out, max_rank):
    torch.manual_seed(0)
    slots = len(ranks) + 1
    layer = AdapterLayer(torch.nn.Linear(d_in, d_out), d_in, d_out, slots)
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
    real = LoraRowsKernel.__call__
    monkeypatch.setattr(LoraRowsKernel, "__call__", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad(), use_context(SimpleNamespace(adapters=batch)):
        got = layer(x)
        monkeypatch.setattr(adapters, "rows_kernel", lambda: None)
        want = layer(x)
        plain = layer.base(x)
    assert calls == [1], "the kernel did not run"
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-4), (got - want).abs().max()
    assert torch.equal(got[token_slots == 0], plain[token_slots == 0])


def _huge_kib() -> int:
    return sum(
        int(line.split()[1])
        for line in Path("/proc/self/smaps").read_text().splitlines()
        if line.startswith("AnonHugePages:")
    )


def test_the_stacks_are_zeros_and_on_huge_pages_where_linux_gives_them():
    small = memory.zeros(3, 5, dtype=torch.float32)
    assert torch.equal(small, torch.zeros(3, 5))
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    before = _huge_kib() if mode.exists() else 0
    big = memory.zeros(3, 1 << 20, dtype=torch.float32)  # 12 MiB: at least 4 whole 2 MiB pages
    assert big.shape == (3, 1 << 20) and not big.any()
    if not mode.exists() or "[never]" in mode.read_text():
        pytest.skip("no transparent huge pages on this machine")
    assert _huge_kib() - before >= 4 * 2048, "the 12 MiB tensor got no 2 MiB pages"


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
