"""`logprobs`, `echo`, `max_tokens: 0`, `/tokenize` and `/detokenize` over HTTP.

Issue 11 #17 and #18: every log-probability the server returns equals the log-softmax of
vanilla transformers + peft logits within 1e-5 (fp32), per adapter, while requests of
several adapters and the base share the engine's iterations; shapes follow the OpenAI
legacy completions, the OpenAI chat and vLLM's tokenizer routes.
"""

from __future__ import annotations

import asyncio
import json
import shutil

import httpx
import openai
import pytest
import torch
from transformers import AutoTokenizer

from symbiont.serve import EngineConfig
from symbiont.serve.config import ServerConfig
from symbiont.serve.http.server import BackgroundServer
from tests.test_serve_common import Reference, add_char_tokenizer, make_adapters

ATOL = 1e-5
# 16 tokens per iteration: the prompts below are prefilled in chunks, next to each other.
ENGINE = EngineConfig(max_running=8, max_batched_tokens=16, block_size=4, num_blocks=256)
MODELS = ["tiny-llama", "lora4", "lora16", "ia3"]
PROMPT = "The quick brown fox jumps over"


@pytest.fixture(scope="module")
def model_dir(checkpoints, tmp_path_factory):
    folder = tmp_path_factory.mktemp("served") / "tiny-llama"
    shutil.copytree(checkpoints("llama"), folder)
    return add_char_tokenizer(folder)


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    return make_adapters(model_dir, tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module", params=[False, True], ids=["in-process", "api-process"])
def server(request, model_dir, adapters):
    preloaded = tuple((name, str(adapters[name])) for name in MODELS[1:])
    config = ServerConfig(
        api_process=request.param, model=str(model_dir), adapters=preloaded, port=0, engine=ENGINE
    )
    with BackgroundServer(config) as running:
        yield running


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def reference(model_dir, adapters):
    return Reference(model_dir, adapters)


def name(tokenizer, token: int) -> str:
    """How the server shows a token (ids past the tokenizer's vocabulary by number)."""
    return tokenizer.decode([token]) if token < len(tokenizer) else f"token_id:{token}"


def adapter_of(model: str) -> str | None:
    return None if model == "tiny-llama" else model


def logsoftmax(reference: Reference, ids: list[int], model: str) -> torch.Tensor:
    return torch.log_softmax(reference.logits(ids, adapter_of(model)).float(), dim=-1)


def post_all(server, path: str, bodies: list[dict]) -> list[httpx.Response]:
    """Send the bodies at once, so the engine batches them together."""

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            return await asyncio.gather(*(client.post(path, json=b) for b in bodies))

    return asyncio.run(main())


def test_echo_with_max_tokens_zero_scores_the_prompt_per_adapter(server, tokenizer, reference):
    bodies = [
        {"model": m, "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 2} for m in MODELS
    ]
    ids = tokenizer(PROMPT).input_ids
    for model, response in zip(MODELS, post_all(server, "/v1/completions", bodies), strict=True):
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
        lp = choice["logprobs"]
        assert lp["tokens"] == [tokenizer.decode([t]) for t in ids]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        want = logsoftmax(reference, ids, model)
        for p in range(1, len(ids)):
            assert abs(lp["token_logprobs"][p] - float(want[p - 1, ids[p]])) <= ATOL, (model, p)
            top = lp["top_logprobs"][p]
            best = want[p - 1].topk(2)
            for token, value in zip(best.indices.tolist(), best.values.tolist(), strict=True):
                assert abs(top[name(tokenizer, token)] - value) <= ATOL
            assert lp["tokens"][p] in top and len(top) <= 3  # the N likeliest + the token
        special = set(tokenizer.all_special_ids)
        for token_id, token, offset in zip(ids, lp["tokens"], lp["text_offset"], strict=True):
            if token_id not in special:  # each token's text is in `text` where it says
                assert choice["text"][offset : offset + len(token)] == token, (token, offset)
        assert response.json()["usage"]["completion_tokens"] == 0


def test_generated_token_logprobs_are_raw_whatever_the_temperature(server, reference):
    bodies = [
        {
            "model": m,
            "prompt": PROMPT,
            "max_tokens": 6,
            "logprobs": 3,
            "temperature": t,
            "seed": 5,
            "return_tokens_as_token_ids": True,  # vLLM's extension: "token_id:<id>"
        }
        for m in MODELS
        for t in (0, 1.5)
    ]
    responses = post_all(server, "/v1/completions", bodies)
    tokenizer = AutoTokenizer.from_pretrained(reference.base_path)
    prompt = tokenizer(PROMPT).input_ids
    for body, response in zip(bodies, responses, strict=True):
        lp = response.json()["choices"][0]["logprobs"]
        assert all(t.startswith("token_id:") for t in lp["tokens"])
        generated = [int(t.removeprefix("token_id:")) for t in lp["tokens"]]
        assert len(generated) == response.json()["usage"]["completion_tokens"]
        want = logsoftmax(reference, prompt + generated, body["model"])
        for j, token in enumerate(generated):
            row = want[len(prompt) + j - 1]  # log-softmax before temperature (vLLM's default)
            assert abs(lp["token_logprobs"][j] - float(row[token])) <= ATOL, body
            assert len(lp["top_logprobs"][j]) in (3, 4)
        if body["temperature"] == 0:  # greedy: each token is the likeliest
            assert all(
                v == max(top.values())
                for v, top in zip(lp["token_logprobs"], lp["top_logprobs"], strict=True)
            )


def test_echo_with_generation_and_streaming_agree(server):
    body = {
        "model": "lora16",
        "prompt": "abcdefghijklmnopqrst",
        "max_tokens": 5,
        "echo": True,
        "logprobs": 1,
        "temperature": 0,
    }
    whole = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    choice = whole["choices"][0]
    assert choice["text"].startswith(body["prompt"])
    lp = choice["logprobs"]
    used = whole["usage"]
    assert len(lp["tokens"]) == used["prompt_tokens"] + used["completion_tokens"]
    assert lp["token_logprobs"][0] is None and None not in lp["token_logprobs"][1:]
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60
    ) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line[6:7] == "{"]
    streamed = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for event in events:
        for key in streamed:
            streamed[key] += event["choices"][0]["logprobs"][key]
    assert streamed == lp
    assert "".join(e["choices"][0]["text"] for e in events) == choice["text"]
    plain = httpx.post(f"{server.url}/v1/completions", json={**body, "echo": False}).json()
    assert choice["text"] == body["prompt"] + plain["choices"][0]["text"]


