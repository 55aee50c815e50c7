"""More PEFT methods through the split: loss, logits and every trainable gradient within
1e-5 of vanilla transformers + peft in fp32 (most are in fact bitwise equal on CPU; HRA
and SHiRA, rewritten as base-layer calls, differ by float rounding).

Methods that wrap linear layers also run on Qwen3 with `attention_bias=True`, where the
methods that transform a layer's output (BOFT scales `base(x) - b` and adds `b` back) need
the layer's real bias on the client. BOFT and HRA also run over a `serve-base` process.
"""

from __future__ import annotations

import json

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM

import symbiont
from symbiont.adapters import AdapterError, read_adapter
from symbiont.client.virt import BaseWeightUnavailable
from tests.conftest import TRANSPORTS
from tests.test_exactness import batch, grads, make_pair

ATTENTION = ["q_proj", "v_proj"]
CAUSAL = dict(task_type="CAUSAL_LM")

# Methods that wrap the attention projections (linear layers).
LAYER_METHODS = {
    "oft": lambda: peft.OFTConfig(oft_block_size=8, r=0, target_modules=ATTENTION, **CAUSAL),
    "boft": lambda: peft.BOFTConfig(boft_block_size=4, target_modules=ATTENTION, **CAUSAL),
    "fourierft": lambda: peft.FourierFTConfig(n_frequency=16, target_modules=ATTENTION, **CAUSAL),
    "vblora": lambda: peft.VBLoRAConfig(
        r=4, num_vectors=16, vector_length=8, target_modules=ATTENTION, **CAUSAL
    ),
    "c3a": lambda: peft.C3AConfig(block_size=8, target_modules=ATTENTION, **CAUSAL),
    "randlora": lambda: peft.RandLoraConfig(r=4, target_modules=ATTENTION, **CAUSAL),
    "miss": lambda: peft.MissConfig(r=4, target_modules=ATTENTION, **CAUSAL),
    "waveft": lambda: peft.WaveFTConfig(n_frequency=16, target_modules=ATTENTION, **CAUSAL),
    "gralora": lambda: peft.GraloraConfig(r=4, gralora_k=2, target_modules=ATTENTION, **CAUSAL),
    # These three compute with W itself in peft; split, they call the base layer instead
    # (symbiont/client/weight_methods.py).
    "hra": lambda: peft.HRAConfig(r=4, target_modules=ATTENTION, **CAUSAL),
    "shira": lambda: peft.ShiraConfig(r=4, target_modules=ATTENTION, **CAUSAL),
    "delora": lambda: peft.DeloraConfig(r=4, target_modules=ATTENTION, **CAUSAL),
}
# Methods that touch no base layer (norms, embeddings, prompts, attention adapters).
OTHER_METHODS = {
    "ln_tuning": lambda: peft.LNTuningConfig(**CAUSAL),
    "p_tuning": lambda: peft.PromptEncoderConfig(
        num_virtual_tokens=3, encoder_hidden_size=16, **CAUSAL
    ),
    "adaption_prompt": lambda: peft.AdaptionPromptConfig(adapter_len=3, adapter_layers=1, **CAUSAL),
    "trainable_tokens": lambda: peft.TrainableTokensConfig(token_indices=[3, 5, 7], **CAUSAL),
}
METHODS = LAYER_METHODS | OTHER_METHODS
TOLERANCE = dict(rtol=1e-5, atol=1e-5)

CASES = [(m, "llama") for m in sorted(METHODS)] + [(m, "qwen3_bias") for m in sorted(LAYER_METHODS)]


def assert_trains_like_vanilla(path, executor, config):
    vanilla, split = make_pair(path, executor, config)
    vanilla.train(), split.train()
    inputs = batch()
    out_v = vanilla(**inputs, labels=inputs["input_ids"])
    out_s = split(**inputs, labels=inputs["input_ids"])
    torch.testing.assert_close(out_s.logits, out_v.logits, **TOLERANCE)
    torch.testing.assert_close(out_s.loss, out_v.loss, **TOLERANCE)
    out_v.loss.backward()
    out_s.loss.backward()
    grads_v, grads_s = grads(vanilla), grads(split)
    assert grads_v and grads_v.keys() == grads_s.keys()
    for name, grad in grads_v.items():
        assert grad is not None and grad.abs().sum() > 0, f"{name} got no gradient"
        torch.testing.assert_close(grads_s[name], grad, **TOLERANCE, msg=name)
    return vanilla, split


@pytest.mark.parametrize(("method", "arch"), CASES)
def test_method_trains_like_vanilla_in_process(method, arch, checkpoints, one_thread):
    path = checkpoints(arch)
    assert_trains_like_vanilla(path, symbiont.BaseExecutor.from_pretrained(path), METHODS[method]())


def test_output_transforming_method_sees_the_real_bias(checkpoints):
    """BOFT computes (base(x) - b) * s + b: the client's bias must be the checkpoint's."""
    path = checkpoints("qwen3_bias")
    vanilla, split = make_pair(path, symbiont.BaseExecutor.from_pretrained(path), METHODS["boft"]())
    layer_v = vanilla.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    layer_s = split.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    assert layer_v.bias.abs().sum() > 0
    assert torch.equal(layer_s.bias, layer_v.bias)


def test_delora_reads_the_column_norms_of_w_like_vanilla(checkpoints):
    """DeLoRA keeps ‖W_{:,j}‖ from creation; split, they come from the executor."""
    path = checkpoints("qwen3_bias")
    torch.manual_seed(0)
    vanilla = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(path), METHODS["delora"]())
    torch.manual_seed(0)
    client = symbiont.load_client(path, symbiont.BaseExecutor.from_pretrained(path))
    split = peft.get_peft_model(client, METHODS["delora"]())
    state_v, state_s = vanilla.state_dict(), split.state_dict()
    norms = [n for n in state_v if "delora_w_norm" in n]
    assert norms
    for name in norms + [n for n in state_v if "delora_A" in n]:
        torch.testing.assert_close(state_s[name], state_v[name], **TOLERANCE, msg=name)


@pytest.mark.parametrize("method", ["boft", "hra"])
def test_method_trains_like_vanilla_over_serve_base(method, checkpoints):
    path = checkpoints("qwen3_bias")
    with TRANSPORTS["tcp"](path) as executor:  # the session's serve-base for this checkpoint
        assert_trains_like_vanilla(path, executor, METHODS[method]())


# -- initialisations from the base weight: refused, saying that the base is shared ------


INITS_THAT_REWRITE_W = ["pissa", "pissa_niter_4", "olora", "loftq", "corda", "lora_ga"]


@pytest.mark.parametrize("init", INITS_THAT_REWRITE_W)
def test_initialisation_from_the_base_weight_is_refused_as_the_base_is_shared(init, tmp_path):
    # Written by hand: peft cannot build a LoftQ config without scipy.
    config = dict(peft_type="LORA", r=2, init_lora_weights=init, target_modules=ATTENTION)
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(AdapterError, match=r"initialisation.*But the base is shared: every tenant"):
        read_adapter(tmp_path, require_weights=False)


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_initialisation_given_to_peft_directly_says_the_base_is_shared(init, checkpoints):
    path = checkpoints("llama")
    client = symbiont.load_client(path, symbiont.BaseExecutor.from_pretrained(path))
    config = peft.LoraConfig(r=2, init_lora_weights=init, target_modules=ATTENTION, **CAUSAL)
    with pytest.raises(BaseWeightUnavailable, match=r"initialisation.*the base is shared"):
        peft.get_peft_model(client, config)
