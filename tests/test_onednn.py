"""`serve-base --matmul onednn` (symbiont/base/onednn.py): every product within fp32
rounding of torch's, forward and backward, LINEAR and CONV1D layers, fused runs; a LoRA
step through a serve-base computing on oneDNN equal to vanilla transformers + peft within
that rounding; clear refusals where oneDNN does not compute."""

from __future__ import annotations

import pytest
import torch

import symbiont
from symbiont import BaseExecutor
from symbiont.base import onednn as onednn_module
from symbiont.base.config import BaseProcessConfig
from symbiont.base.onednn import ONEDNN_MIN_ROWS, OneDnnExecutor, can_use_onednn
from symbiont.model.layers import LayerKind
from symbiont.protocol.executor import Op
from tests.test_exactness import batch, grads, lora, make_pair
from tests.tiny_models import ARCHS

pytestmark = pytest.mark.skipif(
    not can_use_onednn("cpu", torch.float32), reason="this torch build has no oneDNN"
)
# another summation order: fp32 rounding apart, relative to the output scale
ATOL, RTOL = 1e-5, 1e-5


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])  # qwen2: biases; gpt2: CONV1D
def test_every_product_within_fp32_rounding_of_torch(checkpoints, arch, monkeypatch):
    """Every call that oneDNN computes (here every call of 8 rows or more: the tiny test
    layers are below ONEDNN_MIN_MACS, which is set to 0) is within fp32 rounding of
    torch's; fewer rows stay torch's, bit for bit."""
    plain = BaseExecutor.from_pretrained(checkpoints(arch))
    onednn = OneDnnExecutor(BaseExecutor.from_pretrained(checkpoints(arch)))
    assert (plain.products, onednn.products) == ("torch", "onednn")
    monkeypatch.setattr(onednn_module, "ONEDNN_MIN_MACS", 0)
    calls = []
    real = onednn_module.onednn_linear

    def counting(x, weight, bias):
        calls.append(x.shape[0])
        return real(x, weight, bias)

    monkeypatch.setattr(onednn_module, "onednn_linear", counting)
    kinds = {s.kind for s in plain.manifest.layers}
    assert LayerKind.CONV1D in kinds if arch == "gpt2" else LayerKind.LINEAR in kinds
    g = torch.Generator().manual_seed(0)
    for spec in plain.manifest.layers:
        for rows in (1, 5, 64):
            x = torch.randn(rows, spec.in_features, generator=g)
            grad_y = torch.randn(rows, spec.out_features, generator=g)
            for op, data in ((Op.FORWARD, x), (Op.BACKWARD, grad_y)):
                want, got = plain.call(op, spec.id, data), onednn.call(op, spec.id, data)
                assert torch.allclose(got, want, atol=ATOL, rtol=RTOL), (spec.name, op, rows)
                if rows < ONEDNN_MIN_ROWS:
                    assert torch.equal(got, want), (spec.name, op, rows)
    for layers in plain._runs:  # q/k/v, gate/up: one product over the block
        x = torch.randn(9, plain.manifest.layers[layers[0]].in_features, generator=g)
        for w, f in zip(
            plain.forward_fused(layers, x), onednn.forward_fused(layers, x), strict=True
        ):
            assert torch.allclose(f, w, atol=ATOL, rtol=RTOL)
    assert onednn.weight_bytes() == plain.weight_bytes()  # the same tensors, no copy
    n_calls = sum(1 for s in plain.manifest.layers) * 2 + len(plain._runs)
    assert len(calls) == n_calls and min(calls) >= ONEDNN_MIN_ROWS, calls


def test_small_products_stay_torch():
    """oneDNN computes a call from 8 rows and 2M multiply-adds (rows x weights) on."""
    pays = onednn_module._pays
    assert not pays(7, 10**9) and pays(8, 2**18) and not pays(8, 2**18 - 1)
    assert not pays(64, 128 * 128) and pays(128, 128 * 128)


def test_refused_where_onednn_does_not_compute(checkpoints, tmp_path):
    base = BaseExecutor.from_pretrained(checkpoints("llama"), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"not bfloat16 on cpu; use --matmul torch"):
        OneDnnExecutor(base)
    for dtype in ("bfloat16", "fp32"):  # fp32: no torch dtype of that name, load refuses it
        with pytest.raises(ValueError, match=r"--matmul onednn computes float32 on the CPU"):
            BaseProcessConfig(model=str(tmp_path), matmul="onednn", dtype=dtype)
    for dtype in (None, "float32", "float"):
        assert BaseProcessConfig(model=str(tmp_path), matmul="onednn", dtype=dtype).matmul


