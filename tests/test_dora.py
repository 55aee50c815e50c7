"""DoRA through the split (symbiont/client/dora.py): the row norms of W + s·BA come from
the executor (‖W_i‖² once per layer, W Aᵀ as one forward call on A's rows), never from W
on the client; loss, logits, magnitude and LoRA gradients within 1e-5 of vanilla peft."""

from __future__ import annotations

import peft
import pytest
import torch

import symbiont
from symbiont.client.dora import dora_weight_norm
from symbiont.client.virt import VirtLayer
from symbiont.protocol.executor import Executor, Op
from tests.conftest import TRANSPORTS
from tests.test_exactness import batch, grads, make_pair

TOLERANCE = dict(rtol=1e-5, atol=1e-5)


def dora(dropout=0.0, targets="all-linear"):
    return peft.LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=dropout,
        target_modules=targets,
        use_dora=True,
        task_type="CAUSAL_LM",
    )


def assert_trains_like_vanilla(path, executor, config):
    vanilla, split = make_pair(path, executor, config)
    vanilla.train(), split.train()
    inputs = batch()
    torch.manual_seed(5)  # the same dropout masks on both sides
    out_v = vanilla(**inputs, labels=inputs["input_ids"])
    torch.manual_seed(5)
    out_s = split(**inputs, labels=inputs["input_ids"])
    torch.testing.assert_close(out_s.logits, out_v.logits, **TOLERANCE)
    torch.testing.assert_close(out_s.loss, out_v.loss, **TOLERANCE)
    out_v.loss.backward()
    out_s.loss.backward()
    grads_v, grads_s = grads(vanilla), grads(split)
    assert grads_v.keys() == grads_s.keys()
    assert any("lora_magnitude_vector" in name for name in grads_v)
    for name, grad in grads_v.items():
        torch.testing.assert_close(grads_s[name], grad, **TOLERANCE, msg=name)
    return vanilla, split


@pytest.mark.parametrize("dropout", [0.0, 0.1])  # 0.1: peft recomputes W x on the dropped x
@pytest.mark.parametrize("arch", ["llama", "qwen3_bias", "gpt2"])  # plain, biased, Conv1D
def test_dora_trains_like_vanilla(arch, dropout, checkpoints, one_thread):
    path = checkpoints(arch)
    assert_trains_like_vanilla(path, symbiont.BaseExecutor.from_pretrained(path), dora(dropout))


def test_dora_trains_like_vanilla_over_serve_base(checkpoints):
    path = checkpoints("qwen3_bias")
    with TRANSPORTS["tcp"](path) as executor:  # the session's serve-base for this checkpoint
        vanilla, split = assert_trains_like_vanilla(path, executor, dora(0.1))
        # Serving: eval-mode forward and greedy generation through the remote executor.
        vanilla.eval(), split.eval()
        with torch.no_grad():
            inputs = batch(seed=4)
            torch.testing.assert_close(
                split(**inputs).logits, vanilla(**inputs).logits, **TOLERANCE
            )
            gen = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
            prompt = batch(seed=3, rows=1)
            assert torch.equal(split.generate(**prompt, **gen), vanilla.generate(**prompt, **gen))


@pytest.mark.parametrize("arch", ["qwen3_bias", "gpt2"])
def test_dora_magnitude_starts_like_vanilla(arch, checkpoints):
    """peft sets the magnitude to ‖W_i + s(BA)_i‖ when it creates the layer."""
    path = checkpoints(arch)
    torch.manual_seed(0)
    vanilla = peft.get_peft_model(
        symbiont_free_model(path), dora(targets=None if arch == "gpt2" else ["q_proj", "o_proj"])
    )
    torch.manual_seed(0)
    client = symbiont.load_client(path, symbiont.BaseExecutor.from_pretrained(path))
    split = peft.get_peft_model(
        client, dora(targets=None if arch == "gpt2" else ["q_proj", "o_proj"])
    )
    magnitudes_v = {n: p for n, p in vanilla.named_parameters() if "magnitude" in n}
    magnitudes_s = {n: p for n, p in split.named_parameters() if "magnitude" in n}
    assert magnitudes_v and magnitudes_v.keys() == magnitudes_s.keys()
    for name, magnitude in magnitudes_v.items():
        torch.testing.assert_close(magnitudes_s[name], magnitude, **TOLERANCE, msg=name)


def symbiont_free_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path)


@pytest.mark.parametrize("arch", ["qwen3_bias", "gpt2"])
def test_row_norms_equal_the_norms_of_the_full_matrix(arch, checkpoints):
    """The expansion against torch.linalg.norm(W + s·BA, dim=1) on the real W (with bias)."""
    path = checkpoints(arch)
    client = symbiont.load_client(path, symbiont.BaseExecutor.from_pretrained(path))
    full = symbiont_free_model(path)
    layer = next(m for m in client.modules() if isinstance(m, VirtLayer) and m.bias is not None)
    weight = full.get_submodule(layer.spec.name).weight.detach()
    if arch == "gpt2":  # Conv1D stores [in, out]
        weight = weight.t()
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(4, layer.spec.in_features, generator=generator)
    b = torch.randn(layer.spec.out_features, 4, generator=generator)
    expected = torch.linalg.norm(weight + 0.7 * (b @ a), dim=1)
    torch.testing.assert_close(dora_weight_norm(layer, a, b, 0.7), expected, **TOLERANCE)


class _Recording(Executor):
    """Passes calls through and records (op, layer, rows)."""

    def __init__(self, inner: Executor):
        self.inner = inner
        self.calls: list[tuple[Op, int, int]] = []

    @property
    def manifest(self):
        return self.inner.manifest

    def call(self, op, layer, x):
        self.calls.append((op, layer, x.shape[0]))
        return self.inner.call(op, layer, x)


def test_base_norms_are_read_once_per_layer(checkpoints):
    """‖W_i‖² is a property of the frozen base: one pass of backward calls per layer, then
    each step costs one forward call of r rows per adapted layer for W Aᵀ."""
    path = checkpoints("llama")
    executor = _Recording(symbiont.BaseExecutor.from_pretrained(path))
    client = symbiont.load_client(path, executor)
    model = peft.get_peft_model(client, dora(targets=["q_proj", "v_proj"]))
    adapted = {executor.manifest.layer_ids()[n] for n in _names(model)}
    reads = [c for c in executor.calls if c[0] is Op.BACKWARD]
    assert {layer for _, layer, _ in reads} == adapted
    width = {s.id: s.out_features for s in executor.manifest.layers}
    for layer in adapted:  # every row of W once, never again
        assert sum(rows for _, lid, rows in reads if lid == layer) == width[layer]

    executor.calls.clear()
    with torch.no_grad():
        model(**batch())
    assert not [c for c in executor.calls if c[0] is Op.BACKWARD]
    norm_calls = [c for c in executor.calls if c[0] is Op.FORWARD and c[2] == 4]
    assert sorted(layer for _, layer, _ in norm_calls) == sorted(adapted)


def _names(model):
    return [
        name.removeprefix("base_model.model.").removesuffix(".base_layer")
        for name, module in model.named_modules()
        if isinstance(module, VirtLayer) and name.endswith(".base_layer")
    ]


def test_finetune_flags_build_a_dora_config():
    from symbiont.adapters import AdapterFlags, build_peft_config

    config = build_peft_config(AdapterFlags(method="dora", r=4, target="q_proj,v_proj"))
    assert isinstance(config, peft.LoraConfig) and config.use_dora and config.r == 4
    assert not build_peft_config(AdapterFlags(method="lora", r=4)).use_dora
