"""The wire format between clients and the executor service.

Every message is one ZeroMQ multipart message: a small msgpack header frame, then zero
or one raw tensor frame (the tensor's bytes, row-major, no framing). Never pickle.

Header = msgpack array whose first element is the `Kind`:

    HELLO    [kind, call_id, {protocol, token, fingerprint, pid, host, label}]
    WELCOME  [kind, call_id, manifest_dict, {session, max_call_bytes}]
    CALL     [kind, call_id, op, layer, rows, cols, dtype]     + frame x [rows, cols]
    RESULT   [kind, call_id, rows, cols]                       + frame y [rows, cols]
    ERROR    [kind, call_id, code, message]
    ATTACH   [kind, call_id, {path, size}]     shared-memory segment for this session
    OK       [kind, call_id]
    RING     [kind, seq]    doorbell: a shared-memory call was posted / answered
    STATS    [kind, call_id, {token}]  -> STATS_REPLY [kind, call_id, stats_dict]
    BYE      [kind, call_id]            the session ends; the executor frees it
"""

from __future__ import annotations

from enum import IntEnum

import msgpack
import numpy as np
import torch


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


class Code(IntEnum):
    """Why the executor refused a message; sent in ERROR."""

    BAD_MESSAGE = 1  # not a message of this protocol
    BAD_CALL = 2  # unknown layer, wrong shape or dtype
    TOO_LARGE = 3  # over the executor's max_call_bytes
    REFUSED = 4  # wrong token, protocol or checkpoint
    NO_SESSION = 5  # no handshake on this connection (or it expired): say HELLO again
    INTERNAL = 6  # the executor failed running a valid call


class WireError(ValueError):
    """A message that does not follow this protocol."""


MAX_HEADER_BYTES = 1 << 16

DTYPES = {
    name: getattr(torch, name)
    for name in ("float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2")
    if hasattr(torch, name)
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def pack(*fields) -> bytes:
    return msgpack.packb(fields, use_bin_type=True)


def unpack(frame) -> list:
    """Decode a header frame; anything that is not a msgpack array led by a Kind is refused."""
    if len(frame) > MAX_HEADER_BYTES:
        raise WireError(f"header frame of {len(frame)} bytes (at most {MAX_HEADER_BYTES})")
    try:
        header = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
        raise WireError("header frame is not msgpack") from None
    if not isinstance(header, list) or not header or not isinstance(header[0], int):
        raise WireError("header is not an array starting with a message kind")
    try:
        header[0] = Kind(header[0])
    except ValueError:
        raise WireError(f"unknown message kind {header[0]}") from None
    return header


def tensor_bytes(x: torch.Tensor) -> memoryview:
    """The raw bytes of a CPU tensor, without copying when it is already contiguous."""
    x = x.detach().cpu().contiguous()
    return memoryview(x.view(torch.uint8).reshape(-1).numpy())


def tensor_from(buffer, dtype: torch.dtype, rows: int, cols: int) -> torch.Tensor:
    """A writable tensor [rows, cols] copied out of a received frame (not a view: autograd
    lets callers modify it in place)."""
    out = torch.empty(rows, cols, dtype=dtype)
    out.view(-1).view(torch.uint8).numpy()[:] = np.frombuffer(buffer, dtype=np.uint8)
    return out


def expect_ints(header: list, start: int, count: int) -> list[int]:
    """header[start:start+count], checked to be plain integers (not bools)."""
    fields = header[start : start + count]
    if len(fields) != count or not all(type(f) is int for f in fields):
        raise WireError(f"{header[0].name} header needs {count} integers after position {start}")
    return fields
