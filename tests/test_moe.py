"""Mixture-of-experts models through the split: the experts live on the executor.

Three MoE families, each a tiny checkpoint written by transformers' own save_pretrained
(so its per-expert keys go through transformers' conversion mapping on load): forward
logits and LoRA gradients (attention and router) equal vanilla transformers + peft, in
process and over serve-base; the client holds no expert weight; LoRA on the experts is
refused naming the option; malformed experts calls are refused with their reason.
"""

from __future__ import annotations

import dataclasses
import re

import peft
import pytest
import torch
from safetensors import safe_open

import symbiont
from symbiont.base.config import ServiceConfig
from symbiont.base.scheduler import Call as QueuedCall
from symbiont.base.scheduler import Session
from symbiont.base.server import ExecutorServer
from symbiont.client.experts import ExpertWeight
from symbiont.client.virt import BaseWeightUnavailable, RemoteWeight
from symbiont.processes import ServerProcess
from symbiont.protocol.executor import ExecutorError, Op
from symbiont.protocol.experts import request_layout
from symbiont.protocol.wire import Call, Code, Error, decode, encode
from tests.test_exactness import batch, grads, make_pair
from tests.test_service_server import raw_dealer, serve_in_thread
from tests.tiny_models import MOE_ARCHS

ATOL = 1e-5  # fp32; in process the numbers are bitwise equal, batching may change the last bits
ROUTER = {  # the router's weight, adapted with PEFT's target_parameters
    "mixtral": "mlp.gate.weight",
    "qwen3_moe": "mlp.gate.weight",
    "olmoe": "mlp.gate.weight",
    "qwen2_moe": "mlp.gate.weight",
    "granitemoe": "block_sparse_moe.router.weight",
}


@pytest.fixture(scope="module")
def moe_checkpoints(checkpoints):
    return checkpoints


def lora_attention_and_router(name: str) -> peft.LoraConfig:
    return peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=list(MOE_ARCHS[name].attention),
        target_parameters=[ROUTER[name]],
        task_type="CAUSAL_LM",
    )


def assert_split_equals_vanilla(path, executor, config):
    vanilla, split = make_pair(path, executor, config)
    inputs = batch()
    out_v = vanilla(**inputs, labels=inputs["input_ids"])
    out_s = split(**inputs, labels=inputs["input_ids"])
    torch.testing.assert_close(out_s.logits, out_v.logits, atol=ATOL, rtol=0)
    out_v.loss.backward()
    out_s.loss.backward()
    grads_v, grads_s = grads(vanilla), grads(split)
    assert grads_v.keys() == grads_s.keys()
    assert any(
        n.endswith(("gate.lora_A.default.weight", "router.lora_A.default.weight")) for n in grads_v
    ), "the router is not adapted"
    for name, grad in grads_v.items():
        torch.testing.assert_close(grads_s[name], grad, atol=ATOL, rtol=0, msg=name)
    return split


@pytest.mark.parametrize("name", sorted(MOE_ARCHS))
def test_in_process_equals_vanilla(name, moe_checkpoints, one_thread):
    path = moe_checkpoints(name)
    per_expert = any(".experts.0." in k for k in _keys(path))
    assert per_expert != (name == "granitemoe"), "save_pretrained wrote other keys than expected"
    executor = symbiont.BaseExecutor.from_pretrained(path)
    assert len(executor.manifest.experts) == 2  # one stack per decoder layer
    assert_split_equals_vanilla(path, executor, lora_attention_and_router(name))


# Every linear layer (PEFT would also adapt the experts for the bare names "down_proj", ...)
LINEAR = r".*\.(self_attn\.[qkvo]_proj|shared_expert\.(gate|up|down)_proj|shared_expert_gate)"


@pytest.mark.parametrize("name", sorted(MOE_ARCHS))
def test_lora_on_every_linear_layer_equals_vanilla(name, moe_checkpoints, one_thread):
    """Every linear layer by name: attention, and the shared experts where the family has
    them (Qwen2-MoE). The experts module is no linear layer, so it is not matched."""
    path = moe_checkpoints(name)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=LINEAR, task_type="CAUSAL_LM")
    vanilla, split = make_pair(path, symbiont.BaseExecutor.from_pretrained(path), config)
    inputs = batch()
    out_v = vanilla(**inputs, labels=inputs["input_ids"])
    out_s = split(**inputs, labels=inputs["input_ids"])
    torch.testing.assert_close(out_s.logits, out_v.logits, atol=ATOL, rtol=0)
    out_v.loss.backward()
    out_s.loss.backward()
    grads_v, grads_s = grads(vanilla), grads(split)
    assert grads_v.keys() == grads_s.keys()
    assert any("shared_expert" in n for n in grads_v) == (name == "qwen2_moe")
    for param, grad in grads_v.items():
        torch.testing.assert_close(grads_s[param], grad, atol=ATOL, rtol=0, msg=param)


