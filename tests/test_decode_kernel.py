"""symbiont's CPU decode attention kernel (symbiont/serve/decode_kernel.py) against SDPA,
the engine running through it against vanilla transformers, and what happens where it
cannot be built."""

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

from symbiont import BaseExecutor, load_client
from symbiont.kernels import library
from symbiont.serve import Engine, EngineConfig, Request, SamplingParams, decode_kernel
from tests.test_serve_common import Reference, prompts
from tests.tiny_models import ARCHS, build_checkpoint

ATOL = 2e-6  # float32: another summation order and a polynomial exp (about 1 ulp)
LOGITS_ATOL = 1e-4  # the engine's tolerance against vanilla (tests/test_serve_attention.py)


@pytest.fixture(scope="module")
def kernel():
    found = decode_kernel.load()
    if found is None:
        pytest.skip(f"decode kernel not built here: {decode_kernel.unavailable_reason()}")
    return found


def pool_case(n, kv_heads, share, hd, width, seed, window=None):
    """Queries and an in-place strided view of a pool (rows `stride` slots apart, slots
    beyond each context holding NaN), with the engine's additive mask."""
    g = torch.Generator().manual_seed(seed)
    stride = width + 5
    pools = []
    for _ in range(2):
        pool = torch.randn(kv_heads, n * stride + 3, hd, generator=g)
        pools.append(pool)
    lengths = torch.randint(1, width + 1, (n,), generator=g)
    lengths[0] = width
    positions = torch.arange(width)
    allowed = positions[None] < lengths[:, None]
    if window is not None:
        allowed &= positions[None] > (lengths[:, None] - 1) - window
    for pool in pools:  # what lies outside a context must never reach the output
        view = pool[:, 3:].view(kv_heads, n, stride, hd)
        view[:, :, :width][:, ~allowed] = float("nan")
        view[:, :, width:] = float("nan")
    k, v = (
        p.as_strided((n, kv_heads, width, hd), (stride * hd, p.stride(0), hd, 1), 3 * hd)
        for p in pools
    )
    mask = torch.zeros(n, 1, 1, width).masked_fill_(~allowed[:, None, None], float("-inf"))
    q = torch.randn(n, kv_heads, share, hd, generator=g)
    return q, k, v, mask


def sdpa_reference(q, k, v, mask, scale):
    """SDPA on clean copies: masked slots zeroed (SDPA itself lets NaN through 0 x NaN)."""
    keep = torch.isfinite(mask).transpose(-1, -2)  # [n, 1, width, 1]
    k, v = torch.where(keep, k, 0.0), torch.where(keep, v, 0.0)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


@pytest.mark.parametrize("hd", [16, 32, 64, 128, 24])  # 24: the generic (untemplated) path
@pytest.mark.parametrize("share", [1, 3, 8])
def test_kernel_equals_sdpa(kernel, hd, share):
    for seed, (n, kv_heads, width) in enumerate([(1, 1, 1), (5, 2, 7), (7, 2, 9), (4, 3, 130)]):
        q, k, v, mask = pool_case(n, kv_heads, share, hd, width, seed)
        got = kernel(q, k, v, mask, hd**-0.5)
        want = sdpa_reference(q, k, v, mask, hd**-0.5)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-5)


def test_kernel_windows_and_threads(kernel):
    """Masked keys before the window and after the context, on 1 and 2 threads; a
    contiguous (gathered) K/V and an out-of-order mask layout take the same path."""
    q, k, v, mask = pool_case(9, 2, 2, 64, 300, seed=3, window=37)
    want = sdpa_reference(q, k, v, mask, 0.125)
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            torch.testing.assert_close(kernel(q, k, v, mask, 0.125), want, atol=ATOL, rtol=1e-5)
    finally:
        torch.set_num_threads(threads)
    clean_k, clean_v = (torch.nan_to_num(t, nan=0.0).contiguous() for t in (k, v))
    torch.testing.assert_close(kernel(q, clean_k, clean_v, mask, 0.125), want, atol=ATOL, rtol=1e-5)


