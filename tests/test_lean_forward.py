"""The engine's lean forward (symbiont/serve/lean.py) against transformers' own forward of
the same client model: every step's logits bitwise equal (float32), with and without
adapters of every kind the engine applies inside the layers, with prompt and prefix
tuning's virtual tokens, chunked prefill and sliding windows; and the architectures it
must leave to transformers."""

from __future__ import annotations

import dataclasses

import peft
import pytest
import torch

from symbiont import BaseExecutor, load_client
from symbiont.serve import Engine, EngineConfig, SamplingParams
from symbiont.serve.lean import LeanForward
from tests.test_serve_common import lora_config, prompts, save_adapter
from tests.tiny_models import ARCHS, build_checkpoint

GREEDY = SamplingParams(max_tokens=7, temperature=0.0)
# without symbiont's norm and rotary kernels, whose norms differ in rounding (they are
# tested against this forward in tests/test_layer_ops.py)
CHUNKED = EngineConfig(
    max_running=6, max_batched_tokens=11, block_size=4, num_blocks=128, layer_ops=False
)

VARIANTS = {
    "llama": ("llama", {}),
    "qwen2_bias": ("qwen2", {}),  # q/k/v projections with bias
    "mistral_window": ("mistral", {"sliding_window": 5}),
    "qwen2_window": ("qwen2", {"use_sliding_window": True, "sliding_window": 6}),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def base(request, tmp_path_factory):
    arch, extra = VARIANTS[request.param]
    config = {**ARCHS[arch].config, **extra}
    return build_checkpoint(
        dataclasses.replace(ARCHS[arch], config=config), tmp_path_factory.mktemp(request.param)
    )


def adapter_configs() -> dict:
    return {
        "lora": lora_config("llama", 4),
        "ia3": peft.IA3Config(
            target_modules=["q_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"]
        ),
        "dora": peft.LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules="all-linear"),
        "prompt": peft.PromptTuningConfig(num_virtual_tokens=3),
        "prefix": peft.PrefixTuningConfig(num_virtual_tokens=4),
    }


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    folder = tmp_path_factory.mktemp("adapters")
    out = {}
    for i, (name, config) in enumerate(adapter_configs().items()):
        config.task_type = "CAUSAL_LM"
        out[name] = save_adapter(base, config, folder / name, seed=60 + i)
    return out


def engine_for(base, adapters, lean: bool) -> Engine:
    config = dataclasses.replace(CHUNKED, lean_forward=lean)
    engine = Engine(load_client(base, BaseExecutor.from_pretrained(base)), config)
    for name, path in adapters.items():
        engine.load_adapter(name, path)
    return engine


