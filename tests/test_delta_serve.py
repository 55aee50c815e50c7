"""`symbiont serve --delta`: compressed full fine-tunes served per row in shared batches.

References: `symbiont delta merge` + vanilla transformers for a delta, vanilla peft for an
adapter, vanilla transformers for the base; greedy tokens equal, logits within 1e-4 fp32.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import time

import httpx
import openai
import pytest
import torch
from transformers import AutoTokenizer

from symbiont import BaseExecutor, load_client
from symbiont.delta import CompressConfig, load_delta, merge_checkpoint
from symbiont.delta.compress import compress
from symbiont.serve import Engine, EngineConfig, Request, SamplingParams
from symbiont.serve.adapter_cache import AdapterFailed, AdapterState
from symbiont.serve.adapters import AdapterError
from symbiont.serve.config import ServerConfig
from symbiont.serve.http.server import BackgroundServer
from tests.test_adapter_cache import run_all
from tests.test_delta import perturbed_copy
from tests.test_serve_common import Reference, add_char_tokenizer, make_adapters, prompts
from tests.test_serve_engine import GREEDY, SMALL, WIDE
from tests.tiny_models import VOCAB

LOGITS_ATOL = 1e-4


@pytest.fixture(scope="module")
def served(checkpoints, tmp_path_factory):
    """(base, delta folder, adapters, reference for the base and adapters, reference for
    the merged delta)."""
    root = tmp_path_factory.mktemp("delta_serve")
    base = add_char_tokenizer(shutil.copytree(checkpoints("llama"), root / "tiny-llama"))
    finetuned = perturbed_copy(base, root / "ft", seed=3)
    calibration = torch.randint(0, VOCAB, (16, 24), generator=torch.Generator().manual_seed(4))
    compress(base, finetuned, root / "delta", calibration, CompressConfig(group_size=16))
    merged = merge_checkpoint(base, root / "delta", root / "merged")
    adapters = make_adapters(base, root / "adapters")
    return base, root / "delta", adapters, Reference(base, adapters), Reference(merged, {})


def engine_with(base, delta_dir, adapters=None, config=SMALL, hot=False) -> Engine:
    engine = Engine(load_client(base, BaseExecutor.from_pretrained(base)), config)
    engine.load_delta("ft", delta_dir, base)
    if hot:  # the same delta once more, applied merged (dense Δ̃ kept)
        engine.load_delta("hot", delta_dir, mode="merged")
    for name, path in (adapters or {}).items():
        engine.load_adapter(name, path)
    return engine


def want(served, prompt, name, max_tokens):
    _, _, _, reference, merged = served
    if name in ("ft", "hot"):
        return merged.generate(prompt, None, max_tokens)
    return reference.generate(prompt, name, max_tokens)


def test_delta_greedy_output_equals_merged_checkpoint(served):
    base, delta_dir, _, _, merged = served
    engine = engine_with(base, delta_dir)
    batch = prompts(3, seed=1)
    outputs = engine.generate(batch, ["ft"] * 3, GREEDY)
    for prompt, got in zip(batch, outputs, strict=True):
        assert got == merged.generate(prompt, None, GREEDY.max_tokens)
    base_outputs = engine.generate(batch, [None] * 3, GREEDY)
    assert base_outputs != outputs, "the delta changes the output (else this proves nothing)"
    assert "ft" in engine.adapters.names(), "listed like an adapter (GET /v1/models)"


def test_mixed_batch_of_delta_adapters_and_base(served):
    base, delta_dir, adapters, _, _ = served
    engine = engine_with(base, delta_dir, adapters)
    names = [None, "ft", *adapters, "ft", None]
    batch = prompts(len(names), seed=7)
    outputs = engine.generate(batch, names, GREEDY)
    for prompt, name, got in zip(batch, names, outputs, strict=True):
        assert got == want(served, prompt, name, GREEDY.max_tokens), f"{name} differs"
    assert engine.kv_cache.allocator.num_free == SMALL.num_blocks, "KV blocks leaked"


def test_merged_mode_shares_a_batch_with_exact_mode(served):
    base, delta_dir, adapters, _, _ = served
    engine = engine_with(base, delta_dir, adapters, hot=True)
    names = ["hot", None, "ft", next(iter(adapters)), "hot"]
    batch = prompts(len(names), seed=11)
    outputs = engine.generate(batch, names, GREEDY)
    for prompt, name, got in zip(batch, names, outputs, strict=True):
        assert got == want(served, prompt, name, GREEDY.max_tokens), f"{name} differs"
    weights = engine.deltas.by_slot
    modes = {w.mode for w in weights.values()}
    assert modes == {"exact", "merged"} and len(weights) == 2
    exact, merged = sorted(weights.values(), key=lambda w: w.mode)
    assert merged.nbytes > 4 * exact.nbytes, "merged keeps dense Δ̃, exact the packed bytes"


def test_pinned_deltas_beyond_max_deltas_are_refused(served):
    base, delta_dir, _, _, _ = served
    engine = engine_with(base, delta_dir, config=dataclasses.replace(SMALL, max_deltas=1))
    with pytest.raises(AdapterError, match="raise --max-deltas"):
        engine.load_delta("second", delta_dir, mode="merged")
    assert engine.adapters.names() == ["ft"]


def test_parse_delta_mode_suffix(tmp_path):
    from symbiont.serve.config import parse_delta

    assert parse_delta("a=runs/d") == ("a", "runs/d")
    assert parse_delta("a=runs/d:merged") == ("a", "runs/d", "merged")
    assert parse_delta("a=c:/x:exact") == ("a", "c:/x", "exact")
    colon = tmp_path / "d:other"
    colon.mkdir()
    assert parse_delta(f"a={colon}") == ("a", str(colon)), "a folder: not a mode"
    # a typo'd mode was read as a folder, then refused as having no manifest.json
    with pytest.raises(ValueError, match="unknown mode 'hot'; write DIR:MODE with exact or merged"):
        parse_delta("a=runs/d:hot")
    with pytest.raises(ValueError, match="NAME=DIR"):
        parse_delta("runs/d")
    from symbiont.cli import build_parser
    from symbiont.cli.serve import configs

    argv = ["serve", "--model", "m", "--delta", "a=d1:merged", "--delta", "b=d2"]
    argv += ["--max-deltas", "3", "--delta-mode", "merged", "--max-skips", "0"]
    config = configs(build_parser("serve").parse_args(argv))
    assert config.deltas == (("a", "d1", "merged"), ("b", "d2"))
    engine = config.engine
    assert (engine.max_deltas, engine.delta_mode, engine.max_skips) == (3, "merged", 0)


@pytest.mark.parametrize("hot", [False, True], ids=["exact", "merged"])
def test_logits_within_tolerance_in_a_mixed_batch(served, monkeypatch, hot):
    base, delta_dir, adapters, reference, merged = served
    engine = engine_with(base, delta_dir, adapters, config=WIDE, hot=hot)
    captured = []
    forward = engine.runner.forward
    monkeypatch.setattr(
        engine.runner, "forward", lambda b: captured.append(forward(b)) or captured[-1]
    )
    names = ["hot" if hot else "ft", None, next(iter(adapters)), "ft"]
    batch = prompts(len(names), seed=9)
    for i, (p, name) in enumerate(zip(batch, names, strict=True)):
        engine.add_request(Request(f"q{i}", p, name, SamplingParams(max_tokens=1, temperature=0)))
    engine.step()  # one row of logits per request, in arrival order
    for i, (p, name) in enumerate(zip(batch, names, strict=True)):
        ref = merged.logits(p, None) if name in ("ft", "hot") else reference.logits(p, name)
        got = captured[0][i]
        assert torch.allclose(got, ref[-1], atol=LOGITS_ATOL), (
            f"request {i} ({name}): max |diff| {float((got - ref[-1]).abs().max()):.2e}"
        )


def test_bad_deltas_refused_with_reason(served, checkpoints, tmp_path):
    base, delta_dir, _, _, _ = served
    engine = Engine(load_client(base, BaseExecutor.from_pretrained(base)), SMALL)
    with pytest.raises(AdapterError, match="another model"):
        engine.load_delta("other", delta_dir, checkpoints("qwen2"))
    tampered = tmp_path / "tampered"
    tampered.mkdir()
    for file in delta_dir.iterdir():
        (tampered / file.name).write_bytes(file.read_bytes())
    data = tampered / "delta.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-10] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(AdapterError, match="delta 'bad'.*sha256"):
        engine.load_delta("bad", tampered, base)
    assert engine.adapters.names() == [], "nothing loaded half-way"
    assert engine.generate([[5, 6, 7]], [None], GREEDY), "the engine keeps serving"


def compressed_pair(base, root):
    finetuned = perturbed_copy(base, root / "ft", seed=5)
    calibration = torch.randint(0, VOCAB, (8, 16), generator=torch.Generator().manual_seed(6))
    compress(base, finetuned, root / "delta", calibration, CompressConfig(group_size=16))
    return root / "delta"


def test_bias_deltas_are_served_exactly(checkpoints, tmp_path):
    """qwen2 has q/k/v biases: their deltas are added to the delta's rows."""
    base = checkpoints("qwen2")
    delta_dir = compressed_pair(base, tmp_path)
    assert any(name.endswith("q_proj.bias") for name in load_delta(delta_dir).params)
    merged = Reference(merge_checkpoint(base, delta_dir, tmp_path / "merged"), {})
    engine = engine_with(base, delta_dir)
    batch = prompts(3, seed=2)
    outputs = engine.generate(batch, ["ft", None, "ft"], GREEDY)
    plain = Reference(base, {})
    for prompt, name, got in zip(batch, ["ft", None, "ft"], outputs, strict=True):
        ref = merged if name else plain
        assert got == ref.generate(prompt, None, GREEDY.max_tokens), f"{name} differs"


