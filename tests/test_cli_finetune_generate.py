"""`symbiont finetune` and `symbiont generate` as a user drives them: in-process for speed,
plus one killed-subprocess resume and one remote-executor run."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import peft
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from symbiont.cli import build_parser, main
from symbiont.model.default import default_dataset
from symbiont.processes import ServerProcess
from symbiont.tenant import load_tokenizer

REPO = Path(__file__).resolve().parents[1]
PROMPT = "Q: What is 20 plus 19?\nA:"


@pytest.fixture(autouse=True)
def restore_threads():
    """The CLI sets its own thread count; give the other tests theirs back."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    lines = default_dataset().read_text().splitlines()
    folder = tmp_path_factory.mktemp("data")
    (folder / "train.jsonl").write_text("\n".join(lines[:40]) + "\n")
    (folder / "eval.jsonl").write_text("\n".join(lines[40:46]) + "\n")
    return folder


def finetune_args(model_dir, data, out, *extra):
    return [
        "finetune", "--model", str(model_dir), "--data", str(data / "train.jsonl"),
        "--out", str(out), "--target", "all-linear", "--r", "4", "--lr", "1e-2",
        "--threads", "1", "--no-progress", *extra,
    ]  # fmt: skip


def generate_args(model_dir, *extra):
    return ["generate", "--model", str(model_dir), "--prompt", PROMPT, "--threads", "1", *extra]


def test_every_flag_has_help():
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command")
    for name in ("finetune", "generate"):
        for action in subparsers.choices[name]._actions:
            assert action.help, f"{name} {action.option_strings} has no help text"


def test_finetune_writes_adapter_metrics_and_eval_loss(model_dir, data, tmp_path, capsys):
    out = tmp_path / "run"
    args = finetune_args(model_dir, data, out, "--max-steps", "4", "--eval-every", "2")
    assert main([*args, "--eval-data", str(data / "eval.jsonl")]) == 0
    assert "trained 4 steps" in capsys.readouterr().out
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["step"] for r in records if "eval_loss" in r] == [2, 4]
    assert all(r["tokens_per_s"] > 0 for r in records)

    assert main(generate_args(model_dir, "--adapter", str(out), "--max-new-tokens", "6")) == 0
    plain = capsys.readouterr().out
    assert main(generate_args(model_dir, "--adapter", str(out), "--max-new-tokens", "6", "--stream")) == 0  # fmt: skip
    assert capsys.readouterr().out == plain, "streamed and non-streamed output must agree"


def test_any_peft_config_json_is_accepted(model_dir, data, tmp_path):
    peft.IA3Config(target_modules=["q_proj", "down_proj"], feedforward_modules=["down_proj"]).save_pretrained(tmp_path / "cfg")  # fmt: skip
    out = tmp_path / "run"
    args = finetune_args(model_dir, data, out, "--max-steps", "1")
    config = ["--peft-config", str(tmp_path / "cfg" / "adapter_config.json")]
    with pytest.raises(SystemExit):  # --r and --target would be dropped without a word
        main([*args, *config])
    args = [a for a in args if a not in ("--target", "all-linear", "--r", "4")]
    assert main([*args, *config]) == 0
    assert json.loads((out / "adapter_config.json").read_text())["peft_type"] == "IA3"


def test_bad_data_line_is_reported_with_file_and_line(model_dir, tmp_path, capsys):
    (tmp_path / "train.jsonl").write_text('{"text": "ok"}\n{"prompt": 1, "completion": "x"}\n')
    code = main(finetune_args(model_dir, tmp_path, tmp_path / "out", "--max-steps", "1"))
    assert code == 1
    assert (
        f"{tmp_path / 'train.jsonl'}:2: field 'prompt' must be a string" in capsys.readouterr().err
    )


