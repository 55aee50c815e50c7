"""The API process of `symbiont serve`: HTTP and streaming on another core.

`symbiont serve` answers HTTP on the engine's process by default. Every token a client
streams then costs that process's event loop some Python (JSON, SSE framing, a socket
write), and the loop takes the GIL from the engine thread between its tensor operations:
with a small model and 16 streams, decode steps took 4.0-4.5 ms behind HTTP against
2.7-3.3 ms alone (BENCHMARKS.md, issue 17). With `--api-process` this process listens on
the public port instead and does that work under its own GIL:

- `POST /v1/completions` and `/v1/chat/completions` go to the engine process with a
  relay id (`relay.RELAY_HEADER`); it validates and queues them as ever, and answers with
  how to show them. Their outputs then come over `relay.sock`, one frame per engine
  iteration, and this process streams them (the same `_sse` and `_complete` as in
  `api.py`, so responses are byte for byte those of the engine's process).
- Every other request is forwarded unchanged, and its answer sent back unchanged.

Authentication, tenants, validation and metrics stay in the engine's process, which
listens only on a unix socket in a private folder: nothing reaches it but this process.
If the engine's process goes away, this one answers 503 and exits; the engine's process
stops this one when it stops (`FrontProcess`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from symbiont.serve.http.protocol import error_body
from symbiont.serve.http.relay import (
    RELAY_HEADER,
    SPEC_HEADER,
    FrameTooLarge,
    FrontRelay,
    frame_limit,
)
from symbiont.serve.http.render import (
    APIError,
    BodyLimit,
    View,
    complete_response,
    sse_events,
    warm_imports_at_startup,
)
from symbiont.serve.stream import RequestStream

log = logging.getLogger(__name__)

API_SOCKET, RELAY_SOCKET, READY_FILE = "api.sock", "relay.sock", "front.json"
# per-hop headers (RFC 9110 7.6.1), never forwarded; and the relay's own
_HOP = {
    "connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer",
    "upgrade", "host", RELAY_HEADER, SPEC_HEADER,
}  # fmt: skip
_GRACE_S = 5.0  # as SHUTDOWN_GRACE_S of server.py: streams in flight may finish


@dataclass(frozen=True)
class FrontConfig:
    """What the API process needs: where to listen, where the engine's process is."""

    host: str
    port: int
    folder: str  # the private folder holding api.sock and relay.sock
    max_request_bytes: int
    log_level: str = "info"


class _RelayedEngine:
    """What `sse_events` and `complete_response` ask of the engine, over the relay;
    `stopping()` says whether this process was told to stop (then requests cut short are
    answered 503, as the engine's process answers them when it stops)."""

    def __init__(self, relay: FrontRelay, stopping):
        self.relay = relay
        self.stopping = stopping

    @property
    def alive(self) -> bool:
        return self.relay.alive and not self.stopping()

    def abort(self, request_id: str) -> None:
        self.relay.done([request_id])

    def _why_stopped(self) -> str:
        if self.relay.error:
            return f"{self.relay.error}; the server cannot serve requests any more and must restart"
        return "the server is shutting down; retry on another replica or after it restarts"