def test_delta_changing_tied_embeddings_is_refused(checkpoints, tmp_path):
    base = checkpoints("gemma2")
    delta_dir = compressed_pair(base, tmp_path)
    engine = Engine(load_client(base, BaseExecutor.from_pretrained(base)), SMALL)
    with pytest.raises(AdapterError, match="ties to its output layer.*symbiont delta merge"):
        engine.load_delta("ft", delta_dir, base)
    assert engine.adapters.names() == []


def test_openai_client_over_http(served, delta_dir_folder):
    base, delta_dir, adapters, reference, merged = served
    for name in ("lora4", "ia3", "ft2", "tampered"):
        shutil.rmtree(delta_dir_folder / name)
    (delta_dir_folder / "ft").rename(delta_dir_folder / "dft")  # a delta of --adapter-dir
    config = ServerConfig(
        adapter_dir=str(delta_dir_folder),
        model=str(base),
        adapters=(("lora4", str(adapters["lora4"])),),
        deltas=(("ft", str(delta_dir)), ("hot", str(delta_dir), "merged")),
        port=0,
        engine=EngineConfig(max_running=8, max_batched_tokens=24, block_size=4, num_blocks=256),
    )
    tokenizer = AutoTokenizer.from_pretrained(base)
    ids = tokenizer("The cat").input_ids
    with BackgroundServer(config) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        models = {m.id: m for m in client.models.list().data}
        assert set(models) == {"tiny-llama", "lora4", "ft", "hot", "dft"}
        assert models["ft"].model_extra["parent"] == "tiny-llama"
        cards = {c["id"]: c for c in httpx.get(f"{server.url}/v1/adapters").json()["data"]}
        assert cards["other-base"]["method"] == "delta" and cards["other-base"]["state"] == (
            "failed"
        )
        assert "another model" in cards["other-base"]["reason"]
        for model, ref, adapter in [
            ("ft", merged, None),
            ("hot", merged, None),
            ("dft", merged, None),
            ("lora4", reference, "lora4"),
            ("tiny-llama", reference, None),
        ]:
            out = client.completions.create(model=model, prompt=ids, max_tokens=8, temperature=0)
            assert out.choices[0].text == tokenizer.decode(
                ref.generate(ids, adapter, 8), skip_special_tokens=True
            ), model
        refused = httpx.delete(f"{server.url}/v1/adapters/ft")
        assert refused.status_code == 400 and "stays loaded" in refused.text


