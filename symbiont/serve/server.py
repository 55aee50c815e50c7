"""Running the API: load the engine (in the background, so /health answers 503 while it
loads), then serve with uvicorn; `BackgroundServer` does it on a thread for tests and
benchmarks."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn

from symbiont.serve.api import ServerState, build_app
from symbiont.serve.async_engine import AsyncEngine
from symbiont.serve.config import EngineConfig
from symbiont.serve.engine import Engine
from symbiont.transport import open_executor

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerConfig:
    model: str  # checkpoint folder
    adapters: tuple[tuple[str, str], ...] = ()  # (name, PEFT folder) loaded at start
    executor: str | None = None  # URL of a remote base executor; None = in-process
    host: str = "127.0.0.1"
    port: int = 8000  # 0 = any free port
    api_key: str | None = None
    served_model_name: str | None = None
    dtype: str | None = None
    device: str = "cpu"
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self) -> None:
        names = [name for name, _ in self.adapters]
        if len(set(names)) != len(names):
            raise ValueError(f"adapter names must be unique, got {names}")
        if self.model_name in names:
            raise ValueError(
                f"an adapter may not be named like the base model ({self.model_name!r})"
            )

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).name


def load_engine(config: ServerConfig, state: ServerState) -> AsyncEngine:
    """Build the engine and its adapters, then make the state ready."""
    executor = open_executor(config.model, config.executor) if config.executor else None
    engine = Engine.from_pretrained(
        config.model,
        executor=executor,
        config=config.engine,
        device=config.device,
        dtype=config.dtype,
    )
    for name, path in config.adapters:
        engine.load_adapter(name, path)
        log.info("adapter %s loaded from %s", name, path)
    state.metrics.attach(engine)
    state.engine = AsyncEngine(engine).start()
    return state.engine


class BackgroundServer:
    """The server on a daemon thread; `with BackgroundServer(cfg) as s: s.url`."""

    def __init__(self, config: ServerConfig, wait_ready: bool = True):
        self.config = config
        self.state = ServerState(config.model_name, config.model, config.api_key)
        app = build_app(self.state)
        uv = uvicorn.Config(app, host=config.host, port=config.port, log_level="warning")
        self._server = uvicorn.Server(uv)
        self._thread = threading.Thread(target=self._server.run, name="symbiont-http", daemon=True)
        self._wait_ready = wait_ready

    def __enter__(self) -> BackgroundServer:
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"the HTTP server did not start on port {self.config.port}")
            threading.Event().wait(0.02)
        if self._wait_ready:
            load_engine(self.config, self.state)
        return self

    @property
    def port(self) -> int:
        return self._server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        if self.state.engine is not None:
            self.state.engine.stop()


def run(config: ServerConfig) -> int:
    """Serve until interrupted (the `symbiont serve` command)."""
    state = ServerState(config.model_name, config.model, config.api_key)
    server = uvicorn.Server(uvicorn.Config(build_app(state), host=config.host, port=config.port))

    def load() -> None:
        try:
            load_engine(config, state)
            log.info("serving %s on http://%s:%s", config.model_name, config.host, config.port)
        except Exception as err:  # noqa: BLE001 - reported, then the server stops
            state.load_error = f"loading failed: {err}"
            log.error("%s", state.load_error)
            server.should_exit = True

    threading.Thread(target=load, name="symbiont-load", daemon=True).start()
    server.run()
    if state.engine is not None:
        state.engine.stop()
    if state.load_error:
        raise RuntimeError(state.load_error)
    return 0
