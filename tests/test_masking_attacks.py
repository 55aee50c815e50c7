"""The curious executor (docs/privacy.md): it serves honestly but records everything it
receives, then tries to read the client's activations and gradients from it.

Three training steps of 768 tokens each through a tiny Llama with LoRA on every linear
layer; the recording is compared with the true tensors of an unmasked run of the same
steps (calls line up one to one). |r| is Pearson's correlation over all elements.
"""

from __future__ import annotations

import peft
import pytest
import torch

import symbiont
from symbiont import BaseExecutor
from symbiont.client.masking import MaskConfig
from symbiont.protocol.executor import Op
from tests.masking_attacks import (
    Recorder,
    difference_attack,
    layers_of,
    pca_attack,
    pearson,
    remove_subspace_attack,
    single_tensor_attack,
    stacked,
)

LEAK = 0.05  # |r| a recording may reach with the truth
STEPS, BATCH, SEQ = 3, 8, 96  # 768 tokens per call, 2304 per layer and direction
POOL_SIZES = (2, 16, 512)  # below every width, and above the widest (128: lm_head grads)


def record(path, executors, mask) -> None:
    """The steps of a LoRA fine-tune, through `executors` (Recorders)."""
    model = symbiont.load_client(path, executors, mask_activations=mask)
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)
    model = peft.get_peft_model(model, config)
    generator = torch.Generator().manual_seed(0)
    for _ in range(STEPS):
        ids = torch.randint(0, 128, (BATCH, SEQ), generator=generator)
        model(input_ids=ids, labels=ids).loss.backward()


@pytest.fixture(scope="module")
def recordings(checkpoints):
    """truth, and per mode what each executor received."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    path = checkpoints("llama")

    def recorder():
        return Recorder(BaseExecutor.from_pretrained(path))

    truth = recorder()
    record(path, truth, None)
    a, b = recorder(), recorder()
    record(path, (a, b), "shares")
    pools = {}
    for k in POOL_SIZES:
        pools[k] = recorder()
        record(path, pools[k], MaskConfig("pool", pool_size=k))
    torch.set_num_threads(before)
    return {"truth": truth.calls, "shares": (a.calls, b.calls), "pool": pools}


def test_the_recording_is_large_enough(recordings):
    truth = recordings["truth"]
    assert min(c.x.shape[0] for c in truth) >= 700
    assert len(truth) == len(recordings["shares"][0]) == len(recordings["pool"][16].calls)


def test_unmasked_calls_are_read_in_the_clear(recordings):
    """The attacks below are real: on unmasked calls they recover everything."""
    truth = recordings["truth"]
    assert single_tensor_attack(truth, truth) == pytest.approx(1.0)


@pytest.mark.parametrize("party", [0, 1])
def test_shares_no_received_tensor_or_difference_correlates(recordings, party):
    received = recordings["shares"][party]
    truth = recordings["truth"]
    assert single_tensor_attack(received, truth) < LEAK
    assert difference_attack(received, truth) < LEAK


@pytest.mark.parametrize("party", [0, 1])
def test_shares_no_principal_component_projection_correlates(recordings, party):
    received = recordings["shares"][party]
    truth = recordings["truth"]
    for op, layer in layers_of(received):
        recording, true = stacked(received, op, layer), stacked(truth, op, layer)
        ks = [k for k in (1, 4, 16, 64) if k < recording.shape[1]]
        scores = pca_attack(recording, true, ks)
        assert max(scores.values()) < LEAK, f"{op.name} layer {layer}: {scores}"


@pytest.mark.parametrize("k", POOL_SIZES)
def test_pool_no_received_tensor_or_difference_correlates(recordings, k):
    received = recordings["pool"][k].calls
    truth = recordings["truth"]
    assert single_tensor_attack(received, truth) < LEAK
    assert difference_attack(received, truth) < LEAK


def test_pool_falls_to_principal_components_below_the_width(recordings):
    """The documented weakness: K pooled noises span K directions; projecting the top K
    principal components of the recording away recovers what lies outside them."""
    truth = recordings["truth"]
    report = {}
    for k, recorder in recordings["pool"].items():
        for op, layer in layers_of(recorder.calls):
            recording, true = stacked(recorder.calls, op, layer), stacked(truth, op, layer)
            width = recording.shape[1]
            attack = min(k, width - 1)
            report[k, op, width] = max(
                report.get((k, op, width), 0.0), remove_subspace_attack(recording, true, attack)
            )
    print("\npool: |r| recovered by removing the top-K principal components")
    for (k, op, width), r in sorted(report.items()):
        print(f"  K={k:<4} {op.name.lower():<8} width {width:<4} |r| {r:.3f}")
    for (k, _, width), r in report.items():
        if 2 * k <= width:  # the noise leaves at least half the directions clean
            assert r > 0.5, f"K={k} width {width}: the attack should win, got {r:.3f}"
        if k >= 4 * width:  # the pool spans the whole width, noise everywhere
            assert r < LEAK, f"K={k} width {width}: the pool should hide it, got {r:.3f}"


def test_calls_that_share_an_input_get_one_mask(recordings):
    """Averaging q/k/v calls of one hidden state would divide fresh independent noise
    by sqrt(3); they are sent the very same masked tensor instead."""
    truth = recordings["truth"]
    for received in (*recordings["shares"], recordings["pool"][16].calls):
        shared = 0
        for i in range(1, len(truth)):
            before, after = truth[i - 1], truth[i]
            if after.op is Op.FORWARD and before.op is Op.FORWARD:
                if torch.equal(before.x, after.x):
                    shared += 1
                    assert torch.equal(received[i - 1].x, received[i].x)
                else:
                    assert not torch.equal(received[i - 1].x, received[i].x)
        assert shared >= 2 * 3 * STEPS  # q->k->v and gate->up, in each of 2 layers


def test_first_layer_inputs_do_not_decode_to_tokens(checkpoints, recordings):
    """The first layer reads normalised embeddings of known tokens; the executor decodes
    each received row to the nearest candidate. Tiny width: chance level (1/128)."""
    path = checkpoints("llama")
    model = symbiont.load_client(path, BaseExecutor.from_pretrained(path))
    candidates = model.model.layers[0].input_layernorm(model.model.embed_tokens.weight)
    candidates = candidates.detach().double()  # [vocab, hidden]
    truth = recordings["truth"][0]  # q_proj of layer 0, step 1
    true_ids = _nearest(truth.x, candidates)
    assert (true_ids == _nearest(truth.x, candidates)).all()
    for received in (*recordings["shares"], recordings["pool"][16].calls):
        hit = (_nearest(received[0].x, candidates) == true_ids).double().mean()
        assert hit < 0.05, f"{float(hit):.1%} of first-layer tokens decoded"


def _nearest(rows: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    return torch.cdist(rows, candidates).argmin(dim=1)


def test_inference_mode_calls_share_masks_by_content(checkpoints):
    """Under torch.inference_mode (the serving engine) tensors keep no version counter;
    a shared input is recognised by its content, and results stay exact."""
    path = checkpoints("llama")
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(3))
    want = symbiont.load_client(path, BaseExecutor.from_pretrained(path))(ids).logits
    spy = Recorder(BaseExecutor.from_pretrained(path))
    model = symbiont.load_client(path, spy, mask_activations="pool")
    with torch.inference_mode():
        got = model(ids).logits
    assert float((got - want.detach()).abs().max() / want.abs().max()) < 1e-4
    q, k, v = (spy.calls[i].x for i in range(3))
    assert torch.equal(q, k) and torch.equal(k, v)
    assert pearson(spy.calls[3].x, q) < 0.5  # o_proj: another input, another mask
