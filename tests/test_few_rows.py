"""symbiont's few-rows product kernel (symbiont/kernels/few_rows.py) against float64 products,
and the executors that hand it their forward calls of a few rows: the serving one
(symbiont/base/prepack.py) and `serve-base --matmul onednn` (symbiont/base/onednn.py).
The plain executor never does: its products stay bitwise the vanilla model's."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from symbiont import BaseExecutor, load_client
from symbiont.base.executor import FEW_ROWS_MAX
from symbiont.base.onednn import OneDnnExecutor, can_use_onednn
from symbiont.base.prepack import PrepackedExecutor, _Packed
from symbiont.kernels import library
from symbiont.kernels.few_rows import BoundFewRows, FewRows
from symbiont.model.layers import LayerKind
from symbiont.protocol.executor import Op
from symbiont.serve import Engine, EngineConfig, SamplingParams
from symbiont.tenant import open_executor
from tests.test_serve_common import Reference, prompts

# Against a float64 product: fp32 rounding of sums of `width` terms of unit scale
ATOL_PER_TERM = 1e-6
# Against the plain executor (MKL's fp32 sums in another order), relative to unit outputs
ATOL, RTOL = 1e-5, 1e-5


@pytest.fixture(scope="module")
def few_rows() -> FewRows:
    kernel = FewRows.load()
    if kernel is None:
        pytest.skip(f"CPU kernels not built here: {library.unavailable_reason()}")
    return kernel


def product_of(
    n: int, width: int, out: int, seed: int, bias: bool = True, pad: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x [n, width] and weight [out, width] whose rows are `pad` floats longer than their
    used part (rows of a wider tensor, as a block's slices are), and a bias."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, width + pad, generator=g)[:, :width]
    weight = torch.randn(out, width + pad, generator=g)[:, :width]
    return x, weight, torch.randn(out, generator=g) if bias else None


def exact(x, weight, bias) -> torch.Tensor:
    y = x.double() @ weight.double().t()
    return y if bias is None else y + bias.double()


# rows: one, each tile size (4, 2, 1) alone and mixed; widths: below one vector, a vector
# plus a tail, whole vectors; outputs: below, at and past a tile's 8 rows of W
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 9])
@pytest.mark.parametrize("width, out", [(7, 5), (20, 9), (256, 33), (688, 40)])
@pytest.mark.parametrize("bias", [True, False])
def test_products_equal_float64_within_rounding(few_rows, n, width, out, bias):
    x, weight, b = product_of(n, width, out, seed=n * width + out, bias=bias, pad=3)
    assert weight.stride(0) == width + 3  # rows apart, as the kernel is told
    got = few_rows(x, weight, b)
    assert got.shape == (n, out) and got.dtype == torch.float32
    assert torch.allclose(got.double(), exact(x, weight, b), atol=ATOL_PER_TERM * width, rtol=0)


def test_results_do_not_depend_on_the_thread_count(few_rows, monkeypatch):
    """A weight big enough to be split across threads: each output is still summed by one
    thread in one order, so the results are bitwise the same."""
    x, weight, b = product_of(3, 512, 1030, seed=1)  # 527K weights: over the split's 256K
    results = []
    for threads in (1, 2, 3):
        monkeypatch.setattr(torch, "get_num_threads", lambda threads=threads: threads)
        results.append(few_rows(x, weight, b))
    assert all(torch.equal(results[0], r) for r in results[1:])
    assert torch.allclose(results[0].double(), exact(x, weight, b), atol=ATOL_PER_TERM * 512)


def test_a_row_gives_the_same_bits_whatever_the_other_rows(few_rows):
    """Tiles of 4, 2 and 1 rows, and outputs in full tiles or in the leftover ones, sum
    each output's lanes by one tree: a decoding sequence's logits do not depend on which
    others share its step."""
    x, weight, b = product_of(9, 600, 13, seed=5)  # 13 outputs: a tile of 8 and leftovers;
    # 600 columns: two chunks for calls of 3 rows or more
    alone = torch.cat([few_rows(x[i : i + 1], weight, b) for i in range(9)])
    for n in range(2, 10):
        assert torch.equal(few_rows(x[:n], weight, b), alone[:n]), n


def test_nan_stays_in_its_row(few_rows):
    x, weight, b = product_of(3, 64, 16, seed=2)
    x[1, 10] = float("nan")
    y = few_rows(x, weight, b)
    assert y[1].isnan().all()
    assert y[[0, 2]].isfinite().all()


def test_empty_products(few_rows):
    x, weight, b = product_of(0, 32, 8, seed=3)
    assert few_rows(x, weight, b).shape == (0, 8)
    x, weight, b = product_of(2, 0, 8, seed=3)  # no inputs: the bias alone
    assert torch.equal(few_rows(x, weight, b), b.expand(2, 8))
    assert torch.equal(few_rows(x, weight, None), torch.zeros(2, 8))


def test_what_it_does_not_take(few_rows):
    x, weight, b = product_of(2, 32, 8, seed=4)
    assert FewRows.fits(x, weight, b) and FewRows.fits(x, weight, None)
    assert not FewRows.fits(x.double(), weight.double(), None)
    assert not FewRows.fits(x.requires_grad_(), weight, b)  # no backward
    x = x.detach()
    assert not FewRows.fits(x, weight.t().contiguous().t(), b)  # columns not contiguous
    assert not FewRows.fits(x.t().contiguous().t(), weight, b)
    assert not FewRows.fits(x[:, :16], weight, b)  # widths differ
    assert not FewRows.fits(x[0], weight, b)  # one row: [n, in] is asked for
    assert not FewRows.fits(x, weight, b[::2].repeat(2)[::2])  # a strided bias
    assert not FewRows.fits(x, weight, b[:7])
    assert not FewRows.fits(x, weight, b[None])
    assert not FewRows.fits(x, weight, b.clone().requires_grad_())
    # called without `fits`, it refuses what would read past the tensors
    for bad in ((x, weight, b[:7]), (x.double(), weight, b), (x[:, :16], weight, b)):
        with pytest.raises(ValueError, match="it takes float32 CPU rows"):
            few_rows(*bad)


# -- the executors that use it -----------------------------------------------------------


class Counting:
    """The kernel, counting the rows of each call it computes."""

    def __init__(self, kernel: FewRows):
        self.kernel, self.rows = kernel, []

    def fits(self, x, weight, bias) -> bool:
        return self.kernel.fits(x, weight, bias)

    def __call__(self, x, weight, bias):
        self.rows.append(x.shape[0])
        return self.kernel(x, weight, bias)


def linear_layers(executor: BaseExecutor) -> list:
    return [s for s in executor.manifest.layers if s.kind is LayerKind.LINEAR]


@pytest.mark.skipif(not can_use_onednn("cpu", torch.float32), reason="no oneDNN in this torch")
def test_packed_executor_computes_plain_products_of_few_rows_on_it(few_rows, wide_llama):
    """Every call of the small layers under their packed copy's rows, alone or fused, goes
    to the kernel, within fp32 rounding of the plain executor; from those rows on the packed
    product computes it; backward calls never reach it."""
    plain = BaseExecutor.from_pretrained(wide_llama)
    counting = Counting(few_rows)
    packed = PrepackedExecutor(BaseExecutor.from_pretrained(wide_llama), few_rows=counting)
    g = torch.Generator().manual_seed(0)
    for spec in linear_layers(packed):
        product = packed._home[spec.id][0]
        for rows in sorted({1, 2, product.min_rows - 1, product.min_rows}):
            if rows < 1:
                continue
            counting.rows.clear()
            x = torch.randn(rows, spec.in_features, generator=g)
            want, got = plain.call(Op.FORWARD, spec.id, x), packed.call(Op.FORWARD, spec.id, x)
            assert torch.allclose(got, want, atol=ATOL, rtol=RTOL), (spec.name, rows)
            by_kernel = spec.id not in packed.packed_layers and rows < product.min_rows
            assert counting.rows == ([rows] if by_kernel else []), (spec.name, rows)
    for layers, product in packed._fused.items():
        x = torch.randn(1, plain.manifest.layers[layers[0]].in_features, generator=g)
        counting.rows.clear()
        got, want = packed.forward_fused(layers, x), plain.forward_fused(layers, x)
        assert counting.rows == ([1] if product.min_rows > 1 else [])
        for w, f in zip(want, got, strict=True):
            assert torch.allclose(f, w, atol=ATOL, rtol=RTOL)
    counting.rows.clear()
    small = next(s for s in linear_layers(packed) if s.id not in packed.packed_layers)
    grad_y = torch.randn(1, small.out_features, generator=g)
    got, want = (
        packed.call(Op.BACKWARD, small.id, grad_y),
        plain.call(Op.BACKWARD, small.id, grad_y),
    )
    assert torch.equal(got, want) and counting.rows == []


@pytest.mark.skipif(not can_use_onednn("cpu", torch.float32), reason="no oneDNN in this torch")
def test_direct_products_are_the_executors_calls_bitwise(few_rows, wide_llama):
    """`direct_product` of each layer and each fused run gives, for every row count, the
    very bits of the executor's usual call (or None where it leaves the call to it), and
    None for any x it does not take."""
    packed = PrepackedExecutor(BaseExecutor.from_pretrained(wide_llama), few_rows=few_rows)
    g = torch.Generator().manual_seed(0)
    groups = [(s.id,) for s in linear_layers(packed)] + list(packed._fused)
    taken = set()
    for layers in groups:
        direct = packed.direct_product(layers)
        assert direct is not None, layers  # every layer here is small or packed
        width = packed.manifest.layers[layers[0]].in_features
        for rows in range(0, FEW_ROWS_MAX + 3):
            x = torch.randn(rows, width, generator=g)
            if len(layers) == 1:
                want = [packed.call(Op.FORWARD, layers[0], x)]
            else:
                want = list(packed.forward_fused(layers, x))
            got = direct(x)
            if got is None:  # only where the usual call computes it otherwise (torch)
                assert rows >= FEW_ROWS_MAX and rows < direct.min_rows, (layers, rows)
                continue
            taken.add((len(layers) > 1, rows < direct.min_rows))
            assert len(got) == len(want)
            for y, w in zip(got, want, strict=True):
                assert y.shape == w.shape and torch.equal(y, w), (layers, rows)
        wide = torch.randn(3, width + 5, generator=g)[:, :width]  # rows of a wider tensor
        if len(layers) == 1:
            want = [packed.call(Op.FORWARD, layers[0], wide)]
        else:
            want = list(packed.forward_fused(layers, wide))
        got = direct(wide)
        assert got is not None and all(map(torch.equal, got, want)), layers
        x = torch.randn(2, width, generator=g)
        assert direct(x.double()) is None
        assert direct(torch.randn(2, width + 1, generator=g)) is None
        assert direct(torch.randn(width, 2, generator=g).t()) is None  # columns not contiguous
        assert direct(x.clone().requires_grad_()) is None
        assert direct(x[None]) is None
    # fused and single layers, by the kernel and by the packed product
    assert taken == {(False, True), (False, False), (True, True), (True, False)}
    assert packed.direct_product(()) is None
    assert packed.direct_product((len(packed.manifest.layers),)) is None


def decode_one_then_two_like_vanilla(executor, model_dir, model=None) -> None:
    """The serving engine on `executor` (and `model`, a client of it) decodes one
    sequence, then two, into vanilla transformers' greedy tokens."""
    config = EngineConfig(max_running=2, max_batched_tokens=64, block_size=4, num_blocks=64)
    engine = Engine(model or load_client(model_dir, executor), config)
    reference = Reference(model_dir, {})
    for n in (1, 2):
        batch = prompts(n, seed=n)
        outputs = engine.generate(batch, None, SamplingParams(max_tokens=6, temperature=0.0))
        for prompt, got in zip(batch, outputs, strict=True):
            assert got == reference.generate(prompt, None, 6)


