"""Running the API: load the engine (in the background, so /health answers 503 while it
loads), then serve with uvicorn; `BackgroundServer` does it on a thread for tests and
benchmarks. Its configuration, `ServerConfig`, is in `symbiont.serve.config`.

Stopping: on SIGTERM or SIGINT, requests in flight get `SHUTDOWN_GRACE_S` seconds to
finish, then they are cancelled (their sequences aborted) and the process exits. If the
engine thread fails for good, /health turns 503 and `run` stops the server and raises, so
`symbiont serve` exits non-zero and a supervisor can restart it."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from collections.abc import Callable

import uvicorn

from symbiont.serve.async_engine import AsyncEngine
from symbiont.serve.config import ServerConfig
from symbiont.serve.engine import Engine
from symbiont.serve.http.api import ServerState, build_app
from symbiont.serve.http.front import FrontProcess
from symbiont.serve.http.relay import CoreRelay
from symbiont.tenant import open_executor, set_threads

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 5.0  # in-flight requests may finish within this, then are cancelled


def _close_executor(state: ServerState) -> None:
    """After the engine (and the jobs worker) stopped: a serve-base then frees the
    session at once ("left") instead of noticing the process gone."""
    close = getattr(state.executor, "close", None)
    if close is not None:
        close()


def _check_port_free(host: str, port: int) -> None:
    """ValueError naming the address when another process listens on it (as uvicorn
    binds: SO_REUSEADDR, so a port in TIME_WAIT passes). Port 0 picks a free one."""
    if not port:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as err:
            raise ValueError(
                f"cannot listen on {host}:{port} ({err.strerror or err}); choose another "
                "--port, or stop what listens there"
            ) from None


def load_engine(
    config: ServerConfig, state: ServerState, on_failure: Callable[[str], None] | None = None
) -> AsyncEngine:
    """Build the engine and its adapters, then make the state ready; `on_failure(why)` is
    called from the engine thread if it fails for good."""
    pairs = [
        (url, token)
        for url, token in (
            (config.executor, config.executor_token),
            (config.second_executor, config.second_executor_token),
        )
        if url
    ]
    urls = tuple(url for url, _ in pairs) or None
    executor = open_executor(
        config.model,
        urls,
        tokens=tuple(token for _, token in pairs) or None,
        device=config.device,
        dtype=config.dtype,
        mask_activations=config.mask_activations,
        # jobs train through this executor: their backward calls need the plain layout
        prepack=config.prepack and config.jobs_dir is None,
    )
    state.executor = executor
    engine = Engine.from_pretrained(
        config.model,
        executor=executor,
        config=config.engine,
        device=config.device,
        dtype=config.dtype,
    )
    for name, path in config.adapters:
        # as /v1/models shows it (folder adapters' are absolute); ~ as read_adapter reads it
        path = os.path.abspath(os.path.expanduser(path))
        engine.load_adapter(name, path)
        log.info("adapter %s loaded from %s", name, path)
    for name, path, *mode in config.deltas:  # mode: exact or merged, if given
        engine.load_delta(name, path, config.model, *mode)
        log.info("delta %s loaded from %s", name, path)
    if config.adapter_dir is not None:
        cache = engine.attach_adapter_dir(config.adapter_dir)
        log.info("serving %d adapter folders of %s on demand", len(cache.names()), cache.root)
    state.metrics.attach(engine)
    if state.relay is not None:  # it names tokens for the API process
        state.relay.tokenizer = engine.tokenizer
    state.engine = AsyncEngine(engine, on_failure).start()
    return state.engine


class BackgroundServer:
    """The server on a daemon thread; `with BackgroundServer(cfg) as s: s.url`. With
    `config.api_process`, HTTP is answered by the API process, started here too."""

    def __init__(self, config: ServerConfig, wait_ready: bool = True):
        self.config = config
        self.state = server_state(config)
        self.front = _front(config, self.state, self._front_lost, log_level="warning")
        uv = _uvicorn_config(config, self.state, self.front, log_level="warning")
        self._server = _Server(uv, self.state, self.front)
        self._thread = threading.Thread(target=self._server.run, name="symbiont-http", daemon=True)
        self._wait_ready = wait_ready

    def __enter__(self) -> BackgroundServer:
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                self._close_front()
                raise RuntimeError(f"the HTTP server did not start on port {self.config.port}")
            threading.Event().wait(0.02)
        try:
            if self.front is not None:
                self.front.wait_ready()
            if self._wait_ready:
                load_engine(self.config, self.state)
        except BaseException:
            self.__exit__()
            raise
        return self

    @property
    def port(self) -> int:
        if self.front is not None:
            return self.front.port
        return self._server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        if self.state.engine is not None:
            self.state.engine.stop()
        _close_executor(self.state)
        self._close_front()

    def _front_lost(self, why: str) -> None:
        log.error("%s", why)
        self._server.should_exit = True

    def _close_front(self) -> None:
        if self.front is not None:
            self.state.relay.close()
            self.front.close()


def run(config: ServerConfig) -> int:
    """Serve until interrupted (the `symbiont serve` command)."""
    _check_port_free(config.host, config.port)  # before minutes of loading, in one line
    # the whole process's setting: never in tests' threads
    set_threads(config.threads, (config.executor, config.second_executor))
    state = server_state(config)
    front_error: list[str] = []

    def front_lost(why: str) -> None:  # from the relay's thread
        front_error.append(why)
        log.critical("%s; stopping the server", why)
        server.should_exit = True

    front = _front(config, state, front_lost)
    server = _Server(_uvicorn_config(config, state, front), state, front)

    def engine_failed(why: str) -> None:  # from the engine thread
        log.critical("%s; stopping the server", why)
        server.should_exit = True

    def load() -> None:
        try:
            port = config.port
            if front is not None:
                while not server.started:
                    if server.should_exit:  # it never bound its socket (logged)
                        return
                    time.sleep(0.02)
                port = front.wait_ready()
            load_engine(config, state, engine_failed)
            log.info("serving %s on http://%s:%s", config.model_name, config.host, port)
        except Exception as err:  # noqa: BLE001 - reported, then the server stops
            if server.should_exit:  # Ctrl-C stopped it (the API process too): no failure
                return
            state.load_error = f"loading failed: {err}"
            log.error("%s", state.load_error)
            server.should_exit = True

    threading.Thread(target=load, name="symbiont-load", daemon=True).start()
    try:
        server.run()
    finally:
        if state.engine is not None:
            state.engine.stop()
        _close_executor(state)
        if front is not None:
            state.relay.close()
            front.close()
    if state.engine is not None and state.engine.error:
        raise RuntimeError(f"{state.engine.error}; see the log above")
    if state.load_error:
        raise RuntimeError(state.load_error)
    if front_error:
        raise RuntimeError(f"{front_error[0]}; see the log above")
    return 0


def _front(
    config: ServerConfig,
    state: ServerState,
    on_lost: Callable[[str], None],
    log_level: str = "info",
) -> FrontProcess | None:
    """Unless --no-api-process: the API process (not started yet) and the relay it connects
    to, in `state.relay`; the API process's requests end through `on_done`."""
    if not config.api_process:
        return None
    front = FrontProcess(config.host, config.port, config.max_request_bytes, log_level)

    def on_done(request_ids: list[str], outcome: str | None) -> None:  # the relay's thread
        if state.engine is not None:
            for request_id in request_ids:
                state.engine.abort(request_id)
        if outcome is not None:
            state.metrics.requests.labels(outcome).inc()

    def lost() -> None:
        if not front.stopping:
            if state.engine is not None:  # nobody reads their outputs any more
                state.engine.abort_relayed()
            on_lost("the API process stopped unexpectedly")

    state.relay = CoreRelay(front.relay_socket, on_done, lost, config.max_request_bytes)
    return front


