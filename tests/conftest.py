from __future__ import annotations

import pytest
import torch

import symbiont
from symbiont import BaseExecutor
from tests.tiny_models import ALL_ARCHS, WIDE_LLAMA, build_checkpoint

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """arch name -> checkpoint folder, built once per test session."""
    cache: dict = {}

    def get(name: str):
        if name not in cache:
            cache[name] = build_checkpoint(ALL_ARCHS[name], tmp_path_factory.mktemp(name))
        return cache[name]

    return get


@pytest.fixture(scope="session")
def wide_llama(tmp_path_factory):
    """tests.tiny_models.WIDE_LLAMA's checkpoint, built once per test session."""
    return build_checkpoint(WIDE_LLAMA, tmp_path_factory.mktemp("wide-llama"))


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """The embedded default model (real tokenizer, small Llama), built once, unpretrained."""
    from symbiont.model.default import default_model

    return default_model(tmp_path_factory.getbasetemp() / "default-model", pretrain_steps=0)


@pytest.fixture(autouse=True)
def _threads_restored():
    """Commands run in this process (`main([...])`) may set torch's threads for their
    process: the next test gets the session's back (MKL's last bits depend on them)."""
    before = torch.get_num_threads()
    yield
    if torch.get_num_threads() != before:
        torch.set_num_threads(before)


@pytest.fixture
def one_thread():
    """Tiny matmuls are far faster on one thread than two busy ones."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _in_process(path):
    return BaseExecutor.from_pretrained(path)


# serve-base processes started by the remote transports, one per checkpoint, stopped at
# the end of the session (and by themselves if pytest dies: they watch its pid).
_SERVERS: dict = {}


def _server(path):
    from symbiont.processes import ServerProcess

    if path not in _SERVERS:
        _SERVERS[path] = ServerProcess(path, args=("--threads", "1")).start()
    return _SERVERS[path]


def _remote(scheme, mode):
    def open_remote(path):
        return symbiont.connect(_server(path).url(scheme), mode=mode, checkpoint=path)

    return open_remote


@pytest.fixture(scope="session", autouse=True)
def _stop_servers():
    yield
    for server in _SERVERS.values():
        server.stop()


# Every way of reaching an executor; the conformance suite runs against each.
TRANSPORTS = {
    "inprocess": _in_process,
    "tcp": _remote("tcp", "zmq"),
    "ipc": _remote("ipc", "zmq"),
    "shm": _remote("ipc", "shm"),
}


@pytest.fixture(params=sorted(TRANSPORTS))
def connect(request):
    """A function path -> Executor for one transport; closes what it opened."""
    opened = []

    def open_executor(path):
        executor = TRANSPORTS[request.param](path)
        opened.append(executor)
        return executor

    yield open_executor
    for executor in opened:
        executor.close()
