"""Every PEFT weight method the engine serves equals vanilla peft, alone and mixed.

AdaLoRA, VeRA, LoHa, LoKr and DoRA adapters share batches with LoRA adapters of two
ranks and the plain base; each request's greedy tokens must equal vanilla peft's
`generate` with its adapter alone, and its logits must stay within LOGITS_ATOL (fp32).
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import peft
import pytest
import torch

from symbiont import BaseExecutor, load_client
from symbiont.serve import (
    AdapterError,
    Engine,
    EngineConfig,
    Request,
    RequestError,
    SamplingParams,
)
from tests.test_serve_common import Reference, lora_config, prompts, save_adapter

LOGITS_ATOL = 1e-4
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
# max_lora_rank 8: the rank-9 LoHa and the rank-12 VeRA run in their own sub-batch.
SMALL = EngineConfig(
    max_running=6, max_batched_tokens=12, block_size=4, num_blocks=128, max_lora_rank=8
)
WIDE = EngineConfig(
    max_running=16, max_batched_tokens=256, block_size=4, num_blocks=128, max_lora_rank=8
)
ATTN = ["q_proj", "v_proj"]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _adalora_pruned() -> peft.AdaLoraConfig:
    """An AdaLoRA whose rank pattern pruned layer 0's q_proj from 6 to 3 (ranknum stays 6)."""
    config = peft.AdaLoraConfig(
        init_r=6, target_r=4, total_step=10, lora_alpha=12, target_modules=ATTN
    )
    config.rank_pattern = {"model.layers.0.self_attn.q_proj.lora_E": [True, False] * 3}
    return config


def method_configs(targets=ATTN) -> dict:
    return {
        "lora4": lora_config("llama", 4),
        "lora8": lora_config("llama", 8, targets=targets),
        "adalora": peft.AdaLoraConfig(init_r=6, target_r=4, total_step=10, target_modules=targets),
        "adalora_pruned": _adalora_pruned(),
        "vera": peft.VeraConfig(r=4, target_modules=targets),
        "vera_rebuilt": peft.VeraConfig(r=12, target_modules=targets, save_projection=False),
        "loha": peft.LoHaConfig(r=2, alpha=3, target_modules=ALL),
        "loha_wide": peft.LoHaConfig(r=3, alpha=5, target_modules=targets),
        "lokr": peft.LoKrConfig(r=2, alpha=3, target_modules=ALL),
        "lokr_both": peft.LoKrConfig(r=2, alpha=4, decompose_both=True, target_modules=targets),
        "dora": peft.LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules="all-linear"),
        "prompt": peft.PromptTuningConfig(num_virtual_tokens=3),
        "ptuning": peft.PromptEncoderConfig(num_virtual_tokens=4, encoder_hidden_size=16),
        "prefix": peft.PrefixTuningConfig(num_virtual_tokens=5),
        "prefix_mlp": peft.PrefixTuningConfig(
            num_virtual_tokens=2, prefix_projection=True, encoder_hidden_size=16
        ),
    }


def _save_all(base, folder, configs) -> dict:
    out = {}
    for i, (name, config) in enumerate(configs.items()):
        config.task_type = "CAUSAL_LM"
        out[name] = save_adapter(base, config, folder / name, seed=40 + i)
    return out


@pytest.fixture(scope="module")
def setup(checkpoints, tmp_path_factory):
    base = checkpoints("llama")
    adapters = _save_all(base, tmp_path_factory.mktemp("methods"), method_configs())
    return base, adapters, Reference(base, adapters)


def engine_for(base, adapters, config=SMALL) -> Engine:
    engine = Engine(load_client(base, BaseExecutor.from_pretrained(base)), config)
    for name, path in adapters.items():
        engine.load_adapter(name, path)
    return engine


def test_each_method_alone_equals_vanilla(setup, one_thread):
    base, adapters, reference = setup
    engine = engine_for(base, adapters)
    for i, name in enumerate(adapters):
        prompt = prompts(1, seed=100 + i)[0]
        got = engine.generate([prompt], [name], GREEDY)[0]
        assert got == reference.generate(prompt, name, GREEDY.max_tokens), name
    assert engine.kv_cache.allocator.num_free == SMALL.num_blocks, "KV blocks leaked"


def test_mixed_batch_of_every_method_equals_vanilla(setup, one_thread):
    base, adapters, reference = setup
    engine = engine_for(base, adapters)
    names = [None, *adapters, *adapters]  # every method twice, with two LoRA ranks and the base
    batch = prompts(len(names), seed=7)
    for prompt, name, got in zip(batch, names, engine.generate(batch, names, GREEDY), strict=True):
        want = reference.generate(prompt, name, GREEDY.max_tokens)
        assert got == want, f"{name}: batched output differs from vanilla peft alone"


