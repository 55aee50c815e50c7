"""The serving engine equals vanilla transformers + peft, request by request.

Whatever shares the batch (other adapters of other methods and ranks, the base model,
prefill chunks of newcomers, cancellations), each request's greedy tokens must equal
`generate` of vanilla peft with that request's adapter alone, and its logits must stay
within LOGITS_ATOL of vanilla's (fp32; batching changes summation order, not math).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from symbiont import BaseExecutor, load_client
from symbiont.protocol.executor import Executor, ExecutorUnavailable
from symbiont.serve import (
    AdapterError,
    AdapterNotFound,
    Engine,
    EngineConfig,
    QueueFull,
    Request,
    RequestError,
    SamplingParams,
)
from symbiont.serve.adapters import AdapterLayer, LoraWeights, adapter_batch, bucket_rank
from symbiont.serve.context import use_context
from tests.test_serve_common import (
    Reference,
    ia3_config,
    lora_config,
    make_adapters,
    prompts,
    save_adapter,
)

LOGITS_ATOL = 1e-4
GREEDY = SamplingParams(max_tokens=10, temperature=0.0)
# Small budgets so prefill is chunked and sequences come and go across iterations.
SMALL = EngineConfig(max_running=6, max_batched_tokens=12, block_size=4, num_blocks=128)
WIDE = EngineConfig(max_running=16, max_batched_tokens=256, block_size=4, num_blocks=128)


@pytest.fixture(scope="module")
def setup(checkpoints, tmp_path_factory):
    """(checkpoint, adapters, reference) for llama with six adapters of mixed kinds."""
    base = checkpoints("llama")
    adapters = make_adapters(base, tmp_path_factory.mktemp("adapters"))
    return base, adapters, Reference(base, adapters)


def engine_for(base, adapters=None, config=SMALL, executor=None) -> Engine:
    executor = executor or BaseExecutor.from_pretrained(base)
    engine = Engine(load_client(base, executor), config)
    for name, path in (adapters or {}).items():
        engine.load_adapter(name, path)
    return engine


def assign(n: int, names: list, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [names[i] for i in torch.randint(0, len(names), (n,), generator=g).tolist()]


@pytest.mark.parametrize("n_requests", [1, 3, 7, 13])
def test_mixed_batch_equals_each_adapter_alone(setup, n_requests):
    base, adapters, reference = setup
    engine = engine_for(base, adapters)
    batch = prompts(n_requests, seed=n_requests)
    names = assign(n_requests, [None, *adapters], seed=n_requests)
    outputs = engine.generate(batch, names, GREEDY)
    for prompt, name, got in zip(batch, names, outputs, strict=True):
        want = reference.generate(prompt, name, GREEDY.max_tokens)
        assert got == want, f"adapter {name}: batched output differs from vanilla peft alone"
    assert engine.kv_cache.allocator.num_free == SMALL.num_blocks, "KV blocks leaked"


def test_requests_arriving_leaving_and_cancelled_mid_generation(setup):
    base, adapters, reference = setup
    engine = engine_for(base, adapters)
    names = [None, *adapters]
    batch = prompts(12, seed=5, high=20)
    requests = [Request(f"r{i}", p, names[i % len(names)], GREEDY) for i, p in enumerate(batch)]
    cancelled = {"r3", "r8"}
    step = 0
    while step < 200 and not all(r.finished for r in requests):
        if step % 2 == 0 and step // 2 < len(requests):  # a newcomer every other iteration
            engine.add_request(requests[step // 2])
        if step == 6:
            engine.abort("r3")  # mid-generation
        if step == 16:
            engine.abort("r8")  # shortly after arriving
        engine.step()
        step += 1
    assert all(r.finished for r in requests), "the engine stopped making progress"
    for request in requests:
        got = request.sequences[0].output_ids
        if request.request_id in cancelled:
            assert request.sequences[0].finish_reason == "abort"
            assert len(got) < GREEDY.max_tokens, "a cancelled request kept generating"
            continue
        want = reference.generate(request.prompt_ids, request.adapter, GREEDY.max_tokens)
        assert got == want, f"{request.request_id} ({request.adapter}) differs from vanilla"
    assert engine.kv_cache.allocator.num_free == SMALL.num_blocks, "KV blocks leaked"
    assert not engine.has_work()


def test_logits_within_tolerance_of_vanilla(setup, monkeypatch):
    base, adapters, reference = setup
    engine = engine_for(base, adapters, config=WIDE)
    captured = []
    forward = engine.runner.forward
    monkeypatch.setattr(
        engine.runner, "forward", lambda b: captured.append(forward(b)) or captured[-1]
    )
    batch = prompts(7, seed=11)
    names = assign(7, [None, *adapters], seed=3)
    for i, (p, name) in enumerate(zip(batch, names, strict=True)):
        engine.add_request(Request(f"q{i}", p, name, SamplingParams(max_tokens=1, temperature=0)))
    engine.step()  # WIDE fits every prompt: one row of logits per request, in arrival order
    assert captured and captured[0].shape[0] == len(batch)
    for i, (p, name) in enumerate(zip(batch, names, strict=True)):
        want, got = reference.logits(p, name)[-1], captured[0][i]
        assert torch.allclose(got, want, atol=LOGITS_ATOL), (
            f"request {i} ({name}): max |diff| {float((got - want).abs().max()):.2e}"
        )


class CountingExecutor(Executor):
    """Counts base calls per layer, to check one call per layer per iteration."""

    def __init__(self, inner: Executor):
        self.inner, self.calls = inner, []

    @property
    def manifest(self):
        return self.inner.manifest

    def call(self, op, layer, x):
        self.calls.append((layer, x.shape[0]))
        return self.inner.call(op, layer, x)


def test_one_base_call_per_layer_for_the_whole_batch(setup):
    base, adapters, _ = setup
    executor = CountingExecutor(BaseExecutor.from_pretrained(base))
    engine = engine_for(base, adapters, config=WIDE, executor=executor)
    names = [None, *adapters]
    for i, p in enumerate(prompts(len(names), seed=2)):
        engine.add_request(Request(f"c{i}", p, names[i], GREEDY))
    engine.step()
    engine.step()
    executor.calls.clear()
    engine.step()  # a decode iteration of every sequence, each with another adapter
    n_layers = len(executor.manifest.layers)
    layers = [layer for layer, _ in executor.calls]
    assert sorted(layers) == list(range(n_layers)), "a base layer was called more than once"
    tokens = {n for layer, n in executor.calls if layer != n_layers - 1}
    assert tokens == {len(names)}, "base layers did not see all tokens of the batch at once"


@pytest.mark.parametrize("popularity", ["distinct", "uniform", "zipf", "identical"])
@pytest.mark.parametrize("n_tokens", [1, 3, 7, 133])
def test_grouped_lora_equals_per_token_reference(popularity, n_tokens):
    """The grouped op against a plain loop: y_t = x_t W + (x_t A_sᵀ B_sᵀ) * scale_s."""
    torch.manual_seed(0)
    slots, d_in, d_out, r_max = 9, 16, 24, 8
    base = torch.nn.Linear(d_in, d_out)
    layer = AdapterLayer(base, d_in, d_out, slots)
    registry = SimpleNamespace(
        slot_bucket=[0] * slots, slot_is_ia3=[False] * slots, slot_is_dora=[False] * slots
    )
    weights = {}
    for s in range(1, slots):  # ranks 1..8: five rank buckets
        weights[s] = LoraWeights(torch.randn(s, d_in), torch.randn(d_out, s), 0.5 * s)
        layer.put(s, weights[s], r_max)
        registry.slot_bucket[s] = bucket_rank(s, r_max)
    token_slots = _popularity(popularity, n_tokens, slots)
    x = torch.randn(n_tokens, d_in)
    ctx = SimpleNamespace(adapters=adapter_batch(token_slots, registry))
    with torch.no_grad(), use_context(ctx):
        got = layer(x)
        want = base(x)
        for t, s in enumerate(token_slots.tolist()):
            if s:
                w = weights[s]
                want[t] += (x[t] @ w.a.T @ w.b.T) * w.scale
    assert torch.allclose(got, want, atol=1e-5)


def _popularity(kind: str, n: int, slots: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    if kind == "distinct":
        return torch.arange(n) % slots
    if kind == "identical":
        return torch.full((n,), 3)
    if kind == "uniform":
        return torch.randint(0, slots, (n,), generator=g)
    weights = 1.0 / torch.arange(1, slots + 1).float()
    return torch.multinomial(weights, n, replacement=True, generator=g)


def test_unloading_an_adapter_in_use_waits_for_its_requests(setup):
    base, adapters, reference = setup
    engine = engine_for(base, {"lora4": adapters["lora4"]})
    prompt = prompts(1, seed=9)[0]
    running = Request("u", prompt, "lora4", GREEDY)
    engine.add_request(running)
    engine.step()
    engine.unload_adapter("lora4")
    with pytest.raises(AdapterNotFound):
        engine.add_request(Request("late", prompt, "lora4", GREEDY))
    engine.load_adapter("lora4", adapters["lora16"])  # same name, other weights, other slot
    fresh = Request("fresh", prompt, "lora4", GREEDY)
    engine.add_request(fresh)
    while engine.has_work():
        engine.step()
    assert running.sequences[0].output_ids == reference.generate(prompt, "lora4", 10), (
        "unloading freed the weights of an adapter a running request still used"
    )
    assert fresh.sequences[0].output_ids == reference.generate(prompt, "lora16", 10)
    assert (
        engine.adapters.names() == ["lora4"]
        and engine.adapters.num_free_slots == SMALL.max_adapters - 1
    )


def test_unloaded_slot_is_freed_and_reused(setup):
    base, adapters, _ = setup
    engine = engine_for(base, config=EngineConfig(max_adapters=1, block_size=4, num_blocks=64))
    engine.load_adapter("a", adapters["lora4"])
    with pytest.raises(AdapterError, match="adapter slots are in use"):
        engine.load_adapter("b", adapters["ia3"])
    engine.unload_adapter("a")
    engine.load_adapter("b", adapters["ia3"])
    assert engine.adapters.names() == ["b"]


def test_broken_adapters_are_refused_with_clear_errors(setup, tmp_path, checkpoints):
    base, adapters, _ = setup
    engine = engine_for(base)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text(
        (adapters["lora4"] / "adapter_config.json").read_text()
    )
    (broken / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(AdapterError, match="cannot read the adapter weights"):
        engine.load_adapter("broken", broken)
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        engine.load_adapter("missing", tmp_path / "nowhere")
    big = save_adapter(base, lora_config("llama", 8), tmp_path / "big", seed=1)
    small_rank = engine_for(base, config=EngineConfig(max_lora_rank=4, num_blocks=16))
    with pytest.raises(AdapterError, match="--max-lora-rank 8"):
        small_rank.load_adapter("big", big)
    other = save_adapter(checkpoints("gpt2"), lora_config("gpt2", 4), tmp_path / "gpt2", seed=1)
    with pytest.raises(AdapterError, match="not a linear layer of this model"):
        engine.load_adapter("other", other)
    assert engine.adapters.names() == [], "a failed load left an adapter behind"


def test_bad_requests_and_full_queue(setup):
    base, _, _ = setup
    engine = engine_for(base, config=EngineConfig(max_queue=2, block_size=4, num_blocks=64))
    with pytest.raises(RequestError, match="prompt is empty"):
        engine.add_request(Request("e", [], None, GREEDY))
    with pytest.raises(RequestError) as err:
        engine.add_request(Request("l", [5] * 10, None, SamplingParams(max_tokens=10_000)))
    assert err.value.param == "max_tokens"
    with pytest.raises(AdapterNotFound):
        engine.add_request(Request("a", [5], "nope", GREEDY))
    with pytest.raises(RequestError, match=r"n \(3\) is more sequences .*--max-queue 2"):
        engine.add_request(Request("n", [5], None, SamplingParams(max_tokens=2, n=3)))
    engine.add_request(Request("q1", [5], None, GREEDY))
    engine.add_request(Request("q2", [5], None, GREEDY))
    with pytest.raises(QueueFull):
        engine.add_request(Request("q3", [5], None, GREEDY))


def test_sampling_is_reproducible_with_a_seed(setup):
    base, adapters, _ = setup
    engine = engine_for(base, adapters)
    prompt = prompts(1, seed=4)[0]
    params = SamplingParams(max_tokens=8, temperature=1.5, top_p=0.9, seed=7, n=2)
    first = _choices(engine, "s1", prompt, params)
    second = _choices(engine, "s2", prompt, params)
    assert first == second, "same seed gave different samples"
    assert first[0] != first[1], "choices of one request share a random stream"
    nearly_greedy = _choices(engine, "s3", prompt, SamplingParams(max_tokens=8, top_p=1e-6, seed=1))
    assert (
        nearly_greedy[0]
        == engine.generate([prompt], ["ia3"], SamplingParams(max_tokens=8, temperature=0))[0]
    )


def _choices(engine, request_id, prompt, params):
    request = Request(request_id, prompt, "ia3", params)
    engine.add_request(request)
    while not request.finished:
        engine.step()
    return [s.output_ids for s in request.sequences]


@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
def test_other_architectures(arch, checkpoints, tmp_path):
    base = checkpoints(arch)
    adapters = {
        "lora": save_adapter(base, lora_config(arch, 4), tmp_path / "lora", seed=3),
        "ia3": save_adapter(base, ia3_config(arch), tmp_path / "ia3", seed=4),
    }
    reference = Reference(base, adapters)
    engine = engine_for(base, adapters)
    batch = prompts(5, seed=8)
    names = [None, "lora", "ia3", "lora", "ia3"]
    for p, name, got in zip(batch, names, engine.generate(batch, names, GREEDY), strict=True):
        assert got == reference.generate(p, name, GREEDY.max_tokens), f"{arch} {name}"


def test_a_lost_executor_fails_the_iteration_in_one_log_line(setup, monkeypatch, caplog):
    """`symbiont serve --executor` logged some 40 lines of traceback per iteration while
    its serve-base was down; the executor's message already says what happened."""
    base, _, reference = setup
    engine = engine_for(base)
    real = engine.runner.run

    def lost(scheduled):
        monkeypatch.setattr(engine.runner, "run", real)  # back once serve-base is
        raise ExecutorUnavailable("lost the base executor at tcp://127.0.0.1:7100: ...")

    monkeypatch.setattr(engine.runner, "run", lost)
    prompt = prompts(1, seed=2)[0]
    failed = Request("f", prompt, None, GREEDY)
    engine.add_request(failed)
    with caplog.at_level("ERROR", logger="symbiont.serve.engine"):
        outputs = engine.step()
    assert [o.error for o in outputs] == [
        "iteration failed: lost the base executor at tcp://127.0.0.1:7100: ..."
    ]
    assert [r.exc_info for r in caplog.records] == [None], "a traceback was logged"
    engine.add_request(again := Request("g", prompt, None, GREEDY))
    while engine.has_work():
        engine.step()
    assert again.sequences[0].output_ids == reference.generate(prompt, None, 10)
