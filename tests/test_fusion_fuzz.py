"""Random call sequences against the fusion of forward calls: whatever order a client feeds
tensors to layers in, whatever it edits in place or drops between calls, each call's
output is that layer's on that input.

Fusion learns "layer B follows layer A on the same tensor" and from then on computes B
with A's call; a bug there hands one layer's output to another (the executor once
returned fused outputs in ascending layer order while the client listed them in call
order). The sequences here repeat a few call orders, as a model does, and break them:
orders that wrap from the last layer to the first, views of one storage at several
widths, in-place edits, fresh tensors, `inference_mode` (no version counter: never fused),
backward calls between them (training).
Seeded, so a failure replays; the message names the seed and the step.
"""

from __future__ import annotations

import random

import pytest
import torch

import symbiont
from symbiont.client.virt import VirtLayer
from tests.test_service_server import remote, run_at_once, serve_in_thread

STEPS = 400
SEEDS = (0, 1, 2)


def _orders(rng: random.Random, layers) -> list[list[int]]:
    """A few call orders a model could make: runs of layers of one input width, in
    manifest order, reversed, rotated (wrapping), or shuffled."""
    by_width: dict[int, list[int]] = {}
    for spec in layers:
        by_width.setdefault(spec.in_features, []).append(spec.id)
    orders = []
    for ids in by_width.values():
        rotated = ids[len(ids) // 2 :] + ids[: len(ids) // 2]
        shuffled = ids[:]
        rng.shuffle(shuffled)
        orders += [ids, ids[::-1], rotated, shuffled]
    return orders


def _run(call, grad_call, base, seed: int, steps: int = STEPS, order_seed=None) -> None:
    """`call(layer, x)` through fusion, checked against `base.forward` at every step;
    now and then `grad_call(layer, x, grad_y)` -> (y, grad_x) in a training step instead,
    checked against `base.backward` too. Clients given one `order_seed` call the same
    layers in the same order (so that their calls batch), with their own data and edits."""
    rng = random.Random(seed)
    orng = rng if order_seed is None else random.Random(order_seed)
    gen = torch.Generator().manual_seed(seed)
    layers = base.manifest.layers
    widths = sorted({s.in_features for s in layers})
    wide = torch.randn(5, max(widths), generator=gen)  # narrower inputs are views of it
    pool = {w: [torch.randn(rng.randint(1, 6), w, generator=gen), wide[:, :w]] for w in widths}
    orders = _orders(orng, layers)
    step = 0
    while step < steps:
        order = orng.choice(orders)
        width = layers[order[0]].in_features
        inference = rng.random() < 0.15
        for layer in order[: orng.randint(1, len(order))]:  # a run may stop early
            step += 1
            roll = rng.random()
            if roll < 0.05:  # edited in place: a fused output computed before is stale
                rng.choice(pool[width]).add_(0.5)
            elif roll < 0.10:  # a new tensor in the same place of the pool
                pool[width][0] = torch.randn(rng.randint(1, 6), width, generator=gen)
            elif roll < 0.13:  # another tensor of the same width in the middle of a run
                width_pool = pool[width]
                width_pool.append(width_pool.pop(0))
            x = pool[width][0]
            grad_y = grad_x = None
            if inference:
                with torch.inference_mode():
                    got = call(layer, x.clone())
            elif rng.random() < 0.2:
                grad_y = torch.randn(x.shape[0], layers[layer].out_features, generator=gen)
                got, grad_x = grad_call(layer, x, grad_y)
            else:
                with torch.no_grad():
                    got = call(layer, x)
            want = base.forward(layer, x)
            if grad_y is not None:
                want_grad = base.backward(layer, grad_y)
                assert torch.allclose(grad_x, want_grad, rtol=1e-5, atol=1e-6), (
                    f"seed {seed} step {step}: layer {layer}'s input gradient"
                )
            assert got.shape == want.shape, f"seed {seed} step {step}: layer {layer}"
            # fp32 rounding only: a fused matmul may sum in another order than one layer's
            close = torch.allclose(got, want, rtol=1e-5, atol=1e-6)
            assert close, (
                f"seed {seed} step {step}: layer {layer} "
                f"({layers[layer].name}) is off by {float((got - want).abs().max()):.3g}"
            )


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", ["zmq", "shm"])
def test_remote_fusion_gives_each_layer_its_own_output(checkpoints, tmp_path, mode, seed):
    with (
        serve_in_thread(checkpoints("llama"), tmp_path) as server,
        remote(server.endpoints[1], mode=mode) as executor,
    ):
        _run(
            executor.forward,
            lambda layer, x, g: (executor.forward(layer, x), executor.backward(layer, g)),
            server.executor,
            seed,
        )
        assert executor.stats()["errors"] == 0


@pytest.mark.parametrize("seed", SEEDS)
def test_in_process_fusion_gives_each_layer_its_own_output(checkpoints, seed):
    """VirtLayers over an in-process executor fuse through `forward_fused` (one matmul)."""
    path = checkpoints("llama")
    base = symbiont.BaseExecutor.from_pretrained(path)
    model = symbiont.load_client(path, base)
    virt = {m.spec.id: m for m in model.modules() if isinstance(m, VirtLayer)}
    assert len(virt) == len(base.manifest.layers)

    def train(layer, x, grad_y):  # as in a model: autograd through the VirtLayer
        x = x.detach().requires_grad_()  # the same storage: still fused
        y = virt[layer](x)
        y.backward(grad_y)
        return y.detach(), x.grad

    _run(lambda layer, x: virt[layer](x), train, base, seed)


@pytest.mark.parametrize("policy", ["lockstep", "opportunistic"])
def test_clients_batched_together_each_get_their_own_outputs(checkpoints, tmp_path, policy):
    """Two clients call the same layers in the same order, each with its own tensors and
    edits, so their calls meet in one batch, often with different fused layers."""
    from symbiont.base.config import BatchingPolicy

    errors = []
    with serve_in_thread(
        checkpoints("llama"), tmp_path, policy=BatchingPolicy(kind=policy, max_wait_s=0.05)
    ) as server:

        def client(seed, mode):
            try:
                with remote(server.endpoints[1], mode=mode) as executor:
                    _run(
                        executor.forward,
                        lambda layer, x, g: (
                            executor.forward(layer, x),
                            executor.backward(layer, g),
                        ),
                        server.executor,
                        seed,
                        steps=150,
                        order_seed=7,
                    )
            except Exception as err:  # noqa: BLE001 - reported by the test thread
                errors.append(f"{mode} client: {err}")

        # Whether two calls meet depends on timing: on a loaded machine the clients may
        # drift apart for a whole run (once in a full suite run), so run again then.
        for _ in range(3):
            run_at_once(client, [(10, "shm"), (11, "zmq")])
            batched = sum(e.calls - e.batches for e in server.stats.layers.values())
            if batched or errors:
                break
    assert not errors, errors
    assert batched > 0, "no two calls ever ran in one batch: the test proves nothing"


@pytest.mark.parametrize("mode", ["zmq", "shm"])
def test_threads_sharing_one_connection_each_get_their_own_outputs(checkpoints, tmp_path, mode):
    """A serving engine and a fine-tuning job in one process may share one connection:
    its fusion state sees both threads' calls interleaved."""
    errors = []
    with (
        serve_in_thread(checkpoints("llama"), tmp_path) as server,
        remote(server.endpoints[1], mode=mode) as executor,
    ):

        def client(seed):
            try:
                _run(
                    executor.forward,
                    lambda layer, x, g: (executor.forward(layer, x), executor.backward(layer, g)),
                    server.executor,
                    seed,
                    steps=200,
                )
            except Exception as err:  # noqa: BLE001 - reported by the test thread
                errors.append(f"thread {seed}: {err}")

        run_at_once(client, [(20,), (21,)])
    assert not errors, errors
