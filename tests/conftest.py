from __future__ import annotations

import pytest
import torch

from symbiont import BaseExecutor
from tests.tiny_models import ARCHS, build_checkpoint

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """arch name -> checkpoint folder, built once per test session."""
    cache: dict = {}

    def get(name: str):
        if name not in cache:
            cache[name] = build_checkpoint(ARCHS[name], tmp_path_factory.mktemp(name))
        return cache[name]

    return get


def _in_process(path):
    return BaseExecutor.from_pretrained(path)


# Every way of reaching an executor; the conformance suite runs against each.
TRANSPORTS = {"inprocess": _in_process}


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
