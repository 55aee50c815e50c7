"""The README's Python snippet runs as written (the default model swapped for the test
session's copy, which is the same architecture built without pretraining)."""

from __future__ import annotations

import re
from pathlib import Path

import peft
import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)


def test_the_readme_python_snippet_runs(model_dir, one_thread):
    (snippet,) = [b for b in python_blocks() if "symbiont.default_model()" in b]
    namespace: dict = {}
    exec(snippet.replace("symbiont.default_model()", repr(str(model_dir))), namespace)  # noqa: S102
    prompt = namespace["inputs"]["input_ids"]
    out = namespace["out"]
    assert isinstance(out, torch.Tensor) and out.shape[0] == 1
    assert prompt.shape[1] < out.shape[1] <= prompt.shape[1] + 8, "1 to 8 new tokens"
    assert torch.equal(out[:, : prompt.shape[1]], prompt), "generate() keeps the prompt"
    assert isinstance(namespace["model"], peft.PeftModel)
