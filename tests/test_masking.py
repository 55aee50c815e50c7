"""Masked activations (docs/privacy.md): both modes give the unmasked results (logits
within 1e-4, LoRA gradients within 1e-3 relative, fp32), in process and over serve-base,
on layers with and without bias; every misuse is refused with its reason."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import httpx
import peft
import pytest
import torch

import symbiont
from symbiont import BaseExecutor
from symbiont.cli import main
from symbiont.client.masking import (
    MaskConfig,
    PoolMaskedExecutor,
    SharesExecutor,
    noise_scale,
)
from symbiont.model.default import default_dataset
from symbiont.processes import ServerProcess
from symbiont.serve import EngineConfig
from symbiont.serve.config import ServerConfig
from symbiont.serve.http.server import BackgroundServer
from symbiont.tenant import open_executor
from tests.masking_attacks import Recorder
from tests.test_readme import python_blocks
from tests.tiny_models import ARCHS as TINY
from tests.tiny_models import build_checkpoint

LOGITS_RTOL = 1e-4
GRAD_RTOL = 1e-3
# Llama, Mistral: no bias; Qwen2: bias on q/k/v; GPT-2, GPT-BigCode: Conv1D / fused
# projections with biases; OPT, GPT-NeoX: biases everywhere; Phi-3: fused qkv and
# gate_up; Gemma 2: LM head tied to the embeddings (its noise effects read from them).
ARCHS = ("llama", "mistral", "qwen2", "gpt2", "gpt_bigcode", "opt", "gpt_neox", "phi3", "gemma2")
SERVE_ENGINE = EngineConfig(max_running=4, max_batched_tokens=32, block_size=4, num_blocks=64)


@pytest.fixture(autouse=True)
def _threads(one_thread):
    yield


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def lora_step(path, executor, mask=None, ids=None):
    """Logits and LoRA gradients of one training step [batch, seq, vocab], {name: grad}."""
    model = symbiont.load_client(path, executor, mask_activations=mask)
    torch.manual_seed(1)  # the same adapter every time; non-zero B so every path is live
    config = peft.LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)
    model = peft.get_peft_model(model, config)
    if ids is None:
        ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(0))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return out.logits.detach(), grads


def assert_same_step(got, want):
    (logits, grads), (ref_logits, ref_grads) = got, want
    assert relative(logits, ref_logits) < LOGITS_RTOL, "masked logits differ from unmasked"
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert relative(grad, ref_grads[name]) < GRAD_RTOL, f"gradient of {name} differs"


@pytest.mark.parametrize("arch", ARCHS)
def test_both_modes_match_unmasked_in_process(checkpoints, arch):
    path = checkpoints(arch)
    want = lora_step(path, BaseExecutor.from_pretrained(path))
    pool = lora_step(path, BaseExecutor.from_pretrained(path), "pool")
    assert_same_step(pool, want)
    pair = (BaseExecutor.from_pretrained(path), BaseExecutor.from_pretrained(path))
    assert_same_step(lora_step(path, pair, "shares"), want)


def test_masked_calls_are_not_the_plain_calls(checkpoints):
    """Guards against a wrapper that forgets to mask: what reaches the executor differs
    from the true input by far more than the input itself."""
    path = checkpoints("llama")
    spy = Recorder(BaseExecutor.from_pretrained(path))
    masked = symbiont.load_client(path, spy, mask_activations=True)
    x = torch.randn(5, 32)
    masked.model.layers[0].self_attn.q_proj(x)
    assert isinstance(masked.model.layers[0].self_attn.q_proj.executor, PoolMaskedExecutor)
    assert (spy.calls[0].x - x).norm() > 30 * x.norm(), "the call went out (nearly) unmasked"


def test_generate_is_unchanged_by_masking(checkpoints):
    path = checkpoints("qwen2")
    prompt = torch.tensor([[5, 17, 99, 3, 64]])

    def greedy(executor, mask=None):
        model = symbiont.load_client(path, executor, mask_activations=mask)
        return model.generate(prompt, max_new_tokens=12, do_sample=False)

    want = greedy(BaseExecutor.from_pretrained(path))
    assert torch.equal(greedy(BaseExecutor.from_pretrained(path), "pool"), want)
    pair = (BaseExecutor.from_pretrained(path), BaseExecutor.from_pretrained(path))
    assert torch.equal(greedy(pair, "shares"), want)


@pytest.fixture(scope="module")
def qwen2_with_tokenizer(model_dir, tmp_path_factory):
    """A tiny Qwen2 (bias on q/k/v) with the default model's tokenizer, for the CLI."""
    folder = tmp_path_factory.mktemp("qwen2-tok")
    arch = TINY["qwen2"]
    build_checkpoint(replace(arch, config={**arch.config, "vocab_size": 2048}), folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def two_bases(qwen2_with_tokenizer):
    """Two serve-base processes (two parties) on the biased Qwen2 checkpoint."""
    path = qwen2_with_tokenizer

    def start(_):
        return ServerProcess(path, bind=("tcp://127.0.0.1:*",), args=("--threads", "1")).start()

    with ThreadPoolExecutor(2) as both:  # start and stop the two at once
        servers = list(both.map(start, range(2)))
    yield path, [server.url("tcp") for server in servers]
    with ThreadPoolExecutor(2) as both:
        list(both.map(ServerProcess.stop, servers))


def test_both_modes_match_unmasked_over_serve_base(two_bases):
    path, urls = two_bases
    ids = torch.randint(0, 2048, (2, 20), generator=torch.Generator().manual_seed(0))
    want = lora_step(path, BaseExecutor.from_pretrained(path), ids=ids)
    with symbiont.connect(urls[0], checkpoint=path) as remote:
        assert_same_step(lora_step(path, remote, "pool", ids), want)
    a, b = (symbiont.connect(url, checkpoint=path) for url in urls)
    shares = open_executor(path, urls, mask_activations="shares")
    try:
        assert isinstance(shares, SharesExecutor)
        assert_same_step(lora_step(path, (a, b), "shares", ids), want)
        assert_same_step(lora_step(path, shares, ids=ids), want)
    finally:
        for executor in (a, b, shares):
            executor.close()


@pytest.mark.parametrize("cores, spinning", [(2, False), (8, True)])
def test_shares_on_this_host_spin_only_with_a_core_each(two_bases, monkeypatch, cores, spinning):
    """Two serve-bases on the client's host and the client: on two cores nobody spins
    (each would hold a core the others need at every call: 19 against 88 tokens/s); with
    a core each they all may. The results are the same either way."""
    from symbiont import tenant
    from symbiont.protocol import shm

    path, urls = two_bases
    monkeypatch.setattr(tenant, "_cores", lambda: cores)
    ids = torch.randint(0, 2048, (2, 20), generator=torch.Generator().manual_seed(0))
    want = lora_step(path, BaseExecutor.from_pretrained(path), ids=ids)
    shares = open_executor(path, urls, mask_activations="shares")
    try:
        assert_same_step(lora_step(path, shares, ids=ids), want)
        for party in shares.executors:
            assert (party._spin_s > 0) is spinning
            assert party._segment is not None  # same host: shared memory
            # the executor's answer to ATTACH(spin=...), in the segment's control block
            assert bool(party._segment.ctrl[shm.SPIN_OK]) is (spinning and shm.SPIN_SAFE)
    finally:
        shares.close()


def test_generate_cli_with_shares_over_two_bases(two_bases, capsys):
    path, urls = two_bases
    args = ["generate", "--model", str(path), "--prompt", "Q: 2 plus 3?", "--threads", "1"]
    args += ["--max-new-tokens", "8"]
    assert main(args) == 0
    want = capsys.readouterr().out
    shares = ["--executor", urls[0], "--executor", urls[1], "--mask-activations", "shares"]
    assert main([*args, *shares]) == 0
    assert capsys.readouterr().out == want, "generate --mask-activations shares changed the text"
    assert main([*args, "--executor", urls[1], "--mask-activations", "pool"]) == 0
    assert capsys.readouterr().out == want, "generate --mask-activations pool changed the text"


def test_serve_with_masked_executors_answers_the_same(two_bases):
    """`symbiont serve --mask-activations pool` (in process) and `shares` over two
    serve-base give the unmasked server's greedy completion."""
    path, urls = two_bases
    shares = {"executor": urls[0], "second_executor": urls[1], "mask_activations": "shares"}
    texts = {}
    for name, extra in (("plain", {}), ("pool", {"mask_activations": "pool"}), ("shares", shares)):
        config = ServerConfig(model=str(path), port=0, engine=SERVE_ENGINE, **extra)
        with BackgroundServer(config) as server:
            body = {"model": path.name, "prompt": "Q: 2 plus 3?", "max_tokens": 8}
            reply = httpx.post(f"{server.url}/v1/completions", json={**body, "temperature": 0}, timeout=60)  # fmt: skip
            assert reply.status_code == 200, reply.text
            texts[name] = reply.json()["choices"][0]["text"]
    assert texts["pool"] == texts["plain"] and texts["shares"] == texts["plain"], texts


def test_finetune_cli_with_pool_trains_the_same_adapter(model_dir, tmp_path):
    lines = default_dataset().read_text().splitlines()[:8]
    (tmp_path / "train.jsonl").write_text("\n".join(lines) + "\n")
    args = ["finetune", "--model", str(model_dir), "--data", str(tmp_path / "train.jsonl")]
    args += ["--target", "all-linear", "--r", "4", "--max-steps", "2", "--threads", "1"]
    args += ["--no-progress"]
    assert main([*args, "--out", str(tmp_path / "plain")]) == 0
    assert main([*args, "--out", str(tmp_path / "pool"), "--mask-activations", "pool"]) == 0
    # Adam divides each update by the gradient's own size, so single elements whose
    # gradient is near zero may move differently; the losses (the model) must agree.
    want, got = (losses(tmp_path / run / "metrics.jsonl") for run in ("plain", "pool"))
    assert len(want) == len(got) == 2
    assert all(abs(g - w) < LOGITS_RTOL * abs(w) for g, w in zip(got, want, strict=True))


def losses(metrics) -> list[float]:
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]