def _copy(folder, to):
    shutil.copytree(folder, to)
    return to


@pytest.fixture
def delta_dir_folder(served, tmp_path):
    """--adapter-dir with two LoRA adapters, two good deltas, a delta of another base and
    a tampered one."""
    base, delta_dir, adapters, _, _ = served
    root = tmp_path / "dir"
    root.mkdir()
    for name in ("lora4", "ia3"):
        _copy(adapters[name], root / name)
    for name in ("ft", "ft2", "other-base", "tampered"):
        _copy(delta_dir, root / name)
    manifest = root / "other-base" / "manifest.json"
    record = json.loads(manifest.read_text())
    record["base"]["fingerprint"] = "0" * len(record["base"]["fingerprint"])
    manifest.write_text(json.dumps(record))
    data = root / "tampered" / "delta.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-10] ^= 0xFF
    data.write_bytes(bytes(raw))
    return root


def test_deltas_under_adapter_dir_share_the_cache(served, delta_dir_folder, one_thread):
    """Deltas of --adapter-dir are found by their manifest, loaded on demand, evicted by
    the cache (at most --max-deltas resident), and equal `delta merge` + transformers;
    bad ones fail alone with their reason."""
    base = served[0]
    config = EngineConfig(
        max_running=8, max_batched_tokens=64, block_size=4, num_blocks=128, max_adapters=2,
        max_deltas=1,
    )  # fmt: skip
    engine = Engine(load_client(base, BaseExecutor.from_pretrained(base)), config)
    cache = engine.attach_adapter_dir(delta_dir_folder)
    cards = {card["id"]: card for card in cache.cards()}
    assert {n: c["method"] for n, c in cards.items() if c["method"] == "delta"}.keys() == {
        "ft", "ft2", "other-base", "tampered"
    }  # fmt: skip
    assert cards["other-base"]["state"] == "failed"
    assert "another model" in cards["other-base"]["reason"]
    assert cards["tampered"]["state"] == "disk", "file hashes are checked when loaded"
    with pytest.raises(AdapterFailed, match="'other-base'.*another model"):
        engine.add_request(Request("x", [3, 4], "other-base", GREEDY))
    names = ["ft", "ft2", "lora4", "tampered", None, "ft2", "ia3", "ft"]
    batch = prompts(len(names), seed=13)
    pairs = enumerate(zip(batch, names, strict=True))
    requests = [Request(f"r{i}", p, name, GREEDY) for i, (p, name) in pairs]
    run_all(engine, requests)
    bad = requests[names.index("tampered")]
    assert "adapter 'tampered' cannot be served" in bad.error and "sha256" in bad.error
    for prompt, name, request in zip(batch, names, requests, strict=True):
        if name != "tampered":
            assert request.error is None, request.error
            reference_name = "ft" if name == "ft2" else name  # ft2: a copy of ft
            assert request.sequences[0].output_ids == want(
                served, prompt, reference_name, GREEDY.max_tokens
            ), name
    cards = {card["id"]: card for card in cache.cards()}
    assert cards["tampered"]["state"] == "failed"
    resident = [n for n, c in cards.items() if c["method"] == "delta" and c["state"] == "resident"]
    assert len(resident) == 1, "at most --max-deltas deltas resident"
    assert {cards["ft"]["state"], cards["ft2"]["state"]} == {"resident", "host"}
    assert engine.deltas is None or len(engine.deltas.by_slot) <= 1
    assert engine.kv_cache.allocator.num_free == config.num_blocks, "KV blocks leaked"


