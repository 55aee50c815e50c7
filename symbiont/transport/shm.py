"""Same-host shared memory: one segment per client, mapped by the client and the executor.

Layout (offsets in bytes):

    0     control block: int64 slots, each group on its own cache line
            REQ_SEQ, OP, LAYER, ROWS, FUSED,    written by the client
            EXTRA[0..2] (layers fused into the call, fed the same x)
            RESP_SEQ, STATUS, OUT_ROWS          written by the executor
            SERVER_ASLEEP                       executor: "ring me, I am not spinning"
            SPIN_OK                             executor: "spinning pays: a core each"
            CLIENT_ASLEEP                       client: "ring me, I am not spinning"
    256   input area   x [rows, width_in]     (capacity bytes)
    256+c output area  y [rows, width_out]    (capacity bytes; a fused call's outputs
                                              follow one another)

A call moves no tensor bytes through the socket: the client copies x into the input
area, writes the call fields, then bumps REQ_SEQ; the executor, spinning on REQ_SEQ,
runs the call, writes y and bumps RESP_SEQ. Only a side that is not spinning is woken
through the socket (a RING doorbell). Spinning only pays when every spinner has a core:
the executor clears SPIN_OK while its shared-memory clients outnumber the cores, and
then both sides sleep on the socket between calls. On x86-64 stores are seen in program order, so
seeing a new sequence number implies seeing the data written before it; elsewhere the
fast path is off and every call rings (the socket's system calls order memory).

The client creates the segment as a file in /dev/shm, the executor maps it, then the
client unlinks the name: nothing is left behind even if either side is killed.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import platform
import re
import secrets
import stat
import tempfile
from pathlib import Path

import torch

REQ_SEQ, OP, LAYER, ROWS, FUSED, EXTRA = 0, 1, 2, 3, 4, 5  # EXTRA..EXTRA+MAX_FUSED-1
MAX_FUSED = 3
RESP_SEQ, STATUS, OUT_ROWS = 8, 9, 10
SERVER_ASLEEP, SPIN_OK = 16, 17
CLIENT_ASLEEP = 24
HEADER_BYTES = 256
MAX_CACHED_VIEWS = 256

# Spinning on a sequence number is only safe where stores become visible in order.
SPIN_SAFE = platform.machine().lower() in {"x86_64", "amd64", "i386", "i686"}

_NAME = re.compile(r"symbiont-[0-9a-f]{32}")


def shm_dir() -> Path:
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


class Segment:
    """A mapped segment with a control block and input/output areas of `capacity` bytes."""

    def __init__(self, path: Path, fd: int, capacity: int):
        self.path = path
        self.capacity = capacity
        self.size = HEADER_BYTES + 2 * capacity
        self._map = mmap.mmap(fd, self.size)
        os.close(fd)
        self.ctrl = memoryview(self._map)[:HEADER_BYTES].cast("q")
        raw = torch.frombuffer(self._map, dtype=torch.uint8)
        self._in = raw[HEADER_BYTES : HEADER_BYTES + capacity]
        self._out = raw[HEADER_BYTES + capacity :]
        self._views: dict[tuple, torch.Tensor] = {}

    @classmethod
    def create(cls, capacity: int) -> Segment:
        """A new segment (client side); `unlink` it once the executor has mapped it."""
        path = shm_dir() / f"symbiont-{secrets.token_hex(16)}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, HEADER_BYTES + 2 * capacity)
        return cls(path, fd, capacity)

    @classmethod
    def attach(cls, path: str, size: int) -> Segment:
        """Map a segment a client created (executor side); refuses anything else."""
        where = Path(path)
        if where.parent != shm_dir() or not _NAME.fullmatch(where.name):
            raise ValueError(f"{path} is not a symbiont shared-memory segment")
        try:
            fd = os.open(where, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise ValueError(
                f"shared-memory segment {path} not found: the client runs on another host "
                "(use tcp:// without shared memory)"
            ) from None
        info = os.fstat(fd)
        capacity = (size - HEADER_BYTES) // 2
        if not stat.S_ISREG(info.st_mode) or info.st_size != size or capacity <= 0:
            os.close(fd)
            raise ValueError(f"shared-memory segment {path} has size {info.st_size}, not {size}")
        return cls(where, fd, capacity)

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)

    def input(self, dtype: torch.dtype, rows: int, cols: int) -> torch.Tensor:
        """View of the input area as [rows, cols] (cached: decode repeats a few shapes)."""
        key = (0, dtype, rows, cols)
        view = self._views.get(key)
        return view if view is not None else self._view(key, self._in)

    def output(self, dtype: torch.dtype, rows: int, cols: int) -> torch.Tensor:
        """View of the output area as [rows, cols]."""
        key = (1, dtype, rows, cols)
        view = self._views.get(key)
        return view if view is not None else self._view(key, self._out)

    def output_at(self, offset: int, dtype: torch.dtype, rows: int, cols: int) -> torch.Tensor:
        """View [rows, cols] of the output area starting `offset` elements in."""
        if offset == 0:
            return self.output(dtype, rows, cols)
        start = offset * dtype.itemsize
        return self._out[start : start + rows * cols * dtype.itemsize].view(dtype).view(rows, cols)

    def _view(self, key: tuple, area: torch.Tensor) -> torch.Tensor:
        _, dtype, rows, cols = key
        if len(self._views) >= MAX_CACHED_VIEWS:
            self._views.clear()
        view = area[: rows * cols * dtype.itemsize].view(dtype).view(rows, cols)
        self._views[key] = view
        return view

    def close(self) -> None:
        self.ctrl.release()
        self._in = self._out = None
        self._views.clear()
        # A caller may still hold a view; then the mapping goes when that view goes.
        with contextlib.suppress(BufferError):
            self._map.close()


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