def test_all_linear_that_peft_extends_to_the_experts_is_refused(moe_checkpoints):
    """PEFT 0.21 turns target_modules='all-linear' on Mixtral into LoRA on the experts too."""
    path = moe_checkpoints("mixtral")
    client = symbiont.load_client(path, symbiont.BaseExecutor.from_pretrained(path))
    model = peft.get_peft_model(client, peft.LoraConfig(r=2, target_modules="all-linear"))
    with pytest.raises(BaseWeightUnavailable, match=r"target_parameters.*'all-linear'"):
        model(**batch())


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_client_holds_no_expert_weights(name, moe_checkpoints):
    path = moe_checkpoints(name)
    client = symbiont.load_client(path, symbiont.BaseExecutor.from_pretrained(path))
    own, experts = 0, 0
    for param_name, param in client.named_parameters():
        if isinstance(param, RemoteWeight):
            assert param.untyped_storage().nbytes() == param.element_size(), param_name
            experts += ".experts." in param_name
            continue
        assert ".experts." not in param_name, f"the client holds expert weight {param_name}"
        own += param.numel() * param.element_size()
    assert experts == 4  # gate_up_proj and down_proj of 2 layers, all placeholders
    total, expert_bytes = _checkpoint_bytes(path)
    share = own / total
    print(
        f"{name}: the client holds {own} of {total} checkpoint bytes ({share:.1%}); experts "
        f"are {expert_bytes / total:.1%} of the checkpoint"
    )
    assert own == total - expert_bytes - _base_linear_bytes(client)


def test_lora_on_experts_is_refused_naming_the_option(moe_checkpoints):
    path = moe_checkpoints("qwen3_moe")
    client = symbiont.load_client(path, symbiont.BaseExecutor.from_pretrained(path))
    config = peft.LoraConfig(r=2, target_parameters=["mlp.experts.gate_up_proj"])
    model = peft.get_peft_model(client, config)
    with pytest.raises(BaseWeightUnavailable, match=r"target_parameters"):
        model(**batch())


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


@pytest.fixture(scope="module")
def moe_servers(moe_checkpoints):
    """name -> a serve-base process for that checkpoint (stopped after this module)."""
    servers: dict = {}

    def get(name: str) -> ServerProcess:
        if name not in servers:
            servers[name] = ServerProcess(moe_checkpoints(name), args=("--threads", "1")).start()
        return servers[name]

    yield get
    for server in servers.values():
        server.stop()


@pytest.mark.parametrize("mode", ["shm", "zmq"])
def test_over_serve_base_equals_vanilla(mode, moe_checkpoints, moe_servers, one_thread):
    path = moe_checkpoints("mixtral")
    url = moe_servers("mixtral").url("ipc")
    with symbiont.connect(url, mode=mode, checkpoint=path) as executor:
        assert executor.transport == mode
        assert_split_equals_vanilla(path, executor, lora_attention_and_router("mixtral"))


@pytest.mark.parametrize("name,mode", [("qwen3_moe", "shm"), ("olmoe", "zmq")])
def test_over_executor_server_equals_vanilla(name, mode, moe_checkpoints, tmp_path, one_thread):
    """The same server loop as serve-base, in a thread of this process (starts faster)."""
    path = moe_checkpoints(name)
    with serve_in_thread(path, tmp_path) as server:
        url = server.endpoints[1]  # ipc
        with symbiont.connect(url, mode=mode, checkpoint=path, spin_us=0) as executor:
            assert executor.transport == mode
            assert_split_equals_vanilla(path, executor, lora_attention_and_router(name))


def test_executor_server_refuses_bad_experts_calls(moe_checkpoints, tmp_path):
    """The executor's own checks, not the client's: crafted CALLs straight on the socket."""
    path = moe_checkpoints("olmoe")
    with serve_in_thread(path, tmp_path) as server:
        _refuse_bad_calls(path, server.endpoints[0])


