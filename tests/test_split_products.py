"""A lone client's large products split over serve-base's idle workers
(symbiont/base/server.py `_split`, `OneDnnExecutor.run_columns`): the parts together equal
the whole product within fp32 rounding, forward and backward, LINEAR and CONV1D layers,
fused runs and biases; a LoRA step through a splitting serve-base equals vanilla
transformers + peft within that rounding; the client sleeps on split calls and spins on
the rest; a second client ends the splitting; the default executor never splits."""

from __future__ import annotations

import itertools
import os
import threading
import time

import pytest
import torch

import symbiont
from symbiont import BaseExecutor
from symbiont.base import onednn as onednn_module
from symbiont.base import server as server_module
from symbiont.base.config import ServiceConfig
from symbiont.base.onednn import OneDnnExecutor, can_use_onednn
from symbiont.base.server import ExecutorServer
from symbiont.model.layers import LayerKind
from symbiont.protocol import shm
from symbiont.protocol.executor import Op
from tests.test_exactness import batch, grads, lora, make_pair
from tests.test_service_server import serving_thread
from tests.tiny_models import ARCHS

pytestmark = pytest.mark.skipif(
    not can_use_onednn("cpu", torch.float32), reason="this torch build has no oneDNN"
)
ATOL, RTOL = 1e-5, 1e-5  # another summation order: fp32 rounding apart


def onednn_of(path) -> OneDnnExecutor:
    return OneDnnExecutor(BaseExecutor.from_pretrained(path))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])  # qwen2: biases; gpt2: CONV1D
