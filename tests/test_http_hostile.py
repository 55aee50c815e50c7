"""The HTTP server against hostile or broken clients (issue 11 #11-#14).

Every bad request is a 4xx in OpenAI's error shape naming the field, never a 500 or a
dropped connection; bodies over the limit are refused before they are read; adapters load
by path only from under the adapter folder, with one message for every refused path; the
API key is compared in constant time. After all of it the server still answers exactly.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import shutil
import socket
import time

import httpx
import pytest

from symbiont.cli import main
from symbiont.serve import EngineConfig
from symbiont.serve.config import ServerConfig
from symbiont.serve.http.server import BackgroundServer
from tests.test_serve_common import add_char_tokenizer, lora_config, save_adapter

ENGINE = EngineConfig(max_running=4, max_batched_tokens=32, block_size=4, num_blocks=128)
LIMIT = 256 * 1024  # max_request_bytes of the test server
GREEDY = {"model": "tiny-llama", "prompt": "The cat", "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def model_dir(checkpoints, tmp_path_factory):
    folder = tmp_path_factory.mktemp("hostile") / "tiny-llama"
    shutil.copytree(checkpoints("llama"), folder)
    return add_char_tokenizer(folder)


@pytest.fixture(scope="module")
def adapter_root(model_dir, tmp_path_factory):
    """<tmp>/root/ok: a servable adapter; <tmp>/outside: a valid adapter outside the root."""
    top = tmp_path_factory.mktemp("adapter-dirs")
    save_adapter(model_dir, lora_config("llama", 4), top / "root" / "ok", seed=1)
    shutil.copytree(top / "root" / "ok", top / "outside")
    return top / "root"


@pytest.fixture(scope="module", params=[False, True], ids=["in-process", "api-process"])
def server(request, model_dir, adapter_root):
    config = ServerConfig(
        api_process=request.param,
        model=str(model_dir),
        port=0,
        engine=ENGINE,
        adapter_dir=str(adapter_root),
        max_request_bytes=LIMIT,
    )
    with BackgroundServer(config) as running:
        yield running


@pytest.fixture(scope="module")
def greedy_text(server):
    """The greedy completion before any hostile request (the server must stay exact)."""
    return _post(server, "/v1/completions", GREEDY).json()["choices"][0]["text"]


def _post(server, path: str, body=None, content: bytes | None = None, **kw) -> httpx.Response:
    headers = {"content-type": "application/json"}
    return httpx.post(
        f"{server.url}{path}", json=body, content=content, headers=headers, timeout=30, **kw
    )


def _assert_error(response: httpx.Response, status: int, param: str | None = "-") -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["message"], "an error must say what to fix"
    if param != "-":
        assert error["param"] == param, error
    return error


def _assert_still_exact(server, greedy_text: str) -> None:
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    again = _post(server, "/v1/completions", GREEDY).json()["choices"][0]["text"]
    assert again == greedy_text, "the server answers differently after hostile requests"


# -- #11: every kind of bad request is a 4xx naming the field -----------------------------


@pytest.mark.parametrize("role", ["system", "user", "assistant", "developer", "tool"])
def test_every_openai_chat_role_is_served(server, role):
    body = {"model": "tiny-llama", "max_tokens": 3, "temperature": 0}
    plain = _post(
        server, "/v1/chat/completions", {**body, "messages": [{"role": role, "content": "hi"}]}
    )
    assert plain.status_code == 200, plain.text
    parts = [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]
    split = _post(
        server, "/v1/chat/completions", {**body, "messages": [{"role": role, "content": parts}]}
    )
    assert split.status_code == 200, split.text
    text = plain.json()["choices"][0]["message"]["content"]
    assert split.json()["choices"][0]["message"]["content"] == text, "parts must join as one text"


LONE = "a\ud800b"  # json.dumps writes it as the escape "\ud800", which JSON allows


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"model": "tiny-llama", "prompt": LONE}, "prompt"),
        ("/v1/completions", {"model": "tiny-llama", "prompt": ["ok", LONE]}, "prompt"),
        ("/v1/completions", {"model": "tiny-llama", "prompt": "x", "stop": [LONE]}, "stop"),
        ("/v1/completions", {"model": LONE, "prompt": "x"}, "model"),
        ("/v1/chat/completions", {"model": "tiny-llama", "messages": [{"role": "user", "content": LONE}]}, "messages"),
        ("/v1/chat/completions", {"model": "tiny-llama", "messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]}, "messages"),
        ("/v1/adapters", {"name": "x", "path": LONE}, "path"),
    ],
)  # fmt: skip
def test_lone_surrogate_is_400_naming_the_field(server, path, body, param):
    content = json.dumps({"max_tokens": 2, **body} if path != "/v1/adapters" else body)
    assert "\\ud800" in content
    _assert_error(_post(server, path, content=content.encode()), 400, param)


def test_raw_surrogate_bytes_are_400_too(server):
    """json.loads accepts the UTF-8 encoding of a surrogate ('surrogatepass')."""
    content = b'{"model": "tiny-llama", "max_tokens": 2, "prompt": "a\xed\xa0\x80b"}'
    _assert_error(_post(server, "/v1/completions", content=content), 400, "prompt")


@pytest.mark.parametrize("where", ["body", "prompt", "messages"])
def test_100000_deep_json_is_400(server, where):
    deep = b"[" * 100_000 + b"]" * 100_000
    content = {
        "body": deep,
        "prompt": b'{"model": "tiny-llama", "prompt": ' + deep + b"}",
        "messages": b'{"model": "tiny-llama", "messages": [{"role": "user", "content": '
        + deep
        + b"}]}",
    }[where]
    error = _assert_error(_post(server, "/v1/chat/completions", content=content), 400)
    assert "JSON" in error["message"]


@pytest.mark.parametrize("seed", [2**64, 2**64 + 1, 10**400, -1])
def test_seed_out_of_range_is_400(server, seed):
    body = {"model": "tiny-llama", "prompt": "x", "max_tokens": 2, "seed": seed}
    _assert_error(_post(server, "/v1/completions", body), 400, "seed")


COMPLETION = {"model": "tiny-llama", "prompt": "x", "max_tokens": 2}
CHAT = {"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
WRONG_TYPES = [
    *[("/v1/completions", COMPLETION, field, value, field) for field, value in [
        ("model", 1), ("model", None), ("prompt", {}), ("prompt", 5), ("prompt", [[1], "a"]),
        ("prompt", [1.5]), ("prompt", None), ("max_tokens", "many"), ("max_tokens", 1.5),
        ("max_tokens", -3), ("temperature", []), ("temperature", "hot"), ("temperature", -1),
        ("top_p", {}), ("top_p", 0), ("top_k", 1.5), ("top_k", "k"), ("n", "2x"), ("n", 0),
        ("n", 10**30), ("seed", "s"), ("seed", 1.5), ("stop", 5), ("stop", [1]),
        ("stream", {}), ("stream_options", 3), ("stream_options", {"include_usage": []}),
        ("ignore_eos", [])]],
    *[("/v1/chat/completions", CHAT, field, value, field) for field, value in [
        ("messages", "hi"), ("messages", []), ("messages", [1]), ("messages", [{"role": 1}]),
        ("messages", [{"role": "wizard", "content": "x"}]),
        ("messages", [{"role": "user", "content": 5}]),
        ("messages", [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        ("messages", [{"role": "user", "content": [{"type": "text"}]}]),
        ("max_completion_tokens", "x"), ("max_completion_tokens", 0)]],
    *[("/v1/adapters", {"name": "a", "path": "ok"}, field, value, field) for field, value in [
        ("name", 5), ("name", ""), ("name", "a b"), ("path", []), ("path", "")]],
    # found by tests/test_http_fuzz.py: an id past int64 reached the decoder, an empty chat
    # reached the chat template
    ("/v1/completions", {**COMPLETION, "echo": True}, "prompt", [[1], [2**63, -2**63]], "prompt"),
    ("/tokenize", {"model": "tiny-llama"}, "messages", [], "messages"),
]  # fmt: skip


@pytest.mark.parametrize("path, base, field, value, param", WRONG_TYPES)
def test_wrong_types_are_400_naming_the_field(server, path, base, field, value, param):
    _assert_error(_post(server, path, {**base, field: value}), 400, param)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/adapters"])
@pytest.mark.parametrize("content", [b"[]", b'"text"', b"null", b"1e999", b"{", b"\xff\xfe", b""])
def test_a_body_that_is_not_an_object_is_400(server, path, content):
    _assert_error(_post(server, path, content=content), 400)


def test_the_server_is_exact_after_bad_requests(server, greedy_text):
    for path, base, field, value, _ in WRONG_TYPES:
        _post(server, path, {**base, field: value})
    _assert_still_exact(server, greedy_text)


# -- #12: body size limit ---------------------------------------------------------------


def test_default_body_limit_is_8_mib_and_a_flag(capsys):
    assert ServerConfig(model="m").max_request_bytes == 8 * 1024 * 1024
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    options = capsys.readouterr().out
    assert "--max-request-bytes" in options and "--adapter-dir" in options
    with pytest.raises(ValueError, match="max_request_bytes"):
        ServerConfig(model="m", max_request_bytes=0)


def test_body_over_the_limit_is_413(server, greedy_text):
    padding = " " * (LIMIT - len(json.dumps(GREEDY)))
    exact = json.dumps(GREEDY).encode() + padding.encode()
    assert len(exact) == LIMIT
    fits = _post(server, "/v1/completions", content=exact)
    assert fits.status_code == 200 and fits.json()["choices"][0]["text"] == greedy_text
    error = _assert_error(_post(server, "/v1/completions", content=exact + b" "), 413)
    assert "--max-request-bytes" in error["message"]


def test_declared_length_over_the_limit_is_refused_before_the_body_is_sent(server):
    """Content-Length of 1 GB and no body at all: the answer comes at once."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000000000\r\n\r\n"
        )
        reply = b""
        while chunk := sock.recv(65536):  # the server closes after its answer
            reply += chunk
        reply = reply.decode()
    assert reply.startswith("HTTP/1.1 413"), reply
    assert '"request_too_large"' in reply