def _refuse_bad_calls(path, url):
    sock = raw_dealer(url)
    sock.send(encode(symbiont_hello(path)))
    decode(sock.recv())
    ids = torch.tensor([[0, 1], [2, 9]])  # 9: no such expert
    tensors = {"ids": ids, "hidden": torch.randn(2, 32), "weights": torch.rand(2, 2)}
    layout = request_layout(Op.EXPERTS_FORWARD, 2, 2, 32, torch.float32, torch.float32)
    cases = [
        (dict(layer=0, cols=32, top_k=2), tensors, r"expert ids must lie in 0\.\.3"),
        (dict(layer=5, cols=32, top_k=2), tensors, "unknown experts id 5"),
        (dict(layer=0, cols=16, top_k=2), tensors, r"expects hidden states \[n_tokens, 32\]"),
        (dict(layer=0, cols=32, top_k=7), tensors, r"picks 1\.\.4 of them"),
    ]
    for call_id, (fields, values, message) in enumerate(cases, start=100):
        call = Call(call_id, Op.EXPERTS_FORWARD, rows=2, dtype="float32", weights_dtype="float32",
                    **fields)  # fmt: skip
        sock.send_multipart([encode(call), memoryview(layout.pack(values).numpy())])
        answer = decode(sock.recv_multipart()[0])
        assert type(answer) is Error and answer.call_id == call_id, answer
        assert answer.code is Code.BAD_CALL and re.search(message, answer.message), answer
    sock.close()


def symbiont_hello(path):
    from symbiont.model.checkpoint import Checkpoint
    from symbiont.protocol.executor import PROTOCOL_VERSION
    from symbiont.protocol.wire import Hello

    return Hello(
        call_id=1, protocol=PROTOCOL_VERSION, fingerprint=Checkpoint.open(path).fingerprint
    )


def _one_batch_of_experts_calls(path, stack: int, clients):
    """Queue one EXPERTS_FORWARD call per (label, rows, top_k) on experts `stack`, take the
    batch the scheduler hands out and run it. -> (rows per experts op run, each client's
    reply, each client's inputs, the executor)"""
    executor = symbiont.BaseExecutor.from_pretrained(path)
    server = ExecutorServer(executor, ServiceConfig(bind=("tcp://127.0.0.1:*",)))
    runs, replies = [], {}
    run_experts = executor.run_experts
    executor.run_experts = lambda op, e, *t: runs.append(t[0].shape[0]) or run_experts(op, e, *t)
    server._reply = lambda call, ys: replies.setdefault(call.session.label, ys)
    g = torch.Generator().manual_seed(0)
    inputs = {}
    for label, rows, top_k in clients:
        session = Session(key=label.encode(), label=label, pid=0, host="h", endpoint="e",
                          connected_at=0.0)  # fmt: skip
        server.sessions[session.key] = session
        hidden = torch.randn(rows, 32, generator=g)
        ids = torch.stack([torch.randperm(4, generator=g)[:top_k] for _ in range(rows)])
        weights = torch.rand(rows, top_k, generator=g)
        inputs[label] = (hidden, ids, weights)
        server.scheduler.submit(
            QueuedCall(session, 1, Op.EXPERTS_FORWARD, server.n_linear + stack, hidden, 0.0,
                       ids=ids, weights=weights)
        )  # fmt: skip
    batch = server.scheduler.pop_ready(now=1e9)
    assert len(batch) == len(clients)
    server._run(batch, 0.0)
    server.close()
    return runs, replies, inputs, executor


def test_calls_of_many_clients_run_as_one_batch(moe_checkpoints):
    """Experts calls of two clients on one stack leave the queue together and run as one
    experts op over both clients' tokens (grouped per expert inside); each client gets
    its own rows, equal to running its call alone."""
    clients = [("a", 3, 2), ("b", 5, 2)]  # on the second layer's experts
    runs, replies, inputs, executor = _one_batch_of_experts_calls(
        moe_checkpoints("mixtral"), 1, clients
    )
    assert runs == [8], "the two clients' tokens did not run as one experts op"
    for label, (hidden, ids, weights) in inputs.items():
        (alone,) = executor.call_experts(Op.EXPERTS_FORWARD, 1, hidden, ids, weights)
        torch.testing.assert_close(replies[label][0], alone, atol=ATOL, rtol=0)


def test_calls_of_different_top_k_in_one_batch_each_get_their_own_rows(moe_checkpoints):
    """Two clients routing to 2 and to 1 expert per token on one stack: their calls leave
    the queue together, but ids and weights of different widths do not concatenate. That
    raised in the executor's loop and stopped it for every client; now each top-k runs
    as its own experts op."""
    clients = [("a", 3, 2), ("b", 5, 1)]
    runs, replies, inputs, executor = _one_batch_of_experts_calls(
        moe_checkpoints("mixtral"), 0, clients
    )
    assert sorted(runs) == [3, 5], "each top-k should run as its own experts op"
    for label, (hidden, ids, weights) in inputs.items():
        (alone,) = executor.call_experts(Op.EXPERTS_FORWARD, 0, hidden, ids, weights)
        torch.testing.assert_close(replies[label][0], alone, atol=ATOL, rtol=0)


