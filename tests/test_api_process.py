"""`symbiont serve`'s API process (the default; `--no-api-process` turns it off): HTTP
in a second process, outputs over the relay.

The OpenAI API through the API process is tested by the `[api-process]` runs of
test_serve_api.py, test_logprobs_api.py and test_http_hostile.py (responses equal to
vanilla transformers + peft, bad input) and test_http_lifecycle.py (SIGTERM, Ctrl-C, a
dead engine). Here: the relay's encoding, what happens when either process dies, a port
already taken, a forged relay header, and the metrics the API process reports back.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from symbiont.decoding import FinishReason, TokenLogprob
from symbiont.serve import EngineConfig
from symbiont.serve.config import ServerConfig
from symbiont.serve.http.relay import FrontRelay, decode_outputs, encode_outputs, msgpack
from symbiont.serve.http.server import BackgroundServer
from symbiont.serve.sequence import RequestOutput, SeqDelta
from tests.test_http_lifecycle import LONG, serve
from tests.test_serve_common import add_char_tokenizer

REPO = Path(__file__).resolve().parents[1]
ENGINE = EngineConfig(max_running=4, max_batched_tokens=32, block_size=4, num_blocks=128)


@pytest.fixture(scope="module")
def model_dir(checkpoints, tmp_path_factory):
    folder = tmp_path_factory.mktemp("api-process") / "tiny-llama"
    shutil.copytree(checkpoints("llama"), folder)
    return add_char_tokenizer(folder)


def _output(request_id: str, finished: bool = False) -> RequestOutput:
    entry = TokenLogprob(7, -0.25, 1, ((7, -0.25), (3, -math.inf)))
    delta = SeqDelta(0, (7, 9), "ab", FinishReason.LENGTH if finished else None, (entry, entry))
    return RequestOutput(request_id, (delta,), 5, 2, finished, None, (None, entry))


def test_outputs_survive_the_relay_encoding_exactly():
    outputs = [
        _output("cmpl-" + "a" * 32 + "-0"),
        _output("cmpl-" + "a" * 32 + "-1", finished=True),
        RequestOutput("chatcmpl-" + "b" * 32 + "-0", (), 3, 0, True, "the engine failed"),
        RequestOutput("x-0", (SeqDelta(1, (), "", FinishReason.ABORT),), 1, 0, True),
    ]
    data = encode_outputs(outputs)
    assert int.from_bytes(data[:4], "big") == len(data) - 4
    decoded = decode_outputs(msgpack.unpackb(data[4:], raw=False))
    assert decoded == outputs
    assert isinstance(decoded[1].deltas[0].finish_reason, FinishReason)


class _Stream:
    def __init__(self):
        self.got: list[RequestOutput] = []

    def put_nowait(self, output):
        self.got.append(output)


def test_outputs_that_arrive_before_the_answer_wait_for_their_request():
    lost = []
    relay = FrontRelay("/nonexistent", lost.append)
    relay_id = "cmpl-" + "c" * 32
    relay.expect(relay_id)
    early = _output(f"{relay_id}-0")
    relay._route(early)
    relay._route(_output("cmpl-" + "d" * 32 + "-0"))  # nobody expects it: dropped
    (stream,) = relay.attach(relay_id, [f"{relay_id}-0"], lambda _: _Stream())
    assert stream.got == [early]
    relay._route(last := _output(f"{relay_id}-0", finished=True))
    assert stream.got == [early, last]
    assert relay._streams == {} and relay._early == {}
    # the engine's process goes away: every open stream ends with the reason
    relay.expect(relay_id)
    (open_stream,) = relay.attach(relay_id, [f"{relay_id}-0"], lambda _: _Stream())
    relay._lost("the engine process closed the relay")
    (ended,) = open_stream.got
    assert ended.finished and ended.error == "the engine process closed the relay"
    assert lost == ["the engine process closed the relay"] and not relay.alive


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def _front_of(process: subprocess.Popen) -> int:
    for pid in _children(process.pid):
        if b"symbiont.serve.http.front" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    raise AssertionError("symbiont serve has no API process")


def _gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


def test_serve_exits_non_zero_when_its_api_process_dies(model_dir, tmp_path):
    log = tmp_path / "serve.log"
    with serve(model_dir, "pass", log) as (process, url):
        assert httpx.post(f"{url}/v1/completions", json={**LONG, "max_tokens": 2}).is_success
        os.kill(_front_of(process), signal.SIGKILL)
        try:
            code = process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pytest.fail(f"serve ran on without its API process:\n{log.read_text()}")
    assert code not in (0, None)
    assert "the API process stopped unexpectedly" in log.read_text(), log.read_text()


def test_the_api_process_stops_and_cleans_up_when_serve_is_killed(model_dir, tmp_path):
    log = tmp_path / "serve.log"
    with serve(model_dir, "pass", log) as (process, url):
        front = _front_of(process)
        folder = Path(_cmdline_json(front)["folder"])  # the private folder of its sockets
        process.kill()
        process.wait()
        assert _gone(front, within=10), "the API process outlived a killed serve"
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/health", timeout=2)
    assert not folder.exists(), sorted(folder.iterdir())


def _cmdline_json(pid: int) -> dict:
    return json.loads(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[3])


def test_serve_names_a_port_already_taken(model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = [
            sys.executable, "-m", "symbiont", "serve", "--model", str(model_dir),
            "--port", str(port),
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    # one line, before loading (it was three: uvicorn's, the API process's, the loader's)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"symbiont serve: error: cannot listen on 127.0.0.1:{port} (Address already in use); "
        "choose another --port, or stop what listens there"
    ]


@pytest.mark.parametrize("api_process", [False, True], ids=["in-process", "api-process"])
def test_a_relay_header_from_a_client_is_not_obeyed(model_dir, api_process):
    config = ServerConfig(model=str(model_dir), port=0, engine=ENGINE, api_process=api_process)
    forged = {"x-symbiont-relay": "cmpl-" + "e" * 32, "x-symbiont-relay-spec": "1"}
    body = {**LONG, "max_tokens": 3}
    with BackgroundServer(config) as server:
        answer = httpx.post(f"{server.url}/v1/completions", json=body, headers=forged, timeout=60)
    assert answer.status_code == 200, answer.text
    assert "x-symbiont-relay-spec" not in answer.headers
    assert answer.json()["usage"]["completion_tokens"] == 3
    assert answer.json()["id"] != forged["x-symbiont-relay"]


def test_the_api_process_reports_how_each_request_ended(model_dir):
    config = ServerConfig(model=str(model_dir), port=0, engine=ENGINE, api_process=True)
    with BackgroundServer(config) as server:
        registry = server.state.metrics.registry

        def outcome(name: str) -> float:
            return registry.get_sample_value("symbiont_requests_total", {"outcome": name}) or 0

        assert httpx.post(f"{server.url}/v1/completions", json={**LONG, "max_tokens": 2}).is_success
        engine = server.state.engine.engine
        step = engine.step
        engine.step = lambda: time.sleep(0.05) or step()
        body = {**LONG, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    break  # and leave with the stream open
        deadline = time.monotonic() + 10
        while (outcome("disconnected") < 1 or server.state.engine.relayed) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.05)
        assert outcome("ok") == 1 and outcome("disconnected") == 1
        assert server.state.engine.relayed == 0, "the abandoned request kept generating"
        assert not engine.has_work()


def test_requests_through_the_api_process_run_at_once(model_dir):
    """Many concurrent streams through the relay, each complete and in order."""
    config = ServerConfig(model=str(model_dir), port=0, engine=ENGINE, api_process=True)

    async def main(url: str) -> list[list[str]]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:

            async def one(i: int) -> list[str]:
                body = {**LONG, "prompt": f"p{i}", "max_tokens": 5 + i, "stream": True}
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    return [line async for line in response.aiter_lines() if line]

            return await asyncio.gather(*(one(i) for i in range(8)))

    with BackgroundServer(config) as server:
        results = asyncio.run(main(server.url))
    for i, lines in enumerate(results):
        assert lines[-1] == "data: [DONE]"
        assert len(lines) == 5 + i + 1, lines  # one chunk per token, then [DONE]


def test_the_relay_takes_requests_as_large_as_the_server_accepts(tmp_path):
    from symbiont.serve.http.relay import MAX_FRAME, CoreRelay

    relay = CoreRelay(str(tmp_path / "r.sock"), lambda *_: None, lambda: None, 1 << 30)
    try:
        assert relay.max_frame > 1 << 30 > MAX_FRAME
    finally:
        relay.close()


def test_the_api_process_imports_neither_torch_nor_transformers():
    """It shows token strings from names the engine's process sends (render.TokenNames):
    importing torch and transformers would triple its memory."""
    check = (
        "import sys, symbiont.serve.http.front as f; f.build_front(f.FrontConfig('127.0.0.1', "
        "0, '/nonexistent', 1024)); heavy = {'torch', 'transformers'} & set(sys.modules); "
        "assert not heavy, heavy"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr


def test_forwarded_requests_keep_their_path_and_query_as_sent():
    """Routes other than completions are forwarded over HTTP; a query decoded and encoded
    again would change what the app sees (`%20` into `+`, `x` into `x=`)."""
    from starlette.requests import Request

    from symbiont.serve.http.front import _forward

    seen = []

    def engine_process(request: httpx.Request) -> httpx.Response:
        relay_header = request.headers.get("x-symbiont-relay")
        seen.append((request.url.raw_path, relay_header, request.headers["host"]))
        return httpx.Response(200, json={"ok": True})

    scope = {
        "type": "http",
        "method": "GET",
        "path": "//v1/files/a b",
        "raw_path": b"//v1/files/a%20b",
        "query_string": b"a=%20b+c&x&e=\xc3\xa9&f=\xff",
        "headers": [
            (b"x-symbiont-relay", b"cmpl-" + b"f" * 32),
            (b"accept", b"*/*"),
            (b"host", b"example.test:8000"),
        ],
    }

    async def body():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def main():
        transport = httpx.MockTransport(engine_process)
        async with httpx.AsyncClient(transport=transport, base_url="http://symbiont") as client:
            answer = await _forward(client, Request(scope, body))
            await answer.aclose()

    asyncio.run(main())
    # bytes outside ASCII percent-encoded, nothing else changed; the relay header dropped,
    # the client's Host kept (redirects name it)
    assert seen == [(b"//v1/files/a%20b?a=%20b+c&x&e=%C3%A9&f=%FF", None, "example.test:8000")]


@pytest.mark.parametrize("method", ["GET", "HEAD", "OPTIONS", "PUT"])
def test_odd_paths_and_methods_are_answered_by_the_app_as_in_one_process(model_dir, method):
    """The API process answers nothing itself but completions: a path with a newline, or a
    method no route takes, gets the app's answer (found by the schemathesis fuzz test)."""
    answers = []
    for api_process in (False, True):
        config = ServerConfig(model=str(model_dir), port=0, engine=ENGINE, api_process=api_process)
        with BackgroundServer(config) as server:
            for path in ("/v1/no%0Asuch/thing", "/v1/completions"):
                answer = httpx.request(method, f"{server.url}{path}", timeout=30)
                answers.append((api_process, path, answer.status_code, answer.content))
    in_process, relayed = answers[:2], answers[2:]
    assert [a[2:] for a in in_process] == [a[2:] for a in relayed], answers
    assert all(status in (404, 405) for _, _, status, _ in answers), answers