# -- refusals --------------------------------------------------------------------


def test_unknown_mode_is_refused(checkpoints):
    path = checkpoints("llama")
    with pytest.raises(ValueError, match=r"unknown mask_activations 'secret'; use 'pool'"):
        symbiont.load_client(path, BaseExecutor.from_pretrained(path), mask_activations="secret")
    with pytest.raises(ValueError, match="unknown mask_activations mode 'both'"):
        MaskConfig("both")


def test_shares_with_one_executor_is_refused(checkpoints):
    path = checkpoints("llama")
    with pytest.raises(ValueError, match="'shares' needs two executors run by parties that do not collude, got 1"):  # fmt: skip
        symbiont.load_client(path, BaseExecutor.from_pretrained(path), mask_activations="shares")


@pytest.mark.parametrize("mask", [None, "pool"])
def test_two_executors_without_shares_are_refused(checkpoints, mask):
    path = checkpoints("llama")
    pair = (BaseExecutor.from_pretrained(path), BaseExecutor.from_pretrained(path))
    with pytest.raises(ValueError, match="only used by mask_activations='shares'"):
        symbiont.load_client(path, pair, mask_activations=mask)


def test_two_executors_of_different_bases_are_refused(checkpoints):
    llama, mistral = checkpoints("llama"), checkpoints("mistral")
    pair = (BaseExecutor.from_pretrained(llama), BaseExecutor.from_pretrained(mistral))
    with pytest.raises(ValueError, match=r"the two executors serve different bases \(checkpoint fingerprint"):  # fmt: skip
        symbiont.load_client(llama, pair, mask_activations="shares")
    half = (BaseExecutor.from_pretrained(llama), BaseExecutor.from_pretrained(llama, dtype="float64"))  # fmt: skip
    with pytest.raises(ValueError, match=r"different bases \(dtype: torch.float32 vs torch.float64\)"):  # fmt: skip
        symbiont.load_client(llama, half, mask_activations="shares")


