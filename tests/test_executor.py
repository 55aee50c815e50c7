"""The executor interface: stateless calls, exact math, and clear refusals of bad calls.

Uses the `connect` fixture, so every transport must behave the same way.
"""

from __future__ import annotations

import gc

import peft
import pytest
import torch

import symbiont
from symbiont.model.layers import LayerKind
from symbiont.protocol.executor import ExecutorError, Op


def test_forward_and_backward_match_the_module_math(checkpoints, connect, one_thread):
    """Bitwise: like with like. The remote executors run one torch thread (conftest starts
    serve-base with --threads 1), and so does this process here: BLAS kernels may sum in
    another order with another thread count (MKL's addmm differs by ~2e-6 between 1 and 2)."""
    from transformers import AutoModelForCausalLM

    path = checkpoints("gpt2")  # has both Conv1D and nn.Linear (lm_head)
    executor = connect(path)
    full = AutoModelForCausalLM.from_pretrained(path)
    modules = dict(full.named_modules())
    kinds = set()
    for spec in executor.manifest.layers:
        module = modules[spec.name]
        kinds.add(spec.kind)
        x = torch.randn(5, spec.in_features, requires_grad=True)
        y = module(x)
        assert torch.equal(executor.forward(spec.id, x.detach()), y.detach())
        grad_y = torch.randn_like(y)
        y.backward(grad_y)
        assert torch.equal(executor.backward(spec.id, grad_y), x.grad)
    assert kinds == {LayerKind.CONV1D, LayerKind.LINEAR}


def test_zero_token_call_returns_empty(checkpoints, connect):
    executor = connect(checkpoints("llama"))
    spec = executor.manifest.layers[0]
    assert executor.forward(0, torch.empty(0, spec.in_features)).shape == (0, spec.out_features)


@pytest.mark.parametrize(
    "layer, shape, dtype, message",
    [
        (10_000, (2, 32), torch.float32, "unknown layer id 10000"),
        (-1, (2, 32), torch.float32, "unknown layer id -1"),
        (0, (2, 31), torch.float32, r"expects \[n_tokens, 32\], got \[2, 31\]"),
        (0, (2, 1, 32), torch.float32, r"expects \[n_tokens, 32\], got \[2, 1, 32\]"),
        (0, (2, 32), torch.float64, "runs in torch.float32, got torch.float64"),
    ],
)
def test_bad_calls_are_refused_and_the_executor_keeps_serving(
    checkpoints, connect, layer, shape, dtype, message
):
    executor = connect(checkpoints("llama"))
    good = torch.randn(3, 32)
    expected = executor.forward(0, good)
    with pytest.raises(ExecutorError, match=message):
        executor.call(Op.FORWARD, layer, torch.zeros(shape, dtype=dtype))
    assert torch.equal(executor.forward(0, good), expected)


def test_executor_keeps_no_per_call_tensors(checkpoints):
    """Forward and backward of a fine-tuning step leave the executor holding exactly
    its weights (Symbiosis 3.6): nothing per client or per call."""
    path = checkpoints("llama")
    executor = symbiont.BaseExecutor.from_pretrained(path)
    weights = {id(t) for t in executor.weight_tensors()}
    model = peft.get_peft_model(
        symbiont.load_client(path, executor), peft.LoraConfig(target_modules="all-linear")
    )
    ids = torch.randint(0, 128, (2, 16))
    out = model(input_ids=ids, labels=ids)
    assert _tensors_reachable_from(executor) == weights
    # The autograd graph's base-layer nodes keep no activations either.
    assert all(not node.saved_tensors for node in _base_layer_nodes(out.loss.grad_fn))
    out.loss.backward()
    gc.collect()
    assert _tensors_reachable_from(executor) == weights


def _tensors_reachable_from(root) -> set[int]:
    found, seen, stack = set(), set(), [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, type):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.add(id(obj))
            continue
        stack.extend(gc.get_referents(obj))
    return found


def _base_layer_nodes(root):
    nodes, seen, stack = [], set(), [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "_BaseLayerCallBackward":
            nodes.append(node)
        stack.extend(next_node for next_node, _ in node.next_functions)
    assert nodes, "no base-layer autograd nodes found: is the test still exercising VirtLayers?"
    return nodes


def test_client_autocast_does_not_change_base_layer_math(checkpoints, connect):
    """Base layers run in the executor's dtype whatever autocast the client has on, so
    every transport computes the same thing (docs/compatibility.md, Dtypes)."""
    executor = connect(checkpoints("llama"))
    x = torch.randn(4, 32)
    grad_y = torch.randn(4, executor.manifest.layers[0].out_features)
    expected = executor.forward(0, x), executor.backward(0, grad_y)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = executor.forward(0, x), executor.backward(0, grad_y)
    assert all(
        g.dtype == torch.float32 and torch.equal(g, e) for g, e in zip(got, expected, strict=True)
    )
