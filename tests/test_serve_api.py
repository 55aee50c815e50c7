"""The HTTP API driven by the official `openai` client and by plain HTTP.

Servers run on 127.0.0.1 on a free port, on a thread that each fixture stops. Outputs
are checked against vanilla transformers + peft (greedy), so the API adds nothing and
loses nothing on top of the engine.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from symbiont.serve import EngineConfig
from symbiont.serve.config import ServerConfig
from symbiont.serve.http.server import BackgroundServer, load_engine
from symbiont.serve.scheduler import QueueFull
from tests.test_serve_common import Reference, add_char_tokenizer, make_adapters

ENGINE = EngineConfig(max_running=8, max_batched_tokens=24, block_size=4, num_blocks=256)


@pytest.fixture(scope="module")
def model_dir(checkpoints, tmp_path_factory):
    folder = tmp_path_factory.mktemp("served") / "tiny-llama"
    shutil.copytree(checkpoints("llama"), folder)
    return add_char_tokenizer(folder)


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    # in a subfolder of --adapter-dir: the folder's own direct subfolders are served by
    # name (tests/test_adapter_dir_api.py); these are loaded by name or by path only
    return make_adapters(model_dir, tmp_path_factory.mktemp("adapters") / "pool")


@pytest.fixture(scope="module", params=[False, True], ids=["in-process", "api-process"])
def server(request, model_dir, adapters):
    preloaded = tuple((name, str(adapters[name])) for name in ("lora4", "lora16", "ia3"))
    config = ServerConfig(
        api_process=request.param,
        model=str(model_dir),
        adapters=preloaded,
        port=0,
        engine=ENGINE,
        adapter_dir=str(adapters["lora4"].parent.parent),  # POST /v1/adapters loads from here
    )
    with BackgroundServer(config) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def expected(model_dir, adapters):
    """prompt text, adapter, max_tokens -> the text vanilla peft generates greedily."""
    reference = Reference(model_dir, adapters)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def text(prompt: str, adapter: str | None, max_tokens: int) -> str:
        ids = tokenizer(prompt).input_ids
        out = reference.generate(ids, adapter, max_tokens)
        return tokenizer.decode(out, skip_special_tokens=True)

    return text


def test_models_lists_base_and_adapters_with_parent(client):
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"tiny-llama", "lora4", "lora16", "ia3"}
    assert models["lora4"].model_extra["parent"] == "tiny-llama"
    assert models["tiny-llama"].model_extra["parent"] is None


@pytest.mark.parametrize("model", ["tiny-llama", "lora4", "lora16", "ia3"])
def test_completion_equals_vanilla_peft(client, expected, model):
    out = client.completions.create(model=model, prompt="The cat", max_tokens=12, temperature=0)
    adapter = None if model == "tiny-llama" else model
    assert out.choices[0].text == expected("The cat", adapter, 12)
    assert out.usage.prompt_tokens == len("The cat")
    assert out.usage.completion_tokens <= 12
    assert out.model == model


def test_concurrent_requests_of_many_adapters_are_each_exact(server, expected):
    async def main():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        jobs = [
            (f"prompt {i} {'x' * (i % 5)}", ["tiny-llama", "lora4", "lora16", "ia3"][i % 4])
            for i in range(11)
        ]
        calls = [
            client.completions.create(model=m, prompt=p, max_tokens=10, temperature=0)
            for p, m in jobs
        ]
        return jobs, await asyncio.gather(*calls)

    jobs, outs = asyncio.run(main())
    for (prompt, model), out in zip(jobs, outs, strict=True):
        adapter = None if model == "tiny-llama" else model
        assert out.choices[0].text == expected(prompt, adapter, 10), f"{model}: {prompt!r}"


def test_streaming_chat_matches_non_streaming(client):
    messages = [{"role": "user", "content": "Say something"}]
    whole = client.chat.completions.create(
        model="ia3", messages=messages, max_tokens=10, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model="ia3",
            messages=messages,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_plain_http_server_sent_events(server):
    body = {"model": "lora16", "prompt": "abc", "max_tokens": 6, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events)
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(line[6:]) for line in events[:-1]]
    assert all(p["object"] == "text_completion" for p in payloads)
    plain = httpx.post(
        f"{server.url}/v1/completions", json={**body, "stream": False}, timeout=30
    ).json()
    assert "".join(p["choices"][0]["text"] for p in payloads) == plain["choices"][0]["text"]


def test_n_seed_and_stop(client, expected):
    kw = dict(model="lora4", prompt="Once", max_tokens=8, temperature=1.0, seed=3, n=2)
    first, second = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert [c.index for c in first.choices] == [0, 1]
    greedy = expected("Once", "lora4", 12)
    stop = greedy[3:5]
    cut = client.completions.create(
        model="lora4", prompt="Once", max_tokens=12, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == greedy[: greedy.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_openai_style_errors(client, server):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    assert err.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="lora4", prompt="x", max_tokens=0)
    assert err.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="lora4", prompt="x", max_tokens=100_000)
    assert err.value.body["param"] == "max_tokens" and "context" in err.value.body["message"]
    response = httpx.get(f"{server.url}/v1/nothing-here")
    assert response.status_code == 404 and "error" in response.json()


def test_adapter_management_while_requests_run(server, client, adapters, expected, monkeypatch):
    url = f"{server.url}/v1/adapters"
    engine = server.state.engine.engine
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: time.sleep(0.01) or step())  # keep it running

    async def stream_long():
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        stream = await aclient.completions.create(
            model="lora16", prompt="long", max_tokens=30, temperature=0, stream=True
        )
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def main():
        running = asyncio.create_task(stream_long())
        await asyncio.sleep(0.05)
        async with httpx.AsyncClient(timeout=30) as http:
            loaded = await http.post(
                url, json={"name": "late", "path": str(adapters["lora8_attn"])}
            )
            removed = await http.delete(f"{url}/lora16")  # in use by `running`
        assert not running.done(), "the request finished before the adapter was unloaded"
        return loaded, removed, await running

    loaded, removed, text = asyncio.run(main())
    assert loaded.status_code == 200 and loaded.json()["rank"] == 8
    assert removed.status_code == 200
    assert text == expected("long", "lora16", 30), "unloading broke a running request"
    late = client.completions.create(model="late", prompt="hi", max_tokens=6, temperature=0)
    assert late.choices[0].text == expected("hi", "lora8_attn", 6)
    assert "lora16" not in {m.id for m in client.models.list().data}
    assert httpx.delete(f"{url}/lora16").status_code == 404

    broken = adapters["lora4"].parent / "broken"
    shutil.copytree(adapters["lora4"], broken, dirs_exist_ok=True)  # (once per server kind)
    (broken / "adapter_model.safetensors").write_bytes(b"garbage")
    response = httpx.post(url, json={"name": "broken", "path": str(broken)})
    assert response.status_code == 400 and "cannot read" in response.json()["error"]["message"]
    ok = client.completions.create(model="late", prompt="hi", max_tokens=6, temperature=0)
    assert ok.choices[0].text == late.choices[0].text, "a broken adapter affected others"
    assert httpx.delete(f"{url}/late").status_code == 200


def test_disconnected_stream_stops_and_frees_its_memory(server, monkeypatch):
    engine = server.state.engine.engine
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: time.sleep(0.02) or step())  # ~50 tokens/s
    registry = server.state.metrics.registry

    def generated() -> float:
        return registry.get_sample_value("symbiont_generated_tokens_total")

    before = generated()
    body = {
        "model": "lora4",
        "prompt": "go",
        "max_tokens": 100,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        next(line for line in response.iter_lines() if line.startswith("data: "))
    deadline = time.monotonic() + 5
    while engine.has_work() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not engine.has_work(), "a disconnected request kept generating"
    assert generated() - before < 50, "the request ran on after its client left"
    assert engine.kv_cache.allocator.num_free == ENGINE.num_blocks, "its KV blocks were not freed"


def test_metrics_in_prometheus_format(server, client):
    client.completions.create(model="lora4", prompt="m", max_tokens=3, temperature=0)
    text = httpx.get(f"{server.url}/metrics").text
    for name in (
        "symbiont_queue_length",
        "symbiont_running_requests",
        "symbiont_generation_tokens_per_second",
        "symbiont_time_to_first_token_seconds_bucket",
        "symbiont_inter_token_latency_seconds_bucket",
        "symbiont_adapters_loaded",
    ):
        assert name in text, f"/metrics lacks {name}"
    assert "symbiont_generated_tokens_total" in text
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def _full_queue(seqs):
    raise QueueFull("the request queue is full (2 waiting, max_queue=2); retry later")


def test_loading_api_key_and_full_queue(model_dir):
    config = ServerConfig(
        model=str(model_dir),
        port=0,
        api_key="s3cret",
        engine=EngineConfig(max_queue=2, block_size=4, num_blocks=64),
    )
    with BackgroundServer(config, wait_ready=False) as server:
        assert httpx.get(f"{server.url}/health").status_code == 503
        headers = {"Authorization": "Bearer s3cret"}
        body = {"model": "tiny-llama", "prompt": "x", "max_tokens": 2}
        loading = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers)
        assert loading.status_code == 503 and loading.json()["error"]["code"] == "loading"
        # not a list of the base alone, which would read as "no such adapter here"
        models = httpx.get(f"{server.url}/v1/models", headers=headers)
        assert models.status_code == 503 and models.json()["error"]["code"] == "loading"
        load_engine(config, server.state)
        assert httpx.get(f"{server.url}/v1/models", headers=headers).status_code == 200
        assert httpx.get(f"{server.url}/health").status_code == 200
        assert httpx.post(f"{server.url}/v1/completions", json=body).status_code == 401
        for given, status in (("bearer s3cret", 200), ("s3cret", 401), ("Basic s3cret", 401)):
            answer = httpx.get(f"{server.url}/v1/models", headers={"Authorization": given})
            assert answer.status_code == status, given  # the scheme's case does not matter
        for route, payload in (("tokenize", {"prompt": "x"}), ("detokenize", {"tokens": [5]})):
            assert httpx.post(f"{server.url}/{route}", json=payload).status_code == 401, route
        wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        right = openai.OpenAI(base_url=f"{server.url}/v1", api_key="s3cret", max_retries=0)
        # more sequences than the queue ever holds: 400 naming what to lower, not a 429
        # ("retry later") that would never succeed
        for prompt, n, param in (("x", 3, "n"), (["x", "y", "z"], 1, "prompt")):
            with pytest.raises(openai.BadRequestError) as err:
                right.completions.create(model="tiny-llama", prompt=prompt, n=n, max_tokens=2)
            assert err.value.body["param"] == param
            assert "--max-queue 2" in err.value.body["message"]
        scheduler = server.state.ready().engine.scheduler
        scheduler.add = _full_queue  # as if two requests waited
        try:
            with pytest.raises(openai.RateLimitError, match="queue is full"):
                right.completions.create(model="tiny-llama", prompt="x", max_tokens=2)
        finally:
            del scheduler.add
        assert right.completions.create(model="tiny-llama", prompt="x", max_tokens=2).choices


def test_extreme_sampling_parameters_are_safe_and_bad_ones_named(server, client, expected):
    """Issue 11 #10, #11, #18: temperature 2 with top_p 1e-300 once put NaN into sampling
    and killed the engine; top_k was ignored; seed >= 2**64 reset the connection."""
    greedy = expected("Once", "lora4", 8)
    for extra in ({"top_p": 1e-300}, {"top_k": 1}):
        body = {"model": "lora4", "prompt": "Once", "max_tokens": 8, "temperature": 2, **extra}
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == greedy, f"{extra} must leave one token"
    for field, value in (("seed", 2**64), ("top_k", -5)):
        body = {"model": "lora4", "prompt": "Once", "max_tokens": 2, field: value}
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
        assert response.status_code == 400, f"{field}={value}: {response.text}"
        assert response.json()["error"]["param"] == field
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    after = client.completions.create(model="lora4", prompt="Once", max_tokens=8, temperature=0)
    assert after.choices[0].text == greedy, "the engine did not go on after bad requests"


def test_requests_total_counts_http_requests_streamed_or_not(server, client):
    """A streamed request of 3 prompts counted 3 'ok' (one per prompt), a non-streamed
    one 1; a stream the client left was not counted at all."""

    def ok() -> float:
        lines = httpx.get(f"{server.url}/metrics").text.splitlines()
        return sum(
            float(line.split()[-1])
            for line in lines
            if line.startswith('symbiont_requests_total{outcome="ok"}')
        )

    before = ok()
    prompts = ["a", "b", "c"]
    client.completions.create(model="tiny-llama", prompt=prompts, max_tokens=2)
    assert ok() == before + 1
    for _ in client.completions.create(
        model="tiny-llama", prompt=prompts, max_tokens=2, stream=True
    ):
        pass
    assert ok() == before + 2


def test_stop_token_ids_end_a_choice(client, expected, model_dir):
    """vLLM's `stop_token_ids` was accepted and ignored (an unknown field)."""
    greedy = expected("Once", "lora4", 12)
    token = AutoTokenizer.from_pretrained(model_dir).convert_tokens_to_ids(greedy[3])
    cut = client.completions.create(
        model="lora4",
        prompt="Once",
        max_tokens=12,
        temperature=0,
        extra_body={"stop_token_ids": [token]},
    )
    assert cut.choices[0].text == greedy[: greedy.index(greedy[3])]  # the stop token left out
    assert cut.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(
            model="lora4", prompt="Once", max_tokens=2, extra_body={"stop_token_ids": "a"}
        )
    assert err.value.body["param"] == "stop_token_ids"


