"""Split loading: what each half reads, and clear errors for bad checkpoint folders."""

from __future__ import annotations

import json
import shutil

import peft
import pytest
import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    ViTConfig,
)
from transformers.modeling_outputs import CausalLMOutput
from transformers.pytorch_utils import Conv1D

import symbiont
from symbiont.client.virt import BaseWeightUnavailable, RemoteWeight, VirtLayer
from symbiont.model.checkpoint import CheckpointError
from tests.tiny_models import ARCHS, VOCAB, build_checkpoint


def storage_bytes(module: nn.Module) -> int:
    """Bytes of every distinct storage behind the module's parameters and buffers."""
    storages = {}
    for tensor in list(module.parameters()) + list(module.buffers()):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma3"])
def test_client_holds_no_base_weight_bytes(arch, checkpoints):
    path = checkpoints(arch)
    executor = symbiont.BaseExecutor.from_pretrained(path)
    client = symbiont.load_client(path, executor)
    full = AutoModelForCausalLM.from_pretrained(path)
    # Biases ([out], small) stay on the client too, for methods that add them themselves.
    base_linear = sum(
        m.weight.numel() * 4 for m in full.modules() if isinstance(m, (nn.Linear, Conv1D))
    )
    tied_lm_head = full.config.get_text_config().tie_word_embeddings
    if tied_lm_head:  # the executor keeps its own copy of the tied embedding as lm_head
        base_linear -= full.get_output_embeddings().weight.numel() * 4
    placeholders = [p for p in client.parameters() if isinstance(p, RemoteWeight)]
    assert all(p.untyped_storage().nbytes() == 4 for p in placeholders)  # one fp32 element each
    assert storage_bytes(client) == storage_bytes(full) - base_linear + 4 * len(placeholders)
    assert any(isinstance(m, VirtLayer) for m in client.modules())
    assert executor.weight_bytes() >= base_linear


def test_virt_layer_looks_like_the_module_it_replaces(checkpoints):
    path = checkpoints("gpt2")
    client = symbiont.load_client(path, symbiont.BaseExecutor.from_pretrained(path))
    full = AutoModelForCausalLM.from_pretrained(path)
    originals = dict(full.named_modules())
    for name, module in client.named_modules():
        if isinstance(module, VirtLayer):
            original = originals[name]
            assert isinstance(module, type(original))
            assert module.weight.shape == original.weight.shape
            assert module.weight.dtype == original.weight.dtype
            assert (module.bias is None) == (original.bias is None)
            for attr in ("in_features", "out_features", "nf", "nx"):
                if hasattr(original, attr):
                    assert getattr(module, attr) == getattr(original, attr)


def test_moving_client_keeps_weights_zero_storage(checkpoints):
    path = checkpoints("llama")
    executor = symbiont.BaseExecutor.from_pretrained(path)
    client = symbiont.load_client(path, executor)
    ids = torch.tensor([[5, 6, 7]])
    before = client(ids).logits
    client.to(torch.bfloat16)  # the client may run in another dtype than the executor
    q_proj = client.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj.weight, RemoteWeight) and q_proj.weight.dtype == torch.bfloat16
    assert q_proj.weight.untyped_storage().nbytes() == 2
    after = client(ids).logits
    assert after.dtype == torch.bfloat16
    torch.testing.assert_close(after.float(), before, rtol=0.05, atol=0.05)


def test_reading_base_weight_values_is_refused(checkpoints):
    path = checkpoints("llama")
    client = symbiont.load_client(path, symbiont.BaseExecutor.from_pretrained(path))
    weight = client.model.layers[0].mlp.up_proj.weight
    with pytest.raises(BaseWeightUnavailable, match="stay on the base executor"):
        weight.sum()
    with pytest.raises(BaseWeightUnavailable, match="merging adapters"):
        peft.get_peft_model(client, peft.LoraConfig(target_modules=["q_proj"])).merge_and_unload()


def test_sharded_checkpoint_loads_identically(checkpoints, tmp_path):
    reference = AutoModelForCausalLM.from_pretrained(checkpoints("qwen2"))
    reference.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    client = symbiont.load_client(tmp_path, symbiont.BaseExecutor.from_pretrained(tmp_path))
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.equal(client(ids).logits, reference(ids).logits)