def _flood(base, folder, max_skips: int, steps: int):
    """A flood for the resident delta `ft` (2 requests per iteration, more than the engine
    drains) and one request for `ft2`, which is not resident (--max-deltas 1). -> (the
    lone request, flood requests that arrived after it and started before it)."""
    config = EngineConfig(
        max_running=4, max_batched_tokens=64, block_size=4, num_blocks=512, max_adapters=2,
        max_deltas=1, max_skips=max_skips, max_queue=4096,
    )  # fmt: skip
    engine = Engine(load_client(base, BaseExecutor.from_pretrained(base)), config)
    cache = engine.attach_adapter_dir(folder)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    flood = []

    def add_ft():
        flood.append(Request(f"f{len(flood)}", [3, 4, 5], "ft", params))
        engine.add_request(flood[-1])

    add_ft()
    while cache.state("ft") is not AdapterState.RESIDENT:
        engine.step()
        time.sleep(0.002)
    for _ in range(6):
        add_ft()
    lone = Request("lone", [3, 4, 5], "ft2", params)
    engine.add_request(lone)
    arrived = len(flood)
    deadline = time.monotonic() + 60
    while cache.state("ft2") is not AdapterState.HOST:  # loaded: only a slot is missing
        assert time.monotonic() < deadline, f"ft2 did not load: {cache.lookup('ft2').reason}"
        time.sleep(0.002)
    for _ in range(steps):
        add_ft()
        add_ft()
        engine.step()
        if lone.sequences[0].admitted_at is not None:
            break
    started = lone.sequences[0].admitted_at or float("inf")
    skipped = [r for r in flood[arrived:] if (r.sequences[0].admitted_at or float("inf")) < started]
    while lone.sequences[0].admitted_at is not None and not lone.finished:
        engine.step()
    return lone, skipped