class _Server(uvicorn.Server):
    """uvicorn, ending the requests still running just before its grace period does: it
    then cancels their handlers, which logged tracebacks and sent a plain 500 or a
    stream cut without [DONE]. Stopped engines abort their requests instead, so every
    handler ends as it would on an abort (streams finish, others get a 503)."""

    def __init__(self, config: uvicorn.Config, state: ServerState, front: FrontProcess | None):
        super().__init__(config)
        self._state = state
        self._front = front

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self._front is not None and self.started:
            self._state.relay.serve_calls(self.config.app, asyncio.get_running_loop())
            self._front.start()  # it connects to the relay and the socket just bound

    async def shutdown(self, sockets=None) -> None:
        loop = asyncio.get_running_loop()
        ending = loop.call_later(max(SHUTDOWN_GRACE_S - 1.0, 0.0), self._end_requests)
        try:
            if self._front is not None:
                # the API process stops taking requests; those it relays finish (or are
                # ended by _end_requests) before this process stops answering it
                self._front.stop()
                await self._relayed_done()
            await super().shutdown(sockets)
            if self.force_exit and self.lifespan is not None:
                # A second Ctrl-C makes uvicorn skip the app's shutdown (stopping jobs);
                # asyncio would then cancel it at exit, which it logs as a traceback. It
                # ran on cancellation anyway: run it here, quickly, without the traceback.
                await self.lifespan.shutdown()
            if self._front is not None:
                await self._stop_front()
            # here too: after a SIGTERM nothing after `run` runs (see `_stop_front`)
            if self._state.engine is not None:
                await asyncio.to_thread(self._state.engine.stop)
            await asyncio.to_thread(_close_executor, self._state)
        finally:
            ending.cancel()

    async def _relayed_done(self) -> None:
        """Until the requests the API process shows have ended (or were ended at the
        grace period's end: their abort outputs are written before the engine stops)."""
        engine = self._state.engine
        deadline = time.monotonic() + SHUTDOWN_GRACE_S + 2.0
        while engine is not None and engine.relayed and not self.force_exit:
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)

    async def _stop_front(self) -> None:
        """Here, not after `run` returns: uvicorn re-raises SIGTERM once its shutdown is
        done, which ends the process before any code after it runs."""
        if self._state.engine is not None:
            await asyncio.to_thread(self._state.engine.stop)  # its last frames written
        self._state.relay.close()
        await asyncio.to_thread(self._front.close)  # waits for it, removes the folder

    def _end_requests(self) -> None:
        engine = self._state.engine
        if engine is not None and engine.alive:  # joins its thread: not on the event loop
            threading.Thread(target=engine.stop, name="symbiont-stop", daemon=True).start()


def server_state(config: ServerConfig) -> ServerState:
    return ServerState(
        config.model_name,
        config.model,
        api_key=config.api_key,
        adapter_dir=config.adapter_dir,
        max_request_bytes=config.max_request_bytes,
        jobs_dir=config.jobs_dir,
        tenants=config.tenants,
    )


def _uvicorn_config(
    config: ServerConfig, state: ServerState, front: FrontProcess | None, **kw
) -> uvicorn.Config:
    # with an API process, this one listens only on a unix socket in its private folder
    # (the API process logs each request: this one would log them again, without client)
    # (and its own start-up lines would name a socket nobody but that process may use)
    where = (
        {"uds": front.api_socket, "access_log": False, "log_level": "warning"}
        if front
        else {"host": config.host, "port": config.port}
    )
    if front:
        kw.pop("log_level", None)
    return uvicorn.Config(
        build_app(state), timeout_graceful_shutdown=SHUTDOWN_GRACE_S, **where, **kw
    )
