"""Base weights repacked for oneDNN (symbiont/base/prepack.py): the same numbers within fp32
rounding, the same greedy tokens as vanilla transformers, forward calls only, and where
`symbiont serve` uses it."""

from __future__ import annotations

import pytest
import torch

from symbiont import BaseExecutor, load_client
from symbiont.base.prepack import (
    MIN_PACKED_WEIGHTS,
    PACKED_MIN_ROWS,
    PACKED_MIN_ROWS_FLOOR,
    PrepackedExecutor,
    _Packed,
    can_prepack,
    packed_min_rows,
)
from symbiont.model.layers import LayerKind
from symbiont.protocol.executor import ExecutorError, Op
from symbiont.serve import Engine, EngineConfig, SamplingParams
from symbiont.serve.config import ServerConfig
from symbiont.serve.http.server import BackgroundServer
from symbiont.tenant import open_executor
from tests.test_serve_common import Reference, prompts

pytestmark = pytest.mark.skipif(
    not can_prepack("cpu", torch.float32), reason="this torch build has no oneDNN"
)
# Packed and plain sum in different orders: fp32 rounding apart, relative to the output scale
ATOL, RTOL = 1e-5, 1e-5


def test_every_packed_layer_computes_the_plain_forward_within_fp32_rounding(checkpoints):
    plain = BaseExecutor.from_pretrained(checkpoints("llama"))
    layers = plain.manifest.layers
    packed = PrepackedExecutor(BaseExecutor.from_pretrained(checkpoints("llama")), min_weights=0)
    assert packed.packed_layers == {s.id for s in layers if s.kind is LayerKind.LINEAR}
    g = torch.Generator().manual_seed(0)
    for spec in layers:
        for rows in (1, 5, 33):
            x = torch.randn(rows, spec.in_features, generator=g)
            want, got = plain.call(Op.FORWARD, spec.id, x), packed.call(Op.FORWARD, spec.id, x)
            assert got.shape == want.shape == (rows, spec.out_features)
            assert torch.allclose(got, want, atol=ATOL, rtol=RTOL), (
                f"{spec.name}: max |diff| {float((got - want).abs().max()):.2e}"
            )
    x = torch.randn(8, 2 * layers[0].in_features, generator=g)[:, ::2]  # a strided view
    assert torch.allclose(
        packed.call(Op.FORWARD, 0, x), plain.call(Op.FORWARD, 0, x), atol=ATOL, rtol=RTOL
    )


def test_conv1d_layers_stay_plain_and_exact(checkpoints):
    plain = BaseExecutor.from_pretrained(checkpoints("gpt2"))
    packed = PrepackedExecutor(BaseExecutor.from_pretrained(checkpoints("gpt2")), min_weights=0)
    conv = [s.id for s in plain.manifest.layers if s.kind is LayerKind.CONV1D]
    assert conv and not packed.packed_layers & set(conv)
    x = torch.randn(4, plain.manifest.layers[conv[0]].in_features)
    assert torch.equal(packed.call(Op.FORWARD, conv[0], x), plain.call(Op.FORWARD, conv[0], x))


def test_small_layers_keep_their_plain_weights_beside_a_packed_copy(checkpoints):
    """Below MIN_PACKED_WEIGHTS a module keeps its plain weights (calls of few rows stay
    bit for bit the plain executor's, and backward works) and gets a packed copy for calls
    of its product's `packed_min_rows` rows and more; packing big modules changes no
    memory."""
    plain = BaseExecutor.from_pretrained(checkpoints("llama"))
    default = PrepackedExecutor(BaseExecutor.from_pretrained(checkpoints("llama")))
    assert all(s.in_features * s.out_features < MIN_PACKED_WEIGHTS for s in plain.manifest.layers)
    assert default.packed_layers == frozenset()
    linear_bytes = sum(
        4 * (s.in_features * s.out_features + s.out_features * s.has_bias)
        for s in plain.manifest.layers
        if s.kind is LayerKind.LINEAR
    )
    assert default.weight_bytes() == plain.weight_bytes() + linear_bytes
    everything = PrepackedExecutor(BaseExecutor.from_pretrained(checkpoints("llama")), 0)
    assert everything.weight_bytes() == plain.weight_bytes()
    g = torch.Generator().manual_seed(1)
    for spec in plain.manifest.layers:
        if spec.kind is not LayerKind.LINEAR:
            continue
        product = default._home[spec.id][0]
        assert product.min_rows == packed_min_rows(sum(product.widths) * spec.in_features)
        few = torch.randn(product.min_rows - 1, spec.in_features, generator=g)
        many = torch.randn(product.min_rows, spec.in_features, generator=g)
        assert torch.equal(
            default.call(Op.FORWARD, spec.id, few), plain.call(Op.FORWARD, spec.id, few)
        )
        want, got = plain.call(Op.FORWARD, spec.id, many), default.call(Op.FORWARD, spec.id, many)
        assert torch.allclose(got, want, atol=ATOL, rtol=RTOL), spec.name
        grad_y = torch.randn(PACKED_MIN_ROWS, spec.out_features, generator=g)
        assert torch.equal(
            default.call(Op.BACKWARD, spec.id, grad_y), plain.call(Op.BACKWARD, spec.id, grad_y)
        )