def build_front(config: FrontConfig) -> tuple[Starlette, dict]:
    """The API process's app; its `state` holds the relay and HTTP client once started."""
    state: dict = {}
    folder = Path(config.folder)

    async def relayed(request: Request) -> Response:
        relay: FrontRelay = state["relay"]
        if not relay.alive:
            return _unavailable(relay.error)
        chat = request.url.path.endswith("/chat/completions")
        relay_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        relay.expect(relay_id)
        headers = _headers_on(request)
        headers.append((RELAY_HEADER.encode(), relay_id.encode()))
        try:
            status, answer_headers, body = await relay.call(
                relay_id,
                request.method,
                request.scope["path"],
                request.scope.get("query_string", b""),
                headers,
                await request.body(),
            )
        except FrameTooLarge as err:
            relay.forget(relay_id)
            return _too_large(str(err))
        except ConnectionError as err:
            relay.forget(relay_id)
            return _unavailable(str(err))
        except BaseException:  # cancelled: the relay aborts what its answer names
            relay.forget(relay_id)
            raise
        answer = {bytes(k).decode("latin-1").lower(): bytes(v) for k, v in answer_headers}
        if answer.get(SPEC_HEADER) != b"1":  # an error
            relay.forget(relay_id)
            kept = {k: v.decode("latin-1") for k, v in answer.items() if k not in _HOP}
            kept.pop("content-length", None)
            return Response(bytes(body), status_code=status, headers=kept)
        spec = json.loads(body)
        loop = asyncio.get_running_loop()
        streams = relay.attach(relay_id, spec["request_ids"], lambda rid: RequestStream(rid, loop))
        relay.names.update(spec["tokenizer"])
        tokenizer = relay.names if spec["tokenizer"] is not None else None
        engine = _RelayedEngine(relay, state["stopping"])
        return await _show(engine, streams, View.from_spec(spec, tokenizer), spec, request)

    async def forwarded(request: Request) -> Response:
        try:
            return _streamed_back(await _forward(state["client"], request))
        except httpx.TransportError as err:
            return _unavailable(f"the engine process did not answer ({err})")

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        transport = httpx.AsyncHTTPTransport(uds=str(folder / API_SOCKET))
        # no timeout: a completion that is not streamed takes as long as it generates
        # no cap on connections: long forwarded requests (file downloads, adapter loads)
        # must not leave /health waiting for a free one
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=32)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://symbiont", timeout=None, limits=limits
        ) as client:
            state["client"] = client
            relay = FrontRelay(
                str(folder / RELAY_SOCKET), state["on_lost"], frame_limit(config.max_request_bytes)
            )
            state["relay"] = relay
            await relay.connect()
            try:
                yield
            finally:  # before uvicorn re-raises SIGTERM, which ends the process at once
                remove_folder(config.folder)

    app = Starlette(lifespan=lifespan)
    app.add_middleware(_Dispatch, relayed=relayed, forwarded=forwarded)
    app.add_middleware(BodyLimit, max_bytes=config.max_request_bytes)  # outermost
    warm_imports_at_startup(app)
    return app, state


RELAYED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
MAX_HEADER_BYTES = 1 << 20  # headers beyond this are refused (431), not passed on


def _too_large(why: str) -> JSONResponse:
    body = error_body(why, "invalid_request_error", code="request_too_large")
    return JSONResponse(body, status_code=413)


class _Dispatch:
    """Every HTTP request to one of two handlers, whatever its method and path: completions
    relayed, the rest forwarded. (A router would answer some itself: its path pattern
    does not match a newline, so a 404 in its own shape, not the app's.)"""

    def __init__(self, app, relayed, forwarded):
        self.app, self.relayed, self.forwarded = app, relayed, forwarded

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if sum(len(k) + len(v) for k, v in scope["headers"]) > MAX_HEADER_BYTES:
            message = (
                f"the request's headers are larger than this server accepts "
                f"({MAX_HEADER_BYTES} bytes in all); send fewer or shorter ones"
            )
            error = APIError(431, message, "invalid_request_error", code="headers_too_large")
            return await error.response()(scope, receive, send)
        relay = scope["method"] == "POST" and scope["path"] in RELAYED_PATHS
        request = Request(scope, receive)
        response = await (self.relayed if relay else self.forwarded)(request)
        await response(scope, receive, send)


async def _show(engine: _RelayedEngine, streams, view: View, spec: dict, request: Request):
    def count(outcome: str) -> None:
        engine.relay.done([], outcome)

    if spec["stream"]:
        events = sse_events(engine, streams, view, spec["include_usage"], count)
        return StreamingResponse(events, media_type="text/event-stream")
    try:
        return JSONResponse(await complete_response(engine, streams, view, request, count))
    except APIError as err:
        return err.response()


async def _forward(client: httpx.AsyncClient, request: Request) -> httpx.Response:
    """`request` sent on to the engine process as it came: its path and query as sent (not
    decoded and encoded again; only bytes outside ASCII percent-encoded, and `.` segments
    resolved), its Host header (redirects name it), its body at most --max-request-bytes
    (BodyLimit read it). Its answer is streamed back."""
    return await client.send(
        client.build_request(
            request.method,
            _target(request.scope),
            headers=_headers_on(request, keep_host=True),
            content=await request.body(),
        ),
        stream=True,
    )


def _target(scope) -> httpx.URL:
    raw = scope.get("raw_path") or scope["path"].encode()
    if scope.get("query_string"):
        raw += b"?" + scope["query_string"]
    printable = urllib.parse.quote(raw, safe=bytes(range(0x21, 0x7F)))
    return httpx.URL("http://symbiont").copy_with(raw_path=printable.encode("ascii"))


def _headers_on(request: Request, keep_host: bool = False) -> list[tuple[bytes, bytes]]:
    """The request's headers but the per-hop ones and the relay's own."""
    return [
        (k, v)
        for k, v in request.headers.raw
        if (k_ := k.decode("latin-1").lower()) not in _HOP or (keep_host and k_ == "host")
    ]


