"""Layers fed one input (q/k/v, gate/up) cost one in-process executor call and one matmul.

The executor stores such sibling layers back to back (each weight a row-slice view of one
block, no extra memory) and `forward_fused` runs a contiguous run of them as one matmul.
VirtLayers learn which layer follows which on the very same tensor and make one fused
call for the group. Backward stays one node and one call per layer: autograd then sums
the input gradient in vanilla's order, so gradients stay bitwise equal.
"""

from __future__ import annotations

import threading
from collections import Counter

import peft
import pytest
import torch
import torch.nn.functional as F

import symbiont
from symbiont.base.executor import BaseExecutor
from symbiont.protocol.executor import Executor, ExecutorError, Op

LAYERS_PER_BLOCK = 7  # Llama: q, k, v, o, gate, up, down
FUSED_PER_BLOCK = 4  # q(+k, v), o, gate(+up), down


class Counting(Executor):
    """Counts the calls reaching `inner`; `fuses` says whether it fuses like `inner`."""

    def __init__(self, inner: BaseExecutor, fuses: bool):
        self.inner = inner
        self.fuses_calls = fuses
        self.calls: Counter = Counter()

    @property
    def manifest(self):
        return self.inner.manifest

    def call(self, op, layer, x):
        self.calls[op.name] += 1
        return self.inner.call(op, layer, x)

    def forward_fused(self, layers, x):
        self.calls["FUSED"] += 1
        return self.inner.forward_fused(layers, x)


def _client(path, fuses: bool):
    executor = Counting(BaseExecutor.from_pretrained(path), fuses)
    return symbiont.load_client(path, executor), executor


def _ids(rows=2, length=6, seed=0):
    return torch.randint(3, 128, (rows, length), generator=torch.Generator().manual_seed(seed))


def _n_blocks(model) -> int:
    return model.config.num_hidden_layers


def test_inference_forward_is_one_call_per_group_and_bitwise_equal(checkpoints, one_thread):
    path = checkpoints("llama")
    fused, fused_ex = _client(path, fuses=True)
    plain, plain_ex = _client(path, fuses=False)
    ids = _ids()
    with torch.no_grad():
        fused(input_ids=ids)  # the first forward learns which layer follows which
        fused_ex.calls.clear()
        out = fused(input_ids=ids).logits
        ref = plain(input_ids=ids).logits
    assert torch.equal(out, ref), "a fused forward must give the same bits as the split one"
    blocks = _n_blocks(fused)
    # + 1: lm_head
    assert fused_ex.calls["FORWARD"] + fused_ex.calls["FUSED"] == FUSED_PER_BLOCK * blocks + 1
    assert fused_ex.calls["FUSED"] == 2 * blocks, "q/k/v and gate/up each one fused call"
    assert plain_ex.calls["FORWARD"] == LAYERS_PER_BLOCK * blocks + 1


def test_fused_call_is_one_matmul(checkpoints):
    path = checkpoints("llama")
    executor = BaseExecutor.from_pretrained(path)
    ids = executor.manifest.layer_ids()
    qkv = tuple(ids[f"model.layers.0.self_attn.{n}_proj"] for n in "qkv")
    x = torch.randn(5, executor.manifest.layers[qkv[0]].in_features)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ys = executor.forward_fused(qkv, x)
    linears = [e for e in prof.events() if e.name == "aten::linear"]
    assert len(linears) == 1, f"expected one matmul for q/k/v, ran {len(linears)}"
    for layer, y in zip(qkv, ys, strict=True):
        assert torch.equal(y, executor.call(Op.FORWARD, layer, x))