def test_kernel_reads_only_each_rows_unmasked_range(kernel):
    """Rows of a wide view whose keys lie in a short range (a short context, a filler
    row attending to position 0 only, a window) skip the rest; a row with every key
    masked gives zeros (SDPA gives NaN there: the engine never sends one)."""
    q, k, v, mask = pool_case(6, 2, 3, 64, 70, seed=4)
    mask[1] = float("-inf")
    mask[1, ..., 0] = 0.0  # a filler row
    mask[2] = float("-inf")
    mask[2, ..., 30:41] = 0.0  # a window in the middle
    mask[3] = float("-inf")  # nothing to attend to
    k[:, :, :].nan_to_num_(nan=0.0)
    v[:, :, :].nan_to_num_(nan=0.0)
    k[1, :, 1:] = float("nan")  # what a row does not attend to is never read
    k[2, :, :30] = float("nan")
    v[2, :, 41:] = float("nan")
    got = kernel(q, k, v, mask, 0.125)
    want = sdpa_reference(q, k, v, mask, 0.125)
    rows = [0, 1, 2, 4, 5]
    torch.testing.assert_close(got[rows], want[rows], atol=ATOL, rtol=1e-5)
    assert torch.equal(got[3], torch.zeros_like(got[3]))


def test_nan_reaches_the_output_as_with_sdpa(kernel):
    """A NaN in an attended key or in a query makes that row NaN, as SDPA does: a
    diverging model must not turn into plausible text."""
    q, k, v, mask = pool_case(4, 2, 2, 64, 40, seed=6)
    for t in (k, v):
        t.nan_to_num_(nan=0.0)
    k[1, 0, 3, 5] = float("nan")  # row 1, KV head 0: its query heads 0 and 1
    q[2, 1, 0, 0] = float("nan")  # row 2, KV head 1, its first query head
    got = kernel(q, k, v, mask, 0.125)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125)
    assert torch.equal(got.isnan(), want.isnan())
    assert got[1, 0].isnan().all() and got[2, 1, 0].isnan().all()
    assert not got[0].isnan().any() and not got[3].isnan().any()


def test_kernel_refuses_mismatched_shapes(kernel):
    q, k, v, mask = pool_case(2, 2, 2, 16, 8, seed=0)
    with pytest.raises(ValueError, match="decode kernel: q"):
        kernel(q, k[:, :1], v[:, :1], mask, 0.25)


def test_applies_only_to_float32_on_a_cpu():
    q, k, _, mask = pool_case(2, 2, 2, 16, 8, seed=0)
    assert decode_kernel.DecodeKernel.applies(q, k, mask)
    assert not decode_kernel.DecodeKernel.applies(q.double(), k.double(), mask.double())
    assert not decode_kernel.DecodeKernel.applies(q.bfloat16(), k.bfloat16(), mask.bfloat16())
    assert not decode_kernel.DecodeKernel.applies(q.transpose(-1, -2), k, mask)
    assert not decode_kernel.DecodeKernel.applies(q.clone().requires_grad_(), k, mask)


@pytest.fixture
def fresh_load(monkeypatch, tmp_path):
    """load() as in a new process, building into an empty SYMBIONT_HOME."""
    monkeypatch.setenv("SYMBIONT_HOME", str(tmp_path))
    library._load.cache_clear()
    yield tmp_path
    library._load.cache_clear()


def test_build_is_cached_under_symbiont_home(fresh_load, kernel):
    built = decode_kernel.load()
    assert built is not None and built.path.parent == fresh_load / "kernels"
    stamp = built.path.stat().st_mtime_ns
    library._load.cache_clear()
    assert decode_kernel.load().path == built.path  # found, not rebuilt
    assert built.path.stat().st_mtime_ns == stamp
    assert [p.name for p in built.path.parent.iterdir()] == [built.path.name]  # no leftovers


def test_a_broken_cached_library_is_built_again(fresh_load, monkeypatch, kernel):
    """A truncated file, or a library without the kernel, at the cached name is rebuilt
    (before, every later start failed on it, or raised)."""
    name = decode_kernel.load().path.name  # the same in every folder: one source, CPU
    other = fresh_load / "other.cpp"
    other.write_text('extern "C" int something_else() { return 1; }\n')
    compiler = library._compiler()
    for content in ("truncated", "no kernel inside"):
        home = fresh_load / content.replace(" ", "-")
        cached = home / "kernels" / name
        cached.parent.mkdir(parents=True, mode=0o700)
        if content == "truncated":
            cached.write_bytes(b"\x7fELF")
        else:
            subprocess.run(
                [compiler, "-shared", "-fPIC", str(other), "-o", str(cached)], check=True
            )
        monkeypatch.setenv("SYMBIONT_HOME", str(home))
        library._load.cache_clear()
        again = decode_kernel.load()
        assert again is not None, decode_kernel.unavailable_reason()
        assert again.path == cached
        q, k, v, mask = pool_case(2, 2, 2, 16, 8, seed=0)
        torch.testing.assert_close(
            again(q, k, v, mask, 0.25), sdpa_reference(q, k, v, mask, 0.25), atol=ATOL, rtol=1e-5
        )


