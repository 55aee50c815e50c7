"""`symbiont generate` refuses what it cannot do well, before doing it (issue 11 #16)."""

from __future__ import annotations

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM

from symbiont.cli import main


@pytest.fixture(autouse=True)
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_an_adapter_made_for_another_base_is_refused(model_dir, checkpoints, tmp_path, capsys):
    other = checkpoints("llama")  # another base: other widths than the default model
    torch.manual_seed(0)
    adapter = peft.get_peft_model(
        AutoModelForCausalLM.from_pretrained(other), peft.LoraConfig(r=2, target_modules=["q_proj"])
    )
    adapter.save_pretrained(tmp_path / "adapter")
    argv = ["generate", "--model", str(model_dir), "--prompt", "Hi", "--threads", "1"]
    assert main([*argv, "--adapter", str(tmp_path / "adapter")]) == 1
    err = capsys.readouterr().err
    assert "q_proj does not fit the base" in err and "made for another base" in err, err


def test_a_prompt_longer_than_the_context_is_refused(model_dir, capsys):
    argv = ["generate", "--model", str(model_dir), "--prompt", "Hi", "--threads", "1"]
    assert main([*argv, "--max-new-tokens", "5000"]) == 1
    err = capsys.readouterr().err
    assert "exceeds the model's context of 1024 tokens" in err, err
