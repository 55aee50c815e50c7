"""Uses of a split client that cannot work are refused with what to do instead; each of
these once did nothing without a word (training a base weight) or failed obscurely
(saving a client's state_dict recursed without end)."""

from __future__ import annotations

import io

import peft
import pytest
import torch

from symbiont import BaseExecutor, load_client
from symbiont.client.virt import BaseWeightUnavailable


@pytest.fixture
def client(checkpoints):
    path = checkpoints("llama")
    return load_client(path, BaseExecutor.from_pretrained(path))


def test_modules_to_save_on_a_base_layer_is_refused(client):
    config = peft.LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["lm_head"])
    with pytest.raises(BaseWeightUnavailable, match="modules_to_save on a base layer"):
        peft.get_peft_model(client, config)


def test_full_fine_tuning_of_the_base_is_refused(client):
    with pytest.raises(BaseWeightUnavailable, match="training a frozen base weight"):
        client.requires_grad_(True)
    weight = client.model.layers[0].self_attn.q_proj.weight
    with pytest.raises(BaseWeightUnavailable, match="training a frozen base weight"):
        weight.requires_grad = True
    weight.requires_grad_(False)  # what PEFT does: allowed


def test_saving_a_clients_base_weights_is_refused(client):
    with pytest.raises(BaseWeightUnavailable, match="saving a frozen base weight"):
        torch.save(client.state_dict(), io.BytesIO())


def test_a_copied_client_shares_the_executor(checkpoints):
    """deepcopy (and PEFT's layer_replication) copied the executor: the whole base once
    per copied layer in process, and a TypeError on a serve-base connection's lock."""
    import copy

    path = checkpoints("llama")
    executor = BaseExecutor.from_pretrained(path)
    client = load_client(path, executor)
    twin = copy.deepcopy(client)
    assert twin.model.layers[0].self_attn.q_proj.executor is executor
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        assert torch.equal(twin(ids).logits, client(ids).logits)


def test_second_order_gradients_equal_vanilla(checkpoints):
    """A gradient penalty's gradient through a split client lost every path through the
    frozen layers (131% off vanilla, no error); it now equals vanilla's."""
    from transformers import AutoModelForCausalLM

    path = checkpoints("llama")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)  # fmt: skip
    base = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    client = load_client(path, BaseExecutor.from_pretrained(path))
    client.set_attn_implementation("eager")  # torch's SDPA has no second derivative on CPU
    torch.manual_seed(0)
    vanilla = peft.get_peft_model(base, config)
    torch.manual_seed(0)
    split = peft.get_peft_model(client, config)
    ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    second = []
    for model in (vanilla, split):
        params = [p for p in model.parameters() if p.requires_grad]
        loss = model(input_ids=ids, labels=ids).loss
        grads = torch.autograd.grad(loss, params, create_graph=True)
        penalty = sum((g**2).sum() for g in grads)
        second.append(torch.cat([h.flatten() for h in torch.autograd.grad(penalty, params)]))
    assert torch.allclose(second[1], second[0], rtol=1e-4, atol=1e-6), (
        f"max |diff| {(second[1] - second[0]).abs().max():.2e}"
    )


def test_trainable_tokens_on_tied_embeddings_say_to_keep_the_head_local(checkpoints):
    """The error named a torch operation, not trainable tokens or the fix."""
    path = checkpoints("gemma2")  # tied input and output embeddings
    config = peft.TrainableTokensConfig(token_indices=[3, 5, 7])
    model = peft.get_peft_model(load_client(path, BaseExecutor.from_pretrained(path)), config)
    with pytest.raises(BaseWeightUnavailable, match="trainable tokens.*local_lm_head=True"):
        model(input_ids=torch.tensor([[3, 4, 5]]))
    local = load_client(path, BaseExecutor.from_pretrained(path), local_lm_head=True)
    peft.get_peft_model(local, config)(input_ids=torch.tensor([[3, 4, 5]]))  # runs


@pytest.mark.parametrize("bias", ["all", "lora_only"])
def test_lora_that_trains_base_biases_is_refused(checkpoints, tmp_path, bias):
    """bias='all' made the base biases trainable on the client, where the executor's
    frozen ones were added instead: gradients None, the trained biases ignored."""
    from symbiont.adapters import AdapterError, read_adapter

    path = checkpoints("qwen2")  # biased q/k/v
    config = peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], bias=bias)
    model = peft.get_peft_model(load_client(path, BaseExecutor.from_pretrained(path)), config)
    with pytest.raises(BaseWeightUnavailable, match="bias='all' or 'lora_only'"):
        model(input_ids=torch.tensor([[3, 4, 5]]))
    config.save_pretrained(tmp_path)
    with pytest.raises(AdapterError, match=f"bias='{bias}' trains the base layers' biases"):
        read_adapter(tmp_path, require_weights=False)
