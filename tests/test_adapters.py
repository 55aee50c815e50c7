"""The one PEFT adapter reader (symbiont.adapters): real peft folders read into a spec, and
every refusal with a message that says what to fix."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle

import peft
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from symbiont.adapters import (
    AdapterError,
    AdapterFlags,
    AdapterSpec,
    build_peft_config,
    load_peft_config,
    read_adapter,
)
from symbiont.base.executor import BaseExecutor
from symbiont.model.checkpoint import Checkpoint
from symbiont.serve.adapters import AdapterRegistry, Ia3Weights, LoraWeights
from symbiont.serve.config import EngineConfig
from tests.test_serve_common import ia3_config, lora_config, save_adapter
from tests.tiny_models import ARCHS, build_checkpoint

CONFIGS = {
    "lora": lambda: lora_config("llama", 4),
    "ia3": lambda: ia3_config("llama"),
    "prefix": lambda: peft.PrefixTuningConfig(num_virtual_tokens=3, task_type="CAUSAL_LM"),
    "loha": lambda: peft.LoHaConfig(r=2, alpha=4, target_modules=["q_proj", "v_proj"]),
}


@pytest.fixture(scope="module")
def llama(checkpoints):
    return checkpoints("llama")


@pytest.fixture(scope="module")
def saved(llama, tmp_path_factory):
    """method -> an adapter folder saved by real peft on the tiny llama."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: save_adapter(llama, make(), root / name, seed=i)
        for i, (name, make) in enumerate(CONFIGS.items())
    }


def copy_config(source, folder, **changes):
    """An adapter folder: `source`'s weights (if any) and its config with `changes`."""
    folder.mkdir(parents=True, exist_ok=True)
    record = json.loads((source / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**record, **changes}))
    if (source / "adapter_model.safetensors").is_file():
        weights = (source / "adapter_model.safetensors").read_bytes()
        (folder / "adapter_model.safetensors").write_bytes(weights)
    return folder


# -- happy paths --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "method, peft_type, config_type",
    [
        ("lora", "LORA", peft.LoraConfig),
        ("ia3", "IA3", peft.IA3Config),
        ("prefix", "PREFIX_TUNING", peft.PrefixTuningConfig),
        ("loha", "LOHA", peft.LoHaConfig),
    ],
)
def test_folders_saved_by_peft_read_into_a_spec(saved, llama, method, peft_type, config_type):
    folder = saved[method]
    spec = read_adapter(folder)
    assert isinstance(spec, AdapterSpec) and isinstance(spec.config, config_type)
    assert (spec.peft_type, spec.method) == (peft_type, peft_type.lower())
    assert spec.base_model == str(llama), "base_model_name_or_path not carried"
    weights_file = folder / "adapter_model.safetensors"
    assert spec.weights_file == weights_file and spec.size_bytes == weights_file.stat().st_size
    on_disk = load_file(str(weights_file))
    assert {k: list(v.shape) for k, v in on_disk.items()} == {
        k: list(info.shape) for k, info in spec.tensors.items()
    }, "header shapes differ from the tensors in the file"
    loaded = spec.load_tensors()
    assert loaded.keys() == on_disk.keys()
    assert all(torch.equal(loaded[k], on_disk[k]) for k in on_disk)
    spec.check_base(llama)  # made for this base: accepted from a folder,
    spec.check_base(Checkpoint.open(llama))  # a Checkpoint,
    spec.check_base(BaseExecutor.from_pretrained(llama).manifest)  # an executor's manifest
    spec.check_base(AutoModelForCausalLM.from_pretrained(llama))  # and a model
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.path = folder  # type: ignore[misc]


def test_spec_reports_rank_alpha_targets_and_modules(saved):
    lora = read_adapter(saved["lora"])
    assert (lora.rank, lora.alpha) == (4, 8)
    assert "model.layers.1.mlp.up_proj" in lora.targets, "peft saves all-linear resolved"
    assert "model.layers.0.self_attn.q_proj" in lora.modules
    assert set(lora.modules["model.layers.0.self_attn.q_proj"]) == {
        "lora_A.weight",
        "lora_B.weight",
    }
    assert set(lora.ranks.values()) == {4}
    loha = read_adapter(saved["loha"])
    assert (loha.rank, loha.alpha, loha.targets) == (2, 4, ("q_proj", "v_proj"))
    assert set(loha.ranks.values()) == {2} and len(loha.ranks) == 4  # 2 layers x q, v
    ia3 = read_adapter(saved["ia3"])
    assert ia3.rank is None and ia3.alpha is None
    assert len(ia3.modules) == 2 * len(ARCHS["llama"].attention + ARCHS["llama"].feedforward)
    assert read_adapter(saved["prefix"]).modules == {}


