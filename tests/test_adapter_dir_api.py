"""`symbiont serve --adapter-dir DIR` over HTTP: every adapter folder of DIR served by its
name through the `openai` client, the cache watched in /v1/adapters and /metrics, bad
folders refused by name while the others serve."""

from __future__ import annotations

import asyncio
import shutil

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from symbiont.serve import EngineConfig
from symbiont.serve.config import ServerConfig
from symbiont.serve.http.server import BackgroundServer
from tests.test_serve_common import (
    Reference,
    add_char_tokenizer,
    ia3_config,
    lora_config,
    save_adapter,
)

ENGINE = EngineConfig(
    max_running=8, max_batched_tokens=32, block_size=4, num_blocks=256, max_adapters=2
)


@pytest.fixture(scope="module")
def model_dir(checkpoints, tmp_path_factory):
    folder = tmp_path_factory.mktemp("dir-served") / "tiny-llama"
    shutil.copytree(checkpoints("llama"), folder)
    return add_char_tokenizer(folder)


@pytest.fixture(scope="module")
def adapter_dir(model_dir, tmp_path_factory):
    """Three good adapters (more than the two slots) and a broken one."""
    root = tmp_path_factory.mktemp("tenants")
    save_adapter(model_dir, lora_config("llama", 4), root / "sql", seed=21)
    save_adapter(model_dir, lora_config("llama", 8), root / "chat", seed=22)
    save_adapter(model_dir, ia3_config("llama"), root / "tone", seed=23)
    shutil.copytree(root / "sql", root / "broken")
    (root / "broken" / "adapter_model.safetensors").write_bytes(b"garbage")
    return root


@pytest.fixture(scope="module")
def server(model_dir, adapter_dir):
    config = ServerConfig(model=str(model_dir), port=0, engine=ENGINE, adapter_dir=str(adapter_dir))
    with BackgroundServer(config) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def expected(model_dir, adapter_dir):
    reference = Reference(model_dir, {p.name: p for p in adapter_dir.iterdir()})
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def text(prompt: str, adapter: str | None, max_tokens: int) -> str:
        out = reference.generate(tokenizer(prompt).input_ids, adapter, max_tokens)
        return tokenizer.decode(out, skip_special_tokens=True)

    return text


def adapter_cards(server) -> dict[str, dict]:
    data = httpx.get(f"{server.url}/v1/adapters").json()["data"]
    return {card["id"]: card for card in data}


def metric(server, name: str) -> float:
    """Sum of every series of `name` in /metrics."""
    lines = httpx.get(f"{server.url}/metrics").text.splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith(name))


def test_folder_adapters_are_listed_before_first_use(server, client):
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"tiny-llama", "sql", "chat", "tone"}, "failed adapters are not models"
    assert models["chat"].model_extra["parent"] == "tiny-llama"
    cards = adapter_cards(server)
    assert cards["sql"]["method"] == "lora" and cards["sql"]["rank"] == 4
    assert cards["tone"]["method"] == "ia3" and cards["chat"]["bytes"] > 0
    assert {c["state"] for n, c in cards.items() if n != "broken"} <= {"disk", "host", "resident"}


def test_concurrent_requests_load_each_adapter_once_and_equal_vanilla_peft(server, expected):
    """Twelve concurrent requests over three cold adapters and two slots."""
    loads_before = metric(server, 'symbiont_adapter_loads_total{outcome="ok"}')

    async def main():
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        jobs = [(f"hello {i}", ["sql", "chat", "tone", "tiny-llama"][i % 4]) for i in range(12)]
        calls = [
            aclient.completions.create(model=m, prompt=p, max_tokens=8, temperature=0)
            for p, m in jobs
        ]
        return jobs, await asyncio.gather(*calls)

    jobs, outs = asyncio.run(main())
    for (prompt, model), out in zip(jobs, outs, strict=True):
        adapter = None if model == "tiny-llama" else model
        assert out.choices[0].text == expected(prompt, adapter, 8), f"{model}: {prompt!r}"
    loads = metric(server, 'symbiont_adapter_loads_total{outcome="ok"}') - loads_before
    assert loads <= 3, f"{loads} loads for 3 adapters: concurrent requests loaded one twice"
    cards = adapter_cards(server)
    assert all(cards[n]["hits"] == 3 and cards[n]["last_use"] for n in ("sql", "chat", "tone"))
    assert [cards[n]["state"] for n in ("sql", "chat", "tone")].count("resident") <= 2
    assert all(cards[n]["in_use"] == 0 for n in ("sql", "chat", "tone"))