def test_bfloat16_executor_and_client_match_vanilla_bfloat16(checkpoints):
    path = checkpoints("mistral")
    executor = symbiont.BaseExecutor.from_pretrained(path, dtype=torch.bfloat16)
    client = symbiont.load_client(path, executor)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    ids = torch.tensor([[9, 8, 7, 6, 5]])
    assert client.dtype == torch.bfloat16
    assert torch.equal(client(ids).logits, reference(ids).logits)


def test_missing_folder_is_reported(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        symbiont.BaseExecutor.from_pretrained(tmp_path / "nope")


def test_folder_without_config_is_reported(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        symbiont.BaseExecutor.from_pretrained(tmp_path)


def test_folder_without_weights_is_reported(checkpoints, tmp_path):
    shutil.copy(checkpoints("llama") / "config.json", tmp_path)
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        symbiont.BaseExecutor.from_pretrained(tmp_path)


def test_truncated_weights_are_reported(checkpoints, tmp_path):
    shutil.copytree(checkpoints("llama"), tmp_path, dirs_exist_ok=True)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="truncated"):
        symbiont.BaseExecutor.from_pretrained(tmp_path)


def test_garbage_weights_are_reported(checkpoints, tmp_path):
    shutil.copy(checkpoints("llama") / "config.json", tmp_path)
    (tmp_path / "model.safetensors").write_bytes(
        b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!"
    )
    with pytest.raises(CheckpointError, match="corrupt"):
        symbiont.BaseExecutor.from_pretrained(tmp_path)


def test_config_that_does_not_match_weights_is_reported(checkpoints, tmp_path):
    shutil.copytree(checkpoints("llama"), tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config["vocab_size"] = VOCAB * 2
    (tmp_path / "config.json").write_text(json.dumps(config))
    executor = symbiont.BaseExecutor.from_pretrained(tmp_path)  # lm_head shape differs
    with pytest.raises(CheckpointError, match="config.json does not match"):
        symbiont.load_client(tmp_path, executor)


def test_non_causal_lm_architecture_is_reported(tmp_path):
    ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(CheckpointError, match="no causal-LM class"):
        symbiont.BaseExecutor.from_pretrained(tmp_path)


class _NoLinearConfig(PretrainedConfig):
    model_type = "symbiont-test-no-linear"

    def __init__(self, vocab_size=16, **kwargs):
        self.vocab_size = vocab_size
        super().__init__(**kwargs)


class _NoLinearModel(PreTrainedModel):
    config_class = _NoLinearConfig

    def __init__(self, config):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.vocab_size)
        self.post_init()

    def forward(self, input_ids, **kwargs):
        return CausalLMOutput(logits=self.embed(input_ids))


def test_architecture_without_linear_layers_is_reported(tmp_path):
    AutoConfig.register(_NoLinearConfig.model_type, _NoLinearConfig, exist_ok=True)
    AutoModelForCausalLM.register(_NoLinearConfig, _NoLinearModel, exist_ok=True)
    _NoLinearModel(_NoLinearConfig()).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="no nn.Linear or Conv1D layers"):
        symbiont.BaseExecutor.from_pretrained(tmp_path)


def test_client_of_another_checkpoint_is_refused(checkpoints, tmp_path):
    other = build_checkpoint(ARCHS["llama"], tmp_path, seed=123)
    executor = symbiont.BaseExecutor.from_pretrained(checkpoints("llama"))
    with pytest.raises(symbiont.ExecutorError, match="is not the base this executor serves"):
        symbiont.load_client(other, executor)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # untied and tied output embeddings
def test_local_lm_head_keeps_the_output_projection_on_the_client(arch, checkpoints):
    path = checkpoints(arch)
    client = symbiont.load_client(
        path, symbiont.BaseExecutor.from_pretrained(path), local_lm_head=True
    )
    reference = AutoModelForCausalLM.from_pretrained(path)
    head = client.get_output_embeddings()
    assert type(head) is nn.Linear and not isinstance(head.weight, RemoteWeight)
    assert torch.equal(head.weight, reference.get_output_embeddings().weight)
    ids = torch.tensor([[3, 4, 5, 6]])
    assert torch.equal(client(ids).logits, reference(ids).logits)
