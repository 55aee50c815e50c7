"""On a CUDA GPU: every placement of client and executor gives vanilla's results.

Skipped without one (CI has none). The reference is vanilla transformers + peft on the
same GPU, fp32 with TF32 off; tolerances are fp32 rounding, since cuBLAS may pick
another kernel for another batch shape. When client and executor share the GPU, a
serve-base puts the segment's areas there (CUDA IPC: `transport == "cuda-ipc"`).

    python -m pytest tests/test_gpu.py -v
"""

from __future__ import annotations

import json

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM

import symbiont
from symbiont.client.virt import RemoteWeight
from symbiont.processes import ServerProcess
from symbiont.protocol.executor import Op
from tests.tiny_models import ARCHS, VOCAB

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ATOL = 1e-5  # fp32 on the GPU, TF32 off: cuBLAS kernels differ by batch shape


@pytest.fixture(autouse=True)
def no_tf32():
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.fixture(scope="module")
def llama(checkpoints):
    return checkpoints("llama")


@pytest.fixture(scope="module")
def cuda_base(llama, tmp_path_factory):
    """A serve-base computing on the GPU."""
    server = ServerProcess(
        llama,
        args=("--device", "cuda", "--threads", "1"),
        workdir=tmp_path_factory.mktemp("gpu-serve-base"),
    ).start()
    yield server
    server.stop()


def lora_config():
    return peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=list(ARCHS["llama"].attention), task_type="CAUSAL_LM"
    )


def pair(path, executor, device):
    """(vanilla peft model on the GPU, split peft model on `device`), same adapter weights."""
    torch.manual_seed(1)
    vanilla = AutoModelForCausalLM.from_pretrained(path).to("cuda")
    vanilla = peft.get_peft_model(vanilla, lora_config())
    with torch.no_grad():  # LoRA B starts at zero: perturb so gradients mean something
        for param in vanilla.parameters():
            if param.requires_grad:
                param.add_(torch.randn_like(param) * 0.1)
    split = peft.get_peft_model(symbiont.load_client(path, executor, device=device), lora_config())
    twins = dict(split.named_parameters()) | dict(split.named_buffers())
    with torch.no_grad():
        for name, tensor in list(vanilla.named_parameters()) + list(vanilla.named_buffers()):
            if not isinstance(twins[name], RemoteWeight):
                twins[name].copy_(tensor)
    return vanilla.eval(), split.eval()


def assert_like_vanilla(vanilla, split, device):
    ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(2))
    expected = vanilla(input_ids=ids.cuda(), labels=ids.cuda())
    got = split(input_ids=ids.to(device), labels=ids.to(device))
    assert got.logits.device.type == torch.device(device).type
    torch.testing.assert_close(got.logits.cuda(), expected.logits, atol=ATOL, rtol=0)
    expected.loss.backward()
    got.loss.backward()
    ours = {n: p.grad for n, p in split.named_parameters() if p.requires_grad}
    for name, param in vanilla.named_parameters():
        if param.requires_grad:
            torch.testing.assert_close(ours[name].cuda(), param.grad, atol=ATOL, rtol=1e-4)
    prompt = ids[:1, :4]
    want = vanilla.generate(input_ids=prompt.cuda(), max_new_tokens=6, do_sample=False)
    have = split.generate(input_ids=prompt.to(device), max_new_tokens=6, do_sample=False)
    assert have.cpu().tolist() == want.cpu().tolist()


def test_in_process_executor_on_the_gpu_matches_vanilla(llama):
    executor = symbiont.BaseExecutor.from_pretrained(llama, device="cuda")
    assert executor.device.type == "cuda"
    assert_like_vanilla(*pair(llama, executor, "cuda"), "cuda")


def test_client_on_the_executors_gpu_shares_its_areas(llama, cuda_base):
    url = cuda_base.url("tcp")
    executor = symbiont.connect(url, checkpoint=llama, device="cuda")
    try:
        assert executor.transport == "cuda-ipc"
        assert_like_vanilla(*pair(llama, executor, "cuda"), "cuda")
        # a call larger than the segment grows it: the new areas are on the GPU too
        spec = executor.manifest.layers[0]
        x = torch.randn(4096, spec.in_features, device="cuda")
        local = symbiont.BaseExecutor.from_pretrained(llama, device="cuda")
        got = executor.call(Op.FORWARD, 0, x)
        assert got.device.type == "cuda" and executor.transport == "cuda-ipc"
        torch.testing.assert_close(got, local.call(Op.FORWARD, 0, x), atol=ATOL, rtol=0)
    finally:
        executor.close()


