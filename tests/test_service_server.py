"""The executor service in a thread of the test process: batching, faults, handshake, timeouts.

Multi-process behaviour (serve-base as its own process, clients in others, kill -9) is in
test_service_multiprocess.py; the exactness matrix over each transport in test_exactness.py.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest
import torch
import zmq

import symbiont
from symbiont.executor.interface import PROTOCOL_VERSION, ExecutorError, ExecutorUnavailable
from symbiont.service import BatchingPolicy, ExecutorServer, ServiceConfig
from symbiont.transport.wire import Code, Kind, pack, unpack


@contextlib.contextmanager
def serve_in_thread(path, tmp_path, **options):
    """A server on a free loopback port and an IPC socket; spin off (it shares our GIL)."""
    bind = ("tcp://127.0.0.1:*", f"ipc://{tmp_path}/base-{time.monotonic_ns()}.sock")
    config = ServiceConfig(bind=bind, spin_us=0, **options)
    server = ExecutorServer(symbiont.BaseExecutor.from_pretrained(path), config)
    server.bind()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.stop()
        thread.join(10)


def remote(url, **options):
    return symbiont.connect(url, spin_us=0, timeout_s=10, connect_timeout_s=5, **options)


@pytest.fixture(scope="module")
def served(checkpoints, tmp_path_factory):
    with serve_in_thread(
        checkpoints("llama"), tmp_path_factory.mktemp("sock"), max_call_bytes=1 << 20
    ) as server:
        yield server


def raw_dealer(url):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(url)
    return sock


def ask(sock, *frames):
    sock.send_multipart(list(frames))
    return unpack(sock.recv_multipart()[0])


def hello(sock, **extra):
    info = {"protocol": PROTOCOL_VERSION, "label": "raw", **extra}
    return ask(sock, pack(Kind.HELLO, 1, info))


def assert_serves_correctly(server, url, **options):
    base = server.executor
    with remote(url, **options) as executor:
        for layer in (0, len(base.manifest.layers) - 1):
            x = torch.randn(3, base.manifest.layers[layer].in_features)
            assert torch.equal(executor.forward(layer, x), base.forward(layer, x))


@pytest.mark.parametrize("mode", ["zmq", "shm"])
def test_every_layer_both_directions_bitwise(served, mode):
    base = served.executor
    with remote(served.endpoints[1], mode=mode) as executor:
        assert executor.transport == mode
        for spec in base.manifest.layers:
            x = torch.randn(4, spec.in_features)
            g = torch.randn(5, spec.out_features)
            assert torch.equal(executor.forward(spec.id, x), base.forward(spec.id, x))
            assert torch.equal(executor.backward(spec.id, g), base.backward(spec.id, g))
        empty = executor.forward(0, torch.zeros(0, base.manifest.layers[0].in_features))
        assert empty.shape == (0, base.manifest.layers[0].out_features)


def test_shared_memory_grows_on_demand(served):
    base = served.executor
    with remote(served.endpoints[1], mode="shm", shm_tokens=1) as executor:
        for rows in (1, 700, 3):
            x = torch.randn(rows, base.manifest.layers[0].in_features)
            assert torch.equal(executor.forward(0, x), base.forward(0, x))


def test_concurrent_clients_batch_and_each_gets_its_own_rows(checkpoints, tmp_path):
    # A long batching window so concurrent calls of one layer surely meet.
    policy = BatchingPolicy(max_wait_s=0.05, wait_per_token_s=0.05)
    with serve_in_thread(checkpoints("llama"), tmp_path, policy=policy) as server:
        base = server.executor
        errors = []

        def client(seed, rows, mode):
            generator = torch.Generator().manual_seed(seed)
            with remote(server.endpoints[1], mode=mode, label=f"c{seed}") as executor:
                for layer in range(len(base.manifest.layers)):
                    width = base.manifest.layers[layer].in_features
                    x = torch.randn(rows, width, generator=generator)
                    y = executor.forward(layer, x)
                    # Batched GEMMs may differ from a lone one in the last bits.
                    if not torch.allclose(y, base.forward(layer, x), atol=1e-5, rtol=1e-5):
                        errors.append((seed, layer))

        threads = [
            threading.Thread(target=client, args=(seed, rows, mode))
            for seed, rows, mode in [(1, 1, "zmq"), (2, 7, "zmq"), (3, 133, "shm"), (4, 3, "shm")]
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, f"rows of another client or wrong results: {errors}"
        total = server.stats.snapshot([], {})["total"]
        assert total["mean_batch_calls"] > 1.2, "concurrent calls of one layer were not batched"


def test_handshake_refuses_another_checkpoint_and_protocol(served, checkpoints):
    url = served.endpoints[0]
    with pytest.raises(ExecutorError, match="fingerprint"):
        remote(url, checkpoint=checkpoints("gpt2"))
    with remote(url) as executor, pytest.raises(ExecutorError, match="not the base"):
        symbiont.load_client(checkpoints("gpt2"), executor)
    sock = raw_dealer(url)
    reply = hello(sock, protocol=PROTOCOL_VERSION + 1)
    assert reply[0] is Kind.ERROR and reply[2] == Code.REFUSED and "protocol" in reply[3]
    sock.close()


def test_malformed_messages_get_an_error_and_the_service_goes_on(served):
    url = served.endpoints[0]
    manifest = served.executor.manifest
    sock = raw_dealer(url)
    spec = manifest.layers[0]
    x = torch.zeros(2, spec.in_features).numpy().tobytes()

    def call(*fields, data=x):
        return ask(sock, pack(Kind.CALL, 9, *fields), data)

    assert ask(sock, b"\x00garbage\xff")[2] == Code.BAD_MESSAGE
    assert call(1, 0, 2, spec.in_features, "float32")[2] == Code.NO_SESSION, "calls need HELLO"
    assert hello(sock)[0] is Kind.WELCOME
    cases = {
        "not msgpack": (ask(sock, b"\xc1"), Code.BAD_MESSAGE),
        "not an array": (ask(sock, pack(Kind.CALL)[:1] + b"\x80"), Code.BAD_MESSAGE),
        "truncated": (call(1, 0, 2, spec.in_features, "float32", data=x[:7]), Code.BAD_CALL),
        "unknown layer": (call(1, 10_000, 2, spec.in_features, "float32"), Code.BAD_CALL),
        "wrong width": (call(1, 0, 2, spec.in_features + 1, "float32"), Code.BAD_CALL),
        "wrong dtype": (call(1, 0, 2, spec.in_features, "float16"), Code.BAD_CALL),
        "unknown op": (call(7, 0, 2, spec.in_features, "float32"), Code.BAD_CALL),
        "oversized": (call(1, 0, 1 << 30, spec.in_features, "float32"), Code.TOO_LARGE),
        "not ints": (call(1, "0", 2, spec.in_features, "float32"), Code.BAD_MESSAGE),
        "bad segment": (
            ask(sock, pack(Kind.ATTACH, 3, {"path": "/etc/passwd", "size": 1024})),
            Code.REFUSED,
        ),
    }
    for name, (reply, code) in cases.items():
        assert reply[0] is Kind.ERROR and reply[2] == code, f"{name}: {reply}"
    assert "unknown layer id 10000" in cases["unknown layer"][0][3]
    assert "float16" in cases["wrong dtype"][0][3]
    # A frame over the size limit makes ZeroMQ drop that connection, nothing else.
    sock.send_multipart([pack(Kind.CALL, 9, 1, 0, 2, spec.in_features, "float32"), bytes(2 << 20)])
    sock.close()
    assert_serves_correctly(served, url)


def test_random_bytes_on_the_port_do_not_disturb_the_service(served):
    host, port = served.endpoints[0].removeprefix("tcp://").rsplit(":", 1)
    generator = torch.Generator().manual_seed(0)
    for size in (1, 10, 64, 4096):
        with socket.create_connection((host, int(port)), timeout=5) as raw:
            raw.sendall(
                torch.randint(0, 256, (size,), generator=generator, dtype=torch.uint8)
                .numpy()
                .tobytes()
            )
    with socket.create_connection((host, int(port)), timeout=5) as raw:  # a ZMTP greeting, cut
        raw.sendall(b"\xff\x00\x00\x00\x00\x00\x00\x00\x01\x7f\x03")
    assert_serves_correctly(served, served.endpoints[0])


def test_client_side_checks_need_no_round_trip(served):
    with remote(served.endpoints[0], mode="zmq") as executor:
        with pytest.raises(ExecutorError, match="load the client with dtype"):
            executor.forward(0, torch.zeros(1, 32, dtype=torch.float64))
        with pytest.raises(ExecutorError, match="unknown layer id"):
            executor.forward(999, torch.zeros(1, 32))


def test_token_is_required_when_configured(checkpoints, tmp_path):
    with serve_in_thread(checkpoints("llama"), tmp_path, token="s3cret") as server:
        url = server.endpoints[0]
        with pytest.raises(ExecutorError, match="requires a token"):
            remote(url, token=None)
        with pytest.raises(ExecutorError, match="requires a token"):
            remote(url, token="guess")
        assert_serves_correctly(server, url, token="s3cret")
        assert server.stats.refused == 2


def test_no_executor_is_a_clear_error_not_a_hang(tmp_path):
    start = time.monotonic()
    with pytest.raises(ExecutorUnavailable, match="serve-base"):
        symbiont.connect(f"ipc://{tmp_path}/nobody.sock", connect_timeout_s=0.5)
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("mode", ["zmq", "shm"])
def test_executor_gone_mid_session_raises_after_retries(checkpoints, tmp_path, mode):
    with serve_in_thread(checkpoints("llama"), tmp_path) as server:
        executor = symbiont.connect(
            server.endpoints[1], mode=mode, spin_us=0, timeout_s=2, connect_timeout_s=0.5, retries=1
        )
        executor.forward(0, torch.zeros(1, 32))
    start = time.monotonic()
    with pytest.raises(ExecutorUnavailable, match="no answer from the base executor"):
        executor.forward(0, torch.zeros(1, 32))
    assert time.monotonic() - start < 8
    executor.close()


def test_a_restarted_executor_is_reconnected_transparently(checkpoints, tmp_path):
    url = f"ipc://{tmp_path}/restart.sock"
    path = checkpoints("llama")
    base = symbiont.BaseExecutor.from_pretrained(path)
    x = torch.randn(2, 32)

    def serve():
        server = ExecutorServer(base, ServiceConfig(bind=(url,), spin_us=0))
        server.bind()
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        return server, thread

    server, thread = serve()
    with symbiont.connect(url, spin_us=0, timeout_s=2, connect_timeout_s=2) as executor:
        assert torch.equal(executor.forward(0, x), base.forward(0, x))
        server.stop()
        thread.join(10)
        server, thread = serve()
        assert torch.equal(executor.forward(0, x), base.forward(0, x))
    server.stop()
    thread.join(10)


def test_shared_memory_refused_by_the_executor(checkpoints, tmp_path):
    with serve_in_thread(checkpoints("llama"), tmp_path, allow_shm=False) as server:
        with pytest.raises(ExecutorError, match="shared memory"):
            remote(server.endpoints[1], mode="shm")
        with remote(server.endpoints[1], mode="auto") as executor:
            assert executor.transport == "zmq", "auto falls back to frames"


def test_stats_report_clients_and_layers(served):
    from symbiont.cli.stats import render

    with remote(served.endpoints[0], label="stats-test") as executor:
        executor.forward(0, torch.zeros(5, 32))
        stats = executor.stats()
    assert "stats-test" in [c["label"] for c in stats["clients"]]
    first = served.executor.manifest.layers[0].name
    assert stats["layers"][first]["tokens"] >= 5
    assert {"tokens_per_s", "uptime_s", "policy", "total"} <= stats.keys()
    assert first in render(stats)


@pytest.mark.parametrize("mode", ["zmq", "shm"])
def test_calls_sharing_one_input_take_one_round_trip(served, mode):
    base = served.executor
    q, k, v = (base.manifest.layer_ids()[f"model.layers.0.self_attn.{n}_proj"] for n in "qkv")
    with remote(served.endpoints[1], mode=mode) as executor:

        def served_calls():
            return executor.stats()["total"]["calls"]

        x = torch.randn(3, 32)
        for _ in range(2):  # the first pass teaches the client that q, k, v share x
            before = served_calls()
            for layer in (q, k, v):
                assert torch.equal(executor.forward(layer, x), base.forward(layer, x))
        assert served_calls() - before == 1, "k and v were not fused into q's call"

        executor.forward(q, x)
        x.add_(1.0)  # modified in place after q: k must see the new values
        assert torch.equal(executor.forward(k, x), base.forward(k, x)), "stale fused output"
        y = torch.randn(3, 32)
        executor.forward(q, y)
        assert torch.equal(executor.forward(v, y.clone()), base.forward(v, y)), "another tensor"