def test_chunked_body_over_the_limit_is_413_while_it_streams(server):
    sent = []

    def chunks():
        yield b'{"model": "tiny-llama", "prompt": "'
        for _ in range(1000):  # up to 16 MB, far over the limit
            sent.append(1)
            yield b"a" * 16384

    try:
        response = httpx.post(
            f"{server.url}/v1/completions",
            content=chunks(),
            headers={"content-type": "application/json"},
            timeout=30,
        )
    except (httpx.WriteError, httpx.ReadError, httpx.RemoteProtocolError):
        # the server answered 413 and closed while we were still sending
        assert len(sent) < 1000, "the server read the whole body before refusing it"
        return
    _assert_error(response, 413)
    assert len(sent) < 1000, "the server read the whole body before refusing it"


def test_the_server_is_exact_after_oversized_bodies(server, greedy_text):
    for _ in range(3):
        _post(server, "/v1/completions", content=b"x" * (LIMIT + 1))
    _assert_still_exact(server, greedy_text)


# -- #13: adapters load only from under the adapter folder -------------------------------


def test_adapter_loads_from_under_the_adapter_folder(server, adapter_root):
    loaded = _post(server, "/v1/adapters", {"name": "ok-rel", "path": "ok"})
    assert loaded.status_code == 200, loaded.text
    absolute = _post(server, "/v1/adapters", {"name": "ok-abs", "path": str(adapter_root / "ok")})
    assert absolute.status_code == 200, absolute.text
    dotted = _post(server, "/v1/adapters", {"name": "ok-dot", "path": "ok/../ok/."})
    assert dotted.status_code == 200, dotted.text
    one = _post(server, "/v1/completions", {**GREEDY, "model": "ok-rel"}).json()
    two = _post(server, "/v1/completions", {**GREEDY, "model": "ok-abs"}).json()
    assert one["choices"][0]["text"] == two["choices"][0]["text"]
    missing = _post(server, "/v1/adapters", {"name": "nope", "path": "not-there"})
    _assert_error(missing, 400, "path")  # inside the root: saying it is missing leaks nothing