@pytest.mark.skipif(not can_use_onednn("cpu", torch.float32), reason="no oneDNN in this torch")
def test_the_engine_decodes_through_direct_products(few_rows, wide_llama, monkeypatch):
    """The serving engine's lean forward computes a decode step's projections through
    `direct_product`, and generates vanilla transformers' greedy tokens."""
    from symbiont.base.prepack import DirectProduct

    executor = open_executor(wide_llama, prepack=True)
    assert isinstance(executor, PrepackedExecutor)
    direct_rows, usual_rows = [], []
    real_direct, real_call = DirectProduct.__call__, PrepackedExecutor.call

    def counted_direct(product, x):
        out = real_direct(product, x)
        if out is not None:
            direct_rows.append(x.shape[0])
        return out

    monkeypatch.setattr(DirectProduct, "__call__", counted_direct)
    monkeypatch.setattr(
        PrepackedExecutor,
        "call",
        lambda ex, op, layer, x: usual_rows.append(x.shape[0]) or real_call(ex, op, layer, x),
    )
    model = load_client(wide_llama, executor)
    decode_one_then_two_like_vanilla(executor, wide_llama, model)
    assert {1, 2} <= set(direct_rows)  # decode steps of one and two sequences
    assert not {1, 2} & set(usual_rows)
    copy.deepcopy(model)  # the bound products are not the model's to copy
    # without the kernel (benchmarks/few_rows.py's torch arm), its products are not used
    kernel_rows = []
    real_bound = BoundFewRows.__call__
    monkeypatch.setattr(
        BoundFewRows, "__call__", lambda b, x: kernel_rows.append(x.shape[0]) or real_bound(b, x)
    )
    executor.few_rows = None
    decode_one_then_two_like_vanilla(executor, wide_llama, model)
    assert kernel_rows == []


