"""The executor service: one BaseExecutor served to many clients over ZeroMQ and shared memory.

One thread runs one loop: take every message waiting on the ROUTER socket, take every
call posted in a client's shared-memory segment, then let the scheduler pick a layer
to run, run it (one matmul per direction over the concatenated tokens) and answer each
caller. While calls keep coming the loop spins on shared memory instead of sleeping on
the socket, so a same-host call costs no system call on either side.

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
import time

import torch
import zmq

from symbiont.executor.base import BaseExecutor
from symbiont.executor.interface import PROTOCOL_VERSION, Op
from symbiont.service.config import ServiceConfig
from symbiont.service.scheduler import Call, Scheduler, Session
from symbiont.service.stats import Stats
from symbiont.transport import shm
from symbiont.transport.wire import (
    DTYPE_NAMES,
    Code,
    Kind,
    WireError,
    expect_ints,
    pack,
    tensor_bytes,
    tensor_from,
    unpack,
)

log = logging.getLogger("symbiont.service")

HOUSEKEEPING_S = 1.0
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # plain ints: enum operators cost µs
_OPS = {int(op): op for op in Op}
SLEEP_RECHECK_MS = 20  # bounds the (tiny) race between "server asleep" and a client's post
MAX_DRAIN = 256  # messages taken per loop turn, so shared-memory clients are not starved


class Refused(Exception):
    """A message refused with `code`; the text goes back to its sender."""

    def __init__(self, code: Code, message: str):
        super().__init__(message)
        self.code = code


class ExecutorServer:
    """Serves `executor` on the endpoints of `config` until `stop()` (or a signal)."""

    def __init__(self, executor: BaseExecutor, config: ServiceConfig):
        self.executor = executor
        self.config = config
        self.manifest = executor.manifest
        self.dtype_name = DTYPE_NAMES[self.manifest.dtype]
        self.sessions: dict[bytes, Session] = {}
        self.scheduler = Scheduler(config.policy, self.sessions, len(self.manifest.layers))
        self.stats = Stats([spec.name for spec in self.manifest.layers])
        self.widths = [(s.in_features, s.out_features) for s in self.manifest.layers]
        self.endpoints: list[str] = []
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._stopping = False
        self._last_busy = 0.0
        self._next_housekeeping = 0.0
        self._spin_s = config.spin_us * 1e-6 if shm.SPIN_SAFE else 0.0
        self._spin_ok = True
        self._on_cpu = executor.device.type == "cpu"
        self._cores = config.host_cores or shm.cores()
        self._welcome = self.manifest.to_dict()

    # -- lifecycle --------------------------------------------------------------

    def bind(self) -> list[str]:
        """Bind every endpoint; returns them as bound (with the port chosen for `:*`)."""
        sock = self._sock
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.config.max_call_bytes + (1 << 16))
        sock.setsockopt(zmq.SNDHWM, 1000)
        sock.setsockopt(zmq.RCVHWM, 10000)
        for url in self.config.bind:
            try:
                sock.bind(url)
            except zmq.ZMQError as err:
                raise OSError(f"cannot listen on {url}: {err}") from None
            self.endpoints.append(sock.getsockopt_string(zmq.LAST_ENDPOINT))
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
        for session in list(self.sessions.values()):
            self._forget(session)
        self._sock.close(linger=0)
        self._ctx.term()
        for url in self.endpoints:
            if url.startswith("ipc://"):
                with contextlib.suppress(OSError):
                    os.unlink(url.removeprefix("ipc://"))

    # -- the loop ---------------------------------------------------------------

    def step(self) -> None:
        """One turn: take new work, run at most one batch, else spin or sleep."""
        got = self._drain_socket() + self._poll_shm()
        now = time.monotonic()
        batch = self.scheduler.pop_ready(now)
        if batch:
            self._run(batch, now)
            self._last_busy = time.monotonic()
            return
        if got:
            self._last_busy = now
            return
        if now >= self._next_housekeeping:
            self._housekeeping(now)
        wake = self.scheduler.next_wake(now)
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
        self._sock.poll(timeout_ms)
        self._wake(sessions)

    def _wake(self, sessions: list[Session]) -> None:
        for s in sessions:
            s.segment.ctrl[shm.SERVER_ASLEEP] = 0
        self._last_busy = time.monotonic()

    def _shm_sessions(self) -> list[Session]:
        return [s for s in self.sessions.values() if s.segment is not None]

    def _housekeeping(self, now: float) -> None:
        self._next_housekeeping = now + HOUSEKEEPING_S
        for session in list(self.sessions.values()):
            idle = now - max(session.last_seen, session.last_reply)
            if not session.waiting and idle > self.config.session_timeout_s:
                log.info("client %s idle for %.0f s: session closed", session.label, idle)
                self._forget(session)
            elif session.segment is not None and not _alive(session.pid):
                log.info("client %s (pid %d) has exited: session freed", session.label, session.pid)
                self._forget(session)

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
        key = frames[0].bytes
        call_id = 0
        try:
            if len(frames) < 2:
                raise Refused(Code.BAD_MESSAGE, "empty message")
            header = unpack(frames[1].buffer)
            call_id = header[1] if len(header) > 1 and type(header[1]) is int else 0
            self._dispatch(key, header, frames)
        except WireError as err:
            self.stats.errors += 1
            log.debug("malformed message from %r: %s", key, err)
            self._send_error(key, call_id, Code.BAD_MESSAGE, f"malformed message: {err}")
        except Refused as err:
            self.stats.errors += 1
            log.debug("refused a message from %r: %s", key, err)
            self._send_error(key, call_id, err.code, str(err))

    def _dispatch(self, key: bytes, header: list, frames: list) -> None:
        kind = header[0]
        if kind is Kind.HELLO:
            return self._hello(key, header, frames)
        if kind is Kind.STATS:
            return self._stats(key, header)
        session = self.sessions.get(key)
        if session is None:
            if kind in (Kind.BYE, Kind.RING):
                return None
            raise Refused(
                Code.NO_SESSION, "no session on this connection: send HELLO first (reconnect)"
            )
        session.last_seen = time.monotonic()
        if kind is Kind.CALL:
            return self._frame_call(session, header, frames)
        if kind is Kind.ATTACH:
            return self._attach(session, header)
        if kind is Kind.BYE:
            log.info("client %s left", session.label)
            return self._forget(session)
        if kind is Kind.RING:
            return None  # waking the loop was the point; the call is in shared memory
        raise Refused(Code.BAD_MESSAGE, f"a client does not send {kind.name}")

    def _hello(self, key: bytes, header: list, frames: list) -> None:
        info = _mapping(header, 2)
        peer = _peer(frames[1])
        self._check_token(info, peer)
        protocol = info.get("protocol")
        if protocol != PROTOCOL_VERSION:
            raise Refused(
                Code.REFUSED,
                f"client speaks protocol {protocol}, this executor {PROTOCOL_VERSION}: "
                "upgrade symbiont on the older side",
            )
        fingerprint = info.get("fingerprint")
        if fingerprint is not None and fingerprint != self.manifest.fingerprint:
            self.stats.refused += 1
            log.warning("refused client from %s: built from another checkpoint", peer)
            raise Refused(
                Code.REFUSED,
                f"this executor serves checkpoint fingerprint {self.manifest.fingerprint}, the "
                f"client was built from {fingerprint}: load the client from the checkpoint "
                "folder the executor was started with",
            )
        if key in self.sessions:
            self._forget(self.sessions[key])
        now = time.monotonic()
        session = Session(
            key=key,
            label=str(info.get("label") or key.hex()),
            pid=int(info.get("pid") or 0),
            host=str(info.get("host") or "?"),
            endpoint=peer,
            connected_at=now,
            last_seen=now,
        )
        self.sessions[key] = session
        self._update_spin()
        log.info("client %s connected (pid %d on %s)", session.label, session.pid, session.host)
        extra = {"max_call_bytes": self.config.max_call_bytes, "shm": self.config.allow_shm}
        self._send(key, pack(Kind.WELCOME, header[1], self._welcome, extra))

    def _check_token(self, info: dict, peer: str) -> None:
        expected = self.config.token
        if expected and not hmac.compare_digest(str(info.get("token") or ""), expected):
            self.stats.refused += 1
            log.warning("refused a connection from %s: missing or wrong token", peer)
            raise Refused(
                Code.REFUSED,
                "this executor requires a token: pass token=... to symbiont.connect "
                "(or set SYMBIONT_TOKEN) with the value serve-base was started with",
            )

    def _stats(self, key: bytes, header: list) -> None:
        self._check_token(_mapping(header, 2), "stats request")
        clients = [
            {
                "label": s.label,
                "pid": s.pid,
                "host": s.host,
                "transport": "shm" if s.segment is not None else "zmq",
                "calls": s.calls,
                "tokens": s.tokens,
                "connected_s": time.monotonic() - s.connected_at,
            }
            for s in self.sessions.values()
        ]
        policy = {k: str(v) for k, v in self.config.policy.__dict__.items()}
        self._send(key, pack(Kind.STATS_REPLY, header[1], self.stats.snapshot(clients, policy)))

    def _attach(self, session: Session, header: list) -> None:
        if not self.config.allow_shm:
            raise Refused(Code.REFUSED, "this executor does not accept shared memory")
        info = _mapping(header, 2)
        path, size = info.get("path"), info.get("size")
        if not isinstance(path, str) or type(size) is not int:
            raise WireError("ATTACH needs {path: str, size: int}")
        if size > 2 * self.config.max_call_bytes + shm.HEADER_BYTES:
            raise Refused(Code.TOO_LARGE, f"segment of {size} bytes exceeds max_call_bytes")
        try:
            segment = shm.Segment.attach(path, size)
        except (ValueError, OSError) as err:
            raise Refused(Code.REFUSED, str(err)) from None
        if session.segment is not None:
            session.segment.close()
        session.segment = segment
        session.seen_seq = segment.ctrl[shm.REQ_SEQ]
        self._update_spin()
        self._send(session.key, pack(Kind.OK, header[1]))

    def _frame_call(self, session: Session, header: list, frames: list) -> None:
        call_id, op, layer, rows, cols = expect_ints(header, 1, 5)
        op = self._check_call(op, layer, rows, header[6] if len(header) > 6 else None)
        width = self.widths[layer][op is Op.BACKWARD]
        if cols != width:
            raise Refused(Code.BAD_CALL, _shape_error(self.manifest, op, layer, [rows, cols]))
        nbytes = rows * cols * self.manifest.dtype.itemsize
        if len(frames) != 3 or len(frames[2]) != nbytes:
            got = len(frames[2]) if len(frames) == 3 else "no"
            raise Refused(
                Code.BAD_CALL, f"CALL declares {nbytes} bytes of tensor data, sent {got} bytes"
            )
        extra = self._check_extra(op, layer, rows, header[7] if len(header) > 7 else ())
        x = tensor_from(frames[2].buffer, self.manifest.dtype, rows, cols)
        self.scheduler.submit(Call(session, call_id, op, layer, x, time.monotonic(), extra=extra))

    def _check_extra(self, op: Op, layer: int, rows: int, extra) -> tuple[int, ...]:
        """Layers fused into a forward call: they take the same input as `layer`."""
        if not extra:
            return ()
        if not isinstance(extra, list | tuple) or not all(type(e) is int for e in extra):
            raise WireError("fused layers must be a list of layer ids")
        if op is not Op.FORWARD or len(extra) > shm.MAX_FUSED:
            raise Refused(Code.BAD_CALL, f"only forward calls fuse, at most {shm.MAX_FUSED} more")
        for other in extra:
            if not 0 <= other < len(self.widths) or self.widths[other][0] != self.widths[layer][0]:
                raise Refused(
                    Code.BAD_CALL,
                    f"layer {other} cannot be fused with layer {layer}: its "
                    "input width differs or it does not exist",
                )
        width = sum(self.widths[e][1] for e in (layer, *extra))
        if rows * width * self.manifest.dtype.itemsize > self.config.max_call_bytes:
            raise Refused(Code.TOO_LARGE, "fused call exceeds max_call_bytes; split it")
        return tuple(extra)

    def _check_call(self, op: int, layer: int, rows: int, dtype) -> Op:
        op = _OPS.get(op)
        if op is None:
            raise Refused(Code.BAD_CALL, "unknown op: 1 is forward, 2 is backward")
        if not 0 <= layer < len(self.widths):
            raise Refused(
                Code.BAD_CALL,
                f"unknown layer id {layer}: this executor serves layers 0..{len(self.widths) - 1}",
            )
        if dtype is not None and dtype != self.dtype_name:
            raise Refused(
                Code.BAD_CALL,
                f"layer {layer} runs in {self.dtype_name}, got {dtype}; "
                f"load the client with dtype={self.manifest.dtype}",
            )
        width = self.widths[layer][op is Op.BACKWARD]
        if rows < 0:
            raise Refused(Code.BAD_CALL, f"negative row count {rows}")
        if rows * width * self.manifest.dtype.itemsize > self.config.max_call_bytes:
            raise Refused(
                Code.TOO_LARGE,
                f"a call of {rows} tokens exceeds this executor's max_call_bytes "
                f"({self.config.max_call_bytes}); split it into smaller calls",
            )
        return op

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
        ctrl = segment.ctrl
        op, layer, rows, fused = ctrl[shm.OP], ctrl[shm.LAYER], ctrl[shm.ROWS], ctrl[shm.FUSED]
        try:
            op = self._check_call(op, layer, rows, None)
            if not 0 <= fused <= shm.MAX_FUSED:
                raise Refused(Code.BAD_CALL, f"at most {shm.MAX_FUSED} fused layers")
            extra = self._check_extra(op, layer, rows, list(ctrl[shm.EXTRA : shm.EXTRA + fused]))
            in_w, out_w = self.widths[layer] if op is Op.FORWARD else self.widths[layer][::-1]
            out_w += sum(self.widths[e][1] for e in extra)
            if rows * max(in_w, out_w) * self.manifest.dtype.itemsize > segment.capacity:
                raise Refused(Code.TOO_LARGE, "call larger than the shared-memory segment")
        except Refused as err:
            self.stats.errors += 1
            ctrl[shm.STATUS] = int(err.code)
            ctrl[shm.RESP_SEQ] = seq
            self._send_error(session.key, seq, err.code, str(err))
            return
        x = segment.input(self.manifest.dtype, rows, in_w)  # [rows, in_w], no copy
        now = time.monotonic()
        call = Call(session, seq, op, layer, x, now, via_shm=True, extra=extra)
        if len(self.sessions) == 1 and not self.scheduler:
            session.waiting = True
            self._run([call], now)  # alone: nothing to batch with, skip the queues
        else:
            self.scheduler.submit(call)

    # -- running a batch ----------------------------------------------------------

    def _run(self, calls: list[Call], now: float) -> None:
        """Run one layer for `calls`: one matmul per direction over all their tokens."""
        first = calls[0]
        started = time.monotonic()
        if len(calls) == 1:
            tokens = self._run_group(first.op, first.layer, calls)
        else:
            tokens = 0
            for op in (Op.FORWARD, Op.BACKWARD):
                group = [c for c in calls if c.op is op]
                if group:
                    tokens += self._run_group(op, first.layer, group)
        waited = sum(started - c.arrived for c in calls)
        self.stats.record(first.layer, len(calls), tokens, waited, started)

    def _run_group(self, op: Op, layer: int, calls: list[Call]) -> int:
        """One matmul over the concatenated tokens of `calls`, then one per fused layer."""
        outs = self._batched(op, layer, calls)
        if outs is None:
            return 0
        if len(calls) == 1 and not calls[0].extra:
            self._reply(calls[0], outs)
            return calls[0].tokens
        answers = {id(c): [y] for c, y in zip(calls, outs, strict=True)}
        for other in sorted({e for c in calls for e in c.extra}):
            group = [c for c in calls if other in c.extra]
            outs = self._batched(op, other, group)
            if outs is None:
                continue  # those calls were failed; the others still get their answers
            for call, y in zip(group, outs, strict=True):
                answers[id(call)].append(y)
        for call in calls:
            if call.session.waiting:  # not failed on the way
                self._reply(call, answers[id(call)])
        return sum(c.tokens for c in calls)

    def _batched(self, op: Op, layer: int, calls: list[Call]) -> list[torch.Tensor] | None:
        """y of each call [n_i, out] from one matmul over x of all [sum n_i, in]."""
        x = calls[0].x if len(calls) == 1 else torch.cat([c.x for c in calls])
        try:
            if self._on_cpu:
                y = self.executor.run(op, layer, x)
            else:
                y = self.executor.run(op, layer, x.to(self.executor.device)).cpu()
        except (RuntimeError, ValueError) as err:  # e.g. out of memory: fail these calls only
            log.exception("layer %d %s failed", layer, op.name.lower())
            for call in calls:
                self._fail(call, Code.INTERNAL, f"executor failed running layer {layer}: {err}")
            return None
        return [y] if len(calls) == 1 else list(y.split([c.tokens for c in calls]))

    def _reply(self, call: Call, ys: list[torch.Tensor]) -> None:
        """Answer one call with its outputs, each [n_tokens, out_l], back to back."""
        session = call.session
        session.waiting = False
        session.last_reply = time.monotonic()
        session.calls += 1
        session.tokens += call.tokens
        rows = call.tokens
        if not call.via_shm:
            cols = sum(y.shape[1] for y in ys)
            data = tensor_bytes(ys[0] if len(ys) == 1 else torch.cat([y.reshape(-1) for y in ys]))
            header = pack(Kind.RESULT, call.call_id, rows, cols)
            self._sock.send_multipart([session.key, header, data], copy=False)
            return
        segment = session.segment
        if segment is None:
            return  # the client left while its call ran
        offset = 0
        for y in ys:
            segment.output_at(offset, y.dtype, rows, y.shape[1]).copy_(y)
            offset += y.numel()
        ctrl = segment.ctrl
        ctrl[shm.OUT_ROWS] = rows
        ctrl[shm.STATUS] = 0
        ctrl[shm.RESP_SEQ] = call.call_id
        if ctrl[shm.CLIENT_ASLEEP] or not shm.SPIN_SAFE:
            self._send(session.key, pack(Kind.RING, call.call_id))

    def _fail(self, call: Call, code: Code, message: str) -> None:
        session = call.session
        session.waiting = False
        session.last_reply = time.monotonic()
        if call.via_shm and session.segment is not None:
            session.segment.ctrl[shm.STATUS] = int(code)
            session.segment.ctrl[shm.RESP_SEQ] = call.call_id
        self._send_error(session.key, call.call_id, code, message)

    # -- helpers ------------------------------------------------------------------

    def _send(self, key: bytes, header: bytes) -> None:
        self._sock.send_multipart([key, header])

    def _send_error(self, key: bytes, call_id: int, code: Code, message: str) -> None:
        self._send(key, pack(Kind.ERROR, call_id, int(code), message))

    def _forget(self, session: Session) -> None:
        self.sessions.pop(session.key, None)
        self.scheduler.drop_session(session)
        if session.segment is not None:
            session.segment.close()
            session.segment = None
        self._update_spin()

    def _update_spin(self) -> None:
        """Spin only while the executor and each client can have a core (same host or not:
        a remote client's calls still find the loop awake)."""
        self._spin_ok = self._spin_s > 0 and len(self.sessions) + 1 <= self._cores
        for s in self._shm_sessions():
            s.segment.ctrl[shm.SPIN_OK] = int(self._spin_ok)


def _mapping(header: list, index: int) -> dict:
    value = header[index] if len(header) > index else None
    if not isinstance(value, dict):
        raise WireError(f"{header[0].name} needs a map at position {index}")
    return value


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
    return True


def _shape_error(manifest, op: Op, layer: int, shape: list) -> str:
    spec = manifest.layers[layer]
    width = spec.in_features if op is Op.FORWARD else spec.out_features
    return f"layer {layer} ({spec.name}) {op.name.lower()} expects [n_tokens, {width}], got {shape}"
