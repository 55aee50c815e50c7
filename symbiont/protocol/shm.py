"""Same-host shared memory: one segment per client, mapped by the client and the executor.

Layout (offsets in bytes):

    0     control block: int64 slots, each group on its own cache line
            REQ_SEQ, OP, LAYER, ROWS, FUSED,    written by the client
            EXTRA[0..2] (layers fused into the call, fed the same x)
            RESP_SEQ, STATUS, OUT_ROWS          written by the executor
            SERVER_ASLEEP                       executor: "ring me, I am not spinning"
            SPIN_OK                             executor: "spinning pays: a core each"
            SPIN_BELOW                          executor: "...but only on calls of fewer
                                                multiply-adds than this" (0: on any)
            CLOSED                              executor: "session over: say HELLO again"
            DOORBELL                            executor: fd of its wake-up pipe (> 0)
            CLIENT_BELL                         executor: fd of the pipe it wakes this
                                                client through (> 0)
            CLIENT_ASLEEP                       client: "ring me, I am not spinning"
                                                (RING: over the socket; BELL: through
                                                CLIENT_BELL)
            TOP_K, WEIGHTS_DTYPE                client, experts ops only: ids per token,
                                                index of the routing weights' dtype in DTYPES
    256   input area   x [rows, width_in]     (capacity bytes)
    256+c output area  y [rows, width_out]    (capacity bytes; a fused call's outputs
                                              follow one another)
An experts op packs its tensors in each area as `symbiont.protocol.experts` lays them out.
When client and executor compute on the same GPU, the two areas live on that GPU instead
(`symbiont.protocol.gpu_areas`: CUDA IPC) and the segment is the control block alone.

A call moves no tensor bytes through the socket: the client copies x into the input
area, writes the call fields, then bumps REQ_SEQ; the executor, spinning on REQ_SEQ,
runs the call, writes y and bumps RESP_SEQ. Only a side that is not spinning is woken.
Spinning only pays when every spinner has a core: the executor clears SPIN_OK while its
shared-memory clients outnumber the cores, and then both sides sleep between calls; and
a lone client sleeps on the large calls that the executor splits over all its cores
(SPIN_BELOW: from that size on the executor may split a call). A
sleeping side is woken by a byte through a pipe, both pipes the executor's: the client
writes into the executor's wake-up pipe and reads its own bell, opening each as
`/proc/<executor pid>/fd/<n>` (like the segment). A byte into a pipe is one kernel
wake-up; a RING message through the socket costs four thread hand-offs (each side's
ZeroMQ I/O thread), which on busy cores was most of a call's overhead
(`benchmarks/wakeups.py`; BENCHMARKS.md, issue 17, session 9). RING stays the fallback.
On x86-64 stores are seen in program order, so seeing a new sequence number implies
seeing the data written before it; elsewhere the fast path is off and every call rings
(a pipe's or the socket's system calls order memory).

The executor creates and owns every segment it maps: an anonymous memory file (memfd)
of the size the client asked for, sealed against shrinking and growing
(F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL), so no client can truncate it under the
executor's mapping (which would fault the executor with SIGBUS); the kernel refuses.
The client maps it by opening `/proc/<executor pid>/fd/<n>` (same user only, as with
any process's files). It has no name: nothing is left behind if either side is killed.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import mmap
import os
import platform
import select
import stat

import torch

from symbiont.protocol import gpu_areas
from symbiont.protocol.executor import DTYPES, MAX_FUSED, Code, Op, ProtocolError

REQ_SEQ, OP, LAYER, ROWS, FUSED, EXTRA = 0, 1, 2, 3, 4, 5  # EXTRA..EXTRA+MAX_FUSED-1
RESP_SEQ, STATUS, OUT_ROWS = 8, 9, 10
SERVER_ASLEEP, SPIN_OK, CLOSED, DOORBELL, CLIENT_BELL, SPIN_BELOW = 16, 17, 18, 19, 20, 21
CLIENT_ASLEEP = 24
RING, BELL = 1, 2  # CLIENT_ASLEEP values: how the client wants to be woken
TOP_K, WEIGHTS_DTYPE = 25, 26  # experts ops (written by the client before REQ_SEQ)
WIRE_DTYPES = tuple(DTYPES.values())  # WEIGHTS_DTYPE indexes this
HEADER_BYTES = 256
MAX_CACHED_VIEWS = 256

# Spinning on a sequence number is only safe where stores become visible in order.
SPIN_SAFE = platform.machine().lower() in {"x86_64", "amd64", "i386", "i686"}

SEALS = (
    getattr(fcntl, "F_SEAL_SHRINK", 0)
    | getattr(fcntl, "F_SEAL_GROW", 0)
    | getattr(fcntl, "F_SEAL_SEAL", 0)
)
AVAILABLE = hasattr(os, "memfd_create") and hasattr(fcntl, "F_ADD_SEALS")


class Segment:
    """A mapped segment with a control block and input/output areas of `capacity` bytes."""

    def __init__(
        self,
        path: str,
        fd: int,
        capacity: int,
        keep_fd: bool = False,
        gpu_area: torch.Tensor | None = None,
    ):
        self.path = path
        self.capacity = capacity
        # With areas on the GPU (gpu_area: uint8 [2 * capacity]) the host segment is the
        # control block alone.
        self.size = HEADER_BYTES + (0 if gpu_area is not None else 2 * capacity)
        self._map = mmap.mmap(fd, self.size)
        self.fd = fd if keep_fd else None  # the owner keeps it open for the client to open
        if not keep_fd:
            os.close(fd)
        self.ctrl = memoryview(self._map)[:HEADER_BYTES].cast("q")
        if gpu_area is None:
            with torch.inference_mode(False):  # see `_view`
                raw = torch.frombuffer(self._map, dtype=torch.uint8)
            self._in = raw[HEADER_BYTES : HEADER_BYTES + capacity]
            self._out = raw[HEADER_BYTES + capacity :]
        else:
            self._in, self._out = gpu_area[:capacity], gpu_area[capacity:]
        self.gpu_area = gpu_area
        self.gpu_share: list | None = None  # executor side: the handle sent in OK
        # GPU areas: the event ordering each call's outputs (gpu_areas.new_event; None:
        # both sides wait for their copies instead), its handle (executor side, sent in
        # OK) and the client stream its last outputs were read on.
        self.gpu_event = None
        self.gpu_event_handle: bytes | None = None
        self._read_on = None
        self._views: dict[tuple, torch.Tensor] = {}
        self._doorbell: int | None = None  # client side: the executor's wake-up pipe
        # The pipe that wakes the client: the executor holds both ends (so it never opens
        # anything a client names); the client opens the read end through /proc.
        self._bell_r: int | None = None
        self._bell_w: int | None = None
        self._bell_poll = None  # client side: a poll object on _bell_r, made on first sleep

    @classmethod
    def create(
        cls, capacity: int, gpu: torch.device | None = None, events: bool = False
    ) -> Segment:
        """A new sealed segment (executor side): it cannot shrink or grow, whoever opens it.
        `path` is where a same-user process on this host opens it. With `gpu`, its areas
        are allocated on that GPU and `gpu_share` is the handle the client opens them by;
        with `events` too, the event that orders their outputs (`gpu_event_handle`)."""
        if not AVAILABLE:
            raise OSError("shared memory needs Linux memfd sealing: use frames (mode='zmq')")
        area, share = gpu_areas.allocate(gpu, 2 * capacity) if gpu is not None else (None, None)
        fd = os.memfd_create("symbiont", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, HEADER_BYTES + (0 if gpu is not None else 2 * capacity))
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            segment = cls(f"/proc/{os.getpid()}/fd/{fd}", fd, capacity, keep_fd=True, gpu_area=area)
        except BaseException:
            os.close(fd)
            raise
        try:  # out of descriptors here too: close the segment, not leak its memfd
            segment._bell_r, segment._bell_w = os.pipe()
        except BaseException:
            segment.close()
            raise
        segment.gpu_share = share
        if gpu is not None and events:
            try:
                segment.gpu_event, segment.gpu_event_handle = gpu_areas.new_event(gpu)
            except BaseException:
                segment.close()
                raise
        os.set_blocking(segment._bell_w, False)
        segment.ctrl[CLIENT_BELL] = segment._bell_r
        return segment

    @classmethod
    def open(
        cls,
        path: str,
        capacity: int,
        gpu: tuple[int, list] | None = None,
        event: bytes | None = None,
    ) -> Segment:
        """Map the segment the executor created for us (client side); `gpu`: (our index of
        the executor's GPU, the handle of the areas it put there); `event`: the handle of
        the event it records after writing outputs there."""
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as err:
            raise ValueError(
                f"cannot open the executor's shared-memory segment {path} ({err.strerror}): "
                "the executor runs on another host, in another pid namespace or as another "
                "user (use mode='zmq')"
            ) from None
        info = os.fstat(fd)
        size = HEADER_BYTES + (0 if gpu is not None else 2 * capacity)
        if not stat.S_ISREG(info.st_mode) or info.st_size != size:
            os.close(fd)
            raise ValueError(f"shared-memory segment {path} has size {info.st_size}")
        try:
            area = gpu_areas.open_shared(*gpu, 2 * capacity) if gpu is not None else None
            opened = gpu_areas.open_event(gpu[0], event) if gpu and event is not None else None
        except (RuntimeError, TypeError, ValueError) as err:
            os.close(fd)
            raise ValueError(f"cannot open the executor's GPU areas: {err}") from None
        segment = cls(path, fd, capacity, gpu_area=area)
        segment.gpu_event = opened
        return segment

    def settle(self) -> None:
        """Make this thread's writes to GPU areas visible before bumping a sequence number
        (nothing to do for host areas: stores to them are seen in order)."""
        gpu_areas.settle(self.gpu_area)

    def inputs_writable(self) -> None:
        """Client side, before writing a call's x: where the last outputs were read on
        another stream, this one waits for that one, which waited for the executor's
        event: the executor's reads of the last x and our reads of its outputs come
        first. (On the same stream that order holds already; `settle` then waits.)"""
        if self._read_on is not None:
            current = _stream_of(self.gpu_area)
            if self._read_on != current:
                current.wait_stream(self._read_on)
            self._read_on = None

    def outputs_written(self) -> None:
        """Executor side, after queueing a call's output copies and before publishing its
        answer: record the event the client's stream waits for (or, without one, wait
        for the copies)."""
        if self.gpu_event is None:
            self.settle()
        else:
            self.gpu_event.record(_stream_of(self.gpu_area))

    def outputs_ready(self) -> None:
        """Client side, once the answer is published: what this thread queues from now on
        runs after the executor's output copies."""
        if self.gpu_event is not None:
            self.gpu_event.wait(_stream_of(self.gpu_area))

    def outputs_read(self) -> None:
        """Client side, after queueing its copies out of the output area: the executor may
        overwrite it once the next call is posted, and `settle` waits for them then (or,
        without an event, now)."""
        if self.gpu_event is None:
            self.settle()
        else:
            self._read_on = _stream_of(self.gpu_area)

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
        key = (2, dtype, rows, cols, offset)
        view = self._views.get(key)
        return view if view is not None else self._view(key, self._out)

    def input_area(self) -> torch.Tensor:
        """The whole input area as bytes (uint8 [capacity]): experts calls lay out several
        tensors in it."""
        return self._in

    def output_area(self) -> torch.Tensor:
        return self._out

    def _view(self, key: tuple, area: torch.Tensor) -> torch.Tensor:
        _, dtype, rows, cols, *offset = key
        start = offset[0] * dtype.itemsize if offset else 0
        if len(self._views) >= MAX_CACHED_VIEWS:
            self._views.clear()
        # Made outside inference mode whatever the caller's mode: a dtype view taken under
        # `torch.inference_mode()` is an inference tensor, and a view cached by a call
        # under it could not be written by a later call outside it (nor the reverse).
        with torch.inference_mode(False):
            view = area[start : start + rows * cols * dtype.itemsize].view(dtype).view(rows, cols)
        self._views[key] = view
        return view

    def open_pipes(self) -> None:
        """Client side: open the executor's wake-up pipe (DOORBELL) and the read end of
        our bell (CLIENT_BELL), where it offers them; else `ring` and `sleep` return
        False and the client uses RING messages."""
        self._doorbell = self._open_pipe(DOORBELL, os.O_WRONLY)
        self._bell_r = self._open_pipe(CLIENT_BELL, os.O_RDONLY)

    def _open_pipe(self, slot: int, mode: int) -> int | None:
        fd = self.ctrl[slot]
        if fd <= 0 or not self.path.startswith("/proc/"):
            return None
        try:
            pipe = os.open(f"{os.path.dirname(self.path)}/{fd}", mode | os.O_NONBLOCK)
        except OSError:
            return None
        if not stat.S_ISFIFO(os.fstat(pipe).st_mode):  # not what an executor hands out
            os.close(pipe)
            return None
        os.set_inheritable(pipe, False)
        return pipe

    def ring(self) -> bool:
        """Client side: wake the executor through its pipe; False where there is none."""
        return _write_byte(self._doorbell)

    def wake_client(self) -> bool:
        """Executor side: wake the client sleeping on its bell."""
        return _write_byte(self._bell_w)

    def sleep(self, timeout_s: float) -> bool:
        """Client side: wait until the executor rings our bell or `timeout_s` passes (then
        read what it wrote); False at once where there is no bell, or no longer: the
        executor closed its end (it freed the session, or it is gone)."""
        bell = self._bell_r
        if bell is None:
            return False
        # poll, not select: select refuses descriptors from 1024 on, which a process
        # with a raised open-files limit and many files open hands out.
        if self._bell_poll is None:
            self._bell_poll = select.poll()
            self._bell_poll.register(bell, select.POLLIN)
        if self._bell_poll.poll(math.ceil(timeout_s * 1e3)):
            try:
                if not os.read(bell, 4096):  # end of file: nobody will ring again
                    os.close(bell)
                    self._bell_r = None
                    return False
            except BlockingIOError:
                pass
        return True

    def close(self) -> None:
        read_on, self._read_on, self.gpu_event = self._read_on, None, None
        try:
            if read_on is not None:  # copies out of the areas may still be queued
                read_on.synchronize()
        finally:
            self._release()

    def _release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        for name in ("_doorbell", "_bell_r", "_bell_w"):
            fd = getattr(self, name)
            if fd is not None:
                os.close(fd)
                setattr(self, name, None)
        self.ctrl.release()
        self._in = self._out = self.gpu_area = None
        self._views.clear()
        # Tensors made by torch.frombuffer do not pin the mapping: it goes now, and a view
        # still in use would then read unmapped memory. The executor closes a segment only
        # once no call of it is being computed (`ExecutorServer._retire`).
        with contextlib.suppress(BufferError):
            self._map.close()


