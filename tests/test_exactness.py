"""The transparency matrix: symbiont equals vanilla transformers + peft on the same weights.

For each (architecture, PEFT method) pair: logits bitwise equal in fp32 on CPU, adapter
gradients equal after one backward, greedy generate() tokens equal, and an adapter saved
from the split model loads in vanilla peft with equal outputs.
"""

from __future__ import annotations

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM

import symbiont
from symbiont.client.virt import BaseWeightUnavailable, RemoteWeight
from tests.tiny_models import ARCHS, VOCAB


def lora(arch, *, all_linear=False, **kw):
    targets = "all-linear" if all_linear else list(arch.attention)
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, task_type="CAUSAL_LM", **kw)


METHODS = {
    "lora_attn": lambda a: lora(a),
    "lora_all_linear": lambda a: lora(a, all_linear=True),
    "adalora": lambda a: peft.AdaLoraConfig(
        init_r=6, target_r=4, total_step=10, target_modules=list(a.attention), task_type="CAUSAL_LM"
    ),
    "ia3": lambda a: peft.IA3Config(
        target_modules=list(a.attention + a.feedforward),
        feedforward_modules=list(a.feedforward),
        task_type="CAUSAL_LM",
    ),
    "loha": lambda a: peft.LoHaConfig(r=4, target_modules=list(a.attention), task_type="CAUSAL_LM"),
    "lokr": lambda a: peft.LoKrConfig(r=4, target_modules=list(a.attention), task_type="CAUSAL_LM"),
    "vera": lambda a: peft.VeraConfig(r=4, target_modules=list(a.attention), task_type="CAUSAL_LM"),
    "prefix": lambda a: peft.PrefixTuningConfig(num_virtual_tokens=3, task_type="CAUSAL_LM"),
    "prompt": lambda a: peft.PromptTuningConfig(num_virtual_tokens=3, task_type="CAUSAL_LM"),
}


def make_pair(path, executor, config):
    """(vanilla peft model, symbiont peft model) with identical, non-trivial adapter weights."""
    torch.manual_seed(1)
    try:
        vanilla = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(path), config)
    except (TypeError, ValueError, NotImplementedError) as err:
        pytest.skip(f"vanilla peft cannot apply this method here: {err}")
    with torch.no_grad():  # LoRA B starts at zero, IA3 at one: perturb so gradients mean something
        for param in vanilla.parameters():
            if param.requires_grad:
                param.add_(torch.randn_like(param) * 0.1)
    split = peft.get_peft_model(symbiont.load_client(path, executor), config)
    copy_adapter_state(vanilla, split)
    return vanilla.eval(), split.eval()


def copy_adapter_state(source, target):
    target_tensors = dict(target.named_parameters()) | dict(target.named_buffers())
    with torch.no_grad():
        for name, tensor in list(source.named_parameters()) + list(source.named_buffers()):
            twin = target_tensors[name]
            if not isinstance(twin, RemoteWeight):
                twin.copy_(tensor)


def batch(seed=2, rows=2, length=6):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (rows, length), generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def grads(model):
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_split_equals_vanilla(arch, method, checkpoints, connect, tmp_path):
    path = checkpoints(arch)
    config = METHODS[method](ARCHS[arch])
    vanilla, split = make_pair(path, connect(path), config)
    inputs = batch()

    out_v = vanilla(**inputs, labels=inputs["input_ids"])
    out_s = split(**inputs, labels=inputs["input_ids"])
    assert torch.equal(out_v.logits, out_s.logits), "logits differ from vanilla"

    out_v.loss.backward()
    out_s.loss.backward()
    grads_v, grads_s = grads(vanilla), grads(split)
    assert grads_v.keys() == grads_s.keys() and grads_v
    for name, grad in grads_v.items():
        # Bitwise: the split backward runs the same mm (grad_y·W) autograd would run.
        assert torch.equal(grads_s[name], grad), name

    with torch.no_grad():
        gen = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
        tokens_v = vanilla.generate(**batch(seed=3, rows=1), **gen)
        tokens_s = split.generate(**batch(seed=3, rows=1), **gen)
    assert torch.equal(tokens_v, tokens_s), "greedy generation differs from vanilla"

    split.save_pretrained(tmp_path / "adapter")
    reloaded = peft.PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(path), tmp_path / "adapter"
    ).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(**inputs).logits, split(**inputs).logits), (
            "adapter saved by symbiont does not reproduce its outputs in vanilla peft"
        )


def test_weight_initialisations_that_read_base_weights_are_refused(checkpoints, connect):
    path = checkpoints("llama")
    client = symbiont.load_client(path, connect(path))
    with pytest.raises(BaseWeightUnavailable, match="PiSSA"):
        peft.get_peft_model(client, lora(ARCHS["llama"], init_lora_weights="pissa"))
