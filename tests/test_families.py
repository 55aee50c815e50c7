"""Dense decoder families through the split: every linear layer on the executor, LoRA on all
of them, forward and backward equal to vanilla transformers + peft within 1e-5 in fp32.

Each family is a tiny random checkpoint written by transformers' own `save_pretrained`
(tests/tiny_models.py), so its key renames on load are exercised. Every family runs in
process and over a `serve-base` process (one per family, shared by the test session). The
bitwise method x transport matrix of tests/test_exactness.py covers many of these
families with more methods; this file is the family list, with the families only it has
(Qwen3 with and without attention bias, Falcon) and the refusal of an unsupported one.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import symbiont
from symbiont.client.virt import VirtLayer
from symbiont.model.checkpoint import Checkpoint
from symbiont.model.layers import UnsupportedArchitecture
from symbiont.protocol.executor import Executor, Manifest
from tests.conftest import TRANSPORTS
from tests.test_exactness import batch, grads, lora, make_pair
from tests.tiny_models import ALL_ARCHS, VOCAB

FAMILIES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3_bias",  # attention_bias=True: q/k/v/o carry biases
    "gemma2",
    "phi3",
    "gpt2",  # Conv1D layers
    "gpt_neox",  # saves lm_head as embed_out
    "opt",
    "falcon",  # FalconLinear, fused query_key_value with bias
)
TOLERANCE = dict(rtol=1e-5, atol=1e-5)
# A serve-base per checkpoint, over TCP, started once per test session and shared with the
# other suites (test_exactness starts most of these already), stopped at the session's end.
serve_base = TRANSPORTS["tcp"]


@pytest.mark.parametrize("transport", ["inprocess", "serve-base"])
@pytest.mark.parametrize("family", FAMILIES)
def test_family_trains_through_the_split(family, transport, checkpoints):
    path = checkpoints(family)
    if transport == "inprocess":
        executor = symbiont.BaseExecutor.from_pretrained(path)
    else:
        executor = serve_base(path)
    with executor:
        vanilla, split = make_pair(path, executor, lora(ALL_ARCHS[family], all_linear=True))
        adapted = [m for m in split.modules() if isinstance(m, VirtLayer)]
        assert len(adapted) == len(executor.manifest.layers), "a linear layer stayed local"

        inputs = batch()
        out_v = vanilla(**inputs, labels=inputs["input_ids"])
        out_s = split(**inputs, labels=inputs["input_ids"])
        torch.testing.assert_close(out_s.logits, out_v.logits, **TOLERANCE)
        torch.testing.assert_close(out_s.loss, out_v.loss, **TOLERANCE)

        out_v.loss.backward()
        out_s.loss.backward()
        grads_v, grads_s = grads(vanilla), grads(split)
        assert grads_v.keys() == grads_s.keys()
        # "all-linear" adapts every linear layer but the output projection, as peft does.
        assert sum("lora_A" in n for n in grads_v) == len(adapted) - 1
        for name, grad in grads_v.items():
            torch.testing.assert_close(grads_s[name], grad, **TOLERANCE, msg=name)


def test_unsupported_family_is_refused_at_load(tmp_path):
    """DeepSeek-V4's grouped output projection subclasses nn.Linear with a block-diagonal
    forward: run as a plain linear layer it would give wrong numbers, so both halves
    refuse the family at load, naming it and what is missing."""
    config = AutoConfig.for_model(
        "deepseek_v4",
        vocab_size=VOCAB,
        hidden_size=32,
        moe_intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=4,
        head_dim=16,
        q_lora_rank=16,
        num_experts_per_tok=2,
        n_routed_experts=4,
        max_position_embeddings=64,
        o_groups=2,
        o_lora_rank=16,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=8,
        num_nextn_predict_layers=0,
        qk_rope_head_dim=8,
        sliding_window=8,
        hc_mult=2,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    message = (
        r"model family 'deepseek_v4' is not supported: its DeepseekV4GroupedLinear layers "
        r"\(e\.g\. model\.layers\.0\.self_attn\.o_a_proj\) subclass nn\.Linear with their own "
        r"forward.*Missing: an executor operation for that layer's math"
    )
    with pytest.raises(UnsupportedArchitecture, match=message):
        symbiont.BaseExecutor.from_pretrained(tmp_path)
    with pytest.raises(UnsupportedArchitecture, match=message):
        symbiont.load_client(tmp_path, _ManifestOnly(tmp_path))


class _ManifestOnly(Executor):
    """An executor claiming the checkpoint's fingerprint and serving nothing: the client
    refuses the family while it builds its skeleton, before any call."""

    def __init__(self, path):
        self._manifest = Manifest(Checkpoint.open(path).fingerprint, torch.float32, ())

    @property
    def manifest(self) -> Manifest:
        return self._manifest

    def call(self, op, layer, x):
        raise AssertionError("no call is expected")