def _stream_of(area: torch.Tensor):
    """This thread's current stream on the GPU of `area` (None for a CPU tensor: the
    tests' stand-in for GPU memory)."""
    return torch.cuda.current_stream(area.device) if area.is_cuda else None


def _write_byte(fd: int | None) -> bool:
    if fd is None:
        return False
    try:
        os.write(fd, b"x")
    except BlockingIOError:
        pass  # the pipe is full: the reader has bytes to wake it already
    except OSError:
        return False  # its reading end is closed
    return True


def read_call(ctrl) -> tuple[Op, int, int, tuple[int, ...]]:
    """(op, layer, rows, fused layers) of the call posted in a control block, each field
    checked like a CALL message's (the client writes these slots: trust none of them);
    `validate_call` then checks them against the manifest."""
    op, layer, rows, fused = ctrl[OP], ctrl[LAYER], ctrl[ROWS], ctrl[FUSED]
    if op not in _OPS:
        raise ProtocolError(Code.BAD_CALL, f"op = {op} in shared memory: 1 is forward, 2 backward")
    if rows < 0:
        raise ProtocolError(Code.BAD_CALL, f"rows = {rows} in shared memory: must be >= 0")
    if not 0 <= fused <= MAX_FUSED:
        raise ProtocolError(Code.BAD_CALL, f"fused = {fused} in shared memory: 0..{MAX_FUSED}")
    return _OPS[op], layer, rows, tuple(ctrl[EXTRA : EXTRA + fused])


_OPS = {int(op): op for op in Op}


def read_experts(ctrl) -> tuple[int, torch.dtype]:
    """(top_k, routing weights' dtype) of an experts call posted in a control block."""
    top_k, code = ctrl[TOP_K], ctrl[WEIGHTS_DTYPE]
    if not 0 <= code < len(WIRE_DTYPES):
        raise ProtocolError(
            Code.BAD_CALL, f"weights dtype = {code} in shared memory: 0..{len(WIRE_DTYPES) - 1}"
        )
    return top_k, WIRE_DTYPES[code]


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