def test_mixed_batch_logits_within_tolerance(setup, monkeypatch, one_thread):
    base, adapters, reference = setup
    engine = engine_for(base, adapters, config=WIDE)
    captured = []
    forward = engine.runner.forward
    monkeypatch.setattr(
        engine.runner, "forward", lambda b: captured.append(forward(b)) or captured[-1]
    )
    names = [None, *adapters]
    batch = prompts(len(names), seed=21)
    for i, (p, name) in enumerate(zip(batch, names, strict=True)):
        engine.add_request(Request(f"q{i}", p, name, SamplingParams(max_tokens=1, temperature=0)))
    engine.step()  # WIDE fits every prompt: one row of logits per request, in order
    assert captured[0].shape[0] == len(batch)
    for i, (p, name) in enumerate(zip(batch, names, strict=True)):
        want, got = reference.logits(p, name)[-1], captured[0][i]
        assert torch.allclose(got, want, atol=LOGITS_ATOL), (
            f"{name}: max |diff| {float((got - want).abs().max()):.2e}"
        )


def test_wide_methods_run_in_their_own_sub_batch(setup):
    """LoHa r=3 is an exact LoRA of rank 9 and VeRA r=12 one of rank 12, both above
    max_lora_rank 8: served as per-slot row deltas, not refused, and not in the stacks."""
    base, adapters, _ = setup
    engine = engine_for(base, {k: adapters[k] for k in ("loha", "loha_wide", "vera_rebuilt")})
    info = {n: engine.adapters.info(n) for n in ("loha", "loha_wide", "vera_rebuilt")}
    assert info["loha"]["method"] == "loha" and info["loha"]["rank"] == 4  # r1·r2 in the stacks
    assert info["loha_wide"]["rank"] == 0 and info["vera_rebuilt"]["rank"] == 0
    assert engine.adapters.slot_bucket[info["loha_wide"]["slot"]] == 0


def test_refusals_name_the_method_and_reason(setup, tmp_path):
    base, adapters, _ = setup
    engine = engine_for(base, {})
    bias = save_adapter(base, lora_config("llama", 2, lora_bias=True), tmp_path / "bias", seed=1)
    with pytest.raises(AdapterError, match="LoRA biases"):
        engine.load_adapter("bias", bias)
    dora16 = peft.LoraConfig(r=16, use_dora=True, task_type="CAUSAL_LM", target_modules=ATTN)
    big = save_adapter(base, dora16, tmp_path / "big", seed=2)
    with pytest.raises(AdapterError, match="--max-lora-rank 16"):
        engine.load_adapter("big", big)
    assert engine.adapters.names() == []


def test_prompt_logprobs_after_virtual_tokens(setup, one_thread):
    """The prompt's scores come from the rows after the virtual positions, chunked."""
    base, adapters, reference = setup
    engine = engine_for(base, adapters)
    names = ["prompt", "ptuning", "prefix", "lora4", None]
    batch = prompts(len(names), seed=9, low=6, high=14)
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1)
    requests = [
        Request(f"p{i}", p, n, params) for i, (p, n) in enumerate(zip(batch, names, strict=True))
    ]
    for request in requests:
        engine.add_request(request)
    while not all(r.finished for r in requests):
        engine.step()
    for request in requests:
        prompt = request.prompt_ids
        rows = reference.logits(prompt, request.adapter)[-len(prompt) :]  # the prompt's rows
        want = torch.log_softmax(rows, dim=-1)
        got = request.prompt_logprobs
        assert got[0] is None and len(got) == len(prompt)
        for i in range(1, len(prompt)):
            assert got[i].token_id == prompt[i]
            assert abs(got[i].logprob - float(want[i - 1, prompt[i]])) < LOGITS_ATOL, (
                f"{request.adapter}: prompt token {i}"
            )


def test_adapter_dir_serves_every_method_in_three_slots(setup, one_thread):
    """Through the adapter cache: 15 folders of every method, 3 slots, so slots pass from
    one method to another (a prefix's slot to a DoRA, and so on)."""
    base, adapters, reference = setup
    config = EngineConfig(max_running=6, max_batched_tokens=16, block_size=4, num_blocks=128)
    config = dataclasses.replace(config, max_adapters=3, max_lora_rank=8)
    engine = Engine.from_pretrained(base, config=config)
    root = next(iter(adapters.values())).parent
    engine.attach_adapter_dir(root)
    names = [None, *adapters, *reversed(adapters)]
    batch = prompts(len(names), seed=13)
    for prompt, name, got in zip(batch, names, engine.generate(batch, names, GREEDY), strict=True):
        assert got == reference.generate(prompt, name, GREEDY.max_tokens), name
    cards = {card["id"]: card for card in engine.cache.cards()}
    assert not [n for n, c in cards.items() if c["state"] == "failed"], cards
    assert cards["prefix"]["method"] == "prefix_tuning" and cards["dora"]["method"] == "dora"
    assert cards["lokr"]["bytes"] > 0
    assert engine.kv_cache.allocator.num_free == config.num_blocks, "KV blocks leaked"


