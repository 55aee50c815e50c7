"""symbiont's CPU norm and rotary kernels (symbiont/serve/layer_ops.py) against PyTorch's and
transformers' operations, and the engine's lean forward running through them against the
lean forward without them and against vanilla transformers."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from symbiont import BaseExecutor, load_client
from symbiont.kernels import library
from symbiont.serve import Engine, EngineConfig, Request, SamplingParams, decode_kernel
from symbiont.serve.layer_ops import LayerOps
from tests.test_serve_common import Reference, prompts
from tests.tiny_models import ARCHS, build_checkpoint

NORM_ATOL = 4e-6  # float32 unit-scale outputs: the sum of squares in another order
LOGITS_ATOL = 1e-4  # the engine's tolerance against vanilla (tests/test_serve_attention.py)


@pytest.fixture(scope="module")
def ops():
    kernel = decode_kernel.load()
    if kernel is None:
        pytest.skip(f"CPU kernels not built here: {decode_kernel.unavailable_reason()}")
    return LayerOps(kernel.lib)


def rows_of(n: int, dim: int, seed: int, stride: int | None = None) -> torch.Tensor:
    """[1, n, dim] float32, its rows `stride` apart (a slice of a wider tensor)."""
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(1, n, stride or dim, generator=g) * 3
    return wide[..., :dim]


@pytest.mark.parametrize("n, dim", [(1, 8), (5, 13), (16, 256), (600, 768)])
@pytest.mark.parametrize("threads", [1, 2])
def test_rms_norm_equals_pytorch_within_rounding(ops, n, dim, threads, monkeypatch):
    """Row sizes with and without a remainder past whole vectors; 600 x 768 is split
    across threads."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    x, res = rows_of(n, dim, 1, stride=dim + 3), rows_of(n, dim, 2)
    weight = torch.randn(dim, generator=torch.Generator().manual_seed(3))
    h, out = ops.rms_norm(x, weight, 1e-6)
    assert h is x
    torch.testing.assert_close(out, F.rms_norm(x, (dim,), weight, 1e-6), atol=NORM_ATOL, rtol=0)
    h, out = ops.rms_norm(x, weight, 1e-5, res)
    assert torch.equal(h, x + res)  # the residual stream itself is exact
    assert h.is_contiguous() and out.is_contiguous()
    torch.testing.assert_close(
        out, F.rms_norm(x + res, (dim,), weight, 1e-5), atol=NORM_ATOL, rtol=0
    )


def test_rms_norm_results_do_not_depend_on_the_thread_count(ops, monkeypatch):
    x, weight = rows_of(600, 768, 4), torch.randn(768)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    _, one = ops.rms_norm(x, weight, 1e-6)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    _, two = ops.rms_norm(x, weight, 1e-6)
    assert torch.equal(one, two)


def test_rms_norm_carries_nan_and_inf_as_pytorch(ops):
    x, weight = rows_of(3, 16, 5), torch.ones(16)
    x[0, 1, 4] = float("nan")
    x[0, 2, 0] = float("inf")
    _, out = ops.rms_norm(x, weight, 1e-6)
    want = F.rms_norm(x, (16,), weight, 1e-6)
    assert torch.equal(out.isnan(), want.isnan())
    torch.testing.assert_close(out[0, 0], want[0, 0], atol=NORM_ATOL, rtol=0)


def rotary_case(n: int, heads: int, kv_heads: int, hd: int, seed: int):
    """q and k as views of one fused q/k/v output (rows wider than either), and Llama's
    cos and sin for positions 37.. (cat(freqs, freqs))."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(1, n, (heads + 2 * kv_heads) * hd, generator=g)
    q, k = qkv[..., : heads * hd], qkv[..., heads * hd : (heads + kv_heads) * hd]
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
    freqs = (torch.arange(n) + 37.0)[:, None] * inv[None]
    emb = torch.cat((freqs, freqs), dim=-1)
    return q, k, emb.cos()[None], emb.sin()[None]


@pytest.mark.parametrize("hd", [8, 12, 16, 24, 64, 128])
@pytest.mark.parametrize("n, heads, kv_heads", [(1, 4, 2), (7, 3, 3), (300, 12, 4)])
def test_rotary_is_bitwise_transformers(ops, n, heads, kv_heads, hd, monkeypatch):
    """Head dims whose half is whole vectors, less than one (12) and one with a remainder
    (24); 300 tokens of 16 heads of 128 are split across threads."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    q, k, cos, sin = rotary_case(n, heads, kv_heads, hd, seed=hd + n)
    got = ops.rotary(q, k, cos, sin, heads, kv_heads)  # [1, heads + kv_heads, n, hd]
    qh = q.view(1, n, heads, hd).transpose(1, 2)
    kh = k.view(1, n, kv_heads, hd).transpose(1, 2)
    want_q, want_k = apply_rotary_pos_emb(qh, kh, cos, sin)
    assert got.shape == (1, heads + kv_heads, n, hd) and got.is_contiguous()
    assert torch.equal(got[:, :heads], want_q)
    assert torch.equal(got[:, heads:], want_k)