@pytest.mark.parametrize("max_skips", [0, 3])
def test_skipping_the_line_is_bounded(served, delta_dir_folder, one_thread, max_skips):
    """Requests for the resident delta start ahead of one waiting for a slot, at most
    --max-skips of them; then the waiting one gets its slot and its tokens are right."""
    lone, skipped = _flood(served[0], delta_dir_folder, max_skips, steps=200)
    assert lone.finished and lone.error is None, "starved"
    assert len(skipped) == max_skips, f"{len(skipped)} skipped, max_skips={max_skips}"
    assert lone.sequences[0].output_ids == want(served, [3, 4, 5], "ft", 4)


def test_unbounded_skipping_starves_the_waiting_request(served, delta_dir_folder, one_thread):
    """Why the bound: with no limit the flood keeps the resident delta busy forever."""
    lone, skipped = _flood(served[0], delta_dir_folder, max_skips=10**6, steps=60)
    assert lone.sequences[0].admitted_at is None and len(skipped) > 20


def test_engine_config_refuses_bad_delta_limits():
    with pytest.raises(ValueError, match="max_deltas must be >= 1"):
        EngineConfig(max_deltas=0)
    with pytest.raises(ValueError, match="max_skips must be >= 0"):
        EngineConfig(max_skips=-1)
    with pytest.raises(ValueError, match="hot"):
        EngineConfig(delta_mode="hot")


def _delta_folder(delta_dir, to, edit=None):
    """A copy of `delta_dir` at `to`, its manifest changed by `edit(record)`."""
    _copy(delta_dir, to)
    if edit is not None:
        manifest = to / "manifest.json"
        record = json.loads(manifest.read_text())
        edit(record)
        manifest.write_text(json.dumps(record))
    return to


def _zstd_bomb(folder, inflated_bytes: int) -> None:
    """A data file of `inflated_bytes` zeros, zstd-compressed, with a matching manifest."""
    import hashlib

    import zstandard

    (folder / "delta.safetensors").unlink()
    payload = zstandard.ZstdCompressor().compress(bytes(inflated_bytes))
    (folder / "delta.safetensors.zst").write_bytes(payload)
    manifest = folder / "manifest.json"
    record = json.loads(manifest.read_text())
    sha = hashlib.sha256(payload).hexdigest()
    record["files"] = {"delta.safetensors.zst": {"sha256": sha, "bytes": len(payload)}}
    manifest.write_text(json.dumps(record))