@pytest.mark.parametrize("arch", ["gpt2", "qwen2", "gemma3"])
def test_other_architectures(arch, checkpoints, tmp_path, one_thread):
    """GPT-2 (Conv1D layers, learned positions, no GQA), Qwen2 (biases: DoRA scales W x,
    not b) and Gemma 3 (scaled input embeddings: virtual tokens are not scaled)."""
    base = checkpoints(arch)
    configs = {
        "dora": peft.LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules="all-linear"),
        "lora": lora_config(arch, 2),
        "prompt": peft.PromptTuningConfig(num_virtual_tokens=3),
        "prefix": peft.PrefixTuningConfig(num_virtual_tokens=4),
    }
    if arch == "qwen2":
        configs["lokr"] = peft.LoKrConfig(r=2, alpha=3, target_modules=ATTN)
        configs["adalora"] = peft.AdaLoraConfig(init_r=4, total_step=10, target_modules=ATTN)
    adapters = _save_all(base, tmp_path, configs)
    reference = Reference(base, adapters)
    engine = engine_for(base, adapters)
    names = [None, *adapters, *adapters]
    batch = prompts(len(names), seed=3)
    for p, name, got in zip(batch, names, engine.generate(batch, names, GREEDY), strict=True):
        assert got == reference.generate(p, name, GREEDY.max_tokens), f"{arch} {name}"


def test_prompt_learning_for_another_base_is_refused(setup, tmp_path):
    base, adapters, _ = setup
    engine = engine_for(base, {})
    record = json.loads((adapters["prefix"] / "adapter_config.json").read_text())
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    (wrong / "adapter_config.json").write_text(json.dumps({**record, "num_layers": 3}))
    shutil.copy(adapters["prefix"] / "adapter_model.safetensors", wrong)
    with pytest.raises(AdapterError, match="num_layers is 3, this base needs 2"):
        engine.load_adapter("wrong", wrong)


def test_virtual_tokens_count_against_the_context(setup, tmp_path):
    """A prompt that fits the context alone but not after the adapter's virtual tokens is
    refused, naming them; by name and from a folder alike."""
    base, adapters, _ = setup
    engine = engine_for(base, {"prefix": adapters["prefix"]})
    root = tmp_path / "dir"
    root.mkdir()
    shutil.copytree(adapters["prompt"], root / "prompt")
    engine.attach_adapter_dir(root)
    limit = engine.max_model_len  # 128 for the tiny llama
    for name, virtual in (("prefix", 5), ("prompt", 3)):
        params = SamplingParams(max_tokens=limit - 10, temperature=0.0)
        with pytest.raises(RequestError, match=f"the adapter's {virtual} virtual tokens"):
            engine.add_request(Request(f"long-{name}", [5] * (10 - virtual + 1), name, params))
        fits = Request(f"fits-{name}", [5] * (10 - virtual), name, params)
        engine.add_request(fits)  # exactly the context: accepted
        engine.abort(fits.request_id)


def test_openai_client_reaches_every_method_in_an_adapter_dir(checkpoints, tmp_path):
    """`symbiont serve --adapter-dir` over HTTP: folders of four methods through two slots,
    each completion equal to vanilla peft's, each listed with its method."""
    import httpx
    import openai
    from transformers import AutoTokenizer

    from symbiont.serve.config import ServerConfig
    from symbiont.serve.http.server import BackgroundServer
    from tests.test_serve_common import add_char_tokenizer

    model_dir = tmp_path / "tiny-llama"
    shutil.copytree(checkpoints("llama"), model_dir)
    add_char_tokenizer(model_dir)
    methods = {k: v for k, v in method_configs().items() if k in ("dora", "lokr", "prefix")}
    methods["prompt"] = peft.PromptTuningConfig(num_virtual_tokens=3)
    adapters = _save_all(model_dir, tmp_path / "tenants", methods)
    reference, tokenizer = Reference(model_dir, adapters), AutoTokenizer.from_pretrained(model_dir)
    engine = dataclasses.replace(SMALL, max_adapters=2)
    config = ServerConfig(
        model=str(model_dir), port=0, engine=engine, adapter_dir=str(tmp_path / "tenants")
    )
    with BackgroundServer(config) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        for name in [*adapters, *adapters]:
            got = client.completions.create(model=name, prompt="hello", max_tokens=6, temperature=0)
            ids = reference.generate(tokenizer("hello").input_ids, name, 6)
            assert got.choices[0].text == tokenizer.decode(ids, skip_special_tokens=True), name
        # a chat without max_tokens gets the context left after the prefix, not a 400
        chat = client.chat.completions.create(
            model="prefix", messages=[{"role": "user", "content": "hi"}], temperature=0
        )
        assert chat.choices[0].finish_reason in ("stop", "length")
        cards = {c["id"]: c for c in httpx.get(f"{server.url}/v1/adapters").json()["data"]}
    assert {n: cards[n]["method"] for n in adapters} == {
        "dora": "dora",
        "lokr": "lokr",
        "prefix": "prefix_tuning",
        "prompt": "prompt_tuning",
    }