def _streamed_back(upstream: httpx.Response) -> Response:
    headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP}
    return StreamingResponse(
        upstream.aiter_raw(),
        status_code=upstream.status_code,
        headers=headers,
        background=BackgroundTask(upstream.aclose),
    )


def _unavailable(why: str | None) -> JSONResponse:
    message = f"{why or 'the engine process is not reachable'}; the server must restart"
    body = error_body(message, "service_unavailable", code="engine_unreachable")
    return JSONResponse(body, status_code=503)


# -- the process ------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """`python -m symbiont.serve.http.front CONFIG_JSON`, started by `FrontProcess`."""
    args = argv if argv is not None else sys.argv[1:]
    if len(args) != 1 or args[0].startswith("-"):
        print(
            "this is the API process of `symbiont serve`, which starts it; "
            "run that command instead",
            file=sys.stderr,
        )
        return 2
    config = FrontConfig(**json.loads(args[0]))
    logging.basicConfig(level=config.log_level.upper(), format="%(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per forwarded request
    app, state = build_front(config)
    server = _FrontServer(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            timeout_graceful_shutdown=_GRACE_S,
            log_level=config.log_level,
        ),
        Path(config.folder) / READY_FILE,
    )

    def lost(why: str) -> None:
        if not server.should_exit:  # else the engine's process is stopping this one
            log.error("%s; the API process stops", why)
        server.should_exit = True

    state["on_lost"] = lost
    state["stopping"] = lambda: server.should_exit
    try:
        server.run()
    finally:  # the engine's process removes them too, unless it was killed
        remove_folder(config.folder)
    return 0


def remove_folder(folder: str) -> None:
    for name in (API_SOCKET, RELAY_SOCKET, READY_FILE, READY_FILE + ".tmp"):
        with contextlib.suppress(FileNotFoundError):
            (Path(folder) / name).unlink()
    with contextlib.suppress(OSError):
        os.rmdir(folder)


class _FrontServer(uvicorn.Server):
    """Tells the engine's process which port it got (port 0: any free one) once bound."""

    def __init__(self, config: uvicorn.Config, ready_file: Path):
        super().__init__(config)
        self._ready_file = ready_file

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.should_exit or not self.servers:
            return
        port = self.servers[0].sockets[0].getsockname()[1]
        staging = self._ready_file.with_name(READY_FILE + ".tmp")
        staging.write_text(json.dumps({"port": port, "pid": os.getpid()}))
        staging.replace(self._ready_file)


class FrontProcess:
    """The API process, started and stopped by the engine's process.

    `folder` is private (mode 0700): only this user reaches the engine's sockets. The
    API process runs in a session of its own, so a terminal's Ctrl-C reaches only the
    engine's process, which then stops it after the streams in flight have ended."""

    def __init__(self, host: str, port: int, max_request_bytes: int, log_level: str):
        self.folder = tempfile.mkdtemp(prefix="symbiont-api-")  # created 0700
        self.config = FrontConfig(host, port, self.folder, max_request_bytes, log_level)
        self.process: subprocess.Popen | None = None
        self.port: int | None = None
        self.stopping = False  # stop() was called: its exit is expected

    @property
    def api_socket(self) -> str:
        return str(Path(self.folder) / API_SOCKET)

    @property
    def relay_socket(self) -> str:
        return str(Path(self.folder) / RELAY_SOCKET)

    def start(self) -> None:
        argv = [sys.executable, "-m", "symbiont.serve.http.front", json.dumps(asdict(self.config))]
        self.process = subprocess.Popen(argv, start_new_session=True)

    def wait_ready(self, timeout: float = 120.0) -> int:
        """The port it listens on, once it does; raises if it exited first."""
        ready = Path(self.folder) / READY_FILE
        deadline = time.monotonic() + timeout
        while not ready.exists():
            # (None: not started yet; the server starts it just after binding its socket)
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(
                    f"the API process exited before listening on {self.config.host}:"
                    f"{self.config.port} (see its log above); is the port free?"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"the API process did not listen within {timeout:.0f} s")
            time.sleep(0.02)
        self.port = json.loads(ready.read_text())["port"]
        return self.port

    def stop(self) -> None:
        """Ask it to finish (SIGTERM: uvicorn's graceful shutdown), without waiting."""
        self.stopping = True
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)

    def close(self, timeout: float = _GRACE_S + 5.0) -> None:
        self.stop()
        if self.process is not None:
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        remove_folder(self.folder)


if __name__ == "__main__":
    sys.exit(main())