def test_a_16_bit_base_is_refused(checkpoints):
    path = checkpoints("llama")
    executor = BaseExecutor.from_pretrained(path, dtype="bfloat16")
    with pytest.raises(ValueError, match="masked activations need a float32 base, this executor runs torch.bfloat16"):  # fmt: skip
        symbiont.load_client(path, executor, mask_activations="pool")


def test_cli_refuses_bad_combinations(checkpoints, capsys):
    path = str(checkpoints("llama"))
    args = ["generate", "--model", path, "--prompt", "x", "--threads", "1"]
    assert main([*args, "--mask-activations", "shares"]) != 0
    assert "needs two executors run by parties that do not collude, got none" in capsys.readouterr().err  # fmt: skip
    assert main([*args, "--executor", "tcp://127.0.0.1:1", "--executor", "tcp://127.0.0.1:2"]) != 0
    assert "only used by --mask-activations shares" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*args, "--mask-activations", "secret"])
    assert "invalid choice: 'secret'" in capsys.readouterr().err


def test_the_readme_masked_snippet_runs(model_dir):
    (snippet,) = [b for b in python_blocks() if "mask_activations" in b]
    namespace: dict = {}
    exec(snippet.replace("default_model()", repr(str(model_dir))), namespace)  # noqa: S102
    assert isinstance(namespace["model"].model.layers[0].mlp.up_proj.executor, SharesExecutor)
    assert namespace["logits"].shape[:2] == (1, 4)