def test_backward_through_a_packed_layer_is_refused_with_what_to_do(checkpoints):
    packed = PrepackedExecutor(BaseExecutor.from_pretrained(checkpoints("llama")), min_weights=0)
    layer = min(packed.packed_layers)
    grad_y = torch.randn(3, packed.manifest.layers[layer].out_features)
    with pytest.raises(ExecutorError, match="started without packing"):
        packed.call(Op.BACKWARD, layer, grad_y)


@pytest.mark.parametrize("min_weights", [0, MIN_PACKED_WEIGHTS])
def test_engine_on_packed_weights_generates_what_vanilla_transformers_does(
    checkpoints, min_weights
):
    base = checkpoints("llama")
    reference = Reference(base, {})
    executor = PrepackedExecutor(BaseExecutor.from_pretrained(base), min_weights=min_weights)
    config = EngineConfig(max_running=12, max_batched_tokens=16, block_size=4, num_blocks=128)
    engine = Engine(load_client(base, executor), config)
    batch = prompts(12, seed=7)  # decode steps of 12 rows: the small modules' packed copies
    outputs = engine.generate(batch, None, SamplingParams(max_tokens=8, temperature=0.0))
    for prompt, got in zip(batch, outputs, strict=True):
        assert got == reference.generate(prompt, None, 8)


def test_open_executor_packs_only_fp32_on_cpu(checkpoints):
    base = checkpoints("llama")
    assert isinstance(open_executor(base, prepack=True), PrepackedExecutor)
    assert type(open_executor(base, prepack=False)) is BaseExecutor
    bf16 = open_executor(base, dtype=torch.bfloat16, prepack=True)
    assert type(bf16) is BaseExecutor  # no packed bf16 kernel worth it on every CPU
    with pytest.raises(ValueError, match="--no-prepack"):
        PrepackedExecutor(bf16)


@pytest.mark.parametrize("jobs", [False, True])
def test_serve_packs_unless_jobs_train_through_its_executor(checkpoints, tmp_path, jobs):
    config = ServerConfig(
        model=str(checkpoints("llama")),
        port=0,
        jobs_dir=str(tmp_path / "jobs") if jobs else None,
        engine=EngineConfig(max_running=2, max_batched_tokens=16, block_size=4, num_blocks=32),
    )
    with BackgroundServer(config) as server:
        layer = server.state.engine.engine.model.model.layers[0].self_attn.q_proj
        executor = getattr(layer, "base_layer", layer).executor
        assert isinstance(executor, PrepackedExecutor) is not jobs


