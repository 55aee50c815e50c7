"""The channel between the engine's process and the API process (`symbiont serve`,
unless `--no-api-process`).

By default, the OpenAI-compatible endpoints are answered by a second process
(`symbiont.serve.http.front`) so that the per-token work of streaming (JSON, SSE framing,
one socket write per client) runs on another core, under another GIL, instead of taking
the engine thread's GIL between its tensor operations (BENCHMARKS.md, issue 17). The two
processes talk over two unix sockets in a private folder (mode 0700):

- `api.sock`: the engine process's own HTTP app. The API process forwards every request
  but completions there unchanged (authentication, tenants, body limits, validation all
  stay in one place).
- `relay.sock`: completions and their outputs. The API process sends each completion
  request (method, path, headers, body) as a frame with `RELAY_HEADER` added, naming the
  request id it chose; the engine's process runs it through the same app (as an ASGI
  call, without HTTP parsing on either side), which queues it and answers with how to
  show the outputs (`SPEC_HEADER`) or with its error. The engine thread then writes each
  iteration's outputs for relayed requests as one frame, straight from its own thread (no
  event loop wake-up in the engine's process). The API process writes back which
  requests it is done with (finished, or its client left) and how each ended, for the
  metrics.

Frames are a 4-byte big-endian length and a msgpack body: plain lists, numbers and
strings, never pickles.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import socket
import struct
import threading
from collections.abc import Callable

import msgpack

from symbiont.decoding import FinishReason, TokenLogprob
from symbiont.serve.http.render import TokenNames, token_names
from symbiont.serve.sequence import RequestOutput, SeqDelta

log = logging.getLogger(__name__)

RELAY_HEADER = "x-symbiont-relay"  # the request id the API process chose
SPEC_HEADER = "x-symbiont-relay-spec"  # on the engine process's answer: a RelaySpec
RELAY_ID = re.compile(r"^(cmpl|chatcmpl)-[0-9a-f]{32}$")
_LENGTH = struct.Struct(">I")
MAX_FRAME = 256 * 1024 * 1024  # a frame this big is a broken peer, not an iteration


def frame_limit(max_request_bytes: int) -> int:
    """The largest frame either process takes: a request's body (at most
    --max-request-bytes) with its headers, or the answer to it (its prompts as token ids
    and text, for `echo`), with room to spare."""
    return max(MAX_FRAME, 8 * max_request_bytes + (32 << 20))


class FrameTooLarge(ValueError):
    """One request's frame is over `frame_limit`: that request fails, the relay goes on."""


# -- encoding ---------------------------------------------------------------------------


def _logprob(entry: TokenLogprob | None) -> list | None:
    if entry is None:
        return None
    return [entry.token_id, entry.logprob, entry.rank, [list(t) for t in entry.top]]


def _unlogprob(raw) -> TokenLogprob | None:
    if raw is None:
        return None
    token_id, logprob, rank, top = raw
    return TokenLogprob(token_id, logprob, rank, tuple((t, v) for t, v in top))


def logprob_ids(outputs: list[RequestOutput]) -> list[int]:
    """The tokens whose strings showing these outputs' log-probabilities takes."""
    ids = []
    for output in outputs:
        entries = [e for d in output.deltas for e in d.logprobs or ()]
        entries += [e for e in output.prompt_logprobs or () if e is not None]
        for entry in entries:
            ids.append(entry.token_id)
            ids.extend(t for t, _ in entry.top)
    return ids


def encode_outputs(outputs: list[RequestOutput], names: list | None = None) -> bytes:
    """One frame: the outputs, and the token strings (`render.token_names`) the API
    process has not been sent yet."""
    body = [
        [
            o.request_id,
            [
                [
                    d.index,
                    list(d.token_ids),
                    d.text,
                    None if d.finish_reason is None else str(d.finish_reason),
                    None if d.logprobs is None else [_logprob(e) for e in d.logprobs],
                ]
                for d in o.deltas
            ],
            o.prompt_tokens,
            o.completion_tokens,
            o.finished,
            o.error,
            None if o.prompt_logprobs is None else [_logprob(e) for e in o.prompt_logprobs],
        ]
        for o in outputs
    ]
    return frame({"outputs": body, "names": names or []})


