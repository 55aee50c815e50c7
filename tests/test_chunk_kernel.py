"""symbiont's CPU attention kernel for prefill chunks (`DecodeKernel.chunk`,
symbiont/kernels/csrc/chunk_attention.cpp) against SDPA in float64 under the engine's mask;
the engine's chunks through it against vanilla transformers are in
tests/test_serve_attention.py."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from symbiont.serve import decode_kernel
from tests.tiny_models import ARCHS, build_checkpoint

ATOL = 2e-6  # float32: another summation order and a polynomial exp (about 1 ulp)


@pytest.fixture(scope="module")
def kernel():
    found = decode_kernel.load()
    if found is None:
        pytest.skip(f"CPU kernels not built here: {decode_kernel.unavailable_reason()}")
    return found


def chunk_case(heads, kv_heads, hd, m, start, seed):
    """A chunk's queries as the engine holds them (a slice of every token's queries,
    heads first) and its context as rows of a wider pool, NaN past the chunk's last key:
    the kernel must never read there."""
    g = torch.Generator().manual_seed(seed)
    q_all = torch.randn(heads, m + 7, hd, generator=g)
    q = q_all[:, 3 : 3 + m]  # [heads, m, hd], strides (n_tokens * hd, hd, 1)
    pools = []
    for _ in range(2):
        pool = torch.randn(kv_heads, start + m + 9, hd, generator=g)
        pool[:, start + m :] = float("nan")
        pools.append(pool)
    return q, pools[0], pools[1]


def reference(q, k, v, start, window, scale):
    """SDPA in float64 under the engine's additive mask -> [m, heads, hd] float32."""
    m = q.shape[1]
    width = start + m
    keys, queries = torch.arange(width), torch.arange(start, width)
    allowed = keys[None] <= queries[:, None]
    if window is not None:
        allowed &= keys[None] > queries[:, None] - window
    mask = torch.zeros(allowed.shape, dtype=torch.float64).masked_fill_(~allowed, float("-inf"))
    out = F.scaled_dot_product_attention(
        q[None].double(),
        k[None, :, :width].double(),
        v[None, :, :width].double(),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1).float()


CASES = [  # (chunk length, position of its first query, sliding window)
    (2, 0, None),
    (31, 0, None),  # less than one tile of queries
    (33, 5, None),  # one whole tile and a row on AVX-512 (32 queries), more on AVX2 (16)
    (100, 200, None),  # a context longer than the chunk
    (70, 9, 5),  # a window shorter than the chunk
    (129, 40, 64),  # a window of one key block, longer than a tile
    (150, 0, 1),  # each query sees only itself
]


@pytest.mark.parametrize("hd", [8, 16, 64, 128, 24, 80])  # 24, 80: the run-time head dim
@pytest.mark.parametrize("share", [1, 3])
def test_chunk_equals_sdpa(kernel, hd, share):
    kv_heads = 2
    for seed, (m, start, window) in enumerate(CASES):
        q, k, v = chunk_case(share * kv_heads, kv_heads, hd, m, start, seed)
        got = kernel.chunk(q, k, v, start, window, hd**-0.5)
        want = reference(q, k, v, start, window, hd**-0.5)
        assert got.shape == (m, share * kv_heads, hd)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-5)


def test_threads_split_whole_tiles(kernel):
    """Each tile of queries runs on one thread: two threads give bitwise one's results."""
    q, k, v = chunk_case(6, 2, 64, 300, 50, seed=1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel.chunk(q, k, v, 50, None, 0.125)
        torch.set_num_threads(2)
        two = kernel.chunk(q, k, v, 50, None, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_nan_stays_in_its_own_query(kernel):
    """A NaN in one query reaches that query's output and no other (as with SDPA)."""
    q, k, v = chunk_case(4, 2, 16, 40, 0, seed=2)
    q = q.clone()
    q[1, 7, 3] = float("nan")
    out = kernel.chunk(q, k, v, 0, None, 0.25)
    assert out[7, 1].isnan().all()
    out[7, 1] = 0.0
    assert out.isfinite().all()


def test_applies_and_refuses(kernel):
    q, k, v = chunk_case(4, 2, 16, 10, 3, seed=3)
    assert kernel.chunk_applies(q, k, v)
    assert not kernel.chunk_applies(q.double(), k.double(), v.double())
    assert not kernel.chunk_applies(q[..., :12], k[..., :12], v[..., :12])  # no multiple of 8
    assert not kernel.chunk_applies(q.transpose(1, 2), k, v)  # head dim not contiguous
    assert not kernel.chunk_applies(q.clone().requires_grad_(), k, v)  # no backward
    with pytest.raises(ValueError, match=r"chunk kernel: q \(4, 10, 16\), k \(2, 12, 16\)"):
        kernel.chunk(q, k[:, :12], v[:, :12], 3, None, 0.25)  # keys end before the chunk's
    with pytest.raises(ValueError, match="sliding window 0; it must be at least 1"):
        kernel.chunk(q, k, v, 3, 0, 0.25)
    with pytest.raises(ValueError, match="head_dim 12 is no multiple of 8"):
        kernel.chunk(q[..., :12], k[..., :12], v[..., :12], 3, None, 0.25)


REPO = Path(__file__).resolve().parents[1]


def test_the_benchmark_runs(kernel, tmp_path):
    """benchmarks/chunk_attention.py at its smallest sizes: the kernel table's three arms
    agree, and the engine runs all three arms on a small Llama."""
    spec = dataclasses.replace(ARCHS["llama"], config={**ARCHS["llama"].config, "head_dim": 16})
    base = build_checkpoint(spec, tmp_path / "llama")
    done = subprocess.run(
        [
            sys.executable, str(REPO / "benchmarks" / "chunk_attention.py"),
            "--max-chunk", "64", "--rounds", "1", "--model", str(base), "--requests", "3",
            "--users", "2", "--prompt-len", "40:70", "--max-tokens", "2",
        ],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=600, check=True,
    )  # fmt: skip
    out = done.stdout
    assert "Traceback" not in done.stderr, done.stderr
    table = [line for line in out.splitlines() if line.startswith("| 64 | 0 |")]
    assert len(table) == 2, out
    assert all(float(line.split("|")[-2]) < 1e-4 for line in table), out  # max diff
    for arm in ("one call", "blocks", "kernel"):
        assert f"| {arm} |" in out, out