@pytest.mark.parametrize("n_tokens", [1, 3, 33, 130])
@pytest.mark.parametrize("arch", ["llama", "opt"])  # opt: q/k/v/out_proj with biases
def test_fused_matmul_gives_the_bits_of_separate_ones(checkpoints, arch, n_tokens):
    """What the exactness suite relies on, checked on this machine's GEMM: the columns of
    one matmul over the block equal each layer's own matmul, bitwise (CPU, fp32)."""
    executor = BaseExecutor.from_pretrained(checkpoints(arch))
    x = torch.randn(n_tokens, 32, generator=torch.Generator().manual_seed(n_tokens))
    fused_groups = 0
    for block in executor._blocks:
        ys = executor.forward_fused(block.layers, x)
        fused_groups += 1
        for layer, y in zip(block.layers, ys, strict=True):
            assert torch.equal(y, executor.call(Op.FORWARD, layer, x)), (arch, layer)
    assert fused_groups >= 2  # at least the attention block of both decoder layers


def test_training_fuses_forward_and_keeps_exact_per_layer_backward(checkpoints, one_thread):
    """LoRA and AdaLoRA (whose `result +=` edits the base output in place) train with
    fused forwards; adapter gradients are bitwise those of per-layer calls."""
    path = checkpoints("llama")
    for config in (
        peft.LoraConfig(r=4, target_modules="all-linear"),
        peft.AdaLoraConfig(
            init_r=4, target_r=2, total_step=10, target_modules=["q_proj", "k_proj"]
        ),
    ):
        grads, counts = [], []
        for fuses in (True, False):
            model, executor = _client(path, fuses)
            torch.manual_seed(0)
            model = peft.get_peft_model(model, config)
            for p in model.parameters():
                if p.requires_grad:
                    torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(1))
            ids = _ids()
            model(input_ids=ids)  # learn the order
            executor.calls.clear()
            model(input_ids=ids, labels=ids).loss.backward()
            grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
            counts.append(executor.calls)
        for name, grad in grads[1].items():
            assert torch.equal(grads[0][name], grad), name
        blocks = _n_blocks(model)
        fused, plain = counts
        assert fused["FORWARD"] + fused["FUSED"] == FUSED_PER_BLOCK * blocks + 1
        assert plain["FORWARD"] == LAYERS_PER_BLOCK * blocks + 1
        assert fused["BACKWARD"] == plain["BACKWARD"]  # one exact backward call per layer


def test_blocks_hold_no_extra_weight_memory(checkpoints):
    executor = BaseExecutor.from_pretrained(checkpoints("opt"))
    specs = executor.manifest.layers
    expected = sum(s.out_features * (s.in_features + s.has_bias) * 4 for s in specs)
    assert executor.weight_bytes() == expected
    assert executor._blocks, "OPT's q/k/v/out_proj should share a block"
    for block in executor._blocks:
        base = block.weight.untyped_storage().data_ptr()
        for layer in block.layers:
            weight = executor._weights[layer].weight
            assert weight.is_contiguous()
            assert weight.untyped_storage().data_ptr() == base, "a layer's weight was copied"
            assert weight.data_ptr() % 64 == 0


def test_an_input_edited_in_place_between_calls_is_not_fused(checkpoints):
    path = checkpoints("llama")
    model, executor = _client(path, fuses=True)
    attn = model.model.layers[0].self_attn
    q, k, v = attn.q_proj, attn.k_proj, attn.v_proj
    weights = {m: executor.inner._weights[m.spec.id].weight for m in (q, k, v)}
    with torch.no_grad():
        x = torch.randn(4, 32)
        for layer in (q, k, v):  # learn q -> k -> v
            layer(x)
        x = torch.randn(4, 32)
        executor.calls.clear()
        q(x)  # computes k and v too
        assert executor.calls["FUSED"] == 1
        x.mul_(2)  # bumps the version: the held k, v outputs no longer apply
        assert torch.equal(k(x), F.linear(x, weights[k]))
        assert torch.equal(v(x), F.linear(x, weights[v]))
        # k and v computed afresh on the edited x (together: k -> v still holds)
        assert executor.calls["FUSED"] == 2 and executor.calls["FORWARD"] == 0
        y = torch.randn(4, 32)
        executor.calls.clear()
        assert torch.equal(q(y), F.linear(y, weights[q]))
        assert executor.calls["FORWARD"] == 1, "a plan that missed must be learnt again"