def _keys(path) -> list[str]:
    with safe_open(path / "model.safetensors", framework="pt") as f:
        return list(f.keys())


def _checkpoint_bytes(path) -> tuple[int, int]:
    """(all tensor bytes, expert tensor bytes) of a checkpoint."""
    total = experts = 0
    with safe_open(path / "model.safetensors", framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 - safe_open is not iterable
            t = f.get_slice(key)
            n = torch.Size(t.get_shape()).numel() * 4  # fp32 checkpoints
            total += n
            experts += n if ".experts." in key else 0
    return total, experts


def _base_linear_bytes(client) -> int:
    """Bytes of the base linear layers (on the executor as well, as placeholders here)."""
    return sum(
        p.numel() * p.element_size()
        for n, p in client.named_parameters()
        if isinstance(p, RemoteWeight) and not isinstance(p, ExpertWeight)
    )


def test_serve_engine_with_lora_equals_vanilla(moe_checkpoints, tmp_path, one_thread):
    """`symbiont serve`'s engine on an MoE base: greedy tokens of the base and of a LoRA
    adapter, batched together, equal vanilla transformers + peft request by request."""
    from symbiont.serve import Engine, EngineConfig, SamplingParams
    from tests.test_serve_common import Reference, lora_config, prompts, save_adapter

    base = moe_checkpoints("qwen3_moe")
    config = lora_config("qwen3_moe", 4, targets=["q_proj", "v_proj", "o_proj"])
    adapters = {"lora": save_adapter(base, config, tmp_path / "lora", seed=3)}
    client = symbiont.load_client(base, symbiont.BaseExecutor.from_pretrained(base))
    engine = Engine(client, EngineConfig(max_running=4, max_batched_tokens=16, block_size=4))
    engine.load_adapter("lora", adapters["lora"])
    reference = Reference(base, adapters)
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    batch, names = prompts(3, seed=8), [None, "lora", "lora"]
    for prompt, name, got in zip(batch, names, engine.generate(batch, names, greedy), strict=True):
        assert got == reference.generate(prompt, name, greedy.max_tokens), name


def test_the_readme_moe_snippet_runs(tmp_path, monkeypatch, one_thread):
    from tests.test_readme import python_blocks

    (snippet,) = [b for b in python_blocks() if '"mixtral"' in b]
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(snippet, namespace)  # noqa: S102
    model = namespace["model"]
    assert all(isinstance(p, ExpertWeight) for n, p in model.named_parameters() if ".experts." in n)
    router = [p.grad for n, p in model.named_parameters() if "gate.lora_B" in n]
    assert router and all(g is not None and g.abs().sum() > 0 for g in router)


def test_executor_without_experts_is_refused(moe_checkpoints):
    """An executor that lists no experts (an older symbiont) cannot serve an MoE client."""
    path = moe_checkpoints("mixtral")
    executor = symbiont.BaseExecutor.from_pretrained(path)
    executor._manifest = dataclasses.replace(executor.manifest, experts=())
    with pytest.raises(ExecutorError, match="mixture-of-experts stack .* serves no experts"):
        symbiont.load_client(path, executor)


@pytest.mark.parametrize("mode", ["zmq", "shm"])
def test_large_experts_calls_over_the_wire(mode, moe_checkpoints, tmp_path, one_thread):
    """Calls over one frame travel in DATA parts; over shared memory they grow the segment.
    Forward and backward equal the in-process executor."""
    path = moe_checkpoints("olmoe")
    local = symbiont.BaseExecutor.from_pretrained(path)
    g = torch.Generator().manual_seed(1)
    rows = 9000  # about 1.4 MiB of packed tensors: more than one frame or the first segment
    hidden, grad_y = torch.randn(rows, 32, generator=g), torch.randn(rows, 32, generator=g)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(rows)])
    weights = torch.rand(rows, 2, generator=g)
    with serve_in_thread(path, tmp_path) as server:
        remote = symbiont.connect(server.endpoints[1], mode=mode, spin_us=0)
        for op, extra in ((Op.EXPERTS_FORWARD, ()), (Op.EXPERTS_BACKWARD, (grad_y,))):
            got = remote.call_experts(op, 1, hidden, ids, weights, *extra)
            want = local.call_experts(op, 1, hidden, ids, weights, *extra)
            assert len(got) == len(want)
            for g_, w_ in zip(got, want, strict=True):
                torch.testing.assert_close(g_, w_, atol=ATOL, rtol=0)
        remote.close()
