"""The engine on its own thread, driven from asyncio.

The engine thread alone touches the `Engine`: it runs queued commands (add a request,
abort, load or unload an adapter) between iterations, then one iteration, and hands
each request's outputs to that request's asyncio queue. Nothing in the event loop
waits on model compute; nothing in the engine thread waits on a client.

A failing iteration fails its own requests inside `Engine.step`. Anything that escapes it
means the engine cannot go on: the thread fails every request it holds, refuses new work
with `EngineStopped`, records `error` and calls `on_failure` (the server then reports 503
and exits non-zero).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from symbiont.serve.engine import Engine
from symbiont.serve.sequence import Request, RequestOutput
from symbiont.serve.stream import RequestStream, hand_over

log = logging.getLogger(__name__)


class EngineStopped(RuntimeError):
    """The engine thread has stopped (failed, or shut down); nothing more can be served."""


class RelayedStream:
    """Outputs of one request that another process shows (the API process of `symbiont serve`):
    the engine thread writes them to `sink` (a `CoreRelay`) without waking the event loop."""

    def __init__(self, request_id: str, sink):
        self.request_id = request_id
        self.sink = sink

    def put_threadsafe(self, output: RequestOutput) -> None:
        self.sink.send([output])


class AsyncEngine:
    def __init__(self, engine: Engine, on_failure: Callable[[str], None] | None = None):
        self.engine = engine
        self.error: str | None = None  # why the engine thread failed, if it did
        self._on_failure = on_failure
        self._commands: queue.Queue[tuple[Callable[[], Any], Future]] = queue.Queue()
        self._streams: dict[str, RequestStream | RelayedStream] = {}
        self._stopped = threading.Event()
        self._closed = False  # no command is accepted any more (guarded by _lock)
        self._engine_closed = False  # stop() closed the engine (guarded by _lock)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="symbiont-engine", daemon=True)

    def start(self) -> AsyncEngine:
        if self.engine.cache is not None:
            self.engine.cache.wake = self._wake  # a finished adapter load wakes the thread
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread (its requests are aborted) and close the engine; again: nothing."""
        self._stopped.set()
        self._wake()
        if self._thread.is_alive():
            self._thread.join(timeout)
        with self._lock:
            if self._engine_closed:
                return
            self._engine_closed = True
        self.engine.close()

    def abort_relayed(self) -> None:
        """Abort every request another process shows: that process is gone."""
        for request_id, stream in list(self._streams.items()):
            if isinstance(stream, RelayedStream):
                self.abort(request_id)

    def _wake(self) -> None:
        self._commands.put((lambda: None, Future()))

    @property
    def relayed(self) -> int:
        """Requests in flight whose outputs another process shows (the API process)."""
        return sum(isinstance(s, RelayedStream) for s in list(self._streams.values()))

    @property
    def alive(self) -> bool:
        """Whether requests can still be served (the thread runs and has not failed)."""
        return self.error is None and not self._stopped.is_set() and self._thread.is_alive()

    # -- called from the event loop ---------------------------------------------------

    async def submit(self, request: Request, sink=None) -> RequestStream | RelayedStream:
        """Queue a request; raises what `Engine.add_request` raises (bad input, unknown
        adapter, full queue). With `sink` (a `CoreRelay`) its outputs go there instead of
        to the returned stream's queue."""
        if sink is None:
            stream = RequestStream(request.request_id, asyncio.get_running_loop())
        else:
            stream = RelayedStream(request.request_id, sink)

        def add() -> None:
            self.engine.add_request(request)
            self._streams[request.request_id] = stream

        await self._call(add)
        return stream

    def abort(self, request_id: str) -> None:
        """Cancel a request (safe from any thread, never blocks: used on disconnect)."""
        with self._lock:
            if not self._closed:
                self._commands.put((lambda: self._abort(request_id), Future()))

    async def load_adapter(self, name: str, path: str) -> dict:
        weights = await asyncio.to_thread(self.engine.adapters.parse, path)  # file I/O off-thread

        def add() -> dict:
            # as Engine.load_adapter: evict an idle cached adapter, never take the last slot
            self.engine._make_room_for_named(name)
            self.engine.adapters.add(name, weights)
            return self.engine.adapters.info(name)

        return await self._call(add)

    async def unload_adapter(self, name: str) -> None:
        await self._call(lambda: self.engine.unload_adapter(name))

    async def _call(self, fn: Callable[[], Any]) -> Any:
        future: Future = Future()
        with self._lock:
            if self._closed or self._stopped.is_set():
                raise EngineStopped(self._why_stopped())
            self._commands.put((fn, future))
        return await asyncio.wrap_future(future)

    def _why_stopped(self) -> str:
        if self.error:
            return f"{self.error}; the server cannot serve requests any more and must restart"
        return "the server is shutting down; retry on another replica or after it restarts"

    # -- the engine thread ------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                # nothing to run, or only requests whose adapters are loading: sleep until
                # a command or a finished load wakes us (a timeout as a safety net)
                idle = not self.engine.has_work()
                self._run_commands(block=idle or self.engine.stalled, timeout=0.5 if idle else 0.05)
                if self.engine.has_work():
                    self._deliver_all(self.engine.step())
        except BaseException as err:  # noqa: BLE001 - recorded, every waiter told, then reported
            self._fail(err)
            return
        self._close()
        for request_id in list(self._streams):
            self._abort(request_id)

    def _fail(self, err: BaseException) -> None:
        """The engine cannot go on: fail every request and command, then report."""
        self.error = f"the engine failed ({type(err).__name__}: {err})"
        log.critical("%s; failing every request", self.error, exc_info=err)
        self._close()
        for request_id, stream in list(self._streams.items()):
            stream.put_threadsafe(RequestOutput(request_id, (), 0, 0, True, self.error))
        self._streams.clear()
        if self._on_failure is not None:
            self._on_failure(self.error)

    def _close(self) -> None:
        """Refuse new commands; those already queued fail with EngineStopped (on failure)
        or run (on a normal stop, so aborts still free their requests)."""
        with self._lock:
            self._closed = True
        while True:
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if self.error:
                if future.set_running_or_notify_cancel():  # else its caller is gone
                    future.set_exception(EngineStopped(self._why_stopped()))
            else:
                _settle(fn, future)

    def _run_commands(self, block: bool, timeout: float = 0.5) -> None:
        try:
            fn, future = (
                self._commands.get(timeout=timeout) if block else self._commands.get_nowait()
            )
        except queue.Empty:
            return
        while True:
            _settle(fn, future)
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return

    def _abort(self, request_id: str) -> None:
        output = self.engine.abort(request_id)
        if output is not None:
            self._deliver(output)

    def _deliver(self, output: RequestOutput) -> None:
        self._deliver_all([output])

    def _deliver_all(self, outputs: list[RequestOutput]) -> None:
        """Hand an iteration's outputs to their streams with one wake-up per event loop,
        not one per request: each wake-up writes the loop's self-pipe and takes the GIL
        from this thread, a cost that grew with the batch (32 per decode step). Relayed
        requests' outputs go out as one frame per relay, written from this thread."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
        by_sink: dict[object, list[RequestOutput]] = {}
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            if isinstance(stream, RelayedStream):
                by_sink.setdefault(stream.sink, []).append(output)
            else:
                by_loop.setdefault(stream.loop, []).append((stream, output))
        for loop, items in by_loop.items():
            hand_over(loop, items)
        for sink, relayed in by_sink.items():
            sink.send(relayed)


def _settle(fn: Callable[[], Any], future: Future) -> None:
    """Run a queued command for its caller. A command whose caller was cancelled before
    it ran (a handler's task cancelled, a timeout) is skipped: a cancelled submit adds no
    request nobody reads, and settling a cancelled future would raise in the engine
    thread and stop it for everyone."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        result = fn()
    except BaseException as err:  # noqa: BLE001 - handed to the awaiting caller, not swallowed
        future.set_exception(err)
        return
    future.set_result(result)