def test_hostile_delta_folders_fail_alone(served, tmp_path):
    """Delta folders under --adapter-dir that read outside their folder, carry malformed or
    foreign entries, or inflate without bound are refused with the reason; the scan, the
    engine and the good delta go on (each of these once crashed the scan, read a host
    file, or failed every request of the engine)."""
    base, delta_dir, _, _, _ = served
    root = tmp_path / "dir"
    root.mkdir()
    outside = _copy(delta_dir, tmp_path / "outside")
    _copy(delta_dir, root / "ft")

    def files_key(name):
        def edit(record):
            record["files"] = {name: next(iter(record["files"].values()))}

        return edit

    def first_layer(**fields):
        def edit(record):
            record["layers"][0].update(fields)

        return edit

    def add_param(entry):
        def edit(record):
            record["params"].append(entry)

        return edit

    _delta_folder(delta_dir, root / "escape", files_key("../../outside/delta.safetensors"))
    _delta_folder(delta_dir, root / "host-file", files_key("/etc/passwd"))
    link = _delta_folder(delta_dir, root / "link")
    (link / "delta.safetensors").unlink()
    (link / "delta.safetensors").symlink_to(outside / "delta.safetensors")
    _delta_folder(delta_dir, root / "bad-shape", first_layer(shape=5))
    _delta_folder(delta_dir, root / "list-name", first_layer(name=["x"]))
    _delta_folder(delta_dir, root / "no-weight", first_layer(name="model.layers.0.mlp"))
    _delta_folder(delta_dir, root / "embedding-as-layer", first_layer(name="model.embed_tokens"))
    wrong = {"name": "model.layers.0.mlp.down_proj.weight", "kind": "fp16_delta", "shape": [8, 8]}
    _delta_folder(delta_dir, root / "wrong-param", add_param(wrong))
    _zstd_bomb(_delta_folder(delta_dir, root / "bomb"), 80 << 20)
    reasons = {
        "escape": "names data file",
        "host-file": "names data file",
        "link": "link that leaves the delta folder",
        "bad-shape": "malformed entry",
        "list-name": "malformed entry",
        "no-weight": "not a linear layer of this model",
        "embedding-as-layer": "not a linear layer of this model",
        "wrong-param": "is [32, 64] in this model, [8, 8] in the delta",
        "bomb": "inflates to more than",
    }
    config = EngineConfig(max_running=8, max_batched_tokens=64, block_size=4, num_blocks=128)
    engine = Engine(load_client(base, BaseExecutor.from_pretrained(base)), config)
    cache = engine.attach_adapter_dir(root)  # the scan refuses what it can tell alone
    names = ["ft", *reasons, None]
    batch = prompts(len(names), seed=17)
    scanned = {card["id"]: card for card in cache.cards()}
    requests = []
    for i, (prompt, name) in enumerate(zip(batch, names, strict=True)):
        request = Request(f"r{i}", prompt, name, GREEDY)
        if name in scanned and scanned[name]["state"] == "failed":  # refused by the scan
            with pytest.raises(AdapterFailed, match=re.escape(reasons[name])):
                engine.add_request(request)
        else:
            requests.append(request)
    run_all(engine, requests)
    for request in requests:
        if request.adapter in reasons:
            assert reasons[request.adapter] in request.error, request.error
        else:
            assert request.error is None, request.error
            prompt = batch[names.index(request.adapter)]
            expected = want(served, prompt, request.adapter, GREEDY.max_tokens)
            assert request.sequences[0].output_ids == expected, request.adapter
    cards = {card["id"]: card for card in cache.cards()}
    assert {name: cards[name]["state"] for name in reasons} == dict.fromkeys(reasons, "failed")
    assert "1221 bytes" not in json.dumps(cards), "nothing about host files in the reasons"


def test_a_delta_changing_embeddings_shares_a_batch_with_prompt_tuning(served, tmp_path):
    """Virtual tokens make the engine call the embedding with 1-D token ids; the delta's
    embedding rows must still be put in (this failed every such batch)."""
    import peft

    from tests.test_serve_common import save_adapter

    base, delta_dir, _, _, merged = served
    assert any("embed_tokens" in name for name in load_delta(delta_dir).params)
    config = peft.PromptTuningConfig(num_virtual_tokens=3, task_type="CAUSAL_LM")
    tuned = save_adapter(base, config, tmp_path / "pt", seed=1)
    reference = Reference(base, {"pt": tuned})
    engine = engine_with(base, delta_dir, {"pt": tuned})
    names = ["ft", "pt", None, "ft"]
    batch = prompts(len(names), seed=19)
    outputs = engine.generate(batch, names, GREEDY)
    for prompt, name, got in zip(batch, names, outputs, strict=True):
        ref = merged.generate(prompt, None, GREEDY.max_tokens) if name == "ft" else (
            reference.generate(prompt, name, GREEDY.max_tokens)
        )  # fmt: skip
        assert got == ref, name


def test_a_delta_changing_experts_is_refused_by_name(checkpoints, tmp_path):
    """An MoE's experts stay on the executor: a delta changing them is refused with a
    delta's reason (it was refused with LoRA's message)."""
    base = checkpoints("granitemoe")
    delta_dir = compressed_pair(base, tmp_path)
    engine = Engine(load_client(base, BaseExecutor.from_pretrained(base)), SMALL)
    with pytest.raises(AdapterError, match="experts of a mixture-of-experts.*delta merge"):
        engine.load_delta("ft", delta_dir, base)
    assert engine.adapters.names() == []
    assert engine.generate([[5, 6, 7]], [None], GREEDY), "the engine keeps serving"


def test_a_delta_given_as_an_adapter_says_to_use_delta(tmp_path):
    from symbiont.adapters.spec import AdapterError, read_adapter

    (tmp_path / "manifest.json").write_text("{}")
    with pytest.raises(AdapterError, match="is a compressed delta .* --delta NAME=DIR"):
        read_adapter(tmp_path)