@pytest.mark.parametrize("min_weights", [0, MIN_PACKED_WEIGHTS])
@pytest.mark.parametrize("rows", [PACKED_MIN_ROWS - 1, PACKED_MIN_ROWS, 33])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v with biases
def test_fused_calls_give_what_separate_calls_give(checkpoints, min_weights, rows, arch):
    plain = BaseExecutor.from_pretrained(checkpoints(arch))
    packed = PrepackedExecutor(BaseExecutor.from_pretrained(checkpoints(arch)), min_weights)
    names = {s.name: s.id for s in plain.manifest.layers}
    g = torch.Generator().manual_seed(rows)
    for group in (("self_attn", "qkv"), ("mlp", ("gate", "up"))):
        fused = tuple(names[f"model.layers.0.{group[0]}.{p}_proj"] for p in group[1])
        x = torch.randn(rows, plain.manifest.layers[fused[0]].in_features, generator=g)
        want, got = plain.forward_fused(fused, x), packed.forward_fused(fused, x)
        alone = [packed.call(Op.FORWARD, layer, x) for layer in fused]  # its siblings too
        for w, f, a in zip(want, got, alone, strict=True):
            assert torch.allclose(f, w, atol=ATOL, rtol=RTOL)
            assert torch.allclose(a, w, atol=ATOL, rtol=RTOL)
        product = packed._fused[fused]
        if not packed.packed_layers and rows < product.min_rows:  # the plain block itself
            assert all(torch.equal(w, f) for w, f in zip(want, got, strict=True))
        partial = fused[:2]  # a fused call that is no packed product: one per layer
        for w, f in zip(
            plain.forward_fused(partial, x), packed.forward_fused(partial, x), strict=True
        ):
            assert torch.allclose(f, w, atol=ATOL, rtol=RTOL)


def test_decode_steps_of_few_rows_run_packed_and_generate_what_vanilla_does(
    wide_llama, monkeypatch
):
    """Three sequences decoding: the gate/up and down products run packed at 3 rows (q/k/v
    and o stay plain), and the greedy tokens are vanilla transformers'."""
    executor = PrepackedExecutor(BaseExecutor.from_pretrained(wide_llama))
    names = {p.layers: executor.manifest.layers[p.layers[0]].name for p in executor._products()}
    assert sorted(p.min_rows for p in executor._products()) == [2, 3, 4, 8, 8]  # o, lm_head
    packed_at = []
    real = _Packed.__call__

    def spy(self, x):
        packed_at.append((names[self.layers].rpartition(".")[2], x.shape[0]))
        return real(self, x)

    monkeypatch.setattr(_Packed, "__call__", spy)
    config = EngineConfig(max_running=3, max_batched_tokens=64, block_size=4, num_blocks=64)
    engine = Engine(load_client(wide_llama, executor), config)
    batch = prompts(3, seed=4)
    outputs = engine.generate(batch, None, SamplingParams(max_tokens=6, temperature=0.0))
    assert {("gate_proj", 3), ("down_proj", 3)} <= set(packed_at), packed_at
    assert not {name for name, rows in packed_at if rows == 3} & {"q_proj", "o_proj"}
    reference = Reference(wide_llama, {})
    for prompt, got in zip(batch, outputs, strict=True):
        assert got == reference.generate(prompt, None, 6)


def test_bigger_small_products_run_packed_from_fewer_rows():
    """The plain product's time grows with each row, the packed one's hardly up to 4, so
    the row count from which a small product runs packed falls with its size."""
    assert packed_min_rows(16 * 1024) == packed_min_rows(64 * 1024) == PACKED_MIN_ROWS
    assert packed_min_rows(128 * 1024) == 4
    assert packed_min_rows(256 * 1024) == packed_min_rows(400_000) == PACKED_MIN_ROWS_FLOOR
    sizes = [2**k for k in range(8, 22)]
    rows = [packed_min_rows(n) for n in sizes]
    assert rows == sorted(rows, reverse=True)
    assert all(PACKED_MIN_ROWS_FLOOR <= r <= PACKED_MIN_ROWS for r in rows)


def test_q_k_v_and_gate_up_are_one_packed_product_each(checkpoints):
    packed = PrepackedExecutor(BaseExecutor.from_pretrained(checkpoints("llama")), min_weights=0)
    products = [p.layers for p in packed._products()]
    names = [tuple(packed.manifest.layers[i].name.rpartition(".")[2] for i in layers)
             for layers in products]  # fmt: skip
    layers = sum(s.name.endswith(".o_proj") for s in packed.manifest.layers)
    assert layers > 0
    assert names.count(("q_proj", "k_proj", "v_proj")) == layers
    assert names.count(("gate_proj", "up_proj")) == layers
    assert names.count(("o_proj",)) == names.count(("down_proj",)) == layers
