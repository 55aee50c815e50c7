"""The server's life: an engine that cannot go on, and SIGTERM with requests in flight
(issue 11 #10).

If the engine thread fails for good, requests in flight fail at once (OpenAI error
shape), new ones get 503, /health turns 503 and `symbiont serve` exits non-zero naming
the failure. SIGTERM ends `symbiont serve` within 10 s even while requests run.

The child processes run the real `symbiont serve` (`symbiont.cli.main`, what `python -m
symbiont serve` runs) with `Engine.step` patched before it starts: slowed, so requests
are still in flight when the signal comes, or failing, so the engine thread dies.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from symbiont.serve import EngineConfig
from symbiont.serve.config import ServerConfig
from symbiont.serve.http.server import BackgroundServer
from tests.test_serve_common import add_char_tokenizer

REPO = Path(__file__).resolve().parents[1]
ENGINE = EngineConfig(max_running=4, max_batched_tokens=32, block_size=4, num_blocks=128)
LONG = {"model": "tiny-llama", "prompt": "go", "max_tokens": 100, "ignore_eos": True}

# Runs `symbiont serve` after patching Engine.step with the body of PATCHES[sys.argv[1]].
CHILD = """
import sys, time
from symbiont.serve.engine import Engine
step, calls = Engine.step, []
def patched(self):
    calls.append(1)
    {patch}
    return step(self)
