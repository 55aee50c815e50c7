"""The wire protocol's messages: one encoder and one decoder, every field checked on decode."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import msgpack
import pytest

from symbiont.protocol import messages, wire
from symbiont.protocol.executor import PROTOCOL_VERSION, Op
from symbiont.protocol.messages import Ok
from symbiont.protocol.wire import Code, Kind, ProtocolError, decode, encode, encode_fields

EXAMPLES = [
    wire.Hello(call_id=1, protocol=PROTOCOL_VERSION, token="t", pid=42, host="h", label="x"),
    wire.Welcome(call_id=1, manifest={"layers": [{"id": 0}]}, max_call_bytes=1 << 20, shm=True),
    wire.Call(call_id=7, op=Op.BACKWARD, layer=3, rows=5, cols=32, dtype="float32", fused=()),
    wire.Call(call_id=8, op=Op.FORWARD, layer=3, rows=1, cols=32, dtype="bfloat16", fused=(4, 5)),
    wire.Result(call_id=7, rows=5, cols=96),
    wire.Error(call_id=7, code=Code.BAD_CALL, message="what to fix"),
    wire.Attach(call_id=2, capacity=4096),
    wire.Ok(call_id=2, segment="/proc/1/fd/3"),
    wire.Ring(seq=9),
    wire.Stats(call_id=3, token=None),
    wire.StatsReply(call_id=3, stats={"uptime_s": 1.5}),
    wire.Bye(call_id=0),
    wire.Data(call_id=7, offset=1 << 20),
]


def test_every_kind_round_trips_as_a_named_map():
    assert {type(m).KIND for m in EXAMPLES} == set(Kind)
    for message in EXAMPLES:
        frame = encode(message)
        data = msgpack.unpackb(frame)
        assert isinstance(data, dict) and data["kind"] == message.KIND, "named fields, not arrays"
        assert decode(frame) == message


def test_docstring_and_docs_tables_are_the_dataclasses():
    table = messages.table()
    assert table in wire.__doc__, "wire.py's table drifted: paste messages.table() into it"
    docs = (Path(__file__).parent.parent / "docs" / "service.md").read_text()
    assert table in docs, "docs/service.md's table drifted: paste messages.table() into it"


# Values that no field of any message accepts.
HOSTILE = ["x", [1], {"a": 1}, 2**64 - 1, -1, -(2**63), 1.5, True, None, b"\x00", "x" * 20000]


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_each_field_refuses_wrong_types_and_ranges_naming_the_field(message):
    base = msgpack.unpackb(encode(message))
    for field in dataclasses.fields(message):
        check = field.metadata["check"]
        for value in HOSTILE:
            try:
                accepted = check(value)
            except ValueError:
                accepted = None
            else:  # this value is valid for this field (e.g. None for an optional one)
                assert accepted == value or field.name == "fused"
                continue
            frame = msgpack.packb({**base, field.name: value}, use_bin_type=True)
            with pytest.raises(ProtocolError) as caught:
                decode(frame)
            assert f"{message.KIND.name}.{field.name}" in str(caught.value)
            assert check.what in str(caught.value), "the error says what the field should be"


def test_ints_must_be_exact_ints_and_pids_sane():
    hello = dict(call_id=1, protocol=PROTOCOL_VERSION)
    for pid in ("x", [1], 2**64 - 1, -5, True, 1 << 23):
        with pytest.raises(ProtocolError, match="HELLO.pid") as caught:
            decode(encode_fields(Kind.HELLO, **hello, pid=pid))
        assert caught.value.code is Code.BAD_MESSAGE and caught.value.call_id == 1
    assert decode(encode_fields(Kind.HELLO, **hello, pid=4242)).pid == 4242


def test_malformed_frames_raise_the_one_error_type():
    frames = [
        b"",
        b"\xc1",
        b"\x00garbage\xff",
        msgpack.packb(3),
        msgpack.packb({"kind": 99}),
        msgpack.packb({"kind": True}),
        msgpack.packb({"kind": 8}),  # RING without seq
        msgpack.packb({"kind": 11, "call_id": 1, "extra": 2}),
        msgpack.packb({1: 2}),
        b"\x91" * 5000 + b"\x90",  # nested 5000 deep
        b"\xdd\xff\xff\xff\xff",  # an array claiming 4 billion items
        msgpack.packb({"kind": 10, "call_id": 1, "stats": _nested(20)}),
        bytes(wire.MAX_HEADER_BYTES + 1),
    ]
    for frame in frames:
        with pytest.raises(ProtocolError) as caught:
            decode(frame)
        assert isinstance(caught.value, ValueError) and caught.value.code in set(Code)


def test_calls_refused_for_op_and_dtype_say_bad_call():
    fields = dict(call_id=1, layer=0, rows=1, cols=4)
    with pytest.raises(ProtocolError, match="CALL.op") as caught:
        decode(encode_fields(Kind.CALL, op=7, dtype="float32", **fields))
    assert caught.value.code is Code.BAD_CALL
    with pytest.raises(ProtocolError, match="CALL.dtype") as caught:
        decode(encode_fields(Kind.CALL, op=1, dtype="int8", **fields))
    assert caught.value.code is Code.BAD_CALL


def test_protocol_one_headers_are_refused_in_protocol_one_shape():
    with pytest.raises(ProtocolError, match="upgrade symbiont") as caught:
        decode(msgpack.packb([1, 5, {"protocol": 1}]))
    assert caught.value.legacy and caught.value.code is Code.REFUSED and caught.value.call_id == 5
    assert msgpack.unpackb(wire.legacy_error(5, Code.REFUSED, "m")) == [5, 5, 4, "m"]
    with pytest.raises(ProtocolError, match="on the executor's host"):
        decode(msgpack.packb([5, 0, 1, "malformed message"]))


def test_another_protocol_version_is_refused_before_its_fields_are_read():
    with pytest.raises(ProtocolError, match="client speaks protocol 99") as caught:
        decode(encode_fields(Kind.HELLO, call_id=1, protocol=99, new_field=1))
    assert caught.value.code is Code.REFUSED


def _nested(depth):
    value = 1
    for _ in range(depth):
        value = {"a": value}
    return value


def test_an_unknown_field_is_refused_also_when_a_known_one_is_left_out():
    # ATTACH has an optional field (gpu): a header of the right length with a field
    # renamed used to pass the length check and lose the field silently
    with pytest.raises(ProtocolError, match=r"ATTACH has unknown fields \['path'\]") as caught:
        decode(encode_fields(Kind.ATTACH, call_id=3, path="/etc/passwd", capacity=1024))
    assert caught.value.code is Code.BAD_MESSAGE
    assert "'capacity', 'events', 'gpu'" in str(caught.value) and "'kind'" not in str(caught.value)


def test_gpu_area_handles_are_checked_field_by_field():
    good = [b"h" * 64, 4096, 0, b"/torch_123_456", 0, b"e" * 64, True]
    ok = decode(encode(Ok(call_id=1, segment="/proc/1/fd/3", gpu_areas=good)))
    assert ok.gpu_areas == good
    hostile = [
        (0, "text"), (0, None), (1, -1), (1, 1.5), (3, b"x" * 2000), (3, None), (6, 1),
        (3, b"/dev/shm/other"), (3, b"/torch_1/../x"), (4, 10_000), (4, -1), (5, None),
    ]  # fmt: skip
    for index, bad_value in hostile:
        fields = list(good)
        fields[index] = bad_value
        with pytest.raises(ProtocolError, match="OK.gpu_areas"):
            decode(encode_fields(Kind.OK, call_id=1, gpu_areas=fields))
    with pytest.raises(ProtocolError, match="OK.gpu_areas"):
        decode(encode_fields(Kind.OK, call_id=1, gpu_areas=good[:6]))


def test_a_gpu_event_handle_is_64_bytes_or_nil():
    ok = decode(encode(Ok(call_id=1, segment="/proc/1/fd/3", gpu_event=b"v" * 64)))
    assert ok.gpu_event == b"v" * 64
    assert decode(encode(Ok(call_id=1))).gpu_event is None
    for bad_value in (b"v" * 63, b"v" * 65, b"", "v" * 64, 64, [b"v" * 64]):
        with pytest.raises(ProtocolError, match="OK.gpu_event"):
            decode(encode_fields(Kind.OK, call_id=1, gpu_event=bad_value))