def test_without_a_home_the_private_temporary_folder_is_used(fresh_load, monkeypatch, kernel):
    monkeypatch.delenv("SYMBIONT_HOME")

    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(library.Path, "home", no_home)
    tmp = fresh_load / "tmp"
    monkeypatch.setattr(library.tempfile, "gettempdir", lambda: str(tmp))
    built = decode_kernel.load()
    assert built is not None, decode_kernel.unavailable_reason()
    assert built.path.parent == tmp / f"symbiont-kernels-{os.getuid()}"


def test_a_later_success_clears_the_reason(fresh_load, monkeypatch, kernel):
    monkeypatch.setenv("CXX", str(fresh_load / "missing-compiler"))
    monkeypatch.setenv("PATH", str(fresh_load))
    assert decode_kernel.load() is None and decode_kernel.unavailable_reason()
    monkeypatch.undo()
    monkeypatch.setenv("SYMBIONT_HOME", str(fresh_load))
    library._load.cache_clear()
    assert decode_kernel.load() is not None
    assert decode_kernel.unavailable_reason() is None


def test_built_for_torchs_openmp_threads(kernel):
    """Where torch ships libgomp the kernel is built with OpenMP and shares torch's one
    runtime (a second one would spin beside torch's threads)."""
    torch_gomp = Path(torch.__file__).parent / "lib" / "libgomp.so.1"
    if not torch_gomp.exists():
        pytest.skip("this torch build ships no libgomp: the kernel runs on one thread")
    assert b"GOMP_parallel" in kernel.path.read_bytes()
    mapped = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()}
    assert {Path(m).resolve() for m in mapped if "libgomp" in m} == {torch_gomp.resolve()}


def test_no_compiler_means_sdpa_with_the_reason(fresh_load, monkeypatch):
    monkeypatch.setenv("PATH", str(fresh_load))
    monkeypatch.delenv("CXX", raising=False)
    assert decode_kernel.load() is None
    assert "no C++ compiler found" in decode_kernel.unavailable_reason()


def test_a_failing_compiler_is_reported(fresh_load, monkeypatch):
    broken = fresh_load / "broken-cxx"
    broken.write_text("#!/bin/sh\necho 'broken-cxx: error: no such flag' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CXX", str(broken))
    assert decode_kernel.load() is None
    reason = decode_kernel.unavailable_reason()
    assert (
        "could not build decode_attention.cpp, chunk_attention.cpp, layer_ops.cpp, few_rows.cpp, "
        "lora_rows.cpp: "
        "broken-cxx: error: no such flag" in reason
    )
    assert not any((fresh_load / "kernels").iterdir())  # the partial file is gone


def test_folders_others_can_write_are_not_used(fresh_load, monkeypatch, kernel):
    """A library in a folder another user can write could be theirs: never loaded."""
    shared = fresh_load / "kernels"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    tmp = fresh_load / "tmp"
    monkeypatch.setattr(library.tempfile, "gettempdir", lambda: str(tmp))
    built = decode_kernel.load()  # the private fallback under the temporary folder
    assert built is not None and built.path.parent.parent == tmp
    assert not any(shared.iterdir())
    built.path.parent.chmod(0o777)
    library._load.cache_clear()
    assert decode_kernel.load() is None
    reason = decode_kernel.unavailable_reason()
    assert "no folder of this user's own for the CPU kernels" in reason
    assert "writable by others (mode 777); chmod go-w it" in reason


GREEDY = SamplingParams(max_tokens=10, temperature=0.0)
CONFIG = EngineConfig(max_running=6, max_batched_tokens=64, block_size=4, num_blocks=128)