def test_streaming_chat_on_a_folder_adapter(client, expected):
    chunks = client.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
        temperature=0, stream=True,
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = client.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0
    )
    assert text == whole.choices[0].message.content


def test_broken_adapter_is_refused_by_name_and_others_serve(server, client, expected):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="broken", prompt="x", max_tokens=2)
    body = err.value.body
    assert "'broken'" in body["message"] and "cannot read" in body["message"]
    assert body["param"] == "model" and body["code"] == "adapter_failed"
    card = adapter_cards(server)["broken"]
    assert card["state"] == "failed" and "cannot read" in card["reason"]
    again = httpx.post(
        f"{server.url}/v1/completions", json={"model": "broken", "prompt": "x", "max_tokens": 2}
    )
    assert again.status_code == 400 and "'broken'" in again.json()["error"]["message"]
    ok = client.completions.create(model="sql", prompt="still", max_tokens=5, temperature=0)
    assert ok.choices[0].text == expected("still", "sql", 5)


def test_a_folder_adapter_cannot_be_unloaded_by_name(server):
    response = httpx.delete(f"{server.url}/v1/adapters/sql")
    assert response.status_code == 400 and "--adapter-dir" in response.json()["error"]["message"]
    assert httpx.delete(f"{server.url}/v1/adapters/nobody").status_code == 404


@pytest.mark.parametrize("name", ["nobody", "../tenants/sql", "sql/..", "a\u0000b"])
def test_unknown_names_are_404_saying_how_to_list(client, name):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model=name, prompt="x", max_tokens=2)
    assert "/v1/adapters" in err.value.body["message"] and err.value.body["param"] == "model"


def test_a_folder_added_while_serving_is_served(server, client, adapter_dir, expected):
    shutil.copytree(adapter_dir / "tone", adapter_dir / "tone-copy")
    out = client.completions.create(model="tone-copy", prompt="new", max_tokens=5, temperature=0)
    assert out.choices[0].text == expected("new", "tone", 5)
    assert "tone-copy" in {m.id for m in client.models.list().data}


def test_cache_metrics(server, client):
    client.completions.create(model="sql", prompt="m", max_tokens=2)
    text = httpx.get(f"{server.url}/metrics").text
    for series in [
        'symbiont_adapter_cache_lookups_total{result="hit",tier="resident"}',
        'symbiont_adapter_cache_lookups_total{result="miss",tier="host"}',
        "symbiont_adapter_load_seconds_count",
        'symbiont_adapter_cache_adapters{state="failed"} 1.0',
        'symbiont_adapter_requests_total{adapter="sql"}',
    ]:
        assert series in text, series
    assert metric(server, 'symbiont_adapter_evictions_total{tier="resident"}') >= 1


def test_post_adapters_makes_room_and_leaves_the_folder_a_slot(model_dir, adapter_dir, expected):
    """POST /v1/adapters went around the slot rules `--adapter` follows: with idle folder
    adapters in both slots it failed ('all slots in use'), and two loads took every slot,
    so requests for folder adapters then waited forever."""
    config = ServerConfig(model=str(model_dir), port=0, engine=ENGINE, adapter_dir=str(adapter_dir))
    with BackgroundServer(config) as server:
        api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        for name in ("sql", "chat"):  # both slots now hold idle folder adapters
            api.completions.create(model=name, prompt="ab", max_tokens=2, temperature=0)
        first = httpx.post(f"{server.url}/v1/adapters", json={"name": "named", "path": "tone"})
        assert first.status_code == 200, first.text  # an idle folder adapter made room
        second = httpx.post(f"{server.url}/v1/adapters", json={"name": "more", "path": "sql"})
        assert second.status_code == 400, second.text
        assert "would leave no adapter slot for --adapter-dir" in second.json()["error"]["message"]
        got = api.completions.create(model="chat", prompt="ab", max_tokens=4, temperature=0)
        assert got.choices[0].text == expected("ab", "chat", 4)  # folder adapters still serve