def test_chat_logprobs_with_the_openai_client(server, reference):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "Say something"}]
    out = client.chat.completions.create(
        model="ia3",
        messages=messages,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_tokens_as_token_ids": True},
    )
    content = out.choices[0].logprobs.content

    def token_id(token: str) -> int:
        return int(token.removeprefix("token_id:"))

    prompt = httpx.post(
        f"{server.url}/tokenize", json={"model": "ia3", "messages": messages}
    ).json()["tokens"]
    generated = [token_id(c.token) for c in content]
    want = logsoftmax(reference, prompt + generated, "ia3")
    for j, entry in enumerate(content):
        row = want[len(prompt) + j - 1]
        assert abs(entry.logprob - float(row[generated[j]])) <= ATOL
        assert entry.bytes == list(entry.token.encode())
        best = row.topk(2)
        assert [token_id(t.token) for t in entry.top_logprobs] == best.indices.tolist()
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            best.values.tolist(), abs=ATOL
        )
    plain = client.chat.completions.create(
        model="ia3", messages=messages, max_tokens=6, temperature=0
    )
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == out.choices[0].message.content


def test_bad_logprob_requests_name_the_field(server):
    url = f"{server.url}/v1"
    cases = [
        ("/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
        ("/completions", {"prompt": "x", "logprobs": -1}, "logprobs"),
        (
            "/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
            "top_logprobs",
        ),  # fmt: skip
    ]
    for path, body, field in cases:
        response = httpx.post(f"{url}{path}", json={"model": "lora4", **body})
        assert response.status_code == 400, (body, response.text)
        assert response.json()["error"]["param"] == field, response.text


def test_empty_stop_strings_are_ignored(server):
    body = {"model": "lora4", "prompt": "Once", "max_tokens": 8, "temperature": 0}
    url = f"{server.url}/v1/completions"
    want = httpx.post(url, json=body).json()["choices"][0]
    assert want["text"]
    for stop in ("", [""], ["", ""]):
        got = httpx.post(url, json={**body, "stop": stop}).json()["choices"][0]
        assert (got["text"], got["finish_reason"]) == (want["text"], want["finish_reason"])


def test_tokenize_and_detokenize(server, tokenizer):
    base = server.url
    out = httpx.post(f"{base}/tokenize", json={"model": "lora4", "prompt": "Hi there"}).json()
    assert out["tokens"] == tokenizer("Hi there").input_ids
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == 128
    bare = httpx.post(f"{base}/tokenize", json={"prompt": "Hi", "add_special_tokens": False})
    assert bare.json()["tokens"] == tokenizer("Hi", add_special_tokens=False).input_ids
    strs = httpx.post(f"{base}/tokenize", json={"prompt": "ab", "return_token_strs": True})
    assert strs.json()["token_strs"] == tokenizer.convert_ids_to_tokens(strs.json()["tokens"])
    chat = {"messages": [{"role": "user", "content": "Yo"}], "model": "tiny-llama"}
    ids = httpx.post(f"{base}/tokenize", json=chat).json()["tokens"]
    assert tokenizer.decode(ids) == "<user>Yo<assistant>"
    no_prompt = httpx.post(f"{base}/tokenize", json={**chat, "add_generation_prompt": False})
    assert tokenizer.decode(no_prompt.json()["tokens"]) == "<user>Yo"
    # add_special_tokens on a chat once called a method transformers 5 no longer has (500)
    special = httpx.post(f"{base}/tokenize", json={**chat, "add_special_tokens": True})
    assert special.json()["tokens"] == tokenizer("<user>Yo<assistant>").input_ids
    back = httpx.post(f"{base}/detokenize", json={"model": "ia3", "tokens": out["tokens"]})
    assert back.json() == {"prompt": tokenizer.decode(out["tokens"])}
    assert httpx.post(f"{base}/detokenize", json={"tokens": []}).json() == {"prompt": ""}

    for path, body, status, field in [
        ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model"),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": "x", **chat}, 400, "prompt"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/detokenize", {"tokens": [1, len(tokenizer)]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
        ("/detokenize", {"model": "nope", "tokens": [1]}, 404, "model"),
    ]:
        response = httpx.post(f"{base}{path}", json=body)
        assert response.status_code == status, (path, body, response.text)
        assert response.json()["error"]["param"] == field, (path, body, response.text)