@pytest.mark.parametrize(
    "field, value, says",
    [
        ("max_tokens", "5", "valid integer"),
        ("max_tokens", True, "valid integer"),
        ("stream", "yes", "valid boolean"),
        ("temperature", float("nan"), "finite number"),
        ("top_p", float("inf"), "finite number"),
        ("prompt", [1.5, 2], "must be a string, a list of strings, a list of token ids"),
        ("prompt", 5, "must be a string, a list of strings, a list of token ids"),
        ("min_tokens", 3, "min_tokens is not implemented"),
    ],
)
def test_fields_are_typed_strictly_and_named(server, field, value, says):
    """'5' for max_tokens, true for 1 and 'yes' for true were read as numbers and flags;
    NaN was refused as 'less than or equal to 2'."""
    body = {"model": "tiny-llama", "prompt": "x", "max_tokens": 2, field: value}
    response = httpx.post(  # json.dumps writes NaN and Infinity, as some clients do
        f"{server.url}/v1/completions",
        content=json.dumps(body),
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert says in error["message"] and (error["param"] == field or field == "min_tokens"), error


def test_a_body_that_is_not_json_says_so(server):
    response = httpx.post(
        f"{server.url}/v1/completions",
        content=b"model=tiny-llama",
        headers={"content-type": "text/plain"},
        timeout=30,
    )
    assert response.status_code == 400
    assert "Content-Type: application/json" in response.json()["error"]["message"]


def test_an_adapter_name_with_a_slash_can_be_unloaded(server, client, adapters):
    url = f"{server.url}/v1/adapters"
    loaded = httpx.post(url, json={"name": "org/late", "path": str(adapters["lora8_attn"])})
    assert loaded.status_code == 200, loaded.text
    assert client.completions.create(model="org/late", prompt="hi", max_tokens=2).choices
    removed = httpx.delete(f"{url}/org/late")
    assert removed.status_code == 200, removed.text
    assert "org/late" not in {m.id for m in client.models.list().data}


def _requests_of(server, outcome: str) -> float:
    registry = server.state.metrics.registry
    return registry.get_sample_value("symbiont_requests_total", {"outcome": outcome}) or 0.0


def test_a_prompt_far_past_the_context_is_refused_from_its_head(server, client):
    """A prompt of megabytes was tokenized whole (seconds, holding the engine process's
    GIL) before the same refusal; refusals are now counted too."""
    before = _requests_of(server, "refused")
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny-llama", prompt="hello world " * 200_000, max_tokens=1)
    assert err.value.body["param"] == "prompt"
    assert "longer than the model's context" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="tiny-llama", messages=[{"role": "user", "content": "hi " * 400_000}]
        )
    assert err.value.body["param"] == "messages"
    assert _requests_of(server, "refused") == before + 2
    assert client.completions.create(model="tiny-llama", prompt="x", max_tokens=2).choices