def test_fits_only_float32_on_a_cpu_with_contiguous_rows():
    x = torch.zeros(1, 4, 8)
    assert LayerOps.fits(x, x[..., :4])
    assert not LayerOps.fits(x, x.double())
    assert not LayerOps.fits(x.transpose(1, 2))
    assert not LayerOps.fits(x.to(torch.bfloat16))


def test_shapes_the_kernels_do_not_take_are_left_to_pytorch():
    """Partial rotary (cos narrower than a head), an odd head dim, q or k not whole heads,
    a norm weight of another width: the lean forward then runs PyTorch's operations,
    which raise where transformers' would."""
    q, k, cos, sin = rotary_case(5, 4, 2, 16, seed=1)
    assert LayerOps.rotary_fits(q, k, cos, sin, 4, 2, 16)
    assert not LayerOps.rotary_fits(q, k, cos[..., :8], sin[..., :8], 4, 2, 16)
    assert not LayerOps.rotary_fits(q, k, cos, sin, 4, 2, 15)
    assert not LayerOps.rotary_fits(q[..., :60], k, cos, sin, 4, 2, 16)
    assert not LayerOps.rotary_fits(
        q, k, cos, sin.clone().transpose(1, 2).contiguous().transpose(1, 2), 4, 2, 16
    )
    x = torch.zeros(1, 3, 8)
    assert LayerOps.norm_fits(x, torch.ones(8))
    assert not LayerOps.norm_fits(x, torch.ones(9))
    assert not LayerOps.norm_fits(x, torch.ones(2, 4))


def test_outputs_are_float32_whatever_torchs_default_dtype(ops):
    x, weight = rows_of(2, 16, 6), torch.ones(16)
    q, k, cos, sin = rotary_case(3, 2, 1, 8, seed=2)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        _, out = ops.rms_norm(x, weight, 1e-6)
        rotated = ops.rotary(q, k, cos, sin, 2, 1)
    finally:
        torch.set_default_dtype(previous)
    assert out.dtype == rotated.dtype == torch.float32
    torch.testing.assert_close(out, F.rms_norm(x, (16,), weight, 1e-6), atol=NORM_ATOL, rtol=0)


GREEDY = SamplingParams(max_tokens=10, temperature=0.0)
CONFIG = EngineConfig(max_running=6, max_batched_tokens=64, block_size=4, num_blocks=128)

MODELS = {  # head dims 16, 32 and 8; q/k/v biases; a window
    "llama_hd16": ("llama", {"hidden_size": 64, "intermediate_size": 96}),
    "qwen2_hd32": ("qwen2", {"hidden_size": 128, "intermediate_size": 96}),
    "mistral_window_hd8": ("mistral", {"sliding_window": 5}),
}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request, tmp_path_factory):
    arch, extra = MODELS[request.param]
    spec = dataclasses.replace(ARCHS[arch], config={**ARCHS[arch].config, **extra})
    base = build_checkpoint(spec, tmp_path_factory.mktemp(request.param))
    return base, Reference(base, {})


def engine_for(base, **config) -> Engine:
    return Engine(
        load_client(base, BaseExecutor.from_pretrained(base)), dataclasses.replace(CONFIG, **config)
    )


