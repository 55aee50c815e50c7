"""A client of a serve-base on the same host leaves it a core unless --threads says
otherwise (symbiont/tenant.py `set_threads`): the serve-base spins on a core while it
waits for calls, and a client computing on every core then waited for one at each
parallel operation (decoding through a serve-base on two cores: 15-22x slower)."""

from __future__ import annotations

import logging

import pytest
import torch

from symbiont import tenant


@pytest.fixture
def two_cores(monkeypatch):
    monkeypatch.setattr(tenant, "_cores", lambda: 2)
    torch.set_num_threads(2)  # conftest's autouse fixture restores the session's


@pytest.mark.parametrize(
    "executors",
    ["tcp://127.0.0.1:7100", ["ipc:///tmp/base.sock"], ("tcp://[::1]:7100", None)],
)
def test_a_same_host_executor_gets_a_core(two_cores, executors, caplog):
    with caplog.at_level(logging.INFO, logger="symbiont.tenant"):
        tenant.set_threads(None, executors)
    assert torch.get_num_threads() == 1
    assert "leaving a core to the serve-base on this host (--threads chooses)" in caplog.text


@pytest.mark.parametrize("executors", [None, [], "tcp://10.1.2.3:7100", ["tcp://base:7100"]])
def test_in_process_or_another_host_keeps_torch_s_choice(two_cores, executors):
    tenant.set_threads(None, executors)
    assert torch.get_num_threads() == 2


def test_threads_given_are_kept(two_cores):
    tenant.set_threads(2, "tcp://127.0.0.1:7100")
    assert torch.get_num_threads() == 2
    with pytest.raises(ValueError, match="--threads must be >= 1, got 0"):
        tenant.set_threads(0, None)


def test_one_core_stays_one_thread(monkeypatch):
    monkeypatch.setattr(tenant, "_cores", lambda: 1)
    torch.set_num_threads(1)
    tenant.set_threads(None, "tcp://127.0.0.1:7100")
    assert torch.get_num_threads() == 1


def test_generate_through_a_local_serve_base_leaves_it_a_core(
    model_dir, two_cores, monkeypatch, capsys
):
    """The command sets it before it computes: the threads it generated on, seen from
    inside the sampling loop."""
    from symbiont import decoding
    from symbiont.cli import main
    from symbiont.processes import ServerProcess

    seen = []
    real = decoding.generate

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(decoding, "generate", spy)
    with ServerProcess(model_dir, bind=("tcp://127.0.0.1:*",), args=("--threads", "1")) as base:
        argv = ["generate", "--model", str(model_dir), "--prompt", "hello", "--max-new-tokens", "3"]
        assert main([*argv, "--executor", base.url("tcp")]) == 0
    assert seen == [1]
    capsys.readouterr()


@pytest.mark.parametrize(
    "cores, workers, device, expected",
    # (2 cores, 2 workers: one thread each, which spins on nothing between products)
    [(2, 1, "cpu", 1), (1, 1, "cpu", 1), (8, 1, "cpu", 7), (8, 2, "cpu", 3), (2, 2, "cpu", 1)]
    + [(8, 1, "cuda", None)],
)
def test_serve_base_leaves_clients_a_core_by_default(monkeypatch, cores, workers, device, expected):
    """The other half of the rule: a serve-base took every core, its OpenMP threads spun
    after each product on the one a same-host client needed, and a lone fine-tuning
    client ran 3-20x slower than beside `--threads 1` (BENCHMARKS.md, session 23)."""
    from symbiont.base import main as base_main

    monkeypatch.setattr(base_main.os, "sched_getaffinity", lambda _: set(range(cores)))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert base_main._default_threads(device, workers) == expected
    monkeypatch.setenv("OMP_NUM_THREADS", "4")  # the user's own choice stays torch's
    assert base_main._default_threads(device, workers) is None


def test_serve_base_says_its_threads_and_warns_when_a_local_client_gets_no_core(
    model_dir, monkeypatch
):
    from symbiont.cli import main
    from symbiont.processes import ServerProcess

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(__import__("os").sched_getaffinity(0))
    with ServerProcess(model_dir, bind=("tcp://127.0.0.1:*",)) as base:
        pass
    assert f"products on {max(1, cores - 1)} thread" in base.log_text()
    assert ("a core left to clients" in base.log_text()) == (cores > 1)
    if cores < 2:
        pytest.skip("one core: a single thread spins on nothing, nothing to warn of")
    with ServerProcess(model_dir, bind=("tcp://127.0.0.1:*",), args=("--threads", cores)) as base:
        argv = ["generate", "--model", str(model_dir), "--prompt", "hi", "--max-new-tokens", "2"]
        assert main([*argv, "--executor", base.url("tcp"), "--threads", "1"]) == 0
    assert f"the products take all {cores} cores (--threads {cores} x --workers 1)" in (
        base.log_text()
    )
