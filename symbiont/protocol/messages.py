"""Every message of the wire protocol, as a frozen dataclass with typed, bounded fields.

`symbiont.protocol.wire` encodes a message as a msgpack map `{"kind": KIND, field: value,
...}` and decodes it back into one of these classes, checking each field against its
`Check` (type and range) on the way in: a decoded message is well-formed, whoever sent it.
Field order in a class is the order of the table in `wire`'s docstring (`table()`).
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from enum import IntEnum
from typing import ClassVar

from symbiont.protocol import gpu_areas
from symbiont.protocol.executor import DTYPES, Code, Op, ProtocolError

MAX_ID = (1 << 63) - 1  # ids and sequence numbers are int64 (the shared-memory slots are)
MAX_PID = 1 << 22  # Linux's PID_MAX_LIMIT
MAX_LAYERS = 1 << 31
MAX_ROWS = 1 << 40
MAX_TEXT = 1 << 12  # tokens, labels, hosts, paths
MAX_MESSAGE = 1 << 14  # an ERROR's text
MAX_DEPTH = 8  # nesting of a map field (manifest, stats)
MAX_SEGMENT_BYTES = 1 << 48


class Kind(IntEnum):
    HELLO = 1
    WELCOME = 2
    CALL = 3
    RESULT = 4
    ERROR = 5
    ATTACH = 6
    OK = 7
    RING = 8
    STATS = 9
    STATS_REPLY = 10
    BYE = 11
    DATA = 12


def bad(message: str) -> ProtocolError:
    return ProtocolError(Code.BAD_MESSAGE, message)


@dataclass(frozen=True)
class Check:
    """What one field may hold: `what` (for errors and the table) and `convert`, which
    returns the checked value or raises ProtocolError naming what it should be."""

    what: str
    convert: object  # (value) -> value
    code: Code = Code.BAD_MESSAGE  # sent back when the value is refused

    def __call__(self, value):
        return self.convert(value)


def integer(lo: int, hi: int) -> Check:
    def convert(value):
        if type(value) is not int or not lo <= value <= hi:
            raise ValueError
        return value

    return Check(f"int {lo}..{_num(hi)}", convert)


def enum(kind: type[IntEnum], code: Code = Code.BAD_MESSAGE) -> Check:
    members = {int(m): m for m in kind}

    def convert(value):
        if type(value) is not int or value not in members:
            raise ValueError
        return members[value]

    return Check(" | ".join(f"{int(m)} ({m.name})" for m in kind), convert, code)


def text(limit: int, optional: bool = False, choices=None, code=Code.BAD_MESSAGE) -> Check:
    def convert(value):
        if value is None and optional:
            return None
        if type(value) is not str or len(value) > limit or (choices and value not in choices):
            raise ValueError
        return value

    what = f"str of at most {limit} chars" if not choices else " | ".join(choices)
    return Check(what + (" or nil" if optional else ""), convert, code)


def flag() -> Check:
    def convert(value):
        if type(value) is not bool:
            raise ValueError
        return value

    return Check("bool", convert)


def layer_list(limit: int) -> Check:
    def convert(value):
        if type(value) is not list or len(value) > limit:
            raise ValueError
        if not all(type(v) is int and 0 <= v < MAX_LAYERS for v in value):
            raise ValueError
        return tuple(value)

    return Check(f"list of at most {limit} layer ids", convert)


def gpu_share() -> Check:
    def convert(value):
        return None if value is None else gpu_areas.check_share(value)

    return Check("list of torch's CUDA IPC handle fields or nil", convert)


def event_handle() -> Check:
    def convert(value):
        return None if value is None else gpu_areas.check_event(value)

    return Check(f"{gpu_areas.EVENT_HANDLE_BYTES} bytes (a CUDA IPC event handle) or nil", convert)


def mapping() -> Check:
    def convert(value):
        if type(value) is not dict or _depth(value) > MAX_DEPTH:
            raise ValueError
        return value

    return Check(f"map with str keys, nested at most {MAX_DEPTH} deep", convert)


def _depth(value, level: int = 1) -> int:
    if level > MAX_DEPTH:
        return level
    children = value.values() if isinstance(value, dict) else value
    deepest = level
    for child in children:
        if isinstance(child, dict | list):
            deepest = max(deepest, _depth(child, level + 1))
    return deepest


def _num(n: int) -> str:
    return f"2**{n.bit_length()}-1" if n > 1 << 20 and (n + 1) & n == 0 else str(n)


def wire(check: Check, doc: str = "", **default):
    """A message field: its `Check` and a short description (units, shapes)."""
    return field(metadata={"check": check, "doc": doc}, **default)


CALL_ID = integer(0, MAX_ID)


@dataclass(frozen=True)
class Hello:
    """client -> executor: open a session on this connection."""

    KIND: ClassVar[Kind] = Kind.HELLO
    call_id: int = wire(CALL_ID)
    protocol: int = wire(integer(0, 1 << 31), "PROTOCOL_VERSION the client speaks")
    token: str | None = wire(text(MAX_TEXT, optional=True), "serve-base's --token", default=None)
    fingerprint: str | None = wire(
        text(256, optional=True), "refuse another checkpoint", default=None
    )
    pid: int = wire(integer(0, MAX_PID), "client process id (0: unknown)", default=0)
    host: str = wire(text(255), "client host name", default="?")
    label: str | None = wire(text(256, optional=True), "shown by `symbiont stats`", default=None)


@dataclass(frozen=True)
class Welcome:
    """executor -> client: the session is open."""

    KIND: ClassVar[Kind] = Kind.WELCOME
    call_id: int = wire(CALL_ID)
    manifest: dict = wire(mapping(), "Manifest.to_dict(): fingerprint, dtype, layers")
    max_call_bytes: int = wire(integer(1, MAX_ID), "largest x or y of one call, bytes")
    shm: bool = wire(flag(), "whether shared memory is accepted")
    instance: str | None = wire(
        text(64, optional=True), "random id of the serve-base process", default=None
    )  # two URLs reaching one process share it (masked shares must not)


@dataclass(frozen=True)
class Call:
    """client -> executor: run one layer; tensor frame x [rows, cols] follows."""

    KIND: ClassVar[Kind] = Kind.CALL
    call_id: int = wire(CALL_ID)
    op: Op = wire(enum(Op, Code.BAD_CALL), "direction")
    layer: int = wire(integer(0, MAX_LAYERS - 1), "layer id in the manifest")
    rows: int = wire(integer(0, MAX_ROWS), "tokens")
    cols: int = wire(integer(0, MAX_LAYERS), "x width: in (forward) or out (backward)")
    dtype: str = wire(text(32, choices=tuple(DTYPES), code=Code.BAD_CALL), "x's dtype")
    fused: tuple[int, ...] = wire(
        layer_list(3), "forward only: more layers fed the same x", default=()
    )
    top_k: int = wire(integer(0, MAX_LAYERS), "experts ops: expert ids per token", default=0)
    weights_dtype: str | None = wire(
        text(32, optional=True, choices=tuple(DTYPES), code=Code.BAD_CALL),
        "experts ops: the routing weights' dtype",
        default=None,
    )


@dataclass(frozen=True)
class Result:
    """executor -> client: tensor frame y [rows, cols] follows (fused outputs back to back)."""

    KIND: ClassVar[Kind] = Kind.RESULT
    call_id: int = wire(CALL_ID)
    rows: int = wire(integer(0, MAX_ROWS), "tokens")
    cols: int = wire(integer(0, MAX_LAYERS * 4), "summed output widths")


@dataclass(frozen=True)
class Error:
    """executor -> client: the message `call_id` was refused or failed."""

    KIND: ClassVar[Kind] = Kind.ERROR
    call_id: int = wire(CALL_ID)
    code: Code = wire(enum(Code), "why")
    message: str = wire(text(MAX_MESSAGE), "what to fix")


@dataclass(frozen=True)
class Attach:
    """client -> executor: make a shared-memory segment for the session's calls."""

    KIND: ClassVar[Kind] = Kind.ATTACH
    call_id: int = wire(CALL_ID)
    capacity: int = wire(integer(1, MAX_SEGMENT_BYTES), "bytes of its input and of its output area")
    gpu: str | None = wire(
        text(64, optional=True),
        "UUID of the client's GPU: areas there if the executor computes on it",
        default=None,
    )
    spin: bool = wire(
        flag(),
        "false: this client's cores are taken (it computes beside other executors that "
        "spin): the executor does not spin between calls while this segment is attached",
        default=True,
    )
    events: bool = wire(
        flag(),
        "with gpu: the client waits for an event before reading outputs (OK.gpu_event), "
        "so the executor need not wait for the GPU before answering",
        default=False,
    )


