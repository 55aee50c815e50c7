"""HTTP fuzz test over the server's own OpenAPI schema (issue 11, "tests that keep it true").

Schemathesis generates requests for every operation the schema lists, both ones that fit
it (positive) and ones that break it on purpose (negative: wrong types, missing fields,
out-of-range numbers), and they are sent to a real server on a tiny model. No answer may
be a 5xx or a dropped connection, every 4xx is in OpenAI's error shape, and afterwards
the server is alive and exact: a greedy completion equals the one from before.

A second pass uses the schema with `model` narrowed to the served names, so that many
requests really generate (with random sampling fields) instead of stopping at 404.
Bounded: examples are fixed per pass (derandomized, so CI runs the same cases) and the
whole test stops sending after FUZZ_SECONDS.
"""

from __future__ import annotations

import copy
import shutil
import time

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis", reason="pip install -e '.[dev]'")
from hypothesis import HealthCheck, given, settings  # noqa: E402 - after the skip check
from schemathesis import GenerationMode  # noqa: E402

from symbiont.serve import EngineConfig  # noqa: E402
from symbiont.serve.config import ServerConfig  # noqa: E402
from symbiont.serve.http.server import BackgroundServer  # noqa: E402
from tests.test_serve_common import add_char_tokenizer, lora_config, save_adapter  # noqa: E402

FUZZ_SECONDS = 40.0  # total time spent sending requests
EXAMPLES = 150  # per pass and generation mode
ENGINE = EngineConfig(max_running=8, max_batched_tokens=64, block_size=4, num_blocks=256)
GREEDY = {"model": "tiny-llama", "prompt": "The cat", "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def server(checkpoints, tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz") / "tiny-llama"
    shutil.copytree(checkpoints("llama"), folder)
    add_char_tokenizer(folder)
    root = tmp_path_factory.mktemp("fuzz-adapters")
    save_adapter(folder, lora_config("llama", 4), root / "lora", seed=3)
    config = ServerConfig(
        model=str(folder),
        adapters=(("lora", str(root / "lora")),),
        adapter_dir=str(root),
        port=0,
        engine=ENGINE,
        max_request_bytes=1024 * 1024,
    )
    with BackgroundServer(config) as running:
        yield running


def _greedy(url: str) -> str:
    response = httpx.post(f"{url}/v1/completions", json=GREEDY, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def _served_models_only(schema: dict) -> dict:
    """The schema with every request's `model` limited to the names the server serves."""
    narrowed = copy.deepcopy(schema)
    for component in narrowed["components"]["schemas"].values():
        if "model" in component.get("properties", {}):
            component["properties"]["model"] = {"type": "string", "enum": ["tiny-llama", "lora"]}
    return narrowed


def _fuzz(schema, url: str, deadline: float, failures: list) -> int:
    """Send EXAMPLES positive and EXAMPLES negative cases; returns how many were sent."""
    sent = [0]
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=schema.as_strategy(mode))
        def run(case):
            if time.monotonic() > deadline:
                return
            sent[0] += 1
            try:
                response = case.call(base_url=url, timeout=30)
            except Exception as err:  # noqa: BLE001 - a dropped connection is a finding
                failures.append(f"{case.method} {case.formatted_path} {case.body!r}: {err!r}")
                return
            problem = _problem(response)
            if problem:
                body = repr(case.body)[:300]
                failures.append(f"{case.method} {case.formatted_path} {body}: {problem}")

        run()
    return sent[0]


def _problem(response) -> str | None:
    status = response.status_code
    if status >= 500:
        return f"{status} {response.text[:300]}"
    if 400 <= status < 500:
        try:
            error = response.json()["error"]
        except (ValueError, KeyError, TypeError):
            return f"{status} not in OpenAI's error shape: {response.text[:300]}"
        if set(error) != {"message", "type", "param", "code"} or not error["message"]:
            return f"{status} not in OpenAI's error shape: {error}"
    return None


def test_fuzzing_the_openapi_schema_finds_no_5xx_and_leaves_the_server_exact(server):
    url = server.url
    before = _greedy(url)
    raw = httpx.get(f"{url}/openapi.json").json()
    schemas = [
        schemathesis.openapi.from_dict(raw),
        schemathesis.openapi.from_dict(_served_models_only(raw)),
    ]
    started = time.monotonic()
    deadline = started + FUZZ_SECONDS
    failures: list[str] = []
    sent = sum(_fuzz(schema, url, deadline, failures) for schema in schemas)
    assert time.monotonic() - started < 60, "the fuzz test must stay bounded"
    assert not failures, f"{len(failures)} of {sent} requests failed:\n" + "\n".join(failures[:20])
    assert sent >= 100, f"only {sent} requests were sent"
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    assert _greedy(url) == before, "the server answers differently after the fuzzing"
