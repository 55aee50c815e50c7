"""Wire fuzzing against a real serve-base: every field of every message kind replaced by
wrong types, huge and negative numbers; truncated, oversized and random frames. The
executor answers what it can, never dies, and a well-behaved client then still gets
exact results. Seeded, bounded in time (hypothesis is not a dependency)."""

from __future__ import annotations

import dataclasses
import random
import time

import msgpack
import pytest
import torch
import zmq

import symbiont
from symbiont.processes import ServerProcess
from symbiont.protocol.executor import PROTOCOL_VERSION
from symbiont.protocol.messages import MESSAGES
from symbiont.protocol.wire import MAX_FRAME_BYTES, MAX_HEADER_BYTES, Kind, decode

BUDGET_S = 20.0
HOSTILE = [
    None,
    True,
    False,
    -1,
    -(2**63),
    2**63,
    2**64 - 1,
    1.5,
    float("nan"),
    "",
    "x" * 5000,
    "\udcff".encode("utf-8", "surrogatepass"),
    b"\x00" * 64,
    [],
    [1, 2, 3, 4, 5],
    [[[[[[[[[[1]]]]]]]]]],
    {},
    {"a": {"b": {"c": {"d": {"e": {"f": {"g": {"h": {"i": 1}}}}}}}}},
    {1: 2},
    0,
    1,
    10**6,
]
GOOD = {  # a plausible value per field name, so that one bad field is tried at a time
    "call_id": 5,
    "protocol": PROTOCOL_VERSION,
    "token": None,
    "fingerprint": None,
    "pid": 1,
    "host": "h",
    "label": "fuzz",
    "manifest": {},
    "max_call_bytes": 1,
    "shm": False,
    "instance": "0123456789abcdef",
    "op": 1,
    "layer": 0,
    "rows": 2,
    "cols": 32,
    "dtype": "float32",
    "fused": [],
    "top_k": 0,
    "weights_dtype": None,
    "rows_out": 1,
    "code": 1,
    "message": "m",
    "capacity": 4096,
    "segment": None,
    "gpu": "GPU-00000000-0000-0000-0000-000000000000",  # no GPU here: host areas
    "gpu_areas": None,
    "gpu_event": None,
    "spin": True,
    "events": False,
    "seq": 1,
    "stats": {},
    "offset": 0,
}


def _messages(rng: random.Random):
    """(frames, label) to send: each kind with each field made hostile, then mangled."""
    for kind, cls in MESSAGES.items():
        fields = {f.name: GOOD[f.name] for f in dataclasses.fields(cls)}
        for name in fields:
            for value in HOSTILE:
                header = msgpack.packb(
                    {"kind": int(kind), **fields, name: value}, use_bin_type=True
                )
                yield [header, *_tensor(rng, kind)], f"{kind.name}.{name}={value!r:.20}"
            yield (
                [
                    msgpack.packb(
                        {"kind": int(kind), **{k: v for k, v in fields.items() if k != name}}
                    )
                ],
                f"{kind.name} without {name}",
            )
        valid = msgpack.packb({"kind": int(kind), **fields}, use_bin_type=True)
        for cut in range(len(valid)):
            yield [valid[:cut], *_tensor(rng, kind)], f"{kind.name} cut at {cut}"
        yield [valid, bytes(rng.randrange(0, 300))], f"{kind.name} with a stray frame"
        yield [valid, b"", b"", b""], f"{kind.name} with empty frames"
    for _ in range(200):
        yield [rng.randbytes(rng.randrange(0, 200))], "random bytes"
        yield [msgpack.packb([rng.randrange(-5, 20) for _ in range(rng.randrange(6))])], "array"
    yield [bytes(MAX_HEADER_BYTES + 1)], "oversized header"


def _tensor(rng: random.Random, kind: Kind) -> list[bytes]:
    if kind in (Kind.CALL, Kind.DATA, Kind.RESULT):
        return [bytes(rng.choice([0, 7, 256, 4096]))]
    return []


def _check_reply(frame: bytes) -> None:
    """Every answer is a well-formed message of this protocol, except the answer to a
    protocol-1 header (a positional array), which is written the way protocol 1 reads it:
    [ERROR, call_id, code, message] telling the older side to upgrade."""
    if type(msgpack.unpackb(frame, raw=False)) is list:
        kind, _call_id, _code, message = msgpack.unpackb(frame, raw=False)
        assert kind == Kind.ERROR and "upgrade symbiont" in message, message
        return
    decode(frame)


@pytest.fixture
def one_thread_here():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # serve-base runs --threads 1: compare like with like
    yield
    torch.set_num_threads(before)


def test_hostile_messages_never_stop_serve_base(checkpoints, one_thread_here):
    path = checkpoints("llama")
    base = symbiont.BaseExecutor.from_pretrained(path)
    rng = random.Random(1234)
    ctx = zmq.Context.instance()
    with ServerProcess(path, args=("--threads", "1")) as server:
        url = server.url("tcp")

        def fresh():
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(url)
            return sock

        sock = fresh()
        deadline = time.monotonic() + BUDGET_S
        sent = answered = 0
        for number, (frames, label) in enumerate(_messages(rng)):
            if time.monotonic() > deadline:
                break
            if number % 50 == 0:  # with and without a session
                hello = {"kind": 1, "call_id": 1, "protocol": PROTOCOL_VERSION, "label": "fuzz"}
                sock.send(msgpack.packb(hello))
            sock.send_multipart(frames)
            sent += 1
            while sock.poll(0):
                _check_reply(sock.recv_multipart()[0])
                answered += 1
            assert server.proc.poll() is None, f"died on {label}:\n{server.log_text()}"
        while sock.poll(1000):  # the answers still under way are checked too
            _check_reply(sock.recv_multipart()[0])
            answered += 1
        # A frame over the limit: ZeroMQ drops that peer before reading it.
        sock.send_multipart([msgpack.packb({"kind": 3}), bytes(MAX_FRAME_BYTES + 1)])
        sock.close()
        assert sent > 1000 and answered > 100, (sent, answered)

        with symbiont.connect(url, mode="zmq") as executor:
            for spec in base.manifest.layers:
                x = torch.randn(3, spec.in_features)
                assert torch.equal(executor.forward(spec.id, x), base.forward(spec.id, x))
        with symbiont.connect(server.url("ipc"), mode="shm") as executor:
            x = torch.randn(4, base.manifest.layers[0].in_features)
            assert torch.equal(executor.forward(0, x), base.forward(0, x))
        assert server.proc.poll() is None, server.log_text()
        assert "Traceback" not in server.log_text(), server.log_text()