def test_noise_grows_with_the_width_above_1024():
    assert noise_scale(64.0, 32) == noise_scale(64.0, 1024) == 64.0
    assert noise_scale(64.0, 4096) == 128.0  # a wider row: any one direction holds more


def test_a_float64_base_keeps_a_float32_client_exact(checkpoints):
    """The remedy for wide models (docs/privacy.md): masks cost the base's precision,
    not the client's."""
    path = checkpoints("llama")
    want = symbiont.load_client(path, BaseExecutor.from_pretrained(path))
    wide = BaseExecutor.from_pretrained(path, dtype="float64")
    got = symbiont.load_client(path, wide, dtype=torch.float32, mask_activations="pool")
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        assert relative(got(ids).logits, want(ids).logits) < 1e-6


def test_a_mixture_of_experts_base_is_refused(checkpoints):
    path = checkpoints("granitemoe")
    executor = BaseExecutor.from_pretrained(path)
    with pytest.raises(ValueError, match="do not cover mixture-of-experts layers yet"):
        symbiont.load_client(path, executor, mask_activations="pool")


def test_shares_through_one_serve_base_are_refused(qwen2_with_tokenizer):
    """Shares hide x only from parties that see one share each: one serve-base reached
    through one URL twice, or through its TCP and IPC endpoints, saw x + r and -r."""
    path = qwen2_with_tokenizer
    with ServerProcess(path, args=("--threads", "1")) as server:  # tcp:// and ipc://
        tcp, ipc = server.url("tcp"), server.url("ipc")
        for urls in ((tcp, tcp), (tcp, ipc)):
            with pytest.raises(ValueError, match="the same executor twice"):
                open_executor(path, urls, mask_activations="shares")
        one = symbiont.connect(tcp, checkpoint=path)
        try:
            with pytest.raises(ValueError, match="the same executor twice"):
                symbiont.load_client(path, (one, one), mask_activations="shares")
        finally:
            one.close()
    base = BaseExecutor.from_pretrained(path)
    with pytest.raises(ValueError, match="the same executor twice"):
        symbiont.load_client(path, (base, base), mask_activations="shares")


def test_two_parties_with_their_own_tokens_from_the_command_line(qwen2_with_tokenizer, capsys):
    """Each party's serve-base has its own --token; the command line could pass only one
    ($SYMBIONT_TOKEN), so shares between two parties could not run from it."""
    path = qwen2_with_tokenizer

    def start(token):
        args = ("--threads", "1", "--token", token)
        return ServerProcess(path, bind=("tcp://127.0.0.1:*",), args=args).start()

    with ThreadPoolExecutor(2) as both:
        servers = list(both.map(start, ["token-a", "token-b"]))
    try:
        urls = [server.url("tcp") for server in servers]
        argv = ["generate", "--model", str(path), "--prompt", "hi", "--max-new-tokens", "3"]
        argv += ["--threads", "1", "--temperature", "0", "--mask-activations", "shares"]
        argv += ["--executor", urls[0], "--executor", urls[1]]
        assert main([*argv, "--executor-token", "token-a", "--executor-token", "token-b"]) == 0
        plain = capsys.readouterr().out
        assert main([*argv, "--executor-token", "token-a", "--executor-token", "token-a"]) == 1
        assert "was started with another token" in capsys.readouterr().err
        assert main([*argv, "--executor-token", "token-a"]) == 1
        assert "1 --executor-token given for 2 --executor" in capsys.readouterr().err
        assert plain
        config = ServerConfig(
            model=str(path), port=0, engine=SERVE_ENGINE, mask_activations="shares",
            executor=urls[0], second_executor=urls[1],
            executor_token="token-a", second_executor_token="token-b",
        )  # fmt: skip
        with BackgroundServer(config) as server:  # symbiont serve: a token per party too
            body = {"model": path.name, "prompt": "hi", "max_tokens": 3, "temperature": 0}
            reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
            assert reply.status_code == 200, reply.text
    finally:
        with ThreadPoolExecutor(2) as both:
            list(both.map(ServerProcess.stop, servers))