def recorded_run(engine: Engine, batch, names) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Generated tokens and the logits of every iteration."""
    logits, forward = [], engine.runner.forward

    def recording(step_batch):
        out = forward(step_batch)
        logits.append(out.clone())
        return out

    engine.runner.forward = recording
    return engine.generate(batch, names, GREEDY), logits


def test_lean_forward_is_chosen_for_llama_shaped_decoders(base):
    lean = engine_for(base, {}, lean=True)
    assert lean.runner.lean is not None
    assert engine_for(base, {}, lean=False).runner.lean is None


def test_every_step_equals_transformers_forward_bitwise(base, adapters, one_thread):
    """Mixed adapters in one batch, prefill chunked at 11 tokens per iteration."""
    names = [None, "lora", "ia3", "dora", "prompt", "prefix", None, "lora"]
    batch = prompts(len(names), seed=3, low=3, high=17)
    got, got_logits = recorded_run(engine_for(base, adapters, lean=True), batch, names)
    want, want_logits = recorded_run(engine_for(base, adapters, lean=False), batch, names)
    assert got == want
    assert len(got_logits) == len(want_logits) > len(batch)
    for step, (a, b) in enumerate(zip(got_logits, want_logits, strict=True)):
        assert torch.equal(a, b), f"iteration {step}: max diff {(a - b).abs().max().item()}"


def test_with_the_layer_kernels_every_step_is_within_rounding(base, adapters, one_thread):
    """The same batch with symbiont's norm and rotary kernels (tests/test_layer_ops.py):
    every adapter kind and virtual tokens, chunked prefill; equal tokens, and logits
    within the engine's float32 tolerance of transformers' forward."""
    names = [None, "lora", "ia3", "dora", "prompt", "prefix", None, "lora"]
    batch = prompts(len(names), seed=3, low=3, high=17)
    kernels = dataclasses.replace(CHUNKED, layer_ops=True)
    engine = Engine(load_client(base, BaseExecutor.from_pretrained(base)), kernels)
    if engine.runner.layer_ops is None:
        pytest.skip("symbiont's CPU kernels are not built here")
    for name, path in adapters.items():
        engine.load_adapter(name, path)
    got, got_logits = recorded_run(engine, batch, names)
    want, want_logits = recorded_run(engine_for(base, adapters, lean=False), batch, names)
    assert got == want
    assert len(got_logits) == len(want_logits) > len(batch)
    for a, b in zip(got_logits, want_logits, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["gemma2", "qwen3", "phi3"])
def test_other_architectures_keep_transformers_forward(checkpoints, arch):
    """Gemma scales embeddings and norms differently, Qwen3 normalises q and k, Phi-3
    fuses its projections: the lean loop would not be their forward."""
    model = load_client(checkpoints(arch), BaseExecutor.from_pretrained(checkpoints(arch)))
    assert LeanForward.of(model) is None


def test_a_subclassed_layer_keeps_transformers_forward(checkpoints):
    model = load_client(checkpoints("llama"), BaseExecutor.from_pretrained(checkpoints("llama")))
    assert LeanForward.of(model) is not None
    layer = model.model.layers[0]

    class Patched(type(layer)):
        pass

    layer.__class__ = Patched
    assert LeanForward.of(model) is None


def test_a_hook_on_a_skipped_module_gets_transformers_forward(checkpoints):
    engine = Engine(
        load_client(checkpoints("llama"), BaseExecutor.from_pretrained(checkpoints("llama"))),
        CHUNKED,
    )
    batch = prompts(2, seed=4)
    seen = []
    engine.model.model.layers[1].register_forward_hook(lambda *a: seen.append(1))
    assert not engine.runner.lean.applies()
    engine.generate(batch, [None, None], GREEDY)
    assert seen, "the decoder layer's hook never ran"


@pytest.mark.parametrize("executor", ["plain", "prepacked", "gated"])
def test_base_only_steps_call_the_executor_directly_and_equal_the_modules(
    base, executor, one_thread
):
    """Bare VirtLayers (no adapter, no hook) are skipped for one executor call per group
    of siblings: every step's logits bitwise those of the modules' calls, and no VirtLayer
    forward runs. Executors as `symbiont serve` builds them: in-process, packed for
    oneDNN, and behind the co-serving gate of fine-tuning jobs (jobs/priority.py)."""
    from symbiont.client.virt import VirtLayer
    from symbiont.jobs.priority import PriorityGate, give_inference_priority
    from symbiont.tenant import open_executor

    def engine_of_kind() -> Engine:
        if executor == "plain":
            return engine_for(base, {}, lean=True)
        engine = Engine(load_client(base, open_executor(base, prepack=True)), CHUNKED)
        if executor == "gated":
            give_inference_priority(engine.model, PriorityGate())
        return engine

    calls = []
    forward = VirtLayer.call_executor  # what every VirtLayer's forward calls

    def counted(self, op, x):
        calls.append(self.spec.id)
        return forward(self, op, x)

    batch = prompts(5, seed=8, low=3, high=20)
    runs = {}
    for direct in (True, False):
        engine = engine_of_kind()
        engine.runner.lean.direct = direct
        calls.clear()
        VirtLayer.call_executor = counted
        try:
            runs[direct] = recorded_run(engine, batch, [None] * 5)
        finally:
            VirtLayer.call_executor = forward
        runs[direct] += (len(calls),)
    assert runs[True][0] == runs[False][0]
    for a, b in zip(runs[True][1], runs[False][1], strict=True):
        assert torch.equal(a, b)
    assert runs[True][2] == 0 and runs[False][2] > 0


def test_a_hook_on_a_projection_runs_with_direct_calls(base):
    """A hooked VirtLayer (how a served delta changes a layer) is called as a module."""
    engine = engine_for(base, {}, lean=True)
    attn = engine.model.model.layers[0].self_attn
    seen = []
    attn.k_proj.register_forward_hook(lambda *a: seen.append("k"))
    engine.model.model.layers[0].mlp.down_proj.register_forward_hook(lambda *a: seen.append("d"))
    assert engine.runner.lean.applies() and engine.runner.lean.direct
    engine.generate(prompts(2, seed=9), [None, None], GREEDY)
    assert "k" in seen and "d" in seen