def test_back_to_back_calls_through_gpu_areas_each_read_their_own_outputs(llama, cuda_base):
    """Neither host waits for the GPU after a call (an event orders the outputs): many
    calls in a row, some large enough that the GPU lags behind both hosts, each return
    their own outputs, not the previous call's or half-written ones."""
    executor = symbiont.connect(cuda_base.url("tcp"), checkpoint=llama, device="cuda")
    try:
        local = symbiont.BaseExecutor.from_pretrained(llama, device="cuda")
        spec = executor.manifest.layers[0]
        generator = torch.Generator(device="cuda").manual_seed(4)
        shapes = [(rows, spec.in_features) for rows in (8192, 3, 8192, 1, 4096) * 4]
        xs = [torch.randn(shape, device="cuda", generator=generator) for shape in shapes]
        got = [executor.call(Op.FORWARD, spec.id, x) for x in xs]
        assert executor.transport == "cuda-ipc" and executor._segment.gpu_event is not None
        for x, y in zip(xs, got, strict=True):
            torch.testing.assert_close(y, local.call(Op.FORWARD, spec.id, x), atol=ATOL, rtol=0)
        # calls alternating between two streams: each stream's x waits for the executor's
        # reads of the last x and for the other stream's reads of the last outputs
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())  # xs are written
        got = []
        for i, x in enumerate(xs):
            with torch.cuda.stream(side if i % 2 else torch.cuda.current_stream()):
                got.append(executor.call(Op.FORWARD, spec.id, x))
        torch.cuda.current_stream().wait_stream(side)
        for x, y in zip(xs, got, strict=True):
            torch.testing.assert_close(y, local.call(Op.FORWARD, spec.id, x), atol=ATOL, rtol=0)
        grad_ys = [torch.randn(4096, spec.out_features, device="cuda") for _ in range(4)]
        grads = [executor.call(Op.BACKWARD, spec.id, g) for g in grad_ys]
        for grad_y, grad in zip(grad_ys, grads, strict=True):
            want = local.call(Op.BACKWARD, spec.id, grad_y)
            torch.testing.assert_close(grad, want, atol=ATOL, rtol=0)
    finally:
        executor.close()


def test_gpu_areas_without_events_wait_on_both_sides(llama, tmp_path, monkeypatch):
    """SYMBIONT_GPU_EVENTS=0 (the comparison benchmarks/transport_overhead.py draws)."""
    monkeypatch.setenv("SYMBIONT_GPU_EVENTS", "0")
    args = ("--device", "cuda", "--threads", "1")
    server = ServerProcess(llama, args=args, workdir=tmp_path).start()
    try:
        executor = symbiont.connect(server.url("tcp"), checkpoint=llama, device="cuda")
        try:
            assert executor.transport == "cuda-ipc" and executor._segment.gpu_event is None
            assert_like_vanilla(*pair(llama, executor, "cuda"), "cuda")
        finally:
            executor.close()
    finally:
        server.stop()


@pytest.mark.parametrize("mode", ["shm", "zmq"])
def test_a_cpu_client_of_a_gpu_executor(llama, cuda_base, mode):
    executor = symbiont.connect(cuda_base.url("tcp"), checkpoint=llama, mode=mode)
    try:
        assert executor.transport == mode
        assert_like_vanilla(*pair(llama, executor, "cpu"), "cpu")
    finally:
        executor.close()


def test_a_gpu_client_through_frames(llama, cuda_base):
    executor = symbiont.connect(cuda_base.url("tcp"), checkpoint=llama, mode="zmq", device="cuda")
    try:
        assert executor.transport == "zmq"
        assert_like_vanilla(*pair(llama, executor, "cuda"), "cuda")
    finally:
        executor.close()


def test_a_gpu_client_of_a_cpu_executor_uses_host_areas(llama, tmp_path):
    server = ServerProcess(llama, args=("--threads", "1"), workdir=tmp_path).start()
    try:
        executor = symbiont.connect(server.url("tcp"), checkpoint=llama, device="cuda")
        try:
            assert executor.transport == "shm"
            vanilla, split = pair(llama, executor, "cuda")
            ids = torch.randint(3, VOCAB, (1, 5), generator=torch.Generator().manual_seed(3))
            got = split(input_ids=ids.cuda()).logits
            torch.testing.assert_close(got, vanilla(input_ids=ids.cuda()).logits, atol=ATOL, rtol=0)
        finally:
            executor.close()
    finally:
        server.stop()