def test_column_parts_together_equal_the_whole_product(checkpoints, arch, monkeypatch):
    """For every layer and direction, and every fused run, column parts side by side
    equal `run` (`run_fused`): from blocks of the weight's rows where those give the
    output's columns, else from strided blocks of its columns (through torch's product:
    oneDNN's would be ~700x slower), with few rows (the few-rows kernel where built) and
    many (oneDNN's)."""
    from symbiont.kernels.few_rows import FewRows

    executor = onednn_of(checkpoints(arch))
    executor.few_rows = FewRows.load()  # as serve-base attaches it (None: not built here)
    monkeypatch.setattr(onednn_module, "ONEDNN_MIN_MACS", 0)  # tiny layers: oneDNN too
    strided = []
    real_linear = torch.nn.functional.linear

    def spy_linear(x, weight, bias=None):
        strided.append(weight.stride(-1) != 1)
        return real_linear(x, weight, bias)

    monkeypatch.setattr(torch.nn.functional, "linear", spy_linear)
    g = torch.Generator().manual_seed(0)
    kinds = set()
    for spec in executor.manifest.layers:
        linear = spec.kind is LayerKind.LINEAR
        for op, width_in, width_out in (
            (Op.FORWARD, spec.in_features, spec.out_features),
            (Op.BACKWARD, spec.out_features, spec.in_features),
        ):
            blocks = executor.column_blocks(op, (spec.id,))
            assert blocks == ("rows" if linear is (op is Op.FORWARD) else "columns")
            kinds.add((spec.kind, op, blocks))
            for rows in (3, 64):
                x = torch.randn(rows, width_in, generator=g)
                bounds = sorted({0, 16, width_out // 2 // 16 * 16, width_out})
                strided.clear()
                parts = [
                    executor.run_columns(op, (spec.id,), x, s, e)
                    for s, e in itertools.pairwise(bounds)
                ]
                assert all(strided) is (blocks == "columns") or not strided
                got, want = torch.cat(parts, dim=1), executor.run(op, spec.id, x)
                assert torch.allclose(got, want, atol=ATOL, rtol=RTOL), (spec.name, op, rows)
    assert (LayerKind.LINEAR, Op.BACKWARD, "columns") in kinds  # lm_head, even in GPT-2
    if arch == "gpt2":
        assert {
            (LayerKind.CONV1D, Op.FORWARD, "columns"),
            (LayerKind.CONV1D, Op.BACKWARD, "rows"),
        } <= kinds
    for layers, run in executor._runs.items():  # q/k/v, gate/up: the block's rows
        assert executor.column_blocks(Op.FORWARD, layers) == "rows"
        assert executor.column_blocks(Op.FORWARD, layers[::-1]) is None  # not one block
        total = sum(run.widths)
        for rows in (3, 64):
            x = torch.randn(rows, run.in_features, generator=g)
            parts = [
                executor.run_columns(Op.FORWARD, layers, x, s, e) for s, e in ((0, 32), (32, total))
            ]
            want = torch.cat(executor.run_fused(layers, x), dim=1)
            assert torch.allclose(torch.cat(parts, dim=1), want, atol=ATOL, rtol=RTOL), layers
    plain = BaseExecutor.from_pretrained(checkpoints(arch))
    assert not plain.splits and plain.column_blocks(Op.FORWARD, (0,)) is None
    with pytest.raises(NotImplementedError, match="does not split its products"):
        plain.run_columns(Op.FORWARD, (0,), torch.ones(1, 1), 0, 1)


def test_how_a_call_is_split(checkpoints):
    """`_split`: parts cover the output's columns (multiples of 16) or x's rows (16 or
    more each) without gaps, at most `ways` of them, none for small calls or where no
    block fits; strided column blocks only for calls of too few rows for row blocks."""
    config = ServiceConfig(bind=("tcp://127.0.0.1:*",), workers=4, host_cores=4)
    server = ExecutorServer(onednn_of(checkpoints("gpt2")), config)
    try:
        layers = server.manifest.layers
        conv = next(s for s in layers if s.kind is LayerKind.CONV1D)
        linear = next(s for s in layers if s.kind is LayerKind.LINEAR)  # lm_head
        for spec in (conv, linear):
            for op in (Op.FORWARD, Op.BACKWARD):
                width = spec.out_features if op is Op.FORWARD else spec.in_features
                blocks = server.executor.column_blocks(op, (spec.id,))
                for rows in (1, 7, 31, 32, 33, 64, 1000, 5000, 100_000):
                    for ways in (1, 2, 3, 4):
                        split = server._split(op, (spec.id,), rows, ways)
                        macs = rows * spec.in_features * spec.out_features
                        if ways == 1 or macs < 2 * server_module.SPLIT_MIN_MACS:
                            assert split is None, (spec.name, op, rows, ways)
                            continue
                        if split is None:  # too narrow for two column blocks
                            assert width < 2 * server_module.SPLIT_ALIGN, (spec.name, rows)
                            continue
                        by_columns, parts = split
                        assert 2 <= len(parts) <= ways
                        assert by_columns is (blocks == "rows" or rows < 32), (op, rows)
                        size = width if by_columns else rows
                        assert parts[0][0] == 0 and parts[-1][1] == size
                        assert all(a[1] == b[0] for a, b in itertools.pairwise(parts))
                        if by_columns:
                            assert all(s % server_module.SPLIT_ALIGN == 0 for s, _ in parts)
                        else:
                            assert all(e - s >= 16 for s, e in parts[:-1])
    finally:
        server.close()


class Spy:
    """Counts the parts computed, on which threads, and of which layers."""

    def __init__(self, server: ExecutorServer, monkeypatch):
        self.threads: list[int] = []
        self.layers: list[tuple[int, ...]] = []
        for owner, name in ((server.executor, "run_columns"), (server, "_rows_of")):
            real = getattr(owner, name)
            monkeypatch.setattr(owner, name, self.counting(real))

    def counting(self, real):
        def part(op, layers, *args):
            self.threads.append(threading.get_ident())
            self.layers.append(layers)
            return real(op, layers, *args)

        return part


@pytest.fixture
def splitting(checkpoints, monkeypatch):
    """A factory: an in-process serve-base on `arch` with oneDNN products, two workers of
    the tests' two torch threads each on four cores, parts of 2^10 multiply-adds or more
    (the tiny test layers split too)."""
    monkeypatch.setattr(server_module, "SPLIT_MIN_MACS", 1 << 10)
    monkeypatch.setattr(onednn_module, "ONEDNN_MIN_MACS", 0)
    started = []

    def start(arch: str) -> tuple[ExecutorServer, Spy]:
        config = ServiceConfig(bind=("tcp://127.0.0.1:*",), spin_us=2000, workers=2, host_cores=4)
        server = ExecutorServer(onednn_of(checkpoints(arch)), config)
        assert server._threads == torch.get_num_threads() == 2  # tests/conftest.py's
        server.bind()
        started.append((server, serving_thread(server)))
        return server, Spy(server, monkeypatch)

    yield start
    for server, thread in started:
        server.stop()
        thread.join(10)


def connect(server: ExecutorServer, path):
    return symbiont.connect(
        server.endpoints[0], mode="shm", checkpoint=path, timeout_s=20, connect_timeout_s=5
    )


@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # gpt2: CONV1D, split by rows and columns
def test_a_lora_step_through_split_products_equals_vanilla(checkpoints, splitting, arch):
    """Logits, loss and every LoRA gradient of a step whose base products a lone client's
    serve-base splits over its two workers, against vanilla transformers + peft."""
    path = checkpoints(arch)
    server, spy = splitting(arch)
    executor = connect(server, path)
    try:
        vanilla, split = make_pair(path, executor, lora(ARCHS[arch], all_linear=True))
        inputs = batch(rows=4, length=16)  # 64 rows a call
        want = vanilla(**inputs, labels=inputs["input_ids"])
        got = split(**inputs, labels=inputs["input_ids"])
        assert torch.allclose(got.logits, want.logits, atol=1e-5, rtol=1e-5)
        want.loss.backward()
        got.loss.backward()
        assert torch.allclose(got.loss, want.loss, atol=1e-6, rtol=1e-6)
        ours, theirs = grads(split), grads(vanilla)
        assert ours.keys() == theirs.keys() and ours
        for name in theirs:
            assert torch.allclose(ours[name], theirs[name], atol=1e-5, rtol=1e-4), name
    finally:
        executor.close()
    assert len(set(spy.threads)) == 2, "parts ran on the loop and on a worker"
    calls = 2 * len(server.manifest.layers)  # forward and backward of each layer
    assert len(spy.threads) > calls, "most products split in two parts"


def test_fused_calls_split_too(checkpoints, splitting):
    """A model without adapters sends q/k/v and gate/up as fused calls (from its second
    forward on): those split as blocks of the block's rows; its logits equal vanilla
    transformers' within fp32 rounding."""
    from transformers import AutoModelForCausalLM

    path = checkpoints("llama")
    server, spy = splitting("llama")
    executor = connect(server, path)
    try:
        client = symbiont.load_client(path, executor)
        vanilla = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        inputs = batch(rows=4, length=16)
        with torch.no_grad():
            for _ in range(2):  # the first forward teaches the fusion the call order
                got = client(**inputs).logits
            want = vanilla(**inputs).logits
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    finally:
        executor.close()
    fused = [layers for layers in spy.layers if len(layers) > 1]
    assert fused and all(layers in server.executor._runs for layers in fused), spy.layers


def test_the_client_sleeps_on_split_calls_and_a_second_client_ends_the_splitting(
    checkpoints, splitting
):
    """On two cores a lone client must not spin on a call the loop splits over both
    (its spin would take a part's core): SPIN_OK tells it the size from which calls
    split. A second client puts the workers to its own calls: no more splitting, and
    nobody spins (three busy threads on two cores)."""
    path = checkpoints("llama")
    server, spy = splitting("llama")
    spec = server.manifest.layers[0]
    x = torch.randn(64, spec.in_features)
    want = server.executor.run(Op.FORWARD, spec.id, x)
    first = connect(server, path)
    try:
        assert torch.allclose(first.forward(spec.id, x), want, atol=ATOL, rtol=RTOL)
        assert first.transport == "shm"
        assert first._segment.ctrl[shm.SPIN_OK] == 1
        assert first._segment.ctrl[shm.SPIN_BELOW] == 2 * server_module.SPLIT_MIN_MACS
        assert len(spy.threads) == 2
        second = connect(server, path)
        try:
            second.forward(spec.id, x)
            assert first._segment.ctrl[shm.SPIN_OK] == 0
            before = len(spy.threads)
            for client in (first, second):
                got = client.forward(spec.id, x)
                assert torch.allclose(got, want, atol=ATOL, rtol=RTOL)
            assert len(spy.threads) == before, "two clients: each call whole, on a worker"
        finally:
            second.close()
        # the second session ends as it says bye; the loop then sets the flags again (a
        # moment after the session is gone: wait for both, or this raced under load)
        alone = 2 * server_module.SPLIT_MIN_MACS
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and (
            len(server.sessions) > 1 or first._segment.ctrl[shm.SPIN_BELOW] != alone
        ):
            time.sleep(0.01)
        assert first._segment.ctrl[shm.SPIN_BELOW] == alone
        before = len(spy.threads)
        assert torch.allclose(first.forward(spec.id, x), want, atol=ATOL, rtol=RTOL)
        assert len(spy.threads) == before + 2, "alone again: split again"
    finally:
        first.close()


def test_parts_never_take_more_threads_than_cores(checkpoints):
    """Each part computes on its thread's torch threads: with two threads per worker on
    two cores, a lone client's calls stay whole (and it may spin on any of them)."""
    path = checkpoints("llama")
    config = ServiceConfig(bind=("tcp://127.0.0.1:*",), spin_us=2000, workers=2, host_cores=2)
    server = ExecutorServer(onednn_of(path), config)
    server.bind()
    thread = serving_thread(server)
    try:
        client = connect(server, path)
        try:
            client.forward(0, torch.randn(64, server.manifest.layers[0].in_features))
            assert server._threads == 2 and server._split_ways == 1
            assert client._segment.ctrl[shm.SPIN_BELOW] == 0
        finally:
            client.close()
    finally:
        server.stop()
        thread.join(10)


def test_the_default_executor_never_splits(checkpoints, monkeypatch):
    """`--matmul torch` (bitwise the vanilla model's products) keeps every call whole, and
    a lone client may spin on any call."""
    monkeypatch.setattr(server_module, "SPLIT_MIN_MACS", 1 << 10)
    path = checkpoints("llama")
    config = ServiceConfig(bind=("tcp://127.0.0.1:*",), spin_us=2000, workers=2, host_cores=2)
    server = ExecutorServer(BaseExecutor.from_pretrained(path), config)
    server.bind()
    thread = serving_thread(server)
    try:
        client = connect(server, path)
        try:
            spec = server.manifest.layers[0]
            x = torch.randn(64, spec.in_features)
            assert torch.equal(client.forward(spec.id, x), server.executor.run(Op.FORWARD, 0, x))
            assert client._segment.ctrl[shm.SPIN_OK] == 1
            assert client._segment.ctrl[shm.SPIN_BELOW] == 0  # spin on any call
            assert server._split_ways == 1
        finally:
            client.close()
    finally:
        server.stop()
        thread.join(10)


def test_a_call_whose_own_part_fails_waits_for_the_workers_parts(
    checkpoints, splitting, monkeypatch
):
    """The loop's part raises while a worker's part still reads x (in the client's
    segment): the call fails only after that part is done, so nothing reads a segment
    that may be reused or unmapped."""
    from symbiont.protocol.executor import ExecutorError

    path = checkpoints("llama")
    server, _ = splitting("llama")
    spec = server.manifest.layers[0]
    real = server.executor.run_columns
    done = threading.Event()

    def flaky(op, layers, x, start, end):
        if start == 0:
            raise RuntimeError("out of memory")
        time.sleep(0.3)
        out = real(op, layers, x, start, end)
        done.set()
        return out

    monkeypatch.setattr(server.executor, "run_columns", flaky)
    client = connect(server, path)
    try:
        with pytest.raises(ExecutorError, match="out of memory"):
            client.forward(spec.id, torch.randn(64, spec.in_features))
        assert done.is_set(), "the call failed while a worker still read x"
    finally:
        client.close()


def test_a_part_that_fails_fails_its_call_only(checkpoints, splitting, monkeypatch):
    """A part that raises on a worker (out of memory, say) fails that call with the error,
    after every part has finished reading x; the next call is answered."""
    from symbiont.protocol.executor import ExecutorError

    path = checkpoints("llama")
    server, _ = splitting("llama")
    spec = server.manifest.layers[0]
    real = server.executor.run_columns
    worker_part_fails = [True]

    def flaky(op, layers, x, start, end):
        if start > 0 and worker_part_fails[0]:
            raise RuntimeError("out of memory")
        return real(op, layers, x, start, end)

    monkeypatch.setattr(server.executor, "run_columns", flaky)
    x = torch.randn(64, spec.in_features)
    client = connect(server, path)
    try:
        with pytest.raises(ExecutorError, match=f"failed running layer {spec.id}: out of memory"):
            client.forward(spec.id, x)
        worker_part_fails[0] = False
        want = server.executor.run(Op.FORWARD, spec.id, x)
        assert torch.allclose(client.forward(spec.id, x), want, atol=ATOL, rtol=RTOL)
    finally:
        client.close()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="splitting needs two cores")
def test_a_lone_finetune_job_through_a_splitting_serve_base(wide_llama, tmp_path):
    """`symbiont finetune --executor` alone on `serve-base --workers 2 --matmul onednn`
    (real processes, as a user starts them): its fused gate/up calls are split over the
    workers (the base's stats count them), and the adapter it trains equals the same
    run on an in-process executor within fp32 rounding."""
    import shutil
    import subprocess
    import sys

    from safetensors.torch import load_file

    from symbiont.cli import main
    from symbiont.cli.stats import render
    from symbiont.client.remote import stats_of
    from symbiont.processes import ServerProcess
    from tests.test_combinations import REPO, _finetune_argv
    from tests.test_serve_common import add_char_tokenizer

    model = tmp_path / "wide-llama"
    shutil.copytree(wide_llama, model)
    add_char_tokenizer(model)
    data = tmp_path / "train.jsonl"
    long = "a long answer, so that every sequence fills its 32 tokens"
    data.write_text(
        "".join(f'{{"prompt": "Q{i}:", "completion": " {long} {i}"}}\n' for i in range(8))
    )
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    args = ("--threads", "1", "--workers", "2", "--matmul", "onednn")
    with ServerProcess(model, args=args) as base:
        url = base.url("tcp")
        done = subprocess.run(
            [sys.executable, "-m", "symbiont", *_finetune_argv(model, data, tmp_path / "shared", url)],
            capture_output=True, text=True, timeout=300, env={**os.environ, **env},
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        stats = stats_of(url)
    assert stats["split_batches"] > 0, stats
    assert "split over the workers (one client)" in render(stats)
    assert main(_finetune_argv(model, data, tmp_path / "alone", None)) == 0
    shared = load_file(str(tmp_path / "shared" / "adapter_model.safetensors"))
    alone = load_file(str(tmp_path / "alone" / "adapter_model.safetensors"))
    assert shared.keys() == alone.keys() and shared
    # oneDNN's summation order against torch's, over six Adam steps: Adam scales each
    # element's step by its own gradient's size, so the last bits of a near-zero gradient
    # move a few elements by up to ~1e-4 (here: the largest difference 8e-5, the mean
    # 1e-7, against elements of mean size 0.02); a wrong product would move them all.
    for name in shared:
        diff = (shared[name] - alone[name]).abs()
        assert float(diff.mean()) < 1e-6 and float(diff.max()) < 1e-3, name
