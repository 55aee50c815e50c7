"""The executor service: one BaseExecutor served to many clients over ZeroMQ and shared memory.

One thread runs one loop: take every message waiting on the ROUTER socket, take every
call posted in a client's shared-memory segment, then let the scheduler pick a layer
to run, run it (one matmul per direction over the concatenated tokens) and answer each
caller. While calls keep coming the loop spins on shared memory instead of sleeping on
the socket, so a same-host call costs no system call on either side. With `workers` > 1
the batches are computed on a pool of threads (torch releases the GIL in a matmul), so
several layers' batches run at once on several cores; the loop still does everything
else (queues, replies, sessions), and a worker's end wakes it through a pipe.

Nothing a client sends can stop the loop: a malformed message, a wrong shape or dtype,
an unknown layer or an oversized call is answered with an ERROR to that client only; a
client that vanishes is answered into the void (ZeroMQ drops the reply) and its session
and shared memory are freed.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import queue
import secrets
import socket
import stat
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
import zmq

from symbiont.base.config import ServiceConfig
from symbiont.base.executor import BaseExecutor
from symbiont.base.scheduler import Call as QueuedCall
from symbiont.base.scheduler import Scheduler, Session
from symbiont.base.stats import Stats as Counters
from symbiont.protocol import gpu_areas, shm
from symbiont.protocol.executor import EXPERTS_OPS, Op, validate_call
from symbiont.protocol.experts import (
    REPLY_NAMES,
    reply_layout,
    request_layout,
    validate_experts,
    validate_experts_values,
)
from symbiont.protocol.messages import MAX_MESSAGE
from symbiont.protocol.wire import (
    DTYPES,
    MAX_FRAME_BYTES,
    MAX_HEADER_BYTES,
    Attach,
    Bye,
    Call,
    Code,
    Data,
    Error,
    Hello,
    Ok,
    ProtocolError,
    Result,
    Ring,
    Stats,
    StatsReply,
    Welcome,
    decode,
    encode,
    legacy_error,
    tensor_bytes,
    tensor_from,
)

log = logging.getLogger("symbiont.base")

HOUSEKEEPING_S = 1.0
FRAMES_GONE_S = 5.0  # a same-host frames client quiet this long is checked for its pid
# Limits against clients that hold state without using it (ServiceConfig fields to come):
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # plain ints: enum operators cost µs
SLEEP_RECHECK_MS = 20  # bounds the (tiny) race between "server asleep" and a client's post
MAX_DRAIN = 256  # messages taken per loop turn, so shared-memory clients are not starved
# A lone client's large calls are split in parts (blocks of output columns or of rows)
# over the loop and the idle workers, one part per this many multiply-adds at most: a
# hand-off to a worker and back costs ~50 µs, 2^23 multiply-adds about 100 µs of oneDNN
# on one core (BENCHMARKS.md, session 22). So a call splits from 2 * SPLIT_MIN_MACS on.
SPLIT_MIN_MACS = 1 << 23
SPLIT_ALIGN = 16  # columns per part: a multiple of this (64 bytes of float32)
SPLIT_MIN_ROWS = 16  # rows per part, where a call splits by rows


class ExecutorServer:
    """Serves `executor` on the endpoints of `config` until `stop()` (or a signal)."""

    def __init__(self, executor: BaseExecutor, config: ServiceConfig):
        self.executor = executor
        self.config = config
        self.manifest = executor.manifest
        self.instance = secrets.token_hex(8)  # tells clients which URLs reach this process
        self._host = socket.gethostname()[:255]  # as clients name theirs in HELLO
        self.sessions: dict[bytes, Session] = {}
        # Queue keys: linear layers by id, then experts stacks (n_linear + experts id).
        self.n_linear = len(self.manifest.layers)
        names = [s.name for s in self.manifest.layers] + [s.name for s in self.manifest.experts]
        self.scheduler = Scheduler(
            config.policy, self.sessions, len(names), _pass_positions(self.manifest)
        )
        self.stats = Counters(names)
        self.widths = [(s.in_features, s.out_features) for s in self.manifest.layers]
        self.endpoints: list[str] = []
        self._ipc_files: dict[str, tuple[int, int] | None] = {}  # url -> (device, inode)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._stopping = False
        self._last_busy = 0.0
        self._next_housekeeping = 0.0
        self._spin_s = config.spin_us * 1e-6 if shm.SPIN_SAFE else 0.0
        self._spin_ok = True
        self._on_cpu = executor.device.type == "cpu"
        self._crowd_warned = False  # `_warn_if_crowding`
        self._refusals: dict[str, tuple[float, int]] = {}  # peer -> (last warned, quiet since)
        # Clients on this GPU get their segment's areas here (CUDA IPC): matched by UUID.
        self._gpu = executor.device if executor.device.type == "cuda" else None
        self._gpu_uuid = gpu_areas.uuid_of(executor.device) if self._gpu is not None else None
        self._cores = config.host_cores or shm.cores()
        self._welcome = self.manifest.to_dict()
        self._pool: ThreadPoolExecutor | None = None
        self._done: queue.SimpleQueue = queue.SimpleQueue()  # finished batches, from workers
        self._in_flight = 0  # batches handed to workers and not yet answered
        # Segments of sessions that left while a worker may still read or write them:
        # closed once no batch is in flight (unmapping under a worker's matmul kills us).
        self._retired: list[shm.Segment] = []
        # Into how many parts the loop splits a lone client's large calls (1: none)
        self._split_ways = 1
        self._threads = torch.get_num_threads()  # each worker's, and the loop's
        if config.workers > 1:
            # A new thread takes OpenMP's default thread count: give workers ours.
            self._pool = ThreadPoolExecutor(
                config.workers,
                thread_name_prefix="executor",
                initializer=torch.set_num_threads,
                initargs=(self._threads,),
            )
        # The loop sleeps on the socket and on this pipe: a worker that finished writes a
        # byte into it, and so does a shared-memory client that posted a call (opening it
        # as /proc/<pid>/fd/<write end>: one kernel wake-up instead of a RING through
        # ZeroMQ's I/O threads). A byte only wakes the loop; what it does is read from
        # shared memory and the queues, so a stray byte costs one loop turn.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)

    # -- lifecycle --------------------------------------------------------------

    def bind(self) -> list[str]:
        """Bind every endpoint; returns them as bound (with the port chosen for `:*`)."""
        sock = self._sock
        sock.setsockopt(zmq.LINGER, 0)
        # No frame over this is read, from anyone: larger tensors come in DATA parts that
        # are taken only within a session, into a buffer sized after the CALL was checked.
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES + MAX_HEADER_BYTES)
        sock.setsockopt(zmq.SNDHWM, 1000)
        sock.setsockopt(zmq.RCVHWM, 256)  # per peer: at most ~256 MiB queued unread
        for url in self.config.bind:
            if url.startswith("ipc://"):
                _check_ipc_path(url.removeprefix("ipc://"))
            try:
                sock.bind(url)
            except zmq.ZMQError as err:
                raise OSError(f"cannot listen on {url}: {err}") from None
            endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            self.endpoints.append(endpoint)
            if endpoint.startswith("ipc://"):  # ours to remove at exit, while it is ours
                self._ipc_files[endpoint] = _inode(endpoint.removeprefix("ipc://"))
        return self.endpoints

    def stop(self) -> None:
        """Ask the loop to finish its current turn and return (safe from signal handlers)."""
        self._stopping = True

    def serve_forever(self) -> None:
        if not self.endpoints:
            self.bind()
        try:
            with torch.inference_mode():
                while not self._stopping:
                    self.step()
        finally:
            self.close()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._in_flight = 0
        for session in list(self.sessions.values()):
            self._forget(session)
        self._close_retired()
        os.close(self._wake_r)
        os.close(self._wake_w)
        self._sock.close(linger=0)
        self._ctx.term()
        for url, inode in self._ipc_files.items():
            path = url.removeprefix("ipc://")
            if inode is not None and _inode(path) == inode:  # not a later server's socket
                with contextlib.suppress(OSError):
                    os.unlink(path)

    # -- the loop ---------------------------------------------------------------

    def step(self) -> None:
        """One turn: take new work, run at most one batch, else spin or sleep."""
        got = self._drain_socket() + self._poll_shm()
        if self._pool is not None:
            got += self._answer_finished()
            if self._retired and not self._in_flight:
                self._close_retired()
        now = time.monotonic()
        batch = self.scheduler.pop_ready(now) if self._in_flight < self.config.workers else None
        if batch:
            self._run(batch, now)
            self._last_busy = time.monotonic()
            return
        if got:
            self._last_busy = now
            return
        if now >= self._next_housekeeping:
            self._housekeeping(now)
        # Every worker busy: nothing can run before one finishes (its byte wakes us).
        full = self._pool is not None and self._in_flight >= self.config.workers
        wake = None if full else self.scheduler.next_wake(now)
        if (wake is not None and wake < 1e-3) or (
            self._spin_ok and now - self._last_busy < self._spin_s
        ):
            return  # spin: a deadline is near, or shared-memory calls keep coming
        self._sleep(HOUSEKEEPING_S if wake is None else wake)

    def _sleep(self, seconds: float) -> None:
        """Block on the socket; shared-memory clients are told to ring while we sleep."""
        timeout_ms = max(1, int(seconds * 1e3))
        sessions = self._shm_sessions()
        if sessions:
            timeout_ms = min(timeout_ms, SLEEP_RECHECK_MS)
            for s in sessions:
                s.segment.ctrl[shm.SERVER_ASLEEP] = 1
            if self._poll_shm():
                self._wake(sessions)
                return
        if self._done.empty():  # else a worker has finished: no sleep
            self._poller.poll(timeout_ms)  # a message, or a byte in the pipe
        self._wake(sessions)

    def _wake(self, sessions: list[Session]) -> None:
        for s in sessions:
            if s.segment is not None:
                s.segment.ctrl[shm.SERVER_ASLEEP] = 0
        with contextlib.suppress(BlockingIOError):
            os.read(self._wake_r, 4096)  # what woke us is read from the queues next turn
        self._last_busy = time.monotonic()

    def _shm_sessions(self) -> list[Session]:
        return [s for s in self.sessions.values() if s.segment is not None]

    def _housekeeping(self, now: float) -> None:
        self._next_housekeeping = now + HOUSEKEEPING_S
        for session in list(self.sessions.values()):
            idle = now - max(session.last_seen, session.last_reply)
            fresh = session.calls == 0 and session.pending is None
            limit = self.config.new_session_timeout_s if fresh else self.config.session_timeout_s
            if not session.waiting and idle > limit:
                log.info("client %s idle for %.0f s: session closed", session.label, idle)
                self._forget(session)
            elif self._exited(session, idle):
                log.info("client %s (pid %d) has exited: session freed", session.label, session.pid)
                self._forget(session)

    def _exited(self, session: Session, idle: float) -> bool:
        """Whether the session's client process is gone: one with a segment is on this
        host; a frames client that says it is (its HELLO's host) is believed once it has
        also been quiet for a while, so that a remote host of the same name loses nothing
        (its session would be re-made anyway). Exited frames clients held their sessions
        for session_timeout_s (10 minutes), and a few filled --max-sessions."""
        if session.segment is None and (session.host != self._host or idle < FRAMES_GONE_S):
            return False
        return not _alive(session.pid)

    # -- socket messages -------------------------------------------------------

    def _drain_socket(self) -> int:
        taken = 0
        sock = self._sock
        while taken < MAX_DRAIN and sock.getsockopt(_EVENTS) & _POLLIN:
            frames = sock.recv_multipart(copy=False)
            taken += 1
            self._handle(frames)
        return taken

    def _handle(self, frames: list) -> None:
        """One message: whatever goes wrong answers its sender with ERROR; the loop goes on."""
        key = frames[0].bytes
        call_id = 0
        try:
            if len(frames) < 2:
                raise ProtocolError(Code.BAD_MESSAGE, "empty message")
            message = decode(frames[1].buffer)
            call_id = getattr(message, "call_id", 0)
            self._dispatch(key, message, frames)
        except ProtocolError as err:
            if err.code is Code.REFUSED:  # counted once: "4 refused, 4 errors" read as 8
                self.stats.refused += 1
            else:
                self.stats.errors += 1
            log.debug("refused a message from %r: %s", key, err)
            if err.legacy:
                self._send(key, legacy_error(err.call_id, err.code, str(err)))
            else:
                self._send_error(key, err.call_id or call_id, err.code, str(err))
        except Exception as err:  # noqa: BLE001 - no message may stop the loop
            self.stats.errors += 1
            log.warning("failed handling a message from %r", key, exc_info=True)
            self._send_error(key, call_id, Code.INTERNAL, f"executor failed: {err!r}"[:4096])

    def _dispatch(self, key: bytes, message, frames: list) -> None:
        if type(message) is Hello:
            return self._hello(key, message, frames)
        if type(message) is Stats:
            return self._stats(key, message, frames)
        session = self.sessions.get(key)
        if session is None:
            if type(message) in (Bye, Ring):
                return None
            raise ProtocolError(
                Code.NO_SESSION, "no session on this connection: send HELLO first (reconnect)"
            )
        session.last_seen = time.monotonic()
        if type(message) is Call:
            return self._frame_call(session, message, frames)
        if type(message) is Data:
            return self._data(session, message, frames)
        if type(message) is Attach:
            return self._attach(session, message)
        if type(message) is Bye:
            log.info("client %s left", session.label)
            return self._forget(session)
        if type(message) is Ring:
            return None  # waking the loop was the point; the call is in shared memory
        raise ProtocolError(Code.BAD_MESSAGE, f"a client does not send {message.KIND.name}")

    def _hello(self, key: bytes, hello: Hello, frames: list) -> None:
        peer = _peer(frames[1])
        self._check_token(hello.token, peer)
        if hello.fingerprint is not None and hello.fingerprint != self.manifest.fingerprint:
            log.warning("refused client from %s: built from another checkpoint", peer)
            raise ProtocolError(
                Code.REFUSED,
                f"this executor serves checkpoint fingerprint {self.manifest.fingerprint}, the "
                f"client was built from {hello.fingerprint}: load the client from the checkpoint "
                "folder the executor was started with",
            )
        if key in self.sessions:
            self._forget(self.sessions[key])
        if len(self.sessions) >= self.config.max_sessions:
            log.warning(
                "refused a client from %s: %d session(s) open (--max-sessions)",
                peer,
                self.config.max_sessions,
            )
            raise ProtocolError(
                Code.REFUSED,
                f"this executor serves at most {self.config.max_sessions} client(s) at once "
                "(--max-sessions) and has that many: retry later, or start another serve-base",
            )
        now = time.monotonic()
        session = Session(
            key=key,
            label=hello.label or key.hex(),
            pid=hello.pid,
            host=hello.host,
            endpoint=peer,
            connected_at=now,
            last_seen=now,
        )
        self.sessions[key] = session
        self._fit_to_sessions()
        log.info("client %s connected (pid %d on %s)", session.label, session.pid, session.host)
        self._warn_if_crowding(session)
        welcome = Welcome(
            call_id=hello.call_id,
            manifest=self._welcome,
            max_call_bytes=self.config.max_call_bytes,
            shm=self.config.allow_shm,
            instance=self.instance,
        )
        self._send(key, encode(welcome))

    def _check_token(self, token: str | None, peer: str) -> None:
        expected = self.config.token
        if expected and not hmac.compare_digest((token or "").encode(), expected.encode()):
            self._warn_refused(peer)
            why = "requires a token" if not token else "was started with another token"
            raise ProtocolError(
                Code.REFUSED,
                f"this executor {why}: give the value of its --token (symbiont finetune, "
                "generate, serve: --executor-token; symbiont stats: --token; any of them: "
                "$SYMBIONT_TOKEN; Python: symbiont.connect(url, token=...))",
            )

    def _warn_refused(self, peer: str) -> None:
        """A warning per refused token, at most one a minute per peer: on an open port
        anyone could otherwise fill the log (the rest are counted in the next one)."""
        now = time.monotonic()
        last, quiet = self._refusals.get(peer, (-REFUSAL_LOG_S, 0))
        if now - last < REFUSAL_LOG_S:
            self._refusals[peer] = (last, quiet + 1)
            return
        more = f" (and {quiet} more since the last warning)" if quiet else ""
        log.warning("refused a connection from %s: missing or wrong token%s", peer, more)
        if len(self._refusals) > 1024:  # many peers: forget them all, warn again
            self._refusals.clear()
        self._refusals[peer] = (now, 0)

    def _stats(self, key: bytes, request: Stats, frames: list) -> None:
        self._check_token(request.token, f"{_peer(frames[1])} (a stats request)")
        clients = [
            {
                "label": s.label,
                "pid": s.pid,
                "host": s.host,
                "transport": _transport(s.segment),
                "calls": s.calls,
                "tokens": s.tokens,
                "connected_s": time.monotonic() - s.connected_at,
            }
            for s in self.sessions.values()
        ]
        # numbers stay numbers (`stats --json`); the kind, an enum, as its name
        policy = {
            k: v if isinstance(v, int | float) else str(v)
            for k, v in self.config.policy.__dict__.items()
        }
        stats = self.stats.snapshot(clients, policy)
        self._send(key, encode(StatsReply(call_id=request.call_id, stats=stats)))

    def _attach(self, session: Session, attach: Attach) -> None:
        """A new segment of the capacity asked for, created, sealed and mapped here: no
        client can shrink it under our mapping."""
        if not self.config.allow_shm:
            raise ProtocolError(Code.REFUSED, "this executor does not accept shared memory")
        if session.waiting:  # its input is read from the segment this would replace
            raise ProtocolError(
                Code.BUSY, "a call of this connection is still running: attach between calls"
            )
        if attach.capacity > self.config.max_call_bytes:
            raise ProtocolError(
                Code.TOO_LARGE,
                f"a segment of {attach.capacity} bytes per area exceeds max_call_bytes "
                f"({self.config.max_call_bytes})",
            )
        try:
            segment = self._new_segment(session, attach)
        except OSError as err:
            raise ProtocolError(Code.REFUSED, f"no shared memory: {err}") from None
        if session.segment is not None:
            self._retire(session.segment)
        session.segment = segment
        session.seen_seq = segment.ctrl[shm.REQ_SEQ]
        session.spin = attach.spin
        segment.ctrl[shm.DOORBELL] = self._wake_w
        self._fit_to_sessions()
        share, event = segment.gpu_share, segment.gpu_event_handle
        ok = Ok(call_id=attach.call_id, segment=segment.path, gpu_areas=share, gpu_event=event)
        self._send(session.key, encode(ok))

    def _new_segment(self, session: Session, attach: Attach) -> shm.Segment:
        """Areas on our GPU for a client on it, while the GPU-area budget lasts (a client
        that never maps them, or is killed, keeps them until we exit); else host areas.
        The session's current segment is about to be replaced: it does not count."""
        wanted = 2 * attach.capacity
        if attach.gpu is not None and attach.gpu == self._gpu_uuid:
            used = sum(
                s.segment.gpu_area.numel()
                for s in self.sessions.values()
                if s is not session and s.segment is not None and s.segment.gpu_area is not None
            )
            if used + wanted <= self.config.gpu_area_bytes:
                try:
                    events = attach.events and gpu_areas.events_enabled()
                    return shm.Segment.create(attach.capacity, gpu=self._gpu, events=events)
                except RuntimeError as err:  # CUDA: out of memory, or no IPC here
                    log.warning("no GPU areas for a client (%s): host areas instead", err)
        return shm.Segment.create(attach.capacity)

    def _frame_call(self, session: Session, call: Call, frames: list) -> None:
        if session.waiting or session.pending is not None:  # one at a time; never drop
            raise ProtocolError(
                Code.BUSY,
                "a call is already in flight on this connection: wait for its answer before "
                "sending the next (or open another connection)",
            )
        if call.op in EXPERTS_OPS:
            return self._frame_experts(session, call, frames)
        shape = (call.rows, call.cols)
        validate_call(
            self.manifest,
            call.op,
            call.layer,
            shape,
            DTYPES[call.dtype],
            call.fused,
            self.config.max_call_bytes,
        )
        nbytes = call.rows * call.cols * self.manifest.dtype.itemsize
        if len(frames) == 2 and nbytes > MAX_FRAME_BYTES:  # x follows in DATA parts
            x = torch.empty(call.rows, call.cols, dtype=self.manifest.dtype)
            session.pending = (call, x, 0)
            return
        if len(frames) != 3 or len(frames[2]) != nbytes:
            got = len(frames[2]) if len(frames) == 3 else "no"
            raise ProtocolError(
                Code.BAD_CALL, f"CALL declares {nbytes} bytes of tensor data, sent {got} bytes"
            )
        x = tensor_from(frames[2].buffer, self.manifest.dtype, call.rows, call.cols)
        self._submit(session, call, x)

    def _frame_experts(self, session: Session, call: Call, frames: list) -> None:
        """An experts CALL: its packed tensors follow in one frame or in DATA parts."""
        weights_dtype = DTYPES.get(call.weights_dtype)
        if weights_dtype is None:
            raise ProtocolError(Code.BAD_CALL, "an experts CALL needs weights_dtype")
        args = (call.op, call.layer, call.rows, call.cols, call.top_k, DTYPES[call.dtype])
        validate_experts(self.manifest, *args, weights_dtype, self.config.max_call_bytes)
        layout = self._request_layout(call)
        raw = torch.empty(layout.nbytes, dtype=torch.uint8)
        if len(frames) == 2 and layout.nbytes > MAX_FRAME_BYTES:  # parts follow in DATA
            session.pending = (call, raw, 0)
            return
        if len(frames) != 3 or len(frames[2]) != layout.nbytes:
            got = len(frames[2]) if len(frames) == 3 else "no"
            raise ProtocolError(
                Code.BAD_CALL,
                f"CALL declares {layout.nbytes} bytes of experts tensors, sent {got} bytes",
            )
        raw.numpy()[:] = np.frombuffer(frames[2].buffer, dtype=np.uint8)
        self._submit(session, call, raw)

    def _request_layout(self, call: Call):
        weights_dtype = DTYPES[call.weights_dtype]
        args = (call.op, call.rows, call.top_k, call.cols, self.manifest.dtype, weights_dtype)
        return request_layout(*args)

    def _queue_experts(self, session, call_id, op, experts, tensors, via_shm=False) -> None:
        """Check an experts call's tensors (ids in range, all finite) and queue it."""
        spec = self.manifest.experts[experts]
        activations = [tensors[n] for n in ("hidden", "grad_y") if n in tensors]
        validate_experts_values(spec, tensors["ids"], tensors["weights"], *activations)
        now = time.monotonic()
        call = QueuedCall(
            session,
            call_id,
            op,
            self.n_linear + experts,
            tensors["hidden"],
            now,
            via_shm=via_shm,
            ids=tensors["ids"],
            weights=tensors["weights"],
            grad_y=tensors.get("grad_y"),
        )
        if via_shm and len(self.sessions) == 1 and not self.scheduler:
            session.waiting = True
            self._run([call], now)  # alone: nothing to batch with, skip the queues
        else:
            self.scheduler.submit(call)

    def _submit(self, session: Session, call: Call, x: torch.Tensor) -> None:
        if call.op in EXPERTS_OPS:  # x is the packed request
            tensors = self._request_layout(call).views(x)
            return self._queue_experts(session, call.call_id, call.op, call.layer, tensors)
        now = time.monotonic()
        self.scheduler.submit(
            QueuedCall(session, call.call_id, call.op, call.layer, x, now, extra=call.fused)
        )

    def _data(self, session: Session, data: Data, frames: list) -> None:
        """One part of a pending CALL's x, in order, into the buffer made for it."""
        pending, session.pending = session.pending, None
        if pending is None or pending[0].call_id != data.call_id:
            raise ProtocolError(Code.BAD_CALL, f"DATA for call {data.call_id}, which is not open")
        call, x, received = pending
        raw = x.view(-1).view(torch.uint8).numpy()
        size = len(frames[2]) if len(frames) == 3 else 0
        if data.offset != received or size == 0 or received + size > raw.nbytes:
            raise ProtocolError(
                Code.BAD_CALL,
                f"DATA of call {call.call_id} at offset {data.offset} ({size} bytes): expected "
                f"the part at offset {received} of {raw.nbytes} bytes; resend the whole CALL",
            )
        raw[received : received + size] = np.frombuffer(frames[2].buffer, dtype=np.uint8)
        if received + size < raw.nbytes:
            session.pending = (call, x, received + size)
        else:
            self._submit(session, call, x)

    # -- shared memory ----------------------------------------------------------

    def _poll_shm(self) -> int:
        taken = 0
        for session in self.sessions.values():
            segment = session.segment
            if segment is None or session.waiting:
                continue
            seq = segment.ctrl[shm.REQ_SEQ]
            if seq != session.seen_seq:
                session.seen_seq = seq
                session.last_seen = time.monotonic()
                self._shm_call(session, segment, seq)
                taken += 1
        return taken

    def _shm_call(self, session: Session, segment, seq: int) -> None:
        """The call posted in `segment`'s control block: its fields go through the same
        checks as a CALL message's, and must fit the segment."""
        try:
            op, layer, rows, extra = shm.read_call(segment.ctrl)
            if op in EXPERTS_OPS:
                return self._shm_experts(session, segment, seq, op, layer, rows)
            dtype = self.manifest.dtype
            limit = min(self.config.max_call_bytes, segment.capacity)
            validate_call(self.manifest, op, layer, (rows, None), dtype, extra, limit)
        except ProtocolError as err:
            self.stats.errors += 1
            self._send_error(session.key, seq, err.code, str(err))  # before the client wakes
            _publish(segment, seq, int(err.code))
            return
        in_w = self.widths[layer][op is Op.BACKWARD]
        x = segment.input(dtype, rows, in_w)  # [rows, in_w], no copy
        now = time.monotonic()
        call = QueuedCall(session, seq, op, layer, x, now, via_shm=True, extra=extra)
        if len(self.sessions) == 1 and not self.scheduler:
            session.waiting = True
            self._run([call], now)  # alone: nothing to batch with, skip the queues
        else:
            self.scheduler.submit(call)

    def _shm_experts(self, session: Session, segment, seq: int, op: Op, experts, rows) -> None:
        """An experts call posted in shared memory; ids and routing weights are copied out
        before they are checked, so the client cannot change them afterwards."""
        if segment.gpu_area is not None:  # the client sends these as frames
            raise ProtocolError(
                Code.BAD_CALL, "experts calls go as frames when a segment's areas are on the GPU"
            )
        top_k, weights_dtype = shm.read_experts(segment.ctrl)
        dtype = self.manifest.dtype
        limit = min(self.config.max_call_bytes, segment.capacity)
        args = (op, experts, rows, None, top_k, dtype, weights_dtype, limit)
        spec = validate_experts(self.manifest, *args)
        layout = request_layout(op, rows, top_k, spec.hidden, dtype, weights_dtype)
        tensors = layout.views(segment.input_area())
        tensors["ids"], tensors["weights"] = tensors["ids"].clone(), tensors["weights"].clone()
        self._queue_experts(session, seq, op, experts, tensors, via_shm=True)

    # -- running a batch ----------------------------------------------------------

    def _run(self, calls: list[QueuedCall], now: float) -> None:
        """Run one layer for `calls`: one matmul per direction over all their tokens (on a
        worker when there is a pool and another client could use the loop meanwhile)."""
        first = calls[0]
        started = time.monotonic()
        on_worker = self._pool is not None and (self._in_flight or len(self.sessions) > 1)
        if on_worker and first.layer < self.n_linear:
            self._in_flight += 1
            self._pool.submit(self._compute_on_worker, calls, started)
            return
        try:
            if first.layer >= self.n_linear:
                tokens = self._run_experts(first.layer - self.n_linear, calls)
                waited = sum(started - c.arrived for c in calls)
                self.stats.record(first.layer, len(calls), tokens, waited, started)
            else:
                answers = self._compute(calls, self._split_ways)
                self._answer(calls, answers, started, time.monotonic())
        except Exception as err:  # a bug in one batch must not stop the loop for everyone
            log.exception("executor failed on a batch of layer %d", first.layer)
            for call in calls:
                if call.session.waiting and not call.answered:
                    message = f"executor failed running layer {first.layer}: {err!r}"
                    self._fail(call, Code.INTERNAL, message)

    def _compute_on_worker(self, calls: list[QueuedCall], started: float) -> None:
        """A worker thread: compute, answer the shared-memory calls itself (the client
        wakes one hand-off sooner), then hand the batch to the loop, which answers the
        rest and counts it. Whatever fails, the loop hears of the batch."""
        rings = []
        try:
            with torch.inference_mode():  # as the loop computes (segment views take any mode)
                answers = self._compute(calls)
                for call in calls:
                    answer = answers[id(call)]
                    shared = call.via_shm and call.ids is None and type(answer) is not Failed
                    if shared and self._answer_shm(call, answer):
                        rings.append(call)  # wants a RING: only the loop uses the socket
        except BaseException as err:  # noqa: BLE001 - the loop must hear of every batch
            answers = {id(c): Failed(calls[0].layer, err) for c in calls}
        self._done.put((calls, answers, started, time.monotonic(), rings))
        with contextlib.suppress(BlockingIOError):  # full: the loop wakes anyway
            os.write(self._wake_w, b"x")

    def _answer_finished(self) -> int:
        """Answer the batches workers have finished; returns how many."""
        finished = 0
        while not self._done.empty():
            self._in_flight -= 1
            self._answer(*self._done.get_nowait())
            finished += 1
        return finished

    def _compute(self, calls: list[QueuedCall], ways: int = 1) -> dict:
        """id(call) -> its outputs [[n_i, out_l] per layer], or `Failed`.
        Touches no session, socket or segment: runs on a worker thread too (with `ways`
        1: only the loop splits products over the workers, never a worker)."""
        answers: dict = {}
        for op in (Op.FORWARD, Op.BACKWARD):
            group = [c for c in calls if c.op is op]
            if group:
                self._compute_group(op, calls[0].layer, group, answers, ways)
        return answers

    def _compute_group(
        self, op: Op, layer: int, calls: list[QueuedCall], answers: dict, ways: int = 1
    ) -> None:
        """Calls that fuse the same layers run as one batch: one matmul over their
        concatenated tokens for `layer` and its fused siblings together where the executor
        stores them as one block (q/k/v, gate/up), else one per layer."""
        by_fused: dict[tuple[int, ...], list[QueuedCall]] = {}
        for call in calls:
            by_fused.setdefault(call.extra, []).append(call)
        for extra, group in by_fused.items():
            ys_of = self._batched(op, (layer, *extra), group, ways)
            for call, ys in zip(group, ys_of, strict=True):
                answers[id(call)] = ys

    def _answer(
        self, calls: list[QueuedCall], answers: dict, started: float, ended: float, rings=()
    ):
        """Reply to each call of a computed batch (or fail it), then count the batch."""
        for call in rings:
            self._send(call.session.key, encode(Ring(seq=call.call_id)))
        tokens = 0
        for call in calls:
            answer = answers[id(call)]
            if call.answered:
                tokens += call.tokens
            elif type(answer) is Failed:
                message = f"executor failed running layer {answer.layer}: {answer.error}"
                self._fail(call, Code.INTERNAL, message)
            elif call.session.waiting:  # not gone on the way
                self._reply(call, answer)
                tokens += call.tokens
        waited = sum(started - c.arrived for c in calls)
        self.stats.record(calls[0].layer, len(calls), tokens, waited, started, ended)

    def _batched(
        self, op: Op, layers: tuple[int, ...], calls: list[QueuedCall], ways: int = 1
    ) -> list:
        """Each call's outputs [[n_i, out_l] per layer of `layers`, in that order: the
        order its client listed them] from one pass over x of all calls [sum n_i, in]
        (split in up to `ways` parts); where it fails (e.g. out of memory), `Failed` for
        each call instead."""
        try:
            x = self._batch_input(calls)
            split = self._split(op, layers, x.shape[0], ways)
            if split is not None:
                ys = self._split_product(op, layers, x, split)
            elif len(layers) > 1:  # forward only: one matmul where the layers are one run
                ys = list(self.executor.run_fused(layers, x))
            else:
                ys = [self.executor.run(op, layers[0], x)]
            # y stays on the GPU: replies copy it where it goes (host segment, frame, or
            # a segment's GPU areas without leaving the device)
        except (RuntimeError, ValueError) as err:  # fail these calls only
            log.exception("layer %d %s failed", layers[0], op.name.lower())
            return [Failed(layers[0], err)] * len(calls)
        if len(calls) == 1:
            return [ys]
        sizes = [c.tokens for c in calls]
        return [list(parts) for parts in zip(*(y.split(sizes) for y in ys), strict=True)]

    def _split(self, op: Op, layers: tuple[int, ...], rows: int, ways: int):
        """How to compute a call in parts at once: (by_columns, [(start, end)] of the
        output's columns or of x's rows), or None to compute it whole (`ways` 1, or a
        product too small for each part to outweigh its hand-off to a worker)."""
        if ways == 1 or not self.executor.splits:
            return None
        width_in, width_out = self.widths[layers[0]]
        if op is Op.FORWARD:
            width_out = sum(self.widths[layer][1] for layer in layers)
        else:  # grad_x [rows, in]
            width_in, width_out = width_out, width_in
        blocks = self.executor.column_blocks(op, layers)
        # Blocks of the weight's rows where they give the output's columns; else blocks of
        # x's rows, unless too few rows: then strided blocks of the weight's columns
        by_columns = blocks == "rows" or (blocks == "columns" and rows < 2 * SPLIT_MIN_ROWS)
        size = width_out if by_columns else rows
        most = size // (SPLIT_ALIGN if by_columns else SPLIT_MIN_ROWS)
        n = min(ways, rows * width_in * width_out // SPLIT_MIN_MACS, most)
        if n < 2:
            return None
        align = SPLIT_ALIGN if by_columns else 1
        step = -(-size // (n * align)) * align
        return by_columns, [(start, min(start + step, size)) for start in range(0, size, step)]

    def _split_product(self, op: Op, layers: tuple[int, ...], x: torch.Tensor, split) -> list:
        """The call's outputs from its parts, the first computed by the loop and the rest
        by idle workers at once. x [rows, in] -> [[rows, out_l] per layer]"""
        by_columns, parts = split
        self.stats.split_batches += 1  # the loop's own count: only the loop splits
        if by_columns:
            run, dim = partial(self.executor.run_columns, op, layers, x), 1
        else:
            run, dim = partial(self._rows_of, op, layers, x), 0
        futures = []
        try:
            futures += [self._pool.submit(_part, run, *part) for part in parts[1:]]
            blocks = [run(*parts[0])]
        finally:  # the workers read x, which may lie in a client's segment: wait for all
            wait(futures)
        blocks += [future.result() for future in futures]  # raises a part's error
        y = torch.cat(blocks, dim=dim)  # [rows, sum_out]
        if len(layers) == 1:
            return [y]
        return list(y.split_with_sizes([self.widths[layer][1] for layer in layers], dim=1))

    def _rows_of(self, op: Op, layers: tuple[int, ...], x: torch.Tensor, start: int, end: int):
        """Rows [start, end) of a call's output, side by side for fused layers."""
        if len(layers) == 1:
            return self.executor.run(op, layers[0], x[start:end])
        return torch.cat(self.executor.run_fused(layers, x[start:end]), dim=1)

    def _batch_input(self, calls: list[QueuedCall]) -> torch.Tensor:
        """x of all calls [sum n_i, in] on the executor's device (inputs come from host
        segments and frames, or from GPU areas already there)."""
        if self._on_cpu:
            return calls[0].x if len(calls) == 1 else torch.cat([c.x for c in calls])
        device = self.executor.device
        xs = [c.x.to(device) for c in calls]
        return xs[0] if len(xs) == 1 else torch.cat(xs)

    def _run_experts(self, experts: int, calls: list[QueuedCall]) -> int:
        """Run an experts stack once per (direction, top-k, routing-weights dtype) over
        the tokens of every call: inside, the tokens of all clients are grouped per expert."""
        groups: dict[tuple, list[QueuedCall]] = {}
        for call in calls:  # ids and weights [n, top_k] concatenate only with one top_k
            key = (call.op, call.ids.shape[1], call.weights.dtype)
            groups.setdefault(key, []).append(call)
        tokens = 0
        for (op, _, _), group in groups.items():
            outs = self._batched_experts(op, experts, group)
            if outs is None:
                continue  # those calls were failed; the others still get their answers
            for call, ys in zip(group, outs, strict=True):
                self._reply(call, ys)
            tokens += sum(c.tokens for c in group)
        return tokens

    def _batched_experts(self, op: Op, experts: int, calls: list[QueuedCall]) -> list | None:
        """Each call's outputs ([y] or [grad_hidden, grad_weights]) from one run."""
        names = ["x", "ids", "weights"] + (["grad_y"] if op is Op.EXPERTS_BACKWARD else [])
        device = self.executor.device
        try:
            args = [
                getattr(calls[0], n)
                if len(calls) == 1
                else torch.cat([getattr(c, n) for c in calls])
                for n in names
            ]
            outs = self.executor.run_experts(op, experts, *(a.to(device) for a in args))
        except (RuntimeError, ValueError) as err:  # e.g. out of memory: fail these calls only
            log.exception("experts %d %s failed", experts, op.name.lower())
            for call in calls:
                self._fail(call, Code.INTERNAL, f"executor failed running experts: {err}")
            return None
        parts = [o.cpu().split([c.tokens for c in calls]) for o in outs]
        return [list(p) for p in zip(*parts, strict=True)]

    def _reply(self, call: QueuedCall, ys: list[torch.Tensor]) -> None:
        """Answer one call with its outputs, each [n_tokens, out_l], back to back."""
        session = call.session
        session.waiting = False
        session.last_reply = time.monotonic()
        session.calls += 1
        session.tokens += call.tokens
        rows = call.tokens
        if call.ids is not None:
            return self._reply_experts(call, ys)
        if not call.via_shm:
            cols = sum(y.shape[1] for y in ys)
            y = ys[0] if len(ys) == 1 else torch.cat([y.reshape(-1) for y in ys])
            data = tensor_bytes(y.cpu())
            header = encode(Result(call_id=call.call_id, rows=rows, cols=cols))
            self._sock.send_multipart([session.key, header, data], copy=False)
            return
        if self._write_shm(session.segment, call, ys):
            self._send(session.key, encode(Ring(seq=call.call_id)))

    def _answer_shm(self, call: QueuedCall, ys: list[torch.Tensor]) -> bool:
        """`_reply` for a shared-memory call, from a worker thread (touches no socket);
        returns whether the client wants a RING."""
        session = call.session
        session.waiting = False
        session.last_reply = time.monotonic()
        session.calls += 1
        session.tokens += call.tokens
        try:
            ring = self._write_shm(session.segment, call, ys)
        except (TypeError, ValueError):  # the loop closed the segment meanwhile: client gone
            ring = False
        call.answered = True
        return ring

    @staticmethod
    def _write_shm(segment, call: QueuedCall, ys: list[torch.Tensor]) -> bool:
        """Write each output [rows, out_l] back to back into the output area and publish
        the answer; returns whether the client wants a RING."""
        if segment is None:
            return False  # the client left while its call ran
        rows, offset = call.tokens, 0
        for y in ys:
            segment.output_at(offset, y.dtype, rows, y.shape[1]).copy_(y)
            offset += y.numel()
        segment.outputs_written()  # GPU areas: ordered before what the client reads
        segment.ctrl[shm.OUT_ROWS] = rows
        return _publish(segment, call.call_id)

    def _reply_experts(self, call: QueuedCall, ys: list[torch.Tensor]) -> None:
        """Answer an experts call with its outputs packed as `reply_layout` says."""
        rows, width = call.x.shape
        args = (call.op, rows, call.ids.shape[1], width, call.x.dtype, call.weights.dtype)
        layout, tensors = reply_layout(*args), dict(zip(REPLY_NAMES[call.op], ys, strict=True))
        session = call.session
        if not call.via_shm:
            data = memoryview(layout.pack(tensors).numpy())
            header = encode(Result(call_id=call.call_id, rows=rows, cols=width))
            self._sock.send_multipart([session.key, header, data], copy=False)
            return
        segment = session.segment
        if segment is not None:  # else the client left while its call ran
            layout.write(segment.output_area(), tensors)
            segment.ctrl[shm.OUT_ROWS] = rows
            if _publish(segment, call.call_id):
                self._send(session.key, encode(Ring(seq=call.call_id)))

    def _fail(self, call: QueuedCall, code: Code, message: str) -> None:
        session = call.session
        session.waiting = False
        session.last_reply = time.monotonic()
        self._send_error(session.key, call.call_id, code, message)  # before the client wakes
        if call.via_shm and session.segment is not None:
            _publish(session.segment, call.call_id, int(code))

    # -- helpers ------------------------------------------------------------------

    def _send(self, key: bytes, header: bytes) -> None:
        self._sock.send_multipart([key, header])

    def _send_error(self, key: bytes, call_id: int, code: Code, message: str) -> None:
        self._send(key, encode(Error(call_id=call_id, code=code, message=message[:MAX_MESSAGE])))

    def _forget(self, session: Session) -> None:
        self.sessions.pop(session.key, None)
        self.scheduler.drop_session(session)
        session.pending = None
        if session.segment is not None:
            session.segment.ctrl[shm.CLOSED] = 1  # the client says HELLO again
            self._retire(session.segment)
            session.segment = None
        self._fit_to_sessions()

    def _retire(self, segment: shm.Segment) -> None:
        """Close a segment no session uses any more, or, while a worker may still be
        reading a call's input from it or writing an answer into it, once none is."""
        if self._in_flight:
            self._retired.append(segment)
        else:
            segment.close()

    def _close_retired(self) -> None:
        for segment in self._retired:
            segment.close()
        self._retired.clear()

    def _fit_to_sessions(self) -> None:
        """After a client came or went: whether to spin, whether to merge calls, and
        whether to split a lone client's products over the workers."""
        # One client calls one layer at a time: every worker but the loop would sleep,
        # so the loop computes its large calls in parts on all of them at once.
        lone = self._pool is not None and self._on_cpu and len(self.sessions) == 1
        lone = lone and self.executor.splits
        # Each part runs on its thread's torch threads: no more of them than cores
        ways = min(self.config.workers, max(1, self._cores // self._threads))
        self._split_ways = ways if lone else 1
        self._update_spin()
        # On a CPU, merging two clients' calls of one layer saves only 6-11% of the
        # arithmetic (a 256-row matmul against four 64-row ones) but runs them on one
        # worker: while every client can have a worker of its own, keep calls apart so
        # the workers compute side by side (BENCHMARKS.md, issue 17, session 8).
        self.scheduler.merge = not (
            self._pool is not None and self._on_cpu and len(self.sessions) <= self.config.workers
        )

    def _warn_if_crowding(self, session: Session) -> None:
        """Once: a client on this host while the products take every core. OpenMP's
        threads spin after each product on the core the client needs, and its steps ran
        3-20x slower on two cores (symbiont/base/main.py, `_default_threads`)."""
        if self._crowd_warned or not self._on_cpu or session.host != self._host:
            return
        if session.pid == os.getpid():  # a client thread of this process shares its threads
            return
        # single-threaded products spin on nothing; OpenMP's threads spin after each one
        if self._threads < 2 or self._threads * self.config.workers < self._cores:
            return
        self._crowd_warned = True
        log.warning(
            "client %s runs on this host, and the products take all %d cores (--threads %d "
            "x --workers %d): its steps may run many times slower; leave it a core "
            "(--threads %d, or no --threads)",
            session.label,
            self._cores,
            self._threads,
            self.config.workers,
            max(1, (self._cores - 1) // self.config.workers),
        )

    def _update_spin(self) -> None:
        """Spin only while the executor and each client can have a core (same host or not:
        a remote client's calls still find the loop awake)."""
        # The loop, plus the workers once they can be used: with one client the loop
        # computes its calls inline (see `_run`) and the workers sleep, so client and loop
        # take turns on two cores and both may spin.
        workers = self._pool is not None and len(self.sessions) > 1
        busy = 1 + (self.config.workers if workers else 0)
        self._spin_ok = (
            self._spin_s > 0
            and len(self.sessions) + busy <= self._cores
            and all(s.spin for s in self._shm_sessions())  # a client's cores are taken
        )
        # Calls the loop splits over the workers need every core: their client sleeps.
        split_threads = self._split_ways * self._threads
        splits = self._split_ways > 1 and len(self.sessions) + split_threads > self._cores
        for s in self._shm_sessions():
            s.segment.ctrl[shm.SPIN_OK] = int(self._spin_ok)
            s.segment.ctrl[shm.SPIN_BELOW] = 2 * SPLIT_MIN_MACS if splits else 0


REFUSAL_LOG_S = 60.0  # a peer's refused tokens are warned of at most once in this long


def _part(run, start: int, end: int) -> torch.Tensor:
    """One part of a split product, on a worker thread (as the loop computes)."""
    with torch.inference_mode():
        return run(start, end)


@dataclass(frozen=True)
class Failed:
    """The answer of a call whose layer raised (e.g. out of memory): its client gets the
    error, the other calls of the batch their outputs."""

    layer: int
    error: BaseException


def _check_ipc_path(path: str) -> None:
    """ZeroMQ removes whatever is at an ipc:// path before it binds: refuse a path that
    holds a file, or the socket of an executor still listening there."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise OSError(
            f"cannot listen on ipc://{path}: a file is there and would be deleted; choose "
            "another path for the socket"
        )
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except OSError:
        return  # a socket nobody listens on: left by a killed server, reused
    finally:
        probe.close()
    raise OSError(
        f"cannot listen on ipc://{path}: another process (a serve-base?) listens there; "
        "stop it or choose another path"
    )


def _inode(path: str) -> tuple[int, int] | None:
    try:
        info = os.lstat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino


def _transport(segment: shm.Segment | None) -> str:
    if segment is None:
        return "zmq"
    return "shm" if segment.gpu_area is None else "cuda-ipc"


def _publish(segment, seq: int, status: int = 0) -> bool:
    """Publish the answer to shared-memory call `seq` (its outputs, if any, are written)
    and wake the client if it sleeps on its bell; returns whether it wants a RING
    through the socket instead (the caller sends it: only the loop uses the socket)."""
    ctrl = segment.ctrl
    ctrl[shm.STATUS] = status
    ctrl[shm.RESP_SEQ] = seq
    asleep = ctrl[shm.CLIENT_ASLEEP]
    if asleep == shm.BELL and segment.wake_client():
        return False
    return bool(asleep) or not shm.SPIN_SAFE


def _pass_positions(manifest) -> list[int]:
    """Queue key -> place in a forward pass: each experts stack sits after the linear
    layers that precede it in module order."""
    keys = [(spec.id, 1) for spec in manifest.layers]
    keys += [(spec.after, 0) for spec in manifest.experts]
    order = sorted(range(len(keys)), key=lambda k: keys[k])
    positions = [0] * len(keys)
    for place, key in enumerate(order):
        positions[key] = place
    return positions


def _peer(frame) -> str:
    try:
        return frame.get("Peer-Address") or "local"
    except (zmq.ZMQError, AttributeError):
        return "local"


def _alive(pid: int) -> bool:
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed client its parent has not reaped yet is a zombie: gone all the same
        with open(f"/proc/{pid}/stat", "rb") as stat_file:
            return stat_file.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True