def test_adapter_made_with_vanilla_peft_runs_in_generate(model_dir, tmp_path, capsys):
    torch.manual_seed(0)
    vanilla = peft.get_peft_model(
        AutoModelForCausalLM.from_pretrained(model_dir),
        peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    ).eval()
    vanilla.save_pretrained(tmp_path / "adapter")
    tokenizer = load_tokenizer(model_dir)
    inputs = tokenizer(PROMPT, return_tensors="pt")
    with torch.no_grad():
        want = vanilla.generate(**inputs, max_new_tokens=8, do_sample=False, pad_token_id=0)
    expected = tokenizer.decode(want[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert main(generate_args(model_dir, "--adapter", str(tmp_path / "adapter"), "--max-new-tokens", "8")) == 0  # fmt: skip
    assert capsys.readouterr().out == expected + "\n"


def _run_cli(args, **kw):
    """The CLI under `timeout`, in a process group of its own: a signal for it must go to
    the group (`_kill_group`), as SIGKILL to `timeout` alone leaves its child running."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        ["timeout", "300", sys.executable, "-m", "symbiont", *args],
        env=env,
        cwd=REPO,
        start_new_session=True,
        **kw,
    )


def _kill_group(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


def test_killed_finetune_resumes_to_the_same_adapter(model_dir, data, tmp_path):
    # save-total-limit 0 keeps every checkpoint, so we can see the kill came mid-run.
    extra = [
        "--max-steps",
        "40",
        "--save-every",
        "3",
        "--save-total-limit",
        "0",
        "--dropout",
        "0.1",
    ]
    assert main(finetune_args(model_dir, data, tmp_path / "full", *extra)) == 0

    cut = tmp_path / "cut"
    process = _run_cli(finetune_args(model_dir, data, cut, *extra), stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (cut / "checkpoint-000006").is_dir() and process.poll() is None:
            assert time.monotonic() < deadline, "finetune subprocess made no checkpoint"
            time.sleep(0.02)
        _kill_group(process)  # at any moment: possibly mid-checkpoint
    finally:
        _kill_group(process)
        process.wait()
    assert not (cut / "checkpoint-000040").exists(), "the run finished before it was killed"
    assert main([*finetune_args(model_dir, data, cut, *extra), "--resume"]) == 0
    want = load_file(str(tmp_path / "full" / "adapter_model.safetensors"))
    got = load_file(str(cut / "adapter_model.safetensors"))
    assert all(torch.equal(want[k], got[k]) for k in want), "resumed adapter differs"


def test_remote_executor(model_dir, data, tmp_path, capsys):
    symbiont = pytest.importorskip("symbiont")
    if not hasattr(symbiont, "connect"):
        pytest.skip("symbiont.connect (remote transport) is not available")
    with ServerProcess(model_dir, bind=("tcp://127.0.0.1:*",), args=("--threads", "1")) as server:
        url = server.url("tcp")
        out = tmp_path / "run"
        args = finetune_args(model_dir, data, out, "--max-steps", "2", "--executor", url)
        assert main(args) == 0
        capsys.readouterr()
        gen = generate_args(model_dir, "--adapter", str(out), "--max-new-tokens", "6")
        assert main([*gen, "--executor", url]) == 0
        remote = capsys.readouterr().out
        assert main(gen) == 0
        assert remote == capsys.readouterr().out, "remote and in-process executors disagree"


def test_finetune_computes_on_onednn_in_process_when_asked(
    model_dir, data, tmp_path, capsys, monkeypatch
):
    """`--matmul onednn` without --executor: the in-process executor's products run on
    oneDNN (the default model's layers are small, so its threshold is lowered here) and
    the losses are torch's within fp32 rounding; with --executor it is refused, naming
    serve-base's flag."""
    from symbiont.base import onednn

    calls = []
    real = onednn.onednn_linear

    def counting(x, weight, bias):
        calls.append(x.shape[0])
        return real(x, weight, bias)

    losses = {}
    for matmul in ("torch", "onednn"):
        out = tmp_path / matmul
        args = finetune_args(model_dir, data, out, "--max-steps", "3", "--matmul", matmul)
        if matmul == "onednn":
            monkeypatch.setattr(onednn, "ONEDNN_MIN_MACS", 0)
            monkeypatch.setattr(onednn, "onednn_linear", counting)
        assert main(args) == 0
        records = (out / "metrics.jsonl").read_text().splitlines()
        losses[matmul] = [json.loads(line)["loss"] for line in records]
    assert calls, "oneDNN computed nothing"
    assert losses["onednn"] == pytest.approx(losses["torch"], rel=1e-4)
    capsys.readouterr()
    refused = finetune_args(model_dir, data, tmp_path / "x", "--matmul", "onednn")
    assert main([*refused, "--executor", "tcp://127.0.0.1:9"]) == 1
    assert "symbiont serve-base --matmul onednn" in capsys.readouterr().err