@pytest.mark.skipif(not can_use_onednn("cpu", torch.float32), reason="no oneDNN in this torch")
def test_serving_engine_decodes_through_it_and_generates_what_vanilla_does(
    few_rows, wide_llama, monkeypatch
):
    """One and two sequences decoding: the kernel computes the small layers' products below
    their packed copy's rows, and the greedy tokens are vanilla transformers'."""
    executor = open_executor(wide_llama, prepack=True)
    assert isinstance(executor, PrepackedExecutor) and isinstance(executor.few_rows, FewRows)
    counting = Counting(executor.few_rows)
    executor.few_rows = counting
    packed_rows = []
    real = _Packed.__call__
    monkeypatch.setattr(
        _Packed, "__call__", lambda p, x: packed_rows.append(x.shape[0]) or real(p, x)
    )
    decode_one_then_two_like_vanilla(executor, wide_llama)
    assert set(counting.rows) == {1, 2}  # decode steps: a row per sequence
    assert 2 in packed_rows and 1 not in packed_rows  # gate/up: packed from 2 rows


@pytest.mark.skipif(not can_use_onednn("cpu", torch.float32), reason="no oneDNN in this torch")
def test_onednn_executor_computes_forward_calls_of_few_rows_on_it(few_rows, wide_llama):
    plain = BaseExecutor.from_pretrained(wide_llama)
    counting = Counting(few_rows)
    onednn = OneDnnExecutor(BaseExecutor.from_pretrained(wide_llama), few_rows=counting)
    g = torch.Generator().manual_seed(1)
    for spec in linear_layers(onednn):
        for rows in (1, FEW_ROWS_MAX - 1, FEW_ROWS_MAX):
            counting.rows.clear()
            x = torch.randn(rows, spec.in_features, generator=g)
            want, got = plain.call(Op.FORWARD, spec.id, x), onednn.call(Op.FORWARD, spec.id, x)
            assert torch.allclose(got, want, atol=ATOL, rtol=RTOL), (spec.name, rows)
            assert counting.rows == ([rows] if rows < FEW_ROWS_MAX else [])
            grad_y = torch.randn(rows, spec.out_features, generator=g)
            counting.rows.clear()
            got = onednn.call(Op.BACKWARD, spec.id, grad_y)
            assert counting.rows == []  # backward: torch's (or oneDNN's from 8 rows)
            assert torch.allclose(got, plain.call(Op.BACKWARD, spec.id, grad_y), atol=ATOL)
    names = {s.name: s.id for s in plain.manifest.layers}
    qkv = tuple(names[f"model.layers.0.self_attn.{p}_proj"] for p in "qkv")
    x = torch.randn(2, plain.manifest.layers[qkv[0]].in_features, generator=g)
    counting.rows.clear()
    for w, f in zip(plain.forward_fused(qkv, x), onednn.forward_fused(qkv, x), strict=True):
        assert torch.allclose(f, w, atol=ATOL, rtol=RTOL)
    assert counting.rows == [2]  # one product for the fused call