def test_a_bare_config_file_reads_without_weights(saved, tmp_path):
    file = saved["lora"] / "adapter_config.json"
    spec = read_adapter(file)
    assert spec.weights_file is None and spec.size_bytes == 0 and spec.tensors == {}
    with pytest.raises(AdapterError, match="bare config without weights"):
        spec.load_tensors()
    assert isinstance(load_peft_config(file), peft.LoraConfig)
    config_only = copy_config(saved["prefix"], tmp_path / "only")
    (config_only / "adapter_model.safetensors").unlink()
    assert load_peft_config(config_only).num_virtual_tokens == 3, "folder without weights"


def test_serve_turns_lora_and_ia3_specs_into_weights_equal_to_peft(saved, llama):
    registry = AdapterRegistry(AutoModelForCausalLM.from_pretrained(llama), EngineConfig())
    lora = registry.parse(saved["lora"])
    tensors = load_file(str(saved["lora"] / "adapter_model.safetensors"))
    name = "model.layers.1.mlp.down_proj"
    weights = lora.modules[name]
    assert isinstance(weights, LoraWeights) and weights.scale == 8 / 4
    assert torch.equal(weights.a, tensors[f"base_model.model.{name}.lora_A.weight"])
    assert torch.equal(weights.b, tensors[f"base_model.model.{name}.lora_B.weight"])
    ia3 = registry.parse(saved["ia3"])
    assert isinstance(ia3.modules[name], Ia3Weights) and ia3.modules[name].feedforward
    assert not ia3.modules["model.layers.1.self_attn.q_proj"].feedforward


# -- refusals: the folder and its config --------------------------------------------------


def test_missing_folder_and_missing_config(tmp_path):
    with pytest.raises(AdapterError, match=r"nowhere does not exist \(no adapter_config.json"):
        read_adapter(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(AdapterError, match="has no adapter_config.json.*save_pretrained"):
        read_adapter(tmp_path / "empty")


def test_config_that_is_not_json_names_the_line(tmp_path):
    (tmp_path / "adapter_config.json").write_text('{\n  "peft_type": "LORA",\n  r: 4\n}\n')
    with pytest.raises(AdapterError, match=r"adapter_config.json:3: not valid JSON"):
        read_adapter(tmp_path)


def test_config_without_or_with_unknown_peft_type(tmp_path):
    (tmp_path / "a.json").write_text('{"r": 3}')
    with pytest.raises(AdapterError, match="needs a 'peft_type' field"):
        read_adapter(tmp_path / "a.json")
    (tmp_path / "b.json").write_text('{"peft_type": "NOPE"}')
    with pytest.raises(AdapterError, match=r"unknown peft_type 'NOPE'; peft .* knows .*LORA"):
        load_peft_config(tmp_path / "b.json")


def test_config_invalid_for_its_method_carries_peft_message(saved, tmp_path):
    bad = copy_config(saved["ia3"], tmp_path / "bad", feedforward_modules=["not_a_target"])
    with pytest.raises(AdapterError, match="not a valid IA3 config: .*subset of `target_modules`"):
        read_adapter(bad)


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"lora_alpha": 0}, "lora_alpha is 0"),
        ({"alpha_pattern": {"q_proj": 0}}, "alpha_pattern sets 'q_proj' to 0"),
        ({"r": 0}, "r is 0"),
    ],
)
def test_lora_scaling_that_makes_a_no_op_is_refused(saved, tmp_path, changes, field):
    folder = copy_config(saved["lora"], tmp_path / "noop", **changes)
    with pytest.raises(AdapterError, match=field):
        read_adapter(folder)
    with pytest.raises(AdapterError, match=field):
        load_peft_config(folder / "adapter_config.json")


def test_zero_alpha_refused_for_loha_and_from_flags(saved, tmp_path):
    folder = copy_config(saved["loha"], tmp_path / "noop", alpha=0)
    with pytest.raises(AdapterError, match=r"alpha is 0, so the adapter's scale alpha / r is 0"):
        read_adapter(folder)
    with pytest.raises(ValueError, match="alpha is 0"):
        AdapterFlags(alpha=0)
    assert build_peft_config(AdapterFlags(r=4)).lora_alpha == 8


@pytest.mark.parametrize(
    "config, feature",
    [
        (peft.LoraConfig(r=2, init_lora_weights="pissa"), "PiSSA initialisation"),
        (peft.LoraConfig(r=2, init_lora_weights="pissa_niter_4"), "PiSSA initialisation"),
        (peft.LoraConfig(r=2, init_lora_weights="olora"), "OLoRA initialisation"),
        (peft.LoraConfig(r=2, init_lora_weights="corda"), "CorDA initialisation"),
    ],
)
def test_methods_that_need_base_weights_are_refused_by_name(tmp_path, config, feature):
    config.save_pretrained(tmp_path)
    with pytest.raises(AdapterError, match=f"{feature}.* needs the frozen base weights"):
        load_peft_config(tmp_path)