def decode_outputs(body) -> list[RequestOutput]:
    outputs = []
    for request_id, deltas, prompt, completion, finished, error, prompt_lps in body["outputs"]:
        outputs.append(
            RequestOutput(
                request_id,
                tuple(
                    SeqDelta(
                        index,
                        tuple(tokens),
                        text,
                        None if reason is None else FinishReason(reason),
                        None if lps is None else tuple(_unlogprob(e) for e in lps),
                    )
                    for index, tokens, text, reason, lps in deltas
                ),
                prompt,
                completion,
                finished,
                error,
                None if prompt_lps is None else tuple(_unlogprob(e) for e in prompt_lps),
            )
        )
    return outputs


def frame(body) -> bytes:
    data = msgpack.packb(body, use_bin_type=True)
    return _LENGTH.pack(len(data)) + data


def _unpack(data: bytes):
    return msgpack.unpackb(data, raw=False, strict_map_key=True)


# -- the engine process's end -----------------------------------------------------------


class CoreRelay:
    """Listens on `path` for the one API process; the engine thread sends outputs with
    `send`, a reader thread hands the API process's "done" messages to `on_done`.

    `on_done(request_ids, outcome)`: the API process has stopped reading these requests;
    `outcome` ("ok", "error", "disconnected") is counted once per HTTP request, or None.
    `on_lost()`: the API process went away (its socket closed): the engine process stops.
    """

    def __init__(
        self,
        path: str,
        on_done: Callable[[list[str], str | None], None],
        on_lost: Callable[[], None],
        max_request_bytes: int = 0,
    ):
        self.path = path
        self.max_frame = frame_limit(max_request_bytes)
        self._on_done = on_done
        self._on_lost = on_lost
        self.app = None  # the ASGI app that answers calls, and its loop (`serve_calls`)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.tokenizer = None  # the engine's: names the tokens of log-probabilities
        self._named: set[int] = set()  # token ids whose strings the API process has
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(path)
        self._listener.listen(1)
        self._conn: socket.socket | None = None
        self._send_lock = threading.Lock()
        self._closed = False
        self.connected = threading.Event()
        threading.Thread(target=self._serve, name="symbiont-relay", daemon=True).start()

    def serve_calls(self, app, loop: asyncio.AbstractEventLoop) -> None:
        """Run the API process's calls through `app` on `loop` (the HTTP server's)."""
        self.app, self.loop = app, loop

    def send(self, outputs: list[RequestOutput]) -> None:
        """From the engine thread (or whoever fails requests): one frame, written now,
        with the strings of tokens it shows log-probabilities of that were not sent yet
        (claimed and written under one lock: no frame can name a token before the frame
        carrying its string)."""
        ids = logprob_ids(outputs)
        with self._send_lock:
            names = []
            if ids and self.tokenizer is not None:
                names = token_names(self.tokenizer, set(ids) - self._named)
                self._named.update(t for t, _, _ in names)
            self._write_locked(encode_outputs(outputs, names))

    def _write(self, data: bytes) -> None:
        with self._send_lock:
            self._write_locked(data)

    def _write_locked(self, data: bytes) -> None:
        conn = self._conn
        if conn is None:
            return
        with contextlib.suppress(OSError):  # gone: _serve reports it
            conn.sendall(data)

    def close(self) -> None:
        self._closed = True
        for sock in (self._conn, self._listener):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                with contextlib.suppress(OSError):
                    sock.close()

    def _serve(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except OSError:
            return  # closed before the API process connected
        self._conn = conn
        self.connected.set()
        try:
            while True:
                message = _read_frame(conn, self.max_frame)
                if message is None:
                    break
                if "call" not in message:
                    self._on_done(list(message["done"]), message.get("outcome"))
                elif self.loop is not None and not self.loop.is_closed():
                    asyncio.run_coroutine_threadsafe(self._call(message), self.loop)
                # else: this process's server has stopped; the API process learns it
                # when the relay closes
        except Exception as err:  # noqa: BLE001 - a broken relay stops the server, said why
            if not self._closed:
                log.error("the relay from the API process broke (%s: %s)", type(err).__name__, err)
        if not self._closed:
            self._on_lost()

    async def _call(self, message: dict) -> None:
        """One request of the API process through the app; its whole answer goes back
        in one frame (relayed requests answer at once: how to show them, or an error)."""
        call_id = message.get("call")
        status, headers, body = 500, [], []
        try:
            scope = {
                "type": "http",
                "asgi": {"version": "3.0"},
                "http_version": "1.1",
                "method": message["method"],
                "scheme": "http",
                "path": message["path"],
                "raw_path": message["path"].encode(),
                "query_string": message["query"],
                "root_path": "",
                "headers": [(bytes(k), bytes(v)) for k, v in message["headers"]],
                "client": None,
                "server": None,
                "state": {},
            }
            sent_body = False

            async def receive():
                nonlocal sent_body
                if not sent_body:
                    sent_body = True
                    return {"type": "http.request", "body": message["body"], "more_body": False}
                return {"type": "http.disconnect"}

            async def send(event):
                nonlocal status, headers
                if event["type"] == "http.response.start":
                    status, headers = event["status"], [list(h) for h in event["headers"]]
                elif event["type"] == "http.response.body":
                    body.append(event.get("body", b""))

            await self.app(scope, receive, send)
        except Exception as err:  # noqa: BLE001 - the caller gets a 500 naming it
            log.exception("a relayed request failed")
            status, headers = 500, [[b"content-type", b"application/json"]]
            body = [_error_json(f"relayed request failed: {err}")]
        answer = b"".join(body)
        data = frame({"reply": call_id, "status": status, "headers": headers, "body": answer})
        if len(data) > self.max_frame:  # the API process would drop the relay over it
            why = f"the answer to this request is too large to pass on ({len(data)} bytes)"
            json_type = [[b"content-type", b"application/json"]]
            data = frame(
                {"reply": call_id, "status": 500, "headers": json_type, "body": _error_json(why)}
            )
            if status == 200:  # it was queued: nobody will read its outputs
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    self._on_done(list(json.loads(answer)["request_ids"]), "error")
        self._write(data)


def _error_json(message: str) -> bytes:
    error = {"message": message, "type": "internal_error", "param": None, "code": None}
    return json.dumps({"error": error}).encode()


def _read_frame(conn: socket.socket, limit: int):
    """One frame's body from a blocking socket; None at a clean end of stream."""
    head = _recv_exactly(conn, _LENGTH.size)
    if head is None:
        return None
    (size,) = _LENGTH.unpack(head)
    if size > limit:
        raise ValueError(f"frame of {size} bytes")
    body = _recv_exactly(conn, size)
    if body is None:
        raise ValueError("stream ended inside a frame")
    return _unpack(body)


def _recv_exactly(conn: socket.socket, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = conn.recv(min(left, 1 << 20))
        if not chunk:
            if left == size:
                return None
            raise ValueError("stream ended inside a frame")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


# -- the API process's end --------------------------------------------------------------


class FrontRelay:
    """The API process's end, on its event loop: routes outputs to the streams of the
    requests it relays. Outputs that arrive before the engine process has answered the
    HTTP request that queued them wait in `_early` under that request's id."""

    def __init__(self, path: str, on_lost: Callable[[str], None], max_frame: int = MAX_FRAME):
        self.path = path
        self.max_frame = max_frame
        self.error: str | None = None  # why the relay is gone, once it is
        self._on_lost = on_lost
        self._writer: asyncio.StreamWriter | None = None
        self._streams: dict[str, object] = {}  # request id -> RequestStream
        self._early: dict[str, dict[str, list[RequestOutput]]] = {}  # relay id -> by request
        self._replies: dict[str, asyncio.Future] = {}  # relay id -> the answer to its call
        self.names = TokenNames()  # what stands in for the tokenizer (render.py)
        self._task: asyncio.Task | None = None

    async def connect(self) -> None:
        reader, self._writer = await asyncio.open_unix_connection(self.path, limit=MAX_FRAME)
        self._task = asyncio.create_task(self._read(reader))

    @property
    def alive(self) -> bool:
        return self.error is None and self._writer is not None

    async def call(
        self, relay_id: str, method: str, path: str, query: bytes, headers: list, body: bytes
    ) -> tuple[int, list, bytes]:
        """The engine process's answer (status, headers, body) to one request."""
        if not self.alive:
            raise ConnectionError(self.error or "the relay is not connected")
        message = {
            "call": relay_id,
            "method": method,
            "path": path,
            "query": query,
            "headers": headers,
            "body": body,
        }
        data = frame(message)
        if len(data) > self.max_frame:
            raise FrameTooLarge(
                f"the request is {len(data)} bytes with its headers, more than this server "
                f"passes on ({self.max_frame}); send a smaller one"
            )
        reply = asyncio.get_running_loop().create_future()
        self._replies[relay_id] = reply
        self._writer.write(data)
        try:
            return await reply
        finally:
            self._replies.pop(relay_id, None)

    def expect(self, relay_id: str) -> None:
        """Keep outputs of `relay_id`'s requests until `attach` or `forget`."""
        self._early[relay_id] = {}

    def attach(self, relay_id: str, request_ids: list[str], make_stream) -> list:
        """Streams for the requests the engine process queued under `relay_id`."""
        early = self._early.pop(relay_id, {})
        streams = []
        for request_id in request_ids:
            stream = make_stream(request_id)
            self._streams[request_id] = stream
            for output in early.pop(request_id, ()):
                self._put(stream, output)
            streams.append(stream)
        return streams

    def forget(self, relay_id: str) -> None:
        self._early.pop(relay_id, None)

    def done(self, request_ids: list[str], outcome: str | None = None) -> None:
        """These requests are no longer read: the engine process aborts whatever of them
        still runs and counts `outcome`."""
        for request_id in request_ids:
            self._streams.pop(request_id, None)
        if self._writer is not None and self.error is None:
            self._writer.write(frame({"done": request_ids, "outcome": outcome}))

    def _put(self, stream, output: RequestOutput) -> None:
        stream.put_nowait(output)
        if output.finished:
            self._streams.pop(output.request_id, None)

    async def _read(self, reader: asyncio.StreamReader) -> None:
        why = "the engine process closed the relay"
        try:
            while True:
                head = await reader.readexactly(_LENGTH.size)
                (size,) = _LENGTH.unpack(head)
                if size > self.max_frame:
                    raise ValueError(f"frame of {size} bytes")
                body = _unpack(await reader.readexactly(size))
                if "reply" in body:  # the answer to a call (else: outputs)
                    reply = self._replies.get(body["reply"])
                    if reply is not None and not reply.done():
                        reply.set_result((body["status"], body["headers"], body["body"]))
                    else:
                        self._abort_unread(body)
                    continue
                self.names.update({"names": body["names"]})
                for output in decode_outputs(body):
                    self._route(output)
        except asyncio.IncompleteReadError:
            pass
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001 - every waiter is told
            why = f"the relay from the engine process broke ({type(err).__name__}: {err})"
        self._lost(why)

    def _abort_unread(self, reply: dict) -> None:
        """The answer to a call nobody waits for any more (its handler was cancelled):
        whatever it queued is aborted."""
        queued = [bytes(k).lower() == SPEC_HEADER.encode() for k, _ in reply["headers"]]
        if any(queued):
            self.done(list(json.loads(reply["body"])["request_ids"]))

    def _route(self, output: RequestOutput) -> None:
        stream = self._streams.get(output.request_id)
        if stream is not None:
            self._put(stream, output)
            return
        relay_id = output.request_id.rpartition("-")[0]
        early = self._early.get(relay_id)
        if early is not None:
            early.setdefault(output.request_id, []).append(output)
        # else: a request this process already let go of (its client left)

    def _lost(self, why: str) -> None:
        self.error = why
        for reply in self._replies.values():
            if not reply.done():
                reply.set_exception(ConnectionError(why))
        for request_id, stream in list(self._streams.items()):
            stream.put_nowait(RequestOutput(request_id, (), 0, 0, True, why))
        self._streams.clear()
        self._on_lost(why)


def valid_relay_id(value: str | None) -> bool:
    return value is not None and RELAY_ID.match(value) is not None