@dataclass(frozen=True)
class Ok:
    """executor -> client: ATTACH done; the client maps `segment`."""

    KIND: ClassVar[Kind] = Kind.OK
    call_id: int = wire(CALL_ID)
    segment: str | None = wire(
        text(MAX_TEXT, optional=True), "/proc/<executor pid>/fd/<n>, sealed", default=None
    )
    gpu_areas: list | None = wire(
        gpu_share(),
        "CUDA IPC handle of the areas on the client's GPU (then the segment holds only "
        "the control block; symbiont.protocol.gpu_areas)",
        default=None,
    )
    gpu_event: bytes | None = wire(
        event_handle(),
        "with gpu_areas: the event the executor records after writing each call's outputs; "
        "the client's stream waits for it before reading them (nil: the executor waits)",
        default=None,
    )


@dataclass(frozen=True)
class Ring:
    """either way: doorbell; a shared-memory call `seq` was posted or answered."""

    KIND: ClassVar[Kind] = Kind.RING
    seq: int = wire(CALL_ID, "sequence number in the segment")


@dataclass(frozen=True)
class Stats:
    """anyone -> executor: ask for live statistics."""

    KIND: ClassVar[Kind] = Kind.STATS
    call_id: int = wire(CALL_ID)
    token: str | None = wire(text(MAX_TEXT, optional=True), "serve-base's --token", default=None)