def test_paths_outside_the_adapter_folder_are_403_with_one_message(server, adapter_root):
    outside = adapter_root.parent / "outside"
    link = adapter_root / "link-out"
    if not link.exists():
        os.symlink(outside, link)
    paths = [
        str(outside),  # a valid adapter, outside
        "../outside",  # the same through ..
        "ok/../../outside",
        str(link),  # a symlink inside the root that points outside
        "link-out",
        "/etc",  # exists, not an adapter
        "/no/such/folder",  # does not exist
        "../no-such-folder",
        str(adapter_root),  # the root itself is not an adapter folder under it
        ".",
        "/",
    ]
    messages = set()
    for path in paths:
        error = _assert_error(
            _post(server, "/v1/adapters", {"name": "x", "path": path}), 403, "path"
        )
        messages.add(error["message"])
    assert len(messages) == 1, f"refusals differ by path, so they tell which exist: {messages}"
    names = {m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]}
    assert "x" not in names


@pytest.mark.parametrize("path", ["ok\x00", "\x00/etc", "/etc/passwd\x00.json"])
def test_a_nul_in_an_adapter_path_is_400(server, path):
    """Found by the schema fuzzer: realpath raised on the NUL, which answered 500."""
    error = _assert_error(_post(server, "/v1/adapters", {"name": "x", "path": path}), 400, "path")
    assert "NUL" in error["message"]
    assert httpx.get(f"{server.url}/v1/models").status_code == 200