@pytest.fixture(scope="module")
def onednn_base(wide_llama):
    """A serve-base --matmul onednn on a Llama whose products of 64 rows are over
    ONEDNN_MIN_MACS (tests.tiny_models.WIDE_LLAMA: q/k/v 131K weights, gate/up 360K)."""
    from symbiont.processes import ServerProcess

    path = wide_llama
    server = ServerProcess(path, args=("--threads", "1", "--matmul", "onednn")).start()
    yield path, server
    server.stop()


def test_a_lora_step_through_a_onednn_serve_base_equals_vanilla(onednn_base):
    """Logits, loss and every LoRA gradient of one step through `serve-base --matmul
    onednn` (shared memory) against vanilla transformers + peft, within fp32 rounding."""
    path, server = onednn_base
    assert "float32, onednn products" in server.log_text()
    executor = symbiont.connect(server.url("tcp"), mode="shm", checkpoint=path)
    try:
        vanilla, split = make_pair(path, executor, lora(ARCHS["llama"], all_linear=True))
        inputs = batch(rows=4, length=16)  # 64 rows a call: over ONEDNN_MIN_MACS
        want = vanilla(**inputs, labels=inputs["input_ids"])
        got = split(**inputs, labels=inputs["input_ids"])
        assert torch.allclose(got.logits, want.logits, atol=1e-5, rtol=1e-5)
        want.loss.backward()
        got.loss.backward()
        assert torch.allclose(got.loss, want.loss, atol=1e-6, rtol=1e-6)
        ours, theirs = grads(split), grads(vanilla)
        assert ours.keys() == theirs.keys() and ours
        for name in theirs:
            assert torch.allclose(ours[name], theirs[name], atol=1e-5, rtol=1e-4), name
    finally:
        executor.close()


def test_decoding_through_a_onednn_serve_base_generates_what_vanilla_does(onednn_base):
    """A client generating one token per step (one-row calls: symbiont's few-rows kernel
    where it is built, as the serve-base's log says) gets vanilla transformers' greedy
    tokens, and logits within fp32 rounding."""
    from transformers import AutoModelForCausalLM

    from symbiont.serve import decode_kernel

    path, server = onednn_base
    built = decode_kernel.load() is not None  # built here: built there (same compiler)
    assert ("few-rows kernel" in server.log_text()) is built
    executor = symbiont.connect(server.url("tcp"), mode="shm", checkpoint=path)
    try:
        client = symbiont.load_client(path, executor)
        vanilla = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        ids = torch.tensor([[5, 17, 3, 9, 12]])
        settings = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
        want = vanilla.generate(ids, **settings, output_logits=True, return_dict_in_generate=True)
        got = client.generate(ids, **settings, output_logits=True, return_dict_in_generate=True)
        assert torch.equal(got.sequences, want.sequences)
        for g, w in zip(got.logits, want.logits, strict=True):
            assert torch.allclose(g, w, atol=1e-5, rtol=1e-5)
    finally:
        executor.close()


def test_the_flag_reaches_serve_base_help():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "symbiont", "serve-base", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "--matmul {torch,onednn}" in out


def test_strided_inputs_weights_and_biases_give_torch_results():
    """oneDNN reads a strided bias as if it were contiguous: it is made contiguous first.
    Strided inputs and weight views (a block's rows, a transposed view) are read as such."""
    from symbiont.base.onednn import onednn_linear

    g = torch.Generator().manual_seed(5)
    block = torch.randn(40, 24, generator=g)
    weight = block[8:24]  # [16, 24], a view at an offset
    bias = torch.randn(32, generator=g)[::2]  # [16], stride 2
    x = torch.randn(24, 10, generator=g).t()  # [10, 24], not contiguous
    want = torch.nn.functional.linear(x, weight, bias)
    assert torch.allclose(onednn_linear(x, weight, bias), want, atol=ATOL, rtol=RTOL)
    grad_y = torch.randn(10, 16, generator=g)
    want = grad_y @ weight
    assert torch.allclose(onednn_linear(grad_y, weight.t(), None), want, atol=ATOL, rtol=RTOL)