def test_engine_runs_through_the_kernels_as_vanilla(model, ops, monkeypatch):
    """Prefill chunks and decode steps: greedy tokens equal vanilla transformers', and one
    decode step's logits are within the engine's tolerance, with both kernels called."""
    base, reference = model
    calls = {"rms_norm": 0, "rotary": 0}
    for name in calls:
        original = getattr(LayerOps, name)

        def counted(self, *args, _name=name, _original=original, **kw):
            calls[_name] += 1
            return _original(self, *args, **kw)

        monkeypatch.setattr(LayerOps, name, counted)
    engine = engine_for(base)
    assert engine.runner.lean is not None and engine.runner.lean.ops is not None
    batch = prompts(5, seed=21, low=3, high=40)
    for prompt, got in zip(batch, engine.generate(batch, [None] * 5, GREEDY), strict=True):
        assert got == reference.generate(prompt, None, GREEDY.max_tokens)
    layers = len(engine.runner.lean.layers)
    assert calls["rotary"] >= layers and calls["rms_norm"] >= 2 * layers + 1
    for i, p in enumerate(prompts(3, seed=22, low=4, high=9)):
        engine.add_request(Request(f"s{i}", p, None, GREEDY))
    engine.step()
    engine.step()
    scheduled = engine.scheduler.schedule()
    logits = engine.runner.run(scheduled).sampling
    for row, item in zip(logits, scheduled, strict=True):
        want = reference.logits(item.seq.token_ids[: item.start + 1], None)[-1]
        torch.testing.assert_close(row, want, atol=LOGITS_ATOL, rtol=0)


def test_every_step_is_the_plain_lean_forward_within_rounding(model, ops):
    """The same engine with and without the kernels, step by step: equal tokens, logits
    within float32 rounding of the norms."""
    base, _ = model
    with_ops, without = engine_for(base), engine_for(base, layer_ops=False)
    assert without.runner.layer_ops is None and without.runner.lean.ops is None
    logits = {}
    for name, engine in (("ops", with_ops), ("plain", without)):
        seen, forward = [], engine.runner.forward

        def recording(batch, _seen=seen, _forward=forward):
            out = _forward(batch)
            _seen.append(out.clone())
            return out

        engine.runner.forward = recording
        engine.generate(prompts(6, seed=23, low=2, high=30), [None] * 6, GREEDY)
        logits[name] = seen
    assert len(logits["ops"]) == len(logits["plain"])
    for a, b in zip(logits["ops"], logits["plain"], strict=True):
        torch.testing.assert_close(a, b, atol=LOGITS_ATOL, rtol=0)


def test_no_layer_ops_flag_and_fallback(model, monkeypatch, tmp_path, caplog):
    base, reference = model
    off = engine_for(base, layer_ops=False)
    assert off.runner.layer_ops is None and off.runner.lean.ops is None
    monkeypatch.setenv("SYMBIONT_HOME", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))  # no compiler: PyTorch's operations
    monkeypatch.delenv("CXX", raising=False)
    library._load.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="symbiont.serve.model_runner"):
            fallback = engine_for(base)
    finally:
        library._load.cache_clear()
    assert fallback.runner.layer_ops is None and fallback.runner.lean.ops is None
    assert "norms and rotary embedding: PyTorch's operations" in caplog.text
    batch = prompts(3, seed=24, low=3, high=12)
    for engine in (off, fallback):
        for prompt, got in zip(batch, engine.generate(batch, [None] * 3, GREEDY), strict=True):
            assert got == reference.generate(prompt, None, GREEDY.max_tokens)


def test_the_benchmark_runs(ops, tmp_path_factory):
    """The documented `profile_decode.py --layer-ops-ab` (both arms, decode steps and a
    prefill) and `--direct-ab` (symbiont/serve/lean.py), at the smallest sizes."""
    arch, extra = MODELS["llama_hd16"]
    spec = dataclasses.replace(ARCHS[arch], config={**ARCHS[arch].config, **extra})
    base = build_checkpoint(spec, tmp_path_factory.mktemp("bench"))
    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [
            sys.executable, str(repo / "benchmarks" / "profile_decode.py"), "--model", str(base),
            "--batch", "2", "--prompt-len", "8", "--steps", "2", "--layer-ops-ab", "2",
        ],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(repo)},
        timeout=300, check=True,
    ).stdout  # fmt: skip
    for arm in ("PyTorch's operations", "layer kernels"):
        assert f"| {arm}, decode step |" in out and f"| {arm}, prefill of 8 tokens |" in out
    out = subprocess.run(
        [
            sys.executable, str(repo / "benchmarks" / "profile_decode.py"), "--model", str(base),
            "--batch", "2", "--prompt-len", "8", "--steps", "2", "--direct-ab", "2",
        ],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(repo)},
        timeout=300, check=True,
    ).stdout  # fmt: skip
    assert "| projection modules |" in out and "| executor called directly |" in out