def test_without_an_adapter_folder_loads_by_path_are_403(model_dir, adapter_root):
    config = ServerConfig(model=str(model_dir), port=0, engine=ENGINE)
    with BackgroundServer(config) as plain:
        messages = set()
        for path in [str(adapter_root / "ok"), "/no/such/folder", "ok"]:
            response = _post(plain, "/v1/adapters", {"name": "x", "path": path})
            messages.add(_assert_error(response, 403, "path")["message"])
        assert len(messages) == 1 and "--adapter-dir" in messages.pop()


def test_adapter_dir_must_be_a_folder(tmp_path):
    with pytest.raises(ValueError, match="adapter-dir"):
        ServerConfig(model="m", adapter_dir=str(tmp_path / "missing"))


# -- #14: API key -------------------------------------------------------------------------


def test_api_key_is_compared_in_constant_time(model_dir, monkeypatch):
    compared = []
    real = hmac.compare_digest

    def spy(a, b):
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    config = ServerConfig(model=str(model_dir), port=0, engine=ENGINE, api_key="s3cret-ké")
    with BackgroundServer(config) as server:
        url = f"{server.url}/v1/models"
        assert httpx.get(url).status_code == 401
        for given in [b"Bearer s3cret", b"Bearer s3cret-k\xc3\xa9x", b"Bearer \xff\xfe", b"s3cret"]:
            response = httpx.get(url, headers={"authorization": given})
            _assert_error(response, 401)
        assert compared, "the key was not compared with hmac.compare_digest"
        right = httpx.get(url, headers={"authorization": "Bearer s3cret-ké".encode()})
        assert right.status_code == 200, right.text
        assert httpx.get(f"{server.url}/health").status_code == 200  # health needs no key


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.7", "example.com"])
def test_exposed_host_without_a_key_refuses_naming_both_flags(host):
    with pytest.raises(ValueError) as err:
        ServerConfig(model="m", host=host)
    assert "--api-key" in str(err.value) and "--allow-unauthenticated" in str(err.value)
    assert ServerConfig(model="m", host=host, api_key="k").host == host
    assert ServerConfig(model="m", host=host, allow_unauthenticated=True).host == host


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost"])
def test_loopback_needs_no_key(host):
    assert ServerConfig(model="m", host=host).api_key is None


def test_many_bad_requests_in_parallel_leave_the_server_exact(server, greedy_text):
    async def main():
        headers = {"content-type": "application/json"}
        async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=30) as http:
            bad = [
                body
                for _ in range(5)
                for body in (
                    b"[" * 50_000,
                    json.dumps({**COMPLETION, "seed": 2**70}).encode(),
                    json.dumps({**COMPLETION, "prompt": LONE}).encode(),
                    b"x" * (LIMIT + 10),
                )
            ]
            return await asyncio.gather(*(http.post("/v1/completions", content=b) for b in bad))

    started = time.monotonic()
    responses = asyncio.run(main())
    assert all(400 <= r.status_code < 500 for r in responses), [r.status_code for r in responses]
    assert time.monotonic() - started < 30
    _assert_still_exact(server, greedy_text)