def test_a_saved_dora_adapter_is_read_and_served_by_the_serving_engine(llama, tmp_path):
    # DoRA runs split (tests/test_dora.py) and batched (tests/test_serve_methods.py).
    config = lora_config("llama", 2, use_dora=True)
    folder = save_adapter(llama, config, tmp_path / "dora", seed=0)
    assert read_adapter(folder).config.use_dora
    registry = AdapterRegistry(AutoModelForCausalLM.from_pretrained(llama), EngineConfig())
    assert registry.parse(folder).method == "dora"


# -- refusals: the weights file -----------------------------------------------------------


def test_missing_weights(saved, tmp_path):
    folder = copy_config(saved["lora"], tmp_path / "noweights")
    (folder / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match="has no adapter_model.safetensors"):
        read_adapter(folder)


@pytest.mark.parametrize("name", ["adapter_model.safetensors", "adapter_config.json"])
def test_a_file_linking_out_of_the_folder_is_refused(saved, tmp_path, name):
    """A server trusts a folder, not whatever its files point at (an --adapter-dir tenant
    could otherwise make the server read any file of the host)."""
    folder = copy_config(saved["lora"], tmp_path / "linked")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (folder / name).rename(elsewhere / name)
    (folder / name).symlink_to(elsewhere / name)
    with pytest.raises(AdapterError, match="is a link that leaves the adapter folder"):
        read_adapter(folder)


class _Plant:
    """A pickle that makes a folder when unpickled: proof that nothing unpickles it."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_pickled_weights_are_refused_never_unpickled(saved, tmp_path):
    folder = copy_config(saved["lora"], tmp_path / "pickled")
    (folder / "adapter_model.safetensors").unlink()
    marker = tmp_path / "unpickled"
    (folder / "adapter_model.bin").write_bytes(pickle.dumps(_Plant(marker)))
    with pytest.raises(AdapterError, match=r"pickled weights.*safe_serialization=True"):
        read_adapter(folder)
    assert not marker.exists(), "the adapter's pickle was loaded"


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_corrupt_or_truncated_safetensors(saved, tmp_path, damage):
    folder = copy_config(saved["lora"], tmp_path / damage)
    file = folder / "adapter_model.safetensors"
    data = file.read_bytes()
    file.write_bytes(
        {"truncated": data[:-100], "garbage": b"not safetensors", "empty": b""}[damage]
    )
    with pytest.raises(AdapterError, match="cannot read the adapter weights.*re-copy"):
        read_adapter(folder)


def test_nan_weights_are_refused_when_read(saved, tmp_path):
    folder = copy_config(saved["lora"], tmp_path / "nan")
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    key = sorted(tensors)[0]
    tensors[key][0, 0] = float("nan")
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match=f"{key}.*NaN or infinite"):
        read_adapter(folder).load_tensors()


# -- refusals: against a base -------------------------------------------------------------


def test_adapter_for_another_architecture_names_the_module(saved, checkpoints):
    spec = read_adapter(saved["lora"])
    with pytest.raises(AdapterError, match=r"targets 'model.layers.0.* not a linear layer.*llama"):
        spec.check_base(checkpoints("gpt2"))


def test_adapter_for_another_size_names_module_and_shapes(saved, tmp_path):
    llama = ARCHS["llama"]
    narrow = dataclasses.replace(llama, config={**llama.config, "intermediate_size": 48})
    other = build_checkpoint(narrow, tmp_path / "narrow")
    spec = read_adapter(saved["lora"])
    with pytest.raises(
        AdapterError,
        match=r"model.layers.0.mlp.down_proj does not fit the base: the adapter's "
        r"lora_A.weight \[4, 64\], lora_B.weight \[32, 4\] need a layer of in=64, out=32; "
        r"the base layer has in=48, out=32",
    ):
        spec.check_base(other)
    with pytest.raises(AdapterError, match=r"ia3_l \[1, 64\] need a layer of in=64, out=any"):
        read_adapter(saved["ia3"]).check_base(other)
    read_adapter(saved["loha"]).check_base(BaseExecutor.from_pretrained(other).manifest)


def test_prompt_learning_adapter_for_another_width(saved, llama, tmp_path):
    folder = copy_config(saved["prefix"], tmp_path / "wide", token_dim=64)
    with pytest.raises(AdapterError, match="token_dim is 64, this base needs 16"):  # GQA: 2 x 8
        read_adapter(folder).check_base(llama)


def test_serve_refuses_methods_it_does_not_batch(saved, llama, tmp_path):
    registry = AdapterRegistry(AutoModelForCausalLM.from_pretrained(llama), EngineConfig())
    assert registry.parse(saved["prefix"]).method == "prefix_tuning"  # served since issue 14
    hra = peft.HRAConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM")
    folder = save_adapter(llama, hra, tmp_path / "hra", seed=0)
    with pytest.raises(AdapterError, match="is a HRA adapter, which the serving engine does not"):
        registry.parse(folder)
