"""Mixture-of-experts models through the split: the experts live on the executor.

Three MoE families, each a tiny checkpoint written by transformers' own save_pretrained
(so its per-expert keys go through transformers' conversion mapping on load): forward
logits and LoRA gradients (attention and router) equal vanilla transformers + peft, in
process and over serve-base; the client holds no expert weight; LoRA on the experts is
refused naming the option; malformed experts calls are refused with their reason.
"""

from __future__ import annotations

import pytest
import torch

import symbiont
from symbiont.protocol.executor import ExecutorError, Op
from tests.tiny_models import ARCHS, Arch, build_checkpoint

ATOL = 1e-5  # fp32; in process the numbers are bitwise equal, batching may change the last bits
_MOE = {**ARCHS["llama"].config, "num_experts_per_tok": 2}
MOE_ARCHS = {
    a.name: a
    for a in [
        Arch("mixtral", "mixtral", {**_MOE, "num_local_experts": 4}, ("q_proj", "v_proj"), ()),
        Arch(
            "qwen3_moe",
            "qwen3_moe",
            {**_MOE, "num_experts": 4, "moe_intermediate_size": 16, "head_dim": 8},
            ("q_proj", "v_proj"),
            (),
        ),
        Arch("olmoe", "olmoe", {**_MOE, "num_experts": 4}, ("q_proj", "v_proj"), ()),
    ]
}
ROUTER = {"mixtral": "mlp.gate.weight", "qwen3_moe": "mlp.gate.weight", "olmoe": "mlp.gate.weight"}


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory):
    cache: dict = {}

    def get(name: str):
        if name not in cache:
            cache[name] = build_checkpoint(MOE_ARCHS[name], tmp_path_factory.mktemp(name))
        return cache[name]

    return get


def test_in_process_refusals(moe_checkpoints):
    path = moe_checkpoints("olmoe")
    executor = symbiont.BaseExecutor.from_pretrained(path)
    hidden, ids, weights = torch.randn(3, 32), torch.tensor([[0, 1]] * 3), torch.rand(3, 2)
    (y,) = executor.call_experts(Op.EXPERTS_FORWARD, 0, hidden, ids, weights)
    assert y.shape == (3, 32)
    cases = {
        "unknown experts id 2": (2, hidden, ids, weights),
        r"expert ids must lie in 0\.\.3": (0, hidden, ids + 3, weights),
        r"expects hidden states \[n_tokens, 32\]": (0, hidden[:, :16], ids, weights),
        r"must match ids": (0, hidden, ids, weights[:, :1]),
        "NaN or inf": (0, hidden, ids, weights.log() * 0 - float("inf")),
        r"picks 1\.\.4 of them": (0, hidden, torch.zeros(3, 5, dtype=torch.long), torch.rand(3, 5)),
        "in torch.float64": (0, hidden, ids, weights.double()),
    }
    for message, (experts, *tensors) in cases.items():
        with pytest.raises(ExecutorError, match=message):
            executor.call_experts(Op.EXPERTS_FORWARD, experts, *tensors)
    with pytest.raises(ExecutorError, match="not a base-layer op"):
        executor.call(Op.EXPERTS_FORWARD, 0, hidden)