def test_several_gpu_clients_batched_together(llama, cuda_base):
    """Two clients on the GPU at once: their calls batch on the executor, each gets its own."""
    import threading

    url = cuda_base.url("tcp")
    executors = [symbiont.connect(url, checkpoint=llama, device="cuda") for _ in range(2)]
    local = symbiont.BaseExecutor.from_pretrained(llama, device="cuda")
    errors = []

    def hammer(executor, seed):
        generator = torch.Generator(device="cuda").manual_seed(seed)
        try:
            for _ in range(50):
                spec = executor.manifest.layers[seed % len(executor.manifest.layers)]
                x = torch.randn(3, spec.in_features, device="cuda", generator=generator)
                got = executor.call(Op.FORWARD, spec.id, x)
                want = local.call(Op.FORWARD, spec.id, x)
                torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=hammer, args=(e, i)) for i, e in enumerate(executors)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert all(e.transport == "cuda-ipc" for e in executors)
    finally:
        for executor in executors:
            executor.close()


def test_generate_command_on_the_gpu(model_dir, tmp_path, capsys):
    """`symbiont generate --device cuda`, in-process and through a GPU serve-base, prints
    the same greedy text."""
    from symbiont.cli import main

    base = ServerProcess(model_dir, args=("--device", "cuda"), workdir=tmp_path)
    base.start()
    try:
        texts = []
        for extra in ([], ["--executor", base.url("tcp")]):
            argv = ["generate", "--model", str(model_dir), "--device", "cuda", "--prompt", "Hi"]
            assert main([*argv, "--max-new-tokens", "8", *extra]) == 0
            texts.append(capsys.readouterr().out)
        assert texts[0] == texts[1] and texts[0].strip()
    finally:
        base.stop()


def test_serving_engine_on_the_gpu_matches_vanilla(llama, tmp_path):
    """The continuous-batching engine with the model and executor on the GPU, mixed
    adapters in one batch: greedy tokens equal vanilla peft's, KV blocks all returned."""
    from symbiont.serve import Engine, EngineConfig, SamplingParams
    from tests.test_serve_common import Reference, make_adapters, prompts

    adapters = make_adapters(llama, tmp_path / "adapters")
    config = EngineConfig(max_running=6, max_batched_tokens=12, block_size=4, num_blocks=128)
    executor = symbiont.BaseExecutor.from_pretrained(llama, device="cuda")
    engine = Engine(symbiont.load_client(llama, executor, device="cuda"), config)
    for name, path in adapters.items():
        engine.load_adapter(name, path)
    names = [None, *adapters]
    batch = prompts(len(names), seed=4)
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    outputs = engine.generate(batch, names, greedy)
    reference = Reference(llama, adapters)  # vanilla peft on the CPU
    for prompt, name, got in zip(batch, names, outputs, strict=True):
        assert got == reference.generate(prompt, name, greedy.max_tokens), name
    assert engine.kv_cache.allocator.num_free == config.num_blocks


def test_finetune_command_on_the_gpu(model_dir, tmp_path):
    """`symbiont finetune --device cuda`, in-process and through a GPU serve-base: the
    same losses step by step (fp32 within rounding) as the same run on the CPU."""
    from symbiont.cli import main
    from symbiont.model.default import default_dataset

    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(default_dataset().read_text().splitlines()[:12]) + "\n")

    def losses(out, *extra):
        argv = ["finetune", "--model", str(model_dir), "--data", str(data), "--out", str(out)]
        argv += ["--max-steps", "3", "--r", "4", "--target", "q_proj,v_proj", "--no-progress"]
        assert main([*argv, *extra]) == 0
        lines = (out / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line)["loss"] for line in lines]

    on_cpu = losses(tmp_path / "cpu")
    on_gpu = losses(tmp_path / "gpu", "--device", "cuda")
    base = ServerProcess(model_dir, args=("--device", "cuda"), workdir=tmp_path).start()
    try:
        split = losses(tmp_path / "split", "--device", "cuda", "--executor", base.url("tcp"))
    finally:
        base.stop()
    assert on_gpu == pytest.approx(on_cpu, rel=1e-4) and split == pytest.approx(on_gpu, rel=1e-4)
