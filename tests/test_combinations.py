"""Every placement a user can choose, driven through the CLI as a user would.

- `symbiont serve` on an in-process executor, and on a `serve-base` reached through
  shared memory and through TCP frames: completions equal vanilla transformers + peft.
- `finetune`, `generate` and `serve` sharing one `serve-base` at the same time: serve's
  and generate's greedy text equal vanilla transformers + peft, and the adapter trained
  through the shared base equals the same run on an in-process executor (which
  tests/test_train_loop.py holds equal to vanilla peft).

Every process listens on loopback and is stopped by the test (serve-base also stops by
itself when pytest dies: it watches our pid).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from symbiont.cli import main
from symbiont.processes import ServerProcess
from tests.test_serve_common import Reference, add_char_tokenizer, make_adapters

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["The cat", "Q: 2+2?\nA:"]
ENGINE_FLAGS = ["--max-running", "8", "--max-batched-tokens", "24", "--block-size", "4"]


@pytest.fixture(autouse=True)
def restore_threads():
    """The in-process CLI run sets its own thread count; give the other tests theirs back."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_dir(checkpoints, tmp_path_factory):
    folder = tmp_path_factory.mktemp("combos") / "tiny-llama"
    shutil.copytree(checkpoints("llama"), folder)
    return add_char_tokenizer(folder)


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    return make_adapters(model_dir, tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def expected(model_dir, adapters):
    """(prompt, adapter or None, max_tokens) -> the text vanilla peft generates greedily."""
    reference = Reference(model_dir, adapters)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def text(prompt: str, adapter: str | None, max_tokens: int) -> str:
        out = reference.generate(tokenizer(prompt).input_ids, adapter, max_tokens)
        return tokenizer.decode(out, skip_special_tokens=True)

    return text


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(model_dir, adapters, log: Path, executor: str | None = None):
    """`symbiont serve` in a child process; yields an openai client once /health is 200."""
    port = _free_port()
    argv = [
        sys.executable, "-m", "symbiont", "serve", "--model", str(model_dir), "--port", str(port),
        "--adapter", f"lora4={adapters['lora4']}", "--adapter", f"ia3={adapters['ia3']}",
        *ENGINE_FLAGS, *(["--executor", executor] if executor else []),
    ]  # fmt: skip
    with open(log, "wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=_env())
    try:
        _wait_healthy(f"http://127.0.0.1:{port}", process, log)
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait_healthy(url: str, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert process.poll() is None, f"serve exited:\n{log.read_text(errors='replace')}"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    pytest.fail(f"serve did not become healthy:\n{log.read_text(errors='replace')}")


def _check_completions(client, expected) -> None:
    for model, adapter in [("tiny-llama", None), ("lora4", "lora4"), ("ia3", "ia3")]:
        for prompt in PROMPTS:
            out = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
            assert out.choices[0].text == expected(prompt, adapter, 8), f"{model}: {prompt!r}"


def _transports(base: ServerProcess) -> set[str]:
    """How the base's clients reach it, as the base itself reports ('shm' or 'zmq')."""
    import symbiont

    with symbiont.connect(base.url("tcp"), mode="zmq", label="probe") as probe:
        clients = probe.stats()["clients"]
    return {c["transport"] for c in clients if c["label"] != "probe"}


@pytest.mark.parametrize("placement", ["inprocess", "shm", "tcp"])
def test_serve_on_every_executor_placement(placement, model_dir, adapters, expected, tmp_path):
    if placement == "inprocess":
        with serve(model_dir, adapters, tmp_path / "serve.log") as client:
            _check_completions(client, expected)
        return
    # --no-shm makes the base refuse shared memory, so its clients send tensors as frames.
    extra = ("--threads", "1", *(["--no-shm"] if placement == "tcp" else []))
    with ServerProcess(model_dir, args=extra) as base:
        with serve(model_dir, adapters, tmp_path / "serve.log", base.url("tcp")) as client:
            _check_completions(client, expected)
            assert _transports(base) == {"shm" if placement == "shm" else "zmq"}
        # serve said bye as it stopped, as the probe did (it left the base to notice its
        # process gone)
        deadline = time.monotonic() + 5
        while base.log_text().count(" left\n") < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "has exited: session freed" not in base.log_text(), base.log_text()
        assert base.log_text().count(" left\n") == 2, base.log_text()


def _finetune_argv(model_dir, data: Path, out: Path, executor: str | None) -> list[str]:
    return [
        "finetune", "--model", str(model_dir), "--data", str(data), "--out", str(out),
        "--target", "all-linear", "--r", "4", "--lr", "1e-2", "--max-steps", "6",
        "--batch-size", "2", "--max-length", "32", "--threads", "1", "--no-progress",
        *(["--executor", executor] if executor else []),
    ]  # fmt: skip


def test_finetune_generate_and_serve_share_one_base(model_dir, adapters, expected, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text(
        "".join(f'{{"prompt": "Q: {i}+1?\\nA:", "completion": " {i + 1}"}}\n' for i in range(16))
    )
    prompt, max_tokens = PROMPTS[1], 8
    with ServerProcess(model_dir, args=("--threads", "1")) as base:
        url = base.url("tcp")
        with serve(model_dir, adapters, tmp_path / "serve.log", url) as client:
            finetune = subprocess.Popen(
                [sys.executable, "-m", "symbiont",
                 *_finetune_argv(model_dir, data, tmp_path / "shared", url)],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=_env(),
            )  # fmt: skip
            generate = subprocess.Popen(
                [sys.executable, "-m", "symbiont", "generate", "--model", str(model_dir),
                 "--executor", url, "--adapter", str(adapters["lora4"]), "--prompt", prompt,
                 "--max-new-tokens", str(max_tokens), "--threads", "1"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(),
            )  # fmt: skip
            while finetune.poll() is None or generate.poll() is None:  # serve all along
                _check_completions(client, expected)
            generated, gen_err = generate.communicate(timeout=60)
            _, tune_err = finetune.communicate(timeout=60)
    assert generate.returncode == 0, gen_err.decode(errors="replace")
    assert finetune.returncode == 0, tune_err.decode(errors="replace")
    assert generated.decode() == expected(prompt, "lora4", max_tokens) + "\n"

    assert main(_finetune_argv(model_dir, data, tmp_path / "alone", None)) == 0
    shared = load_file(str(tmp_path / "shared" / "adapter_model.safetensors"))
    alone = load_file(str(tmp_path / "alone" / "adapter_model.safetensors"))
    assert shared.keys() == alone.keys()
    for name in shared:  # batched with other clients' tokens: same math, fp32 rounding
        torch.testing.assert_close(shared[name], alone[name], rtol=1e-4, atol=1e-6)