def test_an_oversized_body_gets_413_from_an_async_client(server):
    """An asyncio client still sending when the 413 came got a connection reset instead."""
    limit = server.state.max_request_bytes

    async def main():
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        return await aclient.completions.create(
            model="tiny-llama", prompt="a" * (limit + 1_000_000), max_tokens=1
        )

    with pytest.raises(openai.APIStatusError) as err:
        asyncio.run(main())
    assert err.value.status_code == 413
    assert "--max-request-bytes" in err.value.body["message"]


def test_ready_reports_a_lost_executor_until_an_iteration_succeeds(server, client, monkeypatch):
    """A `serve --executor` whose serve-base was gone answered every request with a 500
    while every probe said ok, so traffic kept coming. /ready says so now; /health (a
    liveness probe: a restart cannot bring back a remote serve-base) stays ok."""
    from symbiont.protocol.executor import ExecutorUnavailable

    engine = server.state.engine.engine
    real = engine.runner.run

    def lost(scheduled):
        monkeypatch.setattr(engine.runner, "run", real)  # back for the next iteration
        raise ExecutorUnavailable("lost the base executor at tcp://127.0.0.1:7100: ...")

    monkeypatch.setattr(engine.runner, "run", lost)
    with pytest.raises(openai.InternalServerError, match="lost the base executor"):
        client.completions.create(model="tiny-llama", prompt="x", max_tokens=2)
    ready = httpx.get(f"{server.url}/ready")
    assert ready.status_code == 503, ready.text
    assert ready.json()["error"]["code"] == "executor_unavailable"
    assert "tcp://" not in ready.json()["error"]["message"], "an open endpoint named it"
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert client.completions.create(model="tiny-llama", prompt="x", max_tokens=2).choices
    assert httpx.get(f"{server.url}/ready").json() == {"status": "ok"}


def test_an_adapter_path_from_home_is_expanded(model_dir, adapters, tmp_path, monkeypatch):
    """`--adapter NAME=~/runs/x` as zsh, systemd or Python pass it, with the ~ kept."""
    monkeypatch.setenv("HOME", str(tmp_path))
    shutil.copytree(adapters["lora4"], tmp_path / "mine")
    config = ServerConfig(
        model=str(model_dir), adapters=(("mine", "~/mine"),), port=0, engine=ENGINE
    )
    with BackgroundServer(config) as server:
        cards = httpx.get(f"{server.url}/v1/models").json()["data"]
    assert {c["id"]: c["root"] for c in cards}["mine"] == str(tmp_path / "mine")
