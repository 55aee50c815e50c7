"""Token-level fine-tuning (symbiont/jobs/windows.py): a step cut into windows of tokens
gives the whole-sequence step's loss and adapter gradients, within 1e-5 in fp32."""

from __future__ import annotations

import peft
import pytest
import torch

from symbiont import BaseExecutor, load_client
from symbiont.jobs.windows import IGNORE_INDEX, windowed_backward
from tests.tiny_models import VOCAB


def lora_model(path):
    torch.manual_seed(0)
    model = load_client(path, BaseExecutor.from_pretrained(path))
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    model = peft.get_peft_model(model, config)
    with torch.no_grad():  # B != 0, so every adapter weight gets a gradient
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    return model


def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, 13), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # the second sequence is right-padded
    labels = ids.clone()
    labels[:, :4] = IGNORE_INDEX  # a prompt without loss
    labels[mask == 0] = IGNORE_INDEX
    return ids, labels, mask


def grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("window", [1, 3, 5, 13])
def test_windows_give_the_whole_sequence_gradients(checkpoints, window, one_thread):
    model = lora_model(checkpoints("llama"))
    ids, labels, mask = batch()
    whole_loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    whole_loss.backward()
    whole = grads(model)
    loss = windowed_backward(model, ids, labels, window, attention_mask=mask)
    windowed = grads(model)
    assert abs(loss.item() - whole_loss.item()) < 1e-6
    assert whole.keys() == windowed.keys() and len(whole) > 0
    for name in whole:
        assert whole[name].abs().max() > 0, f"{name} got no gradient: the test would not see a bug"
        diff = (whole[name] - windowed[name]).abs().max().item()
        assert diff < 1e-5, f"{name}: windowed gradient differs by {diff:.2e}"


def test_bad_window_and_sliding_attention_are_refused(checkpoints):
    model = lora_model(checkpoints("llama"))
    ids, labels, _ = batch()
    with pytest.raises(ValueError, match="window must be >= 1"):
        windowed_backward(model, ids, labels, 0)
    model.config.sliding_window = 4
    with pytest.raises(ValueError, match="needs full attention in every layer"):
        windowed_backward(model, ids, labels, 4)