def test_streamed_chat_logprobs_and_echo_with_n_equal_the_whole_response(server):
    chat = {
        "model": "lora4",
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 5,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 1,
    }
    completion = {
        "model": "lora4",
        "prompt": "Hey you",
        "max_tokens": 4,
        "temperature": 1.0,
        "seed": 3,
        "n": 2,
        "echo": True,
        "logprobs": 0,
    }
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", completion)):
        whole = httpx.post(f"{server.url}{path}", json=body, timeout=60).json()
        with httpx.stream(
            "POST", f"{server.url}{path}", json={**body, "stream": True}, timeout=60
        ) as response:
            events = [json.loads(line[6:]) for line in response.iter_lines() if line[6:7] == "{"]
        for choice in whole["choices"]:
            parts = [c for e in events for c in e["choices"] if c["index"] == choice["index"]]
            if path.startswith("/v1/chat"):
                content = [x for c in parts for x in c["logprobs"]["content"]]
                assert content == choice["logprobs"]["content"]
                assert len(content) == whole["usage"]["completion_tokens"]
                continue
            merged = {key: [] for key in choice["logprobs"]}
            for part in parts:
                for key in merged:
                    merged[key] += part["logprobs"][key]
            assert merged == choice["logprobs"]
            assert "".join(c["text"] for c in parts) == choice["text"]
            assert choice["text"].startswith(body["prompt"])


def test_echo_text_offsets_skip_the_bos_the_text_does_not_hold(tmp_path):
    """The default model's tokenizer adds <|bos|>; the echoed text is the prompt as sent.
    Offsets counted the BOS's 7 characters, so every offset pointed past its token."""
    import symbiont

    config = ServerConfig(model=str(symbiont.default_model()), port=0, engine=ENGINE)
    with BackgroundServer(config) as running:
        body = {"model": "default-v1", "prompt": "the fox", "max_tokens": 0, "echo": True}
        answer = httpx.post(f"{running.url}/v1/completions", json={**body, "logprobs": 1})
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    lp = choice["logprobs"]
    assert lp["tokens"][0] == "<|bos|>" and lp["text_offset"][:2] == [0, 0]
    for token, offset in zip(lp["tokens"][1:], lp["text_offset"][1:], strict=True):
        assert choice["text"][offset : offset + len(token)] == token, (token, offset)