@dataclass(frozen=True)
class StatsReply:
    """executor -> asker: what `symbiont stats URL` prints."""

    KIND: ClassVar[Kind] = Kind.STATS_REPLY
    call_id: int = wire(CALL_ID)
    stats: dict = wire(mapping(), "Stats.snapshot()")


@dataclass(frozen=True)
class Bye:
    """client -> executor: the session ends; the executor frees it."""

    KIND: ClassVar[Kind] = Kind.BYE
    call_id: int = wire(CALL_ID)


@dataclass(frozen=True)
class Data:
    """client -> executor: part of a CALL's x too large for one frame (over MAX_FRAME_BYTES)."""

    KIND: ClassVar[Kind] = Kind.DATA
    call_id: int = wire(CALL_ID, "the CALL this belongs to")
    offset: int = wire(integer(0, MAX_ID), "byte offset in x; parts come in order")


Message = (
    Hello | Welcome | Call | Result | Error | Attach | Ok | Ring | Stats | StatsReply | Bye | Data
)
MESSAGES: dict[Kind, type] = {
    cls.KIND: cls
    for cls in (Hello, Welcome, Call, Result, Error, Attach, Ok, Ring, Stats, StatsReply, Bye, Data)
}
# kind -> ((name, check, required, default), ...): what `wire.decode` walks
SCHEMAS = {
    kind: tuple((f.name, f.metadata["check"], f.default is MISSING, f.default) for f in fields(cls))
    for kind, cls in MESSAGES.items()
}


def table() -> str:
    """The protocol as a markdown table (in `wire`'s docstring and docs/service.md)."""
    lines = ["| kind | fields (`?`: optional) | tensor frame | from -> to |", "|---|---|---|---|"]
    frames = {
        Kind.CALL: "x `[rows, cols]`, or packed experts tensors (none if sent in DATA parts)",
        Kind.RESULT: "y `[rows, cols]`, or packed experts tensors",
        Kind.DATA: "bytes of x from offset",
    }
    for kind, cls in MESSAGES.items():
        names = ", ".join(f.name if f.default is MISSING else f"{f.name}?" for f in fields(cls))
        meaning = cls.__doc__.split(":")[0]
        lines.append(f"| {int(kind)} {kind.name} | {names} | {frames.get(kind, '')} | {meaning} |")
    return "\n".join(lines)
