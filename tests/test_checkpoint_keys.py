"""Checkpoint keys are matched to model tensors exactly as transformers' from_pretrained
matches them (its conversion mapping, base-model prefix and tied weights), and a key that
matches nothing is reported by name with the closest keys the file does hold."""

from __future__ import annotations

import shutil

import pytest
import safetensors.torch
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

import symbiont
from symbiont.model.checkpoint import CheckpointError
from tests.test_exactness import batch, grads, lora, make_pair
from tests.tiny_models import ARCHS, MOE_ARCHS, Arch, build_checkpoint


def keys_in(folder) -> set[str]:
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        return set(f.keys())


def rewrite_keys(folder, rename) -> None:
    """Rewrite model.safetensors with every key k stored as rename(k) (None drops it)."""
    tensors = safetensors.torch.load_file(folder / "model.safetensors")
    renamed = {rename(k): v for k, v in tensors.items() if rename(k) is not None}
    safetensors.torch.save_file(renamed, folder / "model.safetensors", metadata={"format": "pt"})


def assert_split_equals_vanilla(path, arch: Arch, *, all_linear=True):
    """Logits and every LoRA gradient of symbiont equal vanilla transformers + peft, bitwise
    (same process, same thread count, same kernels)."""
    executor = symbiont.BaseExecutor.from_pretrained(path)
    vanilla, split = make_pair(path, executor, lora(arch, all_linear=all_linear))
    inputs = batch()
    out_v = vanilla(**inputs, labels=inputs["input_ids"])
    out_s = split(**inputs, labels=inputs["input_ids"])
    assert torch.equal(out_v.logits, out_s.logits), "logits differ from vanilla"
    out_v.loss.backward()
    out_s.loss.backward()
    grads_v, grads_s = grads(vanilla), grads(split)
    assert grads_v.keys() == grads_s.keys() and grads_v
    for name, grad in grads_v.items():
        assert torch.equal(grads_s[name], grad), name


def test_gpt_neox_saved_by_transformers_loads_like_vanilla(checkpoints):
    path = checkpoints("gpt_neox")  # written by transformers' own save_pretrained
    assert "embed_out.weight" in keys_in(path) and "lm_head.weight" not in keys_in(path)
    assert_split_equals_vanilla(path, ARCHS["gpt_neox"])


def test_granitemoe_legacy_expert_names_load_like_vanilla(checkpoints):
    path = checkpoints("granitemoe")
    assert "model.layers.0.block_sparse_moe.input_linear.weight" in keys_in(path)
    assert_split_equals_vanilla(path, MOE_ARCHS["granitemoe"])


def test_legacy_language_model_prefix_loads_like_vanilla(tmp_path):
    """Qwen3.5's text model as the hub stores it inside the multimodal checkpoint:
    `model.language_model.*`, plus vision tensors the text model does not use."""
    arch = Arch(
        "qwen3_5_text",
        "qwen3_5_text",
        {
            **ARCHS["llama"].config,
            "head_dim": 8,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 2,
            "linear_key_head_dim": 8,
            "linear_value_head_dim": 8,
            "layer_types": ["linear_attention", "full_attention"],
        },
        ("q_proj", "v_proj"),
        (),
    )
    build_checkpoint(arch, tmp_path)
    rewrite_keys(tmp_path, lambda k: k.replace("model.", "model.language_model.", 1))
    tensors = safetensors.torch.load_file(tmp_path / "model.safetensors")
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 4)
    safetensors.torch.save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert "model.language_model.embed_tokens.weight" in keys_in(tmp_path)
    assert_split_equals_vanilla(tmp_path, arch, all_linear=False)


def test_bare_base_model_checkpoint_loads_with_tied_head(tmp_path):
    """Saved from Gemma3TextModel: no `model.` prefix and no lm_head (tied to embeddings)."""
    config = AutoConfig.for_model("gemma3_text", **ARCHS["gemma3"].config)
    torch.manual_seed(0)
    AutoModel.from_config(config).save_pretrained(tmp_path)
    assert "embed_tokens.weight" in keys_in(tmp_path)
    assert_split_equals_vanilla(tmp_path, ARCHS["gemma3"])