def test_inference_tensors_are_never_fused(checkpoints):
    """inference_mode tensors keep no version counter: an edit could not be seen."""
    model, executor = _client(checkpoints("llama"), fuses=True)
    ids = _ids()
    with torch.inference_mode():
        model(input_ids=ids)
        executor.calls.clear()
        model(input_ids=ids)
    assert executor.calls["FUSED"] == 0
    assert executor.calls["FORWARD"] == LAYERS_PER_BLOCK * _n_blocks(model) + 1


def test_executors_without_fused_calls_get_one_call_per_layer(checkpoints):
    """The interface's default forward_fused loops over `call` (remote transports and
    wrappers keep working), and VirtLayers only group calls for executors that fuse."""
    path = checkpoints("llama")
    inner = BaseExecutor.from_pretrained(path)
    wrapper = Counting(inner, fuses=False)
    x = torch.randn(3, 32)
    ys = Executor.forward_fused(wrapper, (0, 1, 2), x)
    assert wrapper.calls["FORWARD"] == 3
    for layer, y in zip((0, 1, 2), ys, strict=True):
        assert torch.equal(y, inner.call(Op.FORWARD, layer, x))


def test_bad_fused_calls_are_refused(checkpoints):
    executor = BaseExecutor.from_pretrained(checkpoints("llama"))
    ids = executor.manifest.layer_ids()
    q, down = ids["model.layers.0.self_attn.q_proj"], ids["model.layers.0.mlp.down_proj"]
    with pytest.raises(ExecutorError, match="cannot be fused"):
        executor.forward_fused((q, down), torch.randn(2, 32))
    with pytest.raises(ExecutorError, match="at least one layer"):
        executor.forward_fused((), torch.randn(2, 32))
    with pytest.raises(ExecutorError, match="expects"):
        executor.forward_fused((q, q + 1), torch.randn(2, 31))


def test_threads_calling_one_executor_fuse_apart(checkpoints, one_thread):
    """A serving engine and a fine-tuning job call one executor from two threads: each
    thread has its own fusion state, and both get their own outputs."""
    path = checkpoints("llama")
    executor = BaseExecutor.from_pretrained(path)
    models = [symbiont.load_client(path, executor) for _ in range(2)]
    reference = symbiont.load_client(path, Counting(executor, fuses=False))
    inputs = [_ids(seed=s) for s in range(2)]
    with torch.no_grad():
        expected = [reference(input_ids=ids).logits for ids in inputs]
    results, errors = {}, []

    def run(i):
        try:
            with torch.no_grad():
                for _ in range(5):
                    results[i] = models[i](input_ids=inputs[i]).logits
        except Exception as err:  # noqa: BLE001 - reported by the assert below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i in range(2):
        assert torch.equal(results[i], expected[i])


def test_the_jobs_priority_gate_keeps_calls_fused(checkpoints, one_thread):
    """`serve --jobs-dir` routes the engine's calls through one InferenceExecutor per
    executor: q/k/v and gate/up stay one call each, with the same bits."""
    from symbiont.client.virt import VirtLayer
    from symbiont.jobs.priority import InferenceExecutor, PriorityGate, give_inference_priority

    path = checkpoints("llama")
    gated, counting = _client(path, fuses=True)
    plain, _ = _client(path, fuses=False)
    give_inference_priority(gated, PriorityGate())
    wrappers = {m.executor for m in gated.modules() if isinstance(m, VirtLayer)}
    assert len(wrappers) == 1, "one wrapper per executor, so fusion is learned across layers"
    assert isinstance(next(iter(wrappers)), InferenceExecutor)
    ids = _ids(seed=3)
    with torch.no_grad():
        gated(input_ids=ids)
        counting.calls.clear()
        out = gated(input_ids=ids).logits
        ref = plain(input_ids=ids).logits
    assert torch.equal(out, ref)
    assert counting.calls["FUSED"] == 2 * _n_blocks(gated)
