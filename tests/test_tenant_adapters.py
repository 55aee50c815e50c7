"""With `--tenants`, who may unload an adapter: a tenant unloads what it loaded with
POST /v1/adapters; what the operator loaded at start (`--adapter`) and what another tenant
loaded serve every tenant and stay, with a 403 that says why."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from symbiont.serve import EngineConfig
from symbiont.serve.config import ServerConfig
from symbiont.serve.http.server import BackgroundServer
from tests.test_serve_common import add_char_tokenizer, lora_config, save_adapter

ENGINE = EngineConfig(max_running=4, max_batched_tokens=16, block_size=4, num_blocks=64)
KEYS = {"alice": "alice-key", "bob": "bob-key"}


@pytest.fixture(scope="module")
def server(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("tenant-adapters")
    model = add_char_tokenizer(shutil.copytree(checkpoints("llama"), root / "tiny-llama"))
    save_adapter(model, lora_config("llama", 4), root / "adapters" / "shared", seed=31)
    save_adapter(model, lora_config("llama", 2), root / "adapters" / "extra", seed=32)
    (root / "tenants.json").write_text(json.dumps({t: {"api_key": k} for t, k in KEYS.items()}))
    config = ServerConfig(
        model=str(model),
        port=0,
        engine=ENGINE,
        adapters=(("shared", str(root / "adapters" / "shared")),),
        adapter_dir=str(root / "adapters"),
        tenants=str(root / "tenants.json"),
    )
    with BackgroundServer(config) as running:
        yield running


def http(server, tenant: str) -> httpx.Client:
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
    return httpx.Client(base_url=server.url, headers=headers, timeout=60)


def complete(api: httpx.Client, model: str) -> httpx.Response:
    body = {"model": model, "prompt": "hello", "max_tokens": 2, "temperature": 0}
    return api.post("/v1/completions", json=body)


def test_a_tenant_cannot_unload_what_the_operator_loaded(server):
    with http(server, "alice") as alice, http(server, "bob") as bob:
        refused = bob.delete("/v1/adapters/shared")
        assert refused.status_code == 403, refused.text
        error = refused.json()["error"]
        assert error["code"] == "adapter_not_yours"
        assert "loaded by the operator, at start" in error["message"]
        assert complete(alice, "shared").status_code == 200


def test_a_tenant_unloads_what_it_loaded_and_nobody_else_does(server):
    with http(server, "alice") as alice, http(server, "bob") as bob:
        loaded = alice.post("/v1/adapters", json={"name": "alices", "path": "extra"})
        assert loaded.status_code == 200, loaded.text
        assert loaded.json()["path"] == "extra", "a tenant was shown the host's folder"
        outside = alice.post("/v1/adapters", json={"name": "x", "path": "/etc"})
        assert outside.status_code == 403 and "(" not in outside.json()["error"]["message"]
        refused = bob.delete("/v1/adapters/alices")
        assert refused.status_code == 403, refused.text
        assert "loaded by another tenant" in refused.json()["error"]["message"]
        assert complete(bob, "alices").status_code == 200  # it still serves every tenant
        assert alice.delete("/v1/adapters/alices").status_code == 200
        assert alice.delete("/v1/adapters/alices").status_code == 404
        # once unloaded, the name is free: whoever loads it next owns it
        assert bob.post("/v1/adapters", json={"name": "alices", "path": "extra"}).status_code == 200
        assert alice.delete("/v1/adapters/alices").status_code == 403
        assert bob.delete("/v1/adapters/alices").status_code == 200


def test_unknown_names_are_still_404(server):
    with http(server, "bob") as bob:
        assert bob.delete("/v1/adapters/nobody").status_code == 404