STRICT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unsupported chat role: ' + m['role']) }}{% endif %}"
    "<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def test_a_chat_the_models_template_refuses_is_400_naming_messages(model_dir, tmp_path):
    """Found driving the default model with the openai client: its template raises on a
    `tool` message, which reached the client as a 500."""
    from transformers import AutoTokenizer

    strict = tmp_path / "strict"
    shutil.copytree(model_dir, strict)
    tokenizer = AutoTokenizer.from_pretrained(strict)
    tokenizer.chat_template = STRICT_TEMPLATE
    tokenizer.save_pretrained(strict)
    config = ServerConfig(model=str(strict), port=0, engine=ENGINE)
    with BackgroundServer(config) as running:
        for route, extra in (("v1/chat/completions", {"max_tokens": 2}), ("tokenize", {})):
            body = {"model": "strict", "messages": [{"role": "tool", "content": "x"}], **extra}
            response = httpx.post(f"{running.url}/{route}", json=body, timeout=30)
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == "messages", error
            assert "Unsupported chat role: tool" in error["message"], error
        ok = {"model": "strict", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert httpx.post(f"{running.url}/v1/chat/completions", json=ok, timeout=30).is_success


@pytest.mark.parametrize(
    "stop, message",
    [
        (["x"] * 17, "at most 16 stop strings, got 17"),
        ("y" * 1001, "a stop string of 1001 characters; at most 1000"),
        (["ok", "z" * 5000], "a stop string of 5000 characters"),
    ],
)
def test_too_many_or_too_long_stop_strings_are_400(server, stop, message):
    """Each stop string is searched for after every token of every choice: a request
    with 100k of them held the engine for every tenant for a minute."""
    for path, body in [
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ]:
        answer = _post(server, path, {"model": "tiny-llama", "max_tokens": 2, "stop": stop, **body})
        _assert_error(answer, 400, "stop")
        assert message in answer.json()["error"]["message"]


def test_tokenizing_a_request_does_not_stall_the_other_clients(server, monkeypatch):
    """Tokenizing an 8 MB prompt took 5 s on the event loop, and every other client
    (/health, open streams) waited. Now it runs on a thread of its own: while one
    request's tokenization is held, the server answers others."""
    import threading

    from symbiont.serve.http import api

    entered, release = threading.Event(), threading.Event()
    tokenize = api._completion_prompts

    def held(state, body):
        entered.set()
        release.wait(20)  # on the event loop (the old code) this held every client
        return tokenize(state, body)

    monkeypatch.setattr(api, "_completion_prompts", held)
    answers = []
    body = {"model": "tiny-llama", "prompt": "ab", "max_tokens": 2}
    caller = threading.Thread(target=lambda: answers.append(_post(server, "/v1/completions", body)))
    caller.start()
    try:
        assert entered.wait(10)
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    finally:
        release.set()
        caller.join(30)
    assert answers and answers[0].status_code == 200, answers


@pytest.mark.parametrize(
    "field, value",
    [("best_of", 3), ("logit_bias", {"5": 10}), ("presence_penalty", 0.5), ("tools", [{}])],
)
def test_unimplemented_openai_fields_are_refused_not_ignored(server, field, value):
    body = {"model": "tiny-llama", "prompt": "x", "max_tokens": 2, field: value}
    answer = _post(server, "/v1/completions", body)
    assert answer.status_code == 400, answer.text
    assert f"{field} is not implemented by this server" in answer.json()["error"]["message"]
    neutral = {"best_of": 1, "logit_bias": {}, "presence_penalty": 0, "tools": []}[field]
    assert _post(server, "/v1/completions", {**body, field: neutral}).status_code == 200


def test_a_chat_prompt_filling_the_context_names_the_messages(server):
    """Without max_tokens, a chat whose prompt fills the context was refused naming
    max_tokens (1), a field the client never sent."""
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "x" * 5000}]}
    answer = _post(server, "/v1/chat/completions", body)
    _assert_error(answer, 400, "messages")
    assert "shorten the messages" in answer.json()["error"]["message"]