def test_the_plain_executor_keeps_torch_products(wide_llama):
    """Its products are bitwise the vanilla model's: no kernel, whatever is built."""
    executor = open_executor(wide_llama)
    assert type(executor) is BaseExecutor and executor.few_rows is None
    spec = linear_layers(executor)[0]
    x = torch.randn(1, spec.in_features)
    weight = executor._weights[spec.id].weight
    assert torch.equal(executor.call(Op.FORWARD, spec.id, x), F.linear(x, weight))


def test_the_benchmark_runs(few_rows, wide_llama):
    """benchmarks/few_rows.py at its smallest: the products table's rows for every layer
    and row count, and the engine's A/B on a small Llama, without a traceback."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [
            sys.executable, str(repo / "benchmarks" / "few_rows.py"), "--rounds", "2",
            "--working-set", "1", "--model", str(wide_llama), "--batch", "1,2", "--steps", "2",
        ],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(repo)},
        timeout=600, check=True,
    )  # fmt: skip
    assert "Traceback" not in done.stderr, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| small |")]
    assert len(rows) == 4 * 4, done.stdout  # four layers, four row counts
    engine = [line for line in done.stdout.splitlines() if line.startswith(("| 1 |", "| 2 |"))]
    assert len(engine) == 2 and all(line.endswith("x |") for line in engine), done.stdout


def test_the_product_ab_runs(few_rows, wide_llama):
    """benchmarks/profile_decode.py --product-ab at its smallest: both arms timed, without
    a traceback; without --prepack it says what to pass."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    command = [
        sys.executable, str(repo / "benchmarks" / "profile_decode.py"), "--model", str(wide_llama),
        "--batch", "2", "--prompt-len", "8", "--steps", "2", "--max-batched-tokens", "64",
        "--product-ab", "2",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(repo)}
    done = subprocess.run(
        [*command, "--prepack"], capture_output=True, text=True, env=env, timeout=300, check=True
    )
    assert "Traceback" not in done.stderr, done.stderr
    assert "| usual executor calls |" in done.stdout and "| direct products |" in done.stdout
    refused = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert refused.returncode != 0 and "pass --prepack" in refused.stderr