Engine.step = patched
from symbiont.cli import main
sys.exit(main(sys.argv[1:]))
"""
SLOW = "time.sleep(0.25)"  # 100 tokens take 25 s
FAILING = "if len(calls) > 2: raise RuntimeError('scheduler state corrupted')"


@pytest.fixture(scope="module")
def model_dir(checkpoints, tmp_path_factory):
    folder = tmp_path_factory.mktemp("lifecycle") / "tiny-llama"
    shutil.copytree(checkpoints("llama"), folder)
    return add_char_tokenizer(folder)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(model_dir: Path, patch: str, log: Path, extra: tuple[str, ...] = ()):
    """`symbiont serve` in a child process with a patched engine; yields (process, url)."""
    port = _free_port()
    argv = [
        sys.executable, "-c", CHILD.format(patch=patch), "serve", "--model", str(model_dir),
        "--port", str(port), "--max-running", "4", "--max-batched-tokens", "32",
        "--block-size", "4", "--num-blocks", "128", *extra,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    with open(log, "wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, process, log)
        yield process, url
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _wait_healthy(url: str, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert process.poll() is None, f"serve exited:\n{log.read_text(errors='replace')}"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    pytest.fail(f"serve did not become healthy:\n{log.read_text(errors='replace')}")


def _in_background(fn) -> dict:
    """Run fn() on a thread; the dict gets 'result' or 'error' when it ends."""
    done: dict = {}

    def run():
        try:
            done["result"] = fn()
        except Exception as err:  # noqa: BLE001 - the test inspects it
            done["error"] = err

    threading.Thread(target=run, daemon=True).start()
    return done


def test_threads_flag_sets_the_engine_threads_torch_count(model_dir, tmp_path):
    # OMP_NUM_THREADS=1 in the child's environment; --threads 2 must win on the engine thread
    check = "assert __import__('torch').get_num_threads() == 2, 'threads not applied'"
    with serve(model_dir, check, tmp_path / "serve.log", ("--threads", "2")) as (_, url):
        body = {**LONG, "max_tokens": 3}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 3


def test_threads_flag_refuses_zero(model_dir):
    argv = [sys.executable, "-m", "symbiont", "serve", "--model", str(model_dir), "--threads", "0"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode != 0
    assert "--threads must be >= 1, got 0" in done.stderr


@pytest.mark.parametrize("extra", [("--no-api-process",), ()], ids=["in-process", "api-process"])
def test_sigterm_ends_serve_within_10_s_with_requests_in_flight(model_dir, tmp_path, extra):
    log = tmp_path / "serve.log"
    with serve(model_dir, SLOW, log, extra) as (process, url):
        # Issue 11 #10: this request once put NaN into sampling and killed the engine.
        extreme = {**LONG, "max_tokens": 2, "temperature": 2, "top_p": 1e-300}
        response = httpx.post(f"{url}/v1/completions", json=extreme, timeout=30)
        assert response.status_code == 200, response.text
        assert httpx.get(f"{url}/health").status_code == 200
        plain = _in_background(lambda: httpx.post(f"{url}/v1/completions", json=LONG, timeout=60))

        def stream():
            body = {**LONG, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                return [line for line in r.iter_lines() if line]

        streamed = _in_background(stream)
        time.sleep(1.5)  # both are generating (each step takes 0.25 s)
        assert not plain and not streamed, "the requests finished before the signal"
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pytest.fail(f"serve ran on 10 s after SIGTERM:\n{log.read_text(errors='replace')}")
        took = time.monotonic() - signalled
    assert took < 10
    deadline = time.monotonic() + 5
    while not (plain and streamed) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert plain and streamed, "a client still waits on a server that exited"
    # Ended as aborts, not cancelled by uvicorn: that logged tracebacks, answered a plain
    # text 500 and cut the stream without [DONE].
    text = log.read_text(errors="replace")
    assert "Traceback" not in text and "Exception in ASGI application" not in text, text
    answer = plain["result"]
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "shutting_down"
    assert "shutting down" in answer.json()["error"]["message"]
    # the stream was cut: it ends with an error event the openai client raises, not with
    # [DONE], which made the text so far read as the whole answer
    lines = streamed["result"]
    assert "data: [DONE]" not in lines, lines[-3:]
    last = json.loads(lines[-1].removeprefix("data: "))
    assert last["error"]["code"] == "shutting_down", lines[-3:]
    assert "shutting down" in last["error"]["message"]


@pytest.mark.parametrize("extra", [("--no-api-process",), ()], ids=["in-process", "api-process"])
def test_ctrl_c_twice_stops_serve_without_a_traceback(model_dir, tmp_path, extra):
    """A second Ctrl-C makes uvicorn skip the app's shutdown; asyncio then cancelled it
    at exit and uvicorn logged that as "Exception in 'lifespan' protocol" with a
    traceback. The server now runs the shutdown itself and exits quietly."""
    log = tmp_path / "serve.log"
    with serve(model_dir, "pass", log, extra) as (process, url):
        response = httpx.post(f"{url}/v1/completions", json={**LONG, "max_tokens": 2}, timeout=60)
        assert response.status_code == 200, response.text
        process.send_signal(signal.SIGINT)
        time.sleep(0.05)
        process.send_signal(signal.SIGINT)
        try:
            code = process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pytest.fail(f"serve ran on 10 s after two SIGINTs:\n{log.read_text(errors='replace')}")
    text = log.read_text(errors="replace")
    assert "Traceback" not in text and "Exception in 'lifespan'" not in text, text
    assert code in (0, 130), text  # 130: Python's SIGINT handler raised KeyboardInterrupt


@pytest.mark.parametrize("extra", [("--no-api-process",), ()], ids=["in-process", "api-process"])
def test_serve_exits_non_zero_when_the_engine_cannot_go_on(model_dir, tmp_path, extra):
    log = tmp_path / "serve.log"
    with serve(model_dir, FAILING, log, extra) as (process, url):
        first = httpx.post(f"{url}/v1/completions", json=LONG, timeout=30)
        assert first.status_code >= 500, first.text  # failed, not hung
        error = first.json()["error"]
        assert "scheduler state corrupted" in error["message"]
        assert set(error) == {"message", "type", "param", "code"}
        try:
            code = process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pytest.fail(f"serve kept running on a dead engine:\n{log.read_text(errors='replace')}")
    assert code not in (0, None), f"exit status {code}"
    text = log.read_text(errors="replace")
    assert "scheduler state corrupted" in text, text


def test_a_dead_engine_turns_health_503_and_fails_every_request(model_dir, monkeypatch):
    config = ServerConfig(model=str(model_dir), port=0, engine=ENGINE)
    with BackgroundServer(config) as server:
        engine = server.state.engine.engine
        step = engine.step
        calls = []

        def dies_on_the_third_step():
            calls.append(1)
            time.sleep(0.05)
            if len(calls) == 3:
                raise RuntimeError("KV cache bookkeeping broke")
            return step()

        monkeypatch.setattr(engine, "step", dies_on_the_third_step)
        url = server.url
        assert httpx.get(f"{url}/health").status_code == 200
        inflight = [
            _in_background(lambda: httpx.post(f"{url}/v1/completions", json=LONG, timeout=20))
            for _ in range(3)
        ]
        deadline = time.monotonic() + 15
        while not all(inflight) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(inflight), "requests in flight hang on a dead engine"
        for done in inflight:
            response = done["result"]
            assert response.status_code >= 500, response.text
            assert "KV cache bookkeeping broke" in response.json()["error"]["message"]
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503, health.text
        assert "KV cache bookkeeping broke" in health.json()["error"]["message"]
        later = httpx.post(f"{url}/v1/completions", json=LONG, timeout=10)
        assert later.status_code == 503, later.text
        adapters = httpx.post(f"{url}/v1/adapters", json={"name": "a", "path": "x"}, timeout=10)
        assert adapters.status_code in (403, 503), adapters.text