def test_renamed_key_is_reported_by_name_with_the_closest_keys(checkpoints, tmp_path):
    shutil.copytree(checkpoints("gpt_neox"), tmp_path, dirs_exist_ok=True)
    rewrite_keys(tmp_path, lambda k: "output_proj.weight" if k == "embed_out.weight" else k)
    with pytest.raises(CheckpointError) as err:
        symbiont.BaseExecutor.from_pretrained(tmp_path)
    message = str(err.value)
    assert "parameter 'lm_head.weight'" in message  # the model parameter it is for
    assert "looked for 'lm_head.weight' or 'embed_out.weight'" in message  # keys tried
    assert "keys in the checkpoint that no parameter uses: 'output_proj.weight'" in message
    assert "corrupt" not in message and "incomplete" not in message


def test_missing_client_tensor_is_reported_by_name(checkpoints, tmp_path):
    shutil.copytree(checkpoints("llama"), tmp_path, dirs_exist_ok=True)
    rewrite_keys(tmp_path, lambda k: None if k == "model.norm.weight" else k)
    executor = symbiont.BaseExecutor.from_pretrained(tmp_path)  # norms are not its weights
    with pytest.raises(CheckpointError) as err:
        symbiont.load_client(tmp_path, executor)
    message = str(err.value)
    assert "LlamaForCausalLM parameter 'model.norm.weight'" in message
    assert "looked for 'model.norm.weight'" in message
    closest = message.split("closest keys in the checkpoint: ")[1]
    assert "'model.layers.1.input_layernorm.weight'" in closest


def test_tied_head_whose_embedding_is_missing_names_both(checkpoints, tmp_path):
    shutil.copytree(checkpoints("gemma3"), tmp_path, dirs_exist_ok=True)
    rewrite_keys(
        tmp_path, lambda k: "model.embed.weight" if k.endswith("embed_tokens.weight") else k
    )
    with pytest.raises(CheckpointError) as err:
        symbiont.BaseExecutor.from_pretrained(tmp_path)
    message = str(err.value)
    assert "'lm_head.weight' (tied to 'model.embed_tokens.weight')" in message
    assert "'model.embed.weight'" in message


def test_per_expert_checkpoint_is_converted_like_vanilla(tmp_path):
    """OLMoE saves each expert separately; transformers merges them into stacked tensors on
    load with its conversion operations. The executor runs those same operations, and the
    client, which holds no expert weight, never reads them; a re-save with the stacked
    tensors under the model's own names loads alike."""
    arch = Arch(
        "olmoe",
        "olmoe",
        {**ARCHS["llama"].config, "num_experts": 4, "num_experts_per_tok": 2},
        ("q_proj", "v_proj"),
        (),
    )
    build_checkpoint(arch, tmp_path / "saved")
    assert "model.layers.0.mlp.experts.0.up_proj.weight" in keys_in(tmp_path / "saved")
    assert_split_equals_vanilla(tmp_path / "saved", arch, all_linear=False)

    fused = tmp_path / "fused"
    fused.mkdir()
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    safetensors.torch.save_model(model, str(fused / "model.safetensors"))
    shutil.copy(tmp_path / "saved" / "config.json", fused)
    assert "model.layers.0.mlp.experts.gate_up_proj" in keys_in(fused)
    assert_split_equals_vanilla(fused, arch, all_linear=False)


def test_client_tensor_needing_a_conversion_is_refused_with_the_fix(tmp_path, monkeypatch):
    """A tensor the client must hold that transformers combines from several keys (here the
    experts, kept on the client by pretending the executor serves none) is refused by name
    with the re-save that fixes it."""
    import symbiont.client.loader as loader

    arch = Arch(
        "olmoe",
        "olmoe",
        {**ARCHS["llama"].config, "num_experts": 4, "num_experts_per_tok": 2},
        ("q_proj", "v_proj"),
        (),
    )
    build_checkpoint(arch, tmp_path)
    executor = symbiont.BaseExecutor.from_pretrained(tmp_path)
    monkeypatch.setattr(loader, "_replace_experts", lambda *args: None)
    with pytest.raises(CheckpointError) as err:
        symbiont.load_client(tmp_path, executor)
    message = str(err.value)
    assert "parameter 'model.layers.0.mlp.experts.gate_up_proj'" in message
    assert "'model.layers.0.mlp.experts.0.gate_proj.weight'" in message
    assert "safetensors.torch.save_model" in message