MODELS = {  # head dims 16 and 32 run the kernel's specialised code, 8 its generic one
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


def test_engine_decodes_through_the_kernel_as_vanilla(model, kernel, monkeypatch):
    base, reference = model
    calls = []
    call = decode_kernel.DecodeKernel.__call__

    def counted(self, *args):
        calls.append(args[0].shape)
        return call(self, *args)

    monkeypatch.setattr(decode_kernel.DecodeKernel, "__call__", counted)
    engine = Engine(load_client(base, BaseExecutor.from_pretrained(base)), CONFIG)
    assert engine.runner.decode_kernel is not None
    batch = prompts(5, seed=11, low=3, high=15)
    for prompt, got in zip(batch, engine.generate(batch, [None] * 5, GREEDY), strict=True):
        assert got == reference.generate(prompt, None, GREEDY.max_tokens)
    assert calls, "the engine never called the decode kernel"
    # and the logits of one decode step, against vanilla on the same tokens
    for i, p in enumerate(prompts(3, seed=12, low=4, high=9)):
        engine.add_request(Request(f"s{i}", p, None, GREEDY))
    engine.step()
    engine.step()
    scheduled = engine.scheduler.schedule()
    assert all(item.n_tokens == 1 for item in scheduled)
    logits = engine.runner.run(scheduled).sampling
    for row, item in zip(logits, scheduled, strict=True):
        want = reference.logits(item.seq.token_ids[: item.start + 1], None)[-1]
        torch.testing.assert_close(row, want, atol=LOGITS_ATOL, rtol=0)


def test_no_decode_kernel_flag_and_fallback(model, fresh_load, monkeypatch, caplog):
    base, reference = model
    off = Engine(
        load_client(base, BaseExecutor.from_pretrained(base)),
        dataclasses.replace(CONFIG, decode_kernel=False),
    )
    assert off.runner.decode_kernel is None
    monkeypatch.setenv("PATH", str(fresh_load))  # no compiler: the engine uses SDPA
    monkeypatch.delenv("CXX", raising=False)
    library._load.cache_clear()  # `off` loaded the library for its norm kernels
    with caplog.at_level(logging.INFO, logger="symbiont.serve.model_runner"):
        fallback = Engine(load_client(base, BaseExecutor.from_pretrained(base)), CONFIG)
    assert fallback.runner.decode_kernel is None
    assert "PyTorch's operations, as symbiont's CPU kernels could not be built (no C++" in (
        caplog.text
    )
    batch = prompts(3, seed=13, low=3, high=12)
    for engine in (off, fallback):
        for prompt, got in zip(batch, engine.generate(batch, [None] * 3, GREEDY), strict=True):
            assert got == reference.generate(prompt, None, GREEDY.max_tokens)


REPO = Path(__file__).resolve().parents[1]


def test_the_benchmarks_run(kernel, tmp_path_factory):
    """The documented commands of benchmarks/decode_attention.py and profile_decode.py
    --kernel-ab / --sdpa, at the smallest sizes: they run and show both arms."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = [sys.executable, str(REPO / "benchmarks" / "decode_attention.py")]
    out = subprocess.run(
        [*run, "--seqs", "2", "--lengths", "16", "--rounds", "1", "--layers", "2"],
        capture_output=True, text=True, env=env, timeout=300, check=True,
    ).stdout  # fmt: skip
    assert "in place, kernel" in out and "| 2 | 16 |" in out
    arch, extra = MODELS["llama_hd16"]
    spec = dataclasses.replace(ARCHS[arch], config={**ARCHS[arch].config, **extra})
    base = build_checkpoint(spec, tmp_path_factory.mktemp("bench"))
    profile = [sys.executable, str(REPO / "benchmarks" / "profile_decode.py"), "--model", str(base)]
    small = ["--batch", "2", "--prompt-len", "8", "--steps", "2", "--max-batched-tokens", "64"]
    out = subprocess.run(
        [*profile, *small, "--kernel-ab", "2"],
        capture_output=True, text=True, env=env, timeout=300, check=True,
    ).stdout  # fmt: skip
    assert "| SDPA |" in out and "| decode kernel |" in out
    out = subprocess.run(
        [*profile, *small, "--profile-steps", "2", "--sdpa"],
        capture_output=True, text=True, env=env, timeout=300, check=True,
    ).stdout  # fmt: skip
    assert "forward: attention" in out and "engine-only decode" in out