def test_huge_headers_are_refused_and_the_server_goes_on(model_dir):
    """The API process copies a completion's headers into a relay frame: beyond a bound it
    answers 431 itself rather than pass on a frame the engine's process would refuse."""
    config = ServerConfig(model=str(model_dir), port=0, engine=ENGINE)
    with BackgroundServer(config) as server:
        huge = {"x-filler": "a" * (2 << 20)}
        body = {**LONG, "max_tokens": 2}
        refused = httpx.post(f"{server.url}/v1/completions", json=body, headers=huge, timeout=60)
        assert refused.status_code == 431, refused.text
        assert refused.json()["error"]["code"] == "headers_too_large"
        after = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert after.status_code == 200, after.text
        assert server.state.engine.alive


def test_a_frame_over_the_limit_fails_only_its_request():
    from symbiont.serve.http.relay import FrameTooLarge

    relay = FrontRelay("/nonexistent", lambda _: None, max_frame=1000)
    relay._writer = object()  # connected, as far as `call` can tell; it must not write

    async def main():
        with pytest.raises(FrameTooLarge, match="send a smaller one"):
            await relay.call("cmpl-" + "a" * 32, "POST", "/v1/completions", b"", [], b"x" * 2000)

    asyncio.run(main())
    assert relay.alive and relay._replies == {}


def test_sigterm_stops_both_processes_and_removes_the_folder(model_dir, tmp_path):
    """uvicorn re-raises SIGTERM once its shutdown is done, ending the process before code
    after `server.run()`: the API process is stopped and its folder removed before that."""
    log = tmp_path / "serve.log"
    with serve(model_dir, "pass", log) as (process, url):
        front = _front_of(process)
        folder = Path(_cmdline_json(front)["folder"])
        assert httpx.post(f"{url}/v1/completions", json={**LONG, "max_tokens": 2}).is_success
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=15)
        assert _gone(front, within=10), "the API process outlived serve"
    assert not folder.exists(), sorted(folder.iterdir())
    assert "Traceback" not in log.read_text(), log.read_text()
