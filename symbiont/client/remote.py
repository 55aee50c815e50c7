"""The client side of the executor service: an `Executor` that calls a remote base.

`connect(url)` returns a `RemoteExecutor`; `load_client(path, executor)` uses it exactly
like the in-process executor. Tensors travel either as raw ZeroMQ frames (any host) or,
when client and executor share a host, through a shared-memory segment the client
allocates at connect time and grows on demand, so a layer call moves no tensor bytes
through the socket.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from symbiont.client.fusion import Fusion
from symbiont.protocol import gpu_areas, shm
from symbiont.protocol.executor import (
    PROTOCOL_VERSION,
    Executor,
    ExecutorError,
    ExecutorUnavailable,
    Manifest,
    Op,
    check_call,
)
from symbiont.protocol.experts import (
    REPLY_NAMES,
    check_experts_call,
    reply_layout,
    request_layout,
)
from symbiont.protocol.urls import check_url, is_loopback
from symbiont.protocol.wire import (
    DTYPE_NAMES,
    MAX_FRAME_BYTES,
    Attach,
    Bye,
    Call,
    Code,
    Data,
    Error,
    Hello,
    ProtocolError,
    Result,
    Ring,
    Stats,
    StatsReply,
    decode,
    encode,
    tensor_bytes,
    tensor_from,
)

log = logging.getLogger("symbiont.client")


class Mode(StrEnum):
    AUTO = "auto"  # shared memory when the executor is on this host, frames otherwise
    FRAMES = "zmq"  # tensors as ZeroMQ frames (works across hosts)
    SHM = "shm"  # shared memory, or fail


@dataclass(frozen=True)
class ClientConfig:
    """How a client reaches the executor.

    timeout_s: longest wait for one call's answer before the connection is re-made and
    the call resent (calls are stateless, so resending is safe); after `retries` such
    attempts the call raises ExecutorUnavailable. spin_us: how long the client polls
    shared memory for the answer before it sleeps on the socket (only while the executor
    says every same-host client can have a core; a 64-token call of a 100M model's layer
    takes 1-10 ms, and a wake-up through the socket about 0.1-0.2 ms). executor_spin
    False: ask the executor (ATTACH) not to spin between calls while this client's segment
    is attached, where the client's cores are taken (beside two serve-bases on its host).
    """

    mode: Mode = Mode.AUTO
    token: str | None = None
    fingerprint: str | None = None  # refuse an executor serving another checkpoint
    label: str | None = None  # shown by `symbiont stats`
    timeout_s: float = 60.0
    connect_timeout_s: float = 10.0
    retries: int = 2
    spin_us: float = 10000.0
    executor_spin: bool = True
    shm_tokens: int = 64  # initial shared-memory capacity, in tokens of the widest layer
    fuse: bool = True  # one round trip for forward calls sharing an input (q/k/v, gate/up)
    # Where the client computes: on the executor's GPU, calls' tensors stay on it (the
    # segment's areas are there, shared by CUDA IPC) instead of crossing to the host.
    device: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "mode", Mode(self.mode))
        if self.device is not None:
            try:
                torch.device(self.device)
            except (RuntimeError, TypeError) as err:
                raise ValueError(f"device {self.device!r} is not a device name: {err}") from None
        if self.timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ValueError("timeouts must be positive (seconds)")
        if self.retries < 0 or self.shm_tokens < 1:
            raise ValueError("retries must be >= 0 and shm_tokens >= 1")


def connect(url: str, *, checkpoint=None, **options) -> RemoteExecutor:
    """An Executor served by `symbiont serve-base` at `url` (tcp://HOST:PORT or ipc:///path).

    checkpoint: a checkpoint folder; the handshake then refuses an executor built from
    another base. Other options are `ClientConfig` fields (mode, token, timeout_s, ...);
    the token defaults to $SYMBIONT_TOKEN.
    """
    check_url(url)
    if checkpoint is not None:
        from symbiont.model.checkpoint import Checkpoint

        options.setdefault("fingerprint", Checkpoint.open(checkpoint).fingerprint)
    options.setdefault("token", os.environ.get("SYMBIONT_TOKEN"))
    return RemoteExecutor(url, ClientConfig(**options))


def stats_of(url: str, *, token: str | None = None, timeout_s: float = 10.0) -> dict:
    """The live statistics of the executor at `url` (what `symbiont stats URL` prints),
    asked without opening a session: a full executor (--max-sessions) still answers,
    and the question shows in no client list."""
    check_url(url)
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(url)
        sock.send(encode(Stats(call_id=1, token=token)))
        if not sock.poll(int(timeout_s * 1000)):
            raise ExecutorUnavailable(
                f"no base executor answered at {url} within {timeout_s:g} s: none runs there, "
                "or it is stuck (start one with `symbiont serve-base`, or check the URL)"
            )
        reply = decode(sock.recv_multipart()[0])
    finally:
        sock.close(linger=0)
        context.term()
    if type(reply) is Error:
        raise ExecutorError(f"base executor at {url}: {reply.message}")
    if type(reply) is not StatsReply:
        raise ExecutorError(f"base executor at {url} answered {type(reply).__name__}, not stats")
    return reply.stats


_mps_hinted = False


def _hint_mps_once() -> None:
    """Warn, once per process, that a client on the executor's GPU runs without MPS."""
    global _mps_hinted
    if not _mps_hinted and not gpu_areas.mps_running():
        _mps_hinted = True
        log.warning("this client computes on the executor's GPU: %s", gpu_areas.MPS_HINT)


class _Lost(Exception):
    """No answer: re-make the connection and resend. The text says what happened."""


TIMED_OUT = "timed out"
SESSION_EXPIRED = "session expired"  # the executor ended an idle session: not a failure
DROPPED = "dropped"
BYE_LINGER_MS = 200  # how long closing a connection waits for its BYE to leave


class RemoteExecutor(Executor):
    """An Executor whose layers run in a `serve-base` process. Thread-safe (one call at a time)."""

    def __init__(self, url: str, config: ClientConfig):
        self.url = url
        self.config = config
        self._lock = threading.Lock()
        self._ctx = zmq.Context()
        self._sock = None
        self._segment: shm.Segment | None = None
        self._manifest: Manifest | None = None
        self._bye_sent = False
        self._next_id = 0
        self._seq = 0
        self._spin_s = config.spin_us * 1e-6 if shm.SPIN_SAFE else 0.0
        self._fusion = Fusion() if config.fuse else None
        self._open()

    @property
    def manifest(self) -> Manifest:
        return self._manifest

    @property
    def transport(self) -> str:
        """'shm' when calls go through shared memory, 'cuda-ipc' when its areas are on
        the GPU that client and executor share, else 'zmq'."""
        if self._segment is None:
            return "zmq"
        return "shm" if self._segment.gpu_area is None else "cuda-ipc"

    def call(self, op: Op, layer: int, x: torch.Tensor) -> torch.Tensor:
        check_call(self._manifest, op, layer, x)
        with self._lock:
            extra = ()
            if op is Op.FORWARD and self._fusion is not None:
                ready = self._fusion.take(layer, x)
                if ready is not None:
                    return ready.to(x.device)
                extra = self._within_call_limit(layer, x, self._fusion.plan(layer, x))

            def one_call() -> torch.Tensor:
                outputs = self._call(op, layer, x, extra)
                if extra:
                    self._fusion.keep(x, extra, outputs[1:])
                return outputs[0].to(x.device)

            return self._retrying(one_call)

    def call_experts(self, op, experts, hidden, ids, weights, grad_y=None):
        check_experts_call(self._manifest, op, experts, hidden, ids, weights, grad_y)
        tensors = {"hidden": hidden, "ids": ids, "weights": weights}
        if grad_y is not None:
            tensors["grad_y"] = grad_y
        with self._lock:

            def one_call() -> tuple:
                outputs = self._call_experts(op, experts, tensors)
                return tuple(t.to(hidden.device) for t in outputs)

            return self._retrying(one_call)

    def _retrying(self, one_call):
        """one_call(), on a new connection each time no answer comes, `retries` times. A
        session the executor ended while we were idle is re-made once without spending
        a retry (it is routine, not a failure), and no reconnect follows the last try."""
        what, renewed, attempt = [], False, 0
        while True:
            try:
                return one_call()
            except _Lost as lost:
                reason = str(lost) or TIMED_OUT
                if reason == SESSION_EXPIRED and not renewed:
                    renewed = True
                    log.info(
                        "session with %s ended (it expired while idle, or the executor "
                        "restarted): opening a new one",
                        self.url,
                    )
                    self._reopen()
                    continue
                what.append(reason)
                if attempt >= self.config.retries:
                    raise ExecutorUnavailable(self._lost_message(what)) from None
                attempt += 1
                log.warning(
                    "no answer from %s (attempt %d, %s): reconnecting", self.url, attempt, reason
                )
                self._reopen()

    def _within_call_limit(self, layer: int, x: torch.Tensor, extra: tuple) -> tuple:
        """The fused layers, or none where their outputs together would exceed the
        executor's max_call_bytes: a call that fits alone must not be refused for the
        siblings fusion added to it (every later step would fail the same way)."""
        if not extra:
            return extra
        layers = self._manifest.layers
        widths = layers[layer].out_features + sum(layers[e].out_features for e in extra)
        need = x.shape[0] * max(layers[layer].in_features, widths) * x.element_size()
        return extra if need <= self._max_call_bytes else ()

    def _lost_message(self, what: list[str]) -> str:
        """Why calls stopped: the executor went away (the connection dropped, nobody
        answers a reconnect) or it is alive but slower than timeout_s."""
        url, cfg = self.url, self.config
        if TIMED_OUT not in what:
            return (
                f"lost the base executor at {url}: no answer from the base executor on "
                f"{len(what)} tries, each after the first on a new connection ({', '.join(what)}"
                f"; a reconnect waits connect_timeout_s={cfg.connect_timeout_s:g} s). It has "
                "exited or restarts: start `symbiont serve-base` at that URL again and retry "
                "(the executor keeps nothing of its clients between calls)"
            )
        return (
            f"no answer from the base executor at {url}: {what.count(TIMED_OUT)} of "
            f"{len(what)} attempts each waited timeout_s={cfg.timeout_s:g} s ({', '.join(what)})."
            f" It is running but stuck or overloaded: check `symbiont stats {url}`, or raise "
            "timeout_s"
        )

    def stats(self) -> dict:
        """The executor's live statistics (what `symbiont stats URL` prints)."""
        with self._lock:
            call_id = self._send(Stats(call_id=self._new_id(), token=self.config.token))
            return self._await(call_id, self.config.connect_timeout_s).stats

    def close(self) -> None:
        with self._lock:
            self._say_bye()
            self._drop()
            if not self._ctx.closed:
                self._ctx.term()

    def __del__(self):
        if getattr(self, "_sock", None) is None:
            return
        # Not contextlib.suppress: at interpreter exit, modules' globals may already be
        # None (contextlib, zmq), and a finalizer must print nothing.
        try:  # noqa: SIM105 - a client dropped without close() frees its session too
            self._say_bye()
        except Exception:  # noqa: BLE001
            pass
        try:  # noqa: SIM105
            self._drop()
        except Exception:  # noqa: BLE001
            pass

    # -- connection --------------------------------------------------------------

    def _open(self) -> None:
        where = self.url.removeprefix("ipc://")
        if self._manifest is None and self.url.startswith("ipc://") and not os.path.exists(where):
            # at first connect (a restart may remove it for a moment): at once, not after
            # connect_timeout_s of waiting on a socket nobody can create
            raise ExecutorUnavailable(
                f"no base executor at {self.url}: {where} does not exist; start one with "
                f"`symbiont serve-base --model DIR --bind {self.url}` or check the URL"
            )
        try:
            self._handshake()
        except ExecutorError:
            self._drop()
            raise
        except _Lost:
            self._drop()
            raise ExecutorUnavailable(
                f"no base executor answered at {self.url} within "
                f"{self.config.connect_timeout_s:g} s; start one with `symbiont serve-base "
                f"--model DIR --bind {self.url}` or check the URL"
            ) from None
        if self.config.mode is not Mode.FRAMES:
            self._attach_shm()

    def _reopen(self) -> None:
        # A new connection is a new session: free the old one now, else it (and its
        # segment) stays on the executor until its idle timeout.
        self._say_bye()
        self._drop()
        try:
            self._open()
        except ExecutorUnavailable as err:
            log.warning("%s", err)

    def _say_bye(self) -> None:
        """Tell the executor this session ends (best effort: it may be gone)."""
        if self._sock is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.send(encode(Bye(call_id=0)), zmq.NOBLOCK)
            self._bye_sent = True

    def _drop(self) -> None:
        if self._fusion is not None:
            self._fusion.forget()
        if self._sock is not None:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
            # A BYE just sent gets a moment to leave; a dead executor costs that moment.
            self._sock.close(linger=BYE_LINGER_MS if self._bye_sent else 0)
            self._bye_sent = False
            self._sock = None
        if self._segment is not None:
            self._segment.close()
            self._segment = None

    def _handshake(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        self._monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(self.url)
        self._sock = sock
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        host = socket.gethostname()[:255]
        hello = Hello(
            call_id=self._new_id(),
            protocol=PROTOCOL_VERSION,
            token=self.config.token,
            fingerprint=self.config.fingerprint,
            pid=os.getpid(),
            host=host,
            label=(self.config.label or f"{host}:{os.getpid()}")[:256],
        )
        welcome = self._await(self._send(hello), self.config.connect_timeout_s)
        manifest = Manifest.from_dict(welcome.manifest)
        if self._manifest is not None and manifest != self._manifest:
            raise ExecutorError(
                f"the executor at {self.url} now serves another base than at connect time; "
                "reload the client"
            )
        self._manifest = manifest
        self._widest = max(max(s.in_features, s.out_features) for s in manifest.layers)
        self._server_shm = welcome.shm
        self._max_call_bytes = welcome.max_call_bytes
        self.instance = welcome.instance  # the serve-base process behind this URL

    def _attach_shm(self, capacity: int | None = None) -> None:
        """Ask for a segment of `capacity` bytes per area (default: `shm_tokens` tokens of
        the widest layer), at most the executor's max_call_bytes, and map it."""
        if not (is_loopback(self.url) and self._server_shm):
            if self.config.mode is Mode.SHM:
                raise ExecutorError(
                    f"shared memory needs the executor on this host and allowing it; "
                    f"{self.url} does not: connect with mode='zmq'"
                )
            return
        default = self.config.shm_tokens * self._widest * self._manifest.dtype.itemsize
        capacity = min(max(capacity or 0, default), self._max_call_bytes)
        gpu = gpu_areas.uuid_of(self.config.device) if self.config.device else None
        try:
            try:
                segment = self._attach(capacity, gpu)
            except (ExecutorError, ValueError) as err:
                if gpu is None:
                    raise
                # An executor that predates GPU areas refuses the field; one whose areas
                # we cannot map has given us a segment we drop. Host areas then.
                log.info("no GPU areas from %s (%s): asking for host areas", self.url, err)
                segment = self._attach(capacity, None)
        except (ExecutorError, ValueError) as err:
            if self.config.mode is Mode.SHM:
                raise ExecutorError(f"shared memory with {self.url}: {err}") from None
            log.info("shared memory refused (%s): tensors go through the socket", err)
            return
        if self._segment is not None:
            self._segment.close()
        segment.open_pipes()
        self._segment = segment
        self._seq = segment.ctrl[shm.RESP_SEQ]

    def _attach(self, capacity: int, gpu: str | None) -> shm.Segment:
        """ATTACH and map the segment the executor made: areas on our GPU `gpu` (its
        UUID) if it computes there, else in the host segment."""
        attach = Attach(
            call_id=self._new_id(),
            capacity=capacity,
            gpu=gpu,
            spin=self.config.executor_spin,
            events=gpu is not None and gpu_areas.events_enabled(),
        )
        ok = self._await(self._send(attach), self.config.connect_timeout_s)
        areas = None
        if ok.gpu_areas is not None:
            index = gpu_areas.index_of(gpu) if gpu is not None else None
            if index is None:
                raise ValueError("the executor put the areas on a GPU this client lacks")
            areas = (index, ok.gpu_areas)
            _hint_mps_once()
        event = ok.gpu_event if areas is not None else None
        return shm.Segment.open(ok.segment or "", capacity, gpu=areas, event=event)

    # -- calls -------------------------------------------------------------------

    def _call(self, op: Op, layer: int, x: torch.Tensor, extra: tuple[int, ...]) -> list:
        """Outputs of `layer` and of each fused layer in `extra` (forward only), each
        [rows, out_l]. x [rows, in_w]."""
        if self._sock is None:
            raise _Lost("not connected")
        layers = self._manifest.layers
        spec = layers[layer]
        in_w, out_w = (
            (spec.in_features, spec.out_features)
            if op is Op.FORWARD
            else (spec.out_features, spec.in_features)
        )
        out_ws = [out_w, *(layers[e].out_features for e in extra)]
        if self._fits_shm(x.shape[0] * max(in_w, sum(out_ws)) * x.element_size()):
            return self._call_shm(op, layer, x, extra, in_w, out_ws)
        return self._call_frames(op, layer, x, extra, in_w, out_ws)

    def _fits_shm(self, need: int) -> bool:
        """Whether a call whose input and outputs each take at most `need` bytes goes
        through shared memory (growing the segment if it must). Else it goes as frames:
        no segment, one the executor refused to grow, or a call over max_call_bytes, which
        the executor then refuses with its own message."""
        if self._segment is None or need > self._max_call_bytes:
            return False
        if need > self._segment.capacity:
            self._grow(need)
        return self._segment is not None and need <= self._segment.capacity

    def _call_experts(self, op: Op, experts: int, tensors: dict) -> tuple:
        """(y,) or (grad_hidden, grad_weights) of one experts call (see protocol.experts)."""
        if self._sock is None:
            raise _Lost("not connected")
        hidden, weights = tensors["hidden"], tensors["weights"]
        (rows, width), top_k = hidden.shape, tensors["ids"].shape[1]
        args = (op, rows, top_k, width, hidden.dtype, weights.dtype)
        request, reply = request_layout(*args), reply_layout(*args)
        call = Call(
            self._new_id(), op, experts, rows, width, DTYPE_NAMES[hidden.dtype], (), top_k,
            DTYPE_NAMES[weights.dtype],
        )  # fmt: skip
        on_gpu = self._segment is not None and self._segment.gpu_area is not None
        if not on_gpu and self._fits_shm(max(request.nbytes, reply.nbytes)):
            return self._experts_shm(call, tensors, request, reply)
        self._send_call(call, memoryview(request.pack(tensors).numpy()), copy=False)
        result, data = self._await(call.call_id, self.config.timeout_s, frames=True)
        if result.rows != rows or len(data) != reply.nbytes:
            raise ExecutorError(f"the executor answered {len(data)} bytes for experts: a bug")
        raw = torch.empty(reply.nbytes, dtype=torch.uint8)
        raw.numpy()[:] = np.frombuffer(data, dtype=np.uint8)
        views = reply.views(raw)
        return tuple(views[name] for name in REPLY_NAMES[op])

    def _experts_shm(self, call: Call, tensors: dict, request, reply) -> tuple:
        segment = self._segment
        ctrl = segment.ctrl
        if ctrl[shm.CLOSED]:
            raise _Lost(SESSION_EXPIRED)  # the executor freed it: reconnect
        request.write(segment.input_area(), tensors)
        ctrl[shm.OP] = int(call.op)
        ctrl[shm.LAYER] = call.layer
        ctrl[shm.ROWS] = call.rows
        ctrl[shm.FUSED] = 0
        ctrl[shm.TOP_K] = call.top_k
        ctrl[shm.WEIGHTS_DTYPE] = shm.WIRE_DTYPES.index(tensors["weights"].dtype)
        self._post_shm(segment)
        views = reply.views(segment.output_area())
        return tuple(views[name].clone() for name in REPLY_NAMES[call.op])

    def _grow(self, need: int) -> None:
        """A segment of at least `need` bytes per area: room for the next power of two of
        tokens of the widest layer, within max_call_bytes."""
        unit = self._widest * self._manifest.dtype.itemsize
        tokens = 1 << max(need // unit, 1).bit_length()
        self._attach_shm(max(need, min(tokens * unit, self._max_call_bytes)))

    def _call_frames(self, op, layer, x, extra, in_w, out_ws) -> list:
        """x [rows, in_w] as a frame -> outputs [rows, out_w] back to back in one frame."""
        rows = x.shape[0]
        call = Call(self._new_id(), op, layer, rows, in_w, DTYPE_NAMES[x.dtype], extra)
        self._send_call(call, tensor_bytes(x), copy=rows * in_w < 8192)
        result, data = self._await(call.call_id, self.config.timeout_s, frames=True)
        if (
            result.rows != rows
            or result.cols != sum(out_ws)
            or len(data) != rows * result.cols * x.element_size()
        ):
            raise ExecutorError(f"the executor answered [{result.rows}, {result.cols}]: a bug")
        dtype = self._manifest.dtype
        if len(out_ws) == 1:
            return [tensor_from(data, dtype, rows, out_ws[0])]
        outputs, start, view = [], 0, memoryview(data)
        for width in out_ws:
            size = rows * width * dtype.itemsize
            outputs.append(tensor_from(view[start : start + size], dtype, rows, width))
            start += size
        return outputs

    def _send_call(self, call: Call, data: memoryview, copy: bool) -> None:
        """A CALL with its tensor bytes: one frame, or DATA parts over MAX_FRAME_BYTES."""
        if len(data) <= MAX_FRAME_BYTES:
            self._sock.send_multipart([encode(call), data], copy=copy)
        else:  # the executor reads no frame over MAX_FRAME_BYTES: send x in parts
            self._sock.send(encode(call))
            for offset in range(0, len(data), MAX_FRAME_BYTES):
                part = data[offset : offset + MAX_FRAME_BYTES]
                self._sock.send_multipart([encode(Data(call.call_id, offset)), part], copy=False)

    def _call_shm(self, op, layer, x, extra, in_w, out_ws) -> list:
        """x [rows, in_w] into shared memory -> outputs [rows, out_w] out of it (copied)."""
        segment = self._segment
        ctrl = segment.ctrl
        rows = x.shape[0]
        if ctrl[shm.CLOSED]:
            raise _Lost(SESSION_EXPIRED)  # the executor freed it: reconnect
        segment.inputs_writable()  # GPU areas: after the executor's reads of the last x
        segment.input(x.dtype, rows, in_w).copy_(x)
        segment.settle()  # GPU areas: x is there before the executor sees REQ_SEQ
        ctrl[shm.OP] = int(op)
        ctrl[shm.LAYER] = layer
        ctrl[shm.ROWS] = rows
        ctrl[shm.FUSED] = len(extra)
        for i, other in enumerate(extra):
            ctrl[shm.EXTRA + i] = other
        self._post_shm(segment, rows * in_w * sum(out_ws))
        segment.outputs_ready()  # GPU areas: our copies out queue after the executor's in
        outputs, offset = [], 0
        try:
            for width in out_ws:
                outputs.append(segment.output_at(offset, x.dtype, rows, width).clone())
                offset += rows * width
        finally:
            # GPU areas: the copies out are done before the executor may overwrite the
            # area, whichever stream the next call comes from
            segment.outputs_read()
        return outputs

    def _post_shm(self, segment: shm.Segment, macs: int = 0) -> None:
        """Post the call written in the segment and wait for its answer (raises its ERROR).
        macs: the call's multiply-adds, which tell whether spinning on it pays."""
        ctrl = segment.ctrl
        self._seq += 1
        seq = self._seq
        ctrl[shm.REQ_SEQ] = seq
        if (ctrl[shm.SERVER_ASLEEP] or not shm.SPIN_SAFE) and not segment.ring():
            self._sock.send(encode(Ring(seq=seq)))
        error = self._wait_shm(segment, seq, macs)
        if ctrl[shm.STATUS]:
            if error:
                self._raise(error)
            self._await(seq, self.config.timeout_s)  # raises with the executor's message

    def _wait_shm(self, segment: shm.Segment, seq: int, macs: int) -> Error | None:
        """Spin on the answer's sequence number, then sleep until the executor wakes us.
        Returns the executor's ERROR if one arrived for this call."""
        ctrl = segment.ctrl
        below = ctrl[shm.SPIN_BELOW]  # 0 from executors that never split a call
        spin = self._spin_s if ctrl[shm.SPIN_OK] and (not below or macs < below) else 0.0
        spin_until = time.perf_counter() + spin
        while ctrl[shm.RESP_SEQ] != seq:
            if time.perf_counter() > spin_until:
                break
        else:
            return None
        if segment.sleep(0):  # there is a bell (and stale bytes in it are read)
            return self._sleep_on_bell(segment, seq)
        ctrl[shm.CLIENT_ASLEEP] = shm.RING
        deadline = time.monotonic() + self.config.timeout_s
        error = None
        try:
            while ctrl[shm.RESP_SEQ] != seq:
                message = self._next_message(min(deadline - time.monotonic(), 0.02))
                if type(message) is Error and message.call_id == seq:
                    error = message
                if time.monotonic() > deadline:
                    raise _Lost(TIMED_OUT)
        finally:
            ctrl[shm.CLIENT_ASLEEP] = 0
        return error

    def _sleep_on_bell(self, segment: shm.Segment, seq: int) -> None:
        """Sleep on our bell, which the executor rings when it answers; every 20 ms, also
        see whether the connection dropped or the call timed out. An ERROR stays queued
        on the socket for `_post_shm` to read."""
        ctrl = segment.ctrl
        ctrl[shm.CLIENT_ASLEEP] = shm.BELL
        deadline = time.monotonic() + self.config.timeout_s
        try:
            while ctrl[shm.RESP_SEQ] != seq:
                rung = segment.sleep(0.02)
                if ctrl[shm.RESP_SEQ] == seq:
                    break
                if ctrl[shm.CLOSED]:
                    raise _Lost(SESSION_EXPIRED)
                if not rung:  # the executor closed the bell: it is gone
                    raise _Lost(DROPPED)
                if self._monitor.poll(0) and self._dropped():
                    raise _Lost(DROPPED)
                if time.monotonic() > deadline:
                    raise _Lost(TIMED_OUT)
        finally:
            ctrl[shm.CLIENT_ASLEEP] = 0
        return None

    def _dropped(self) -> bool:
        """Whether the monitor socket reports that the connection dropped."""
        return recv_monitor_message(self._monitor)["event"] == zmq.EVENT_DISCONNECTED

    # -- messages ----------------------------------------------------------------

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _send(self, message) -> int:
        self._sock.send(encode(message))
        return message.call_id

    def _await(self, call_id: int, timeout_s: float, frames: bool = False):
        """The reply to `call_id` (stale replies are skipped); ERROR raises ExecutorError."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Lost(TIMED_OUT)
            message = self._next_message(left, whole=True)
            if message is None:
                continue
            header = message[0]
            if getattr(header, "call_id", None) != call_id:
                continue  # a RING, or the answer to a call given up on
            if type(header) is Error:
                self._raise(header)
            if frames and (type(header) is not Result or len(message) != 2):
                continue
            return (header, message[1]) if frames else header

    def _next_message(self, timeout_s: float, whole: bool = False):
        """The next message's header (or [header, *frames] if `whole`) within `timeout_s`,
        or None; raises _Lost at once when the connection to the executor drops."""
        events = dict(self._poller.poll(max(0, int(timeout_s * 1e3)) + 1))
        if self._monitor in events and self._dropped():
            raise _Lost(DROPPED)
        if self._sock not in events:
            return None
        message = self._sock.recv_multipart()
        try:
            header = decode(message[0])
        except ProtocolError as err:
            if err.legacy:  # an executor of protocol 1 answered: say which side to upgrade
                raise ExecutorError(f"base executor at {self.url}: {err}") from None
            log.warning("ignored a malformed message from %s: %s", self.url, err)
            return None
        return [header, *message[1:]] if whole else header

    def _raise(self, error: Error) -> None:
        if error.code is Code.NO_SESSION:
            raise _Lost(SESSION_EXPIRED)  # the executor restarted or expired us: resend
        raise ExecutorError(f"base executor at {self.url}: {error.message}")
