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
